"""Likelihood estimators: how a trainer gets per-token log pi(completion) from a diffusion model.

All five share one signature and return ``(logps, entropies, scored)`` ``[B, C]``; ``scored`` marks the tokens
that received an estimate (the others carry 0 and must be left out of the loss).

* ``trajectory`` (TraceRL): every committed token given the state the sampler committed it from, steps merged
  ``shrinkage`` at a time. At the first iteration on a fresh rollout this equals the sampler's log-probs.
* ``random_masking`` (dLLM-RL / d1-style baseline): each completion token masked with probability
  ``u ~ U(low, high)`` drawn per token; masked tokens are scored given the rest.
* ``coupled`` (DiffuCoder): ``t ~ U(low, high)``, a mask and its complement plus the fully masked completion;
  ``log pi(o_k) = (log p_0(o_k) + w_k log p_{M|~M}(o_k)) / 2`` with ``w_k = 1/t`` or ``1/(1-t)``. Every token is
  scored exactly once in the complementary pair.
* ``coupled_pairs`` (dLLM-RL's ``coupled``): a random mask and its complement, each an unweighted PPO row; a token
  gets the log-prob from the half that masked it (no full-mask forward, no ``1/t`` weights).
* ``mean_field`` (d1 diffu-GRPO): the whole completion masked and prompt tokens masked with probability
  ``prompt_mask_prob``; one state, every token scored.

``random_masking`` and ``coupled_pairs`` draw ``masks_per_response`` masks (pairs) per response, either with a mask
probability per token (``random_mask_sampling="per_token"``, dLLM-RL's block models) or one ratio ``t`` per mask
(``"per_row"``, dLLM-RL's full-attention models). With ``m`` masks their outputs are ``[B, m * C]``: columns
``k * C ... (k + 1) * C - 1`` hold the completion scored under mask ``k``. ``draw_masks(...)["row"]`` names the
official training row of every scored token and ``row_sizes`` counts them, for dLLM-RL's loss normalisation.

Random masks come from one ``torch.Generator`` per row seeded with ``seeds[row]``, so old, new and reference
log-probs (and a resumed run) see the same masks.

On block models every estimator scores a row within its own canvas: the trajectory estimator up to the row's last
committed token (``row_canvas``), the masking ones up to the end of the rollout block that holds it
(``rollout_canvas``). The batch's right padding, and rollout blocks a row never reached, are left out of every
state, so a training block larger than the rollout's (``block_size`` > ``rollout_block_length``) shows no masks
that exist only because another response of the batch is longer.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from ..generation.sampling import check_sampling_filters, target_scores
from ..states import (
    NOT_COMMITTED,
    check_attention_backend,
    completion_blocks,
    resolve_model_attention_backend,
    trajectory_groups,
)
from ..synced_forwards import agreed_forward_count, needs_synced_forwards, zero_forward_term
from .packing import build_scoring_chunks

ESTIMATORS = ("trajectory", "random_masking", "coupled", "coupled_pairs", "mean_field")
MASK_SAMPLING = ("per_token", "per_row")
MULTI_MASK_ESTIMATORS = ("random_masking", "coupled_pairs")
"""Estimators that draw ``masks_per_response`` masks (pairs) and honour ``random_mask_sampling``."""


def check_mask_options(random_mask_sampling: str, masks_per_response: int) -> None:
    """Raise a ValueError naming the field for masking options no estimator can use (settings and configs)."""
    if random_mask_sampling not in MASK_SAMPLING:
        raise ValueError(f"random_mask_sampling must be one of {MASK_SAMPLING}, got {random_mask_sampling!r}.")
    if isinstance(masks_per_response, bool) or not isinstance(masks_per_response, int) or masks_per_response < 1:
        raise ValueError(f"masks_per_response must be an integer >= 1, got {masks_per_response!r}.")


@dataclass
class EstimatorSettings:
    name: str = "trajectory"
    shrinkage: int = 1
    block_size: int | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    token_budget: int | None = None
    mask_low: float = 0.1
    mask_high: float = 0.9
    coupled_low: float = 0.2
    coupled_high: float = 0.8
    prompt_mask_prob: float = 0.15
    attention_backend: str = "auto"
    random_mask_sampling: str = "per_token"
    masks_per_response: int = 1
    exclude_mask_token: bool = True
    """Leave the mask token out of the scored softmax (a committed token is never a mask; the sampler excludes it
    too). False: dLLM-RL's trainers, which include it."""
    rollout_block_length: int | None = None
    """Block length the rollouts were sampled with (block models; default: the model's block size, the sampler's
    default). The masking estimators end each row's canvas with the rollout block of its last committed token
    (``rollout_canvas``), so that with a larger training block (``block_size``) a row scores the same alone as in a
    batch with longer rows. Full-attention models ignore it (their sampler saw the whole shared canvas)."""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.name not in ESTIMATORS:
            raise ValueError(f"unknown likelihood_estimator {self.name!r}; choose one of {ESTIMATORS}.")
        for name in ("shrinkage", "block_size", "token_budget"):  # counts: None for the last two means "unset"
            value = getattr(self, name)
            if (value is not None or name == "shrinkage") and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                unset = "" if name == "shrinkage" else "None or "
                raise ValueError(f"{name} must be {unset}an integer >= 1, got {value!r}.")
        check_sampling_filters(self.temperature, self.top_k, self.top_p, zero_means="scored at 1")
        check_attention_backend(self.attention_backend)
        if not 0 <= self.prompt_mask_prob <= 1:
            raise ValueError(f"prompt_mask_prob must lie in [0, 1], got {self.prompt_mask_prob!r}.")
        if not 0 < self.mask_low <= self.mask_high < 1 or not 0 < self.coupled_low <= self.coupled_high < 1:
            raise ValueError("masking ratios must satisfy 0 < low <= high < 1.")
        check_mask_options(self.random_mask_sampling, self.masks_per_response)
        length = self.rollout_block_length
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
            raise ValueError(f"rollout_block_length must be None or an integer >= 1, got {length!r}.")
        if self.name not in MULTI_MASK_ESTIMATORS and (
                self.masks_per_response != 1 or self.random_mask_sampling != "per_token"):
            raise ValueError(f"masks_per_response and random_mask_sampling apply to the {MULTI_MASK_ESTIMATORS} "
                             f"estimators only, not to {self.name!r} (leave them at 1 and 'per_token').")

    def score_width(self, completion_width: int) -> int:
        """Width of the estimator's ``[B, width]`` outputs: one completion per mask (pair) drawn."""
        return completion_width * self.masks_per_response


def score_chunks(model, chunks, completion_ids, settings: EstimatorSettings, compute_entropy: bool, *,
                 router_losses: list[torch.Tensor] | None = None):
    """Run each chunk and scatter the target tokens' log-probs (and entropies) back to ``[B, C]``. The LM head runs
    only at the targets (``logits_to_keep``), never over a whole packed row.

    ``router_losses`` (mixture-of-experts models): a list that gets each forward's load-balancing ``aux_loss`` over
    the chunk's real tokens (``layout.valid``: not the padding of its shorter rows); None asks for no router logits,
    whatever the model config says. The forwards that only keep processes in step add none."""
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    shift = 1 if model.logits_shift else 0
    if shift and model.block_size is not None:
        raise ValueError("packed scoring of shifted logits on a block-causal model is not supported.")
    backend = resolve_model_attention_backend(settings.attention_backend, model, completion_ids.device)
    synced = needs_synced_forwards(model)  # FSDP / ZeRO-3: every process runs as many forwards as the busiest
    for _ in range(agreed_forward_count(len(chunks), completion_ids.device, synced) - len(chunks)):
        logps = logps + zero_forward_term(model, completion_ids[:1, :1])
    for chunk in chunks:
        mask = chunk.layout.attention_mask(backend)
        output = model(input_ids=chunk.input_ids, attention_mask=mask, position_ids=chunk.position_ids,
                       logits_to_keep=(chunk.chunk_row, chunk.chunk_col - shift),
                       output_router_logits=router_losses is not None, router_loss_mask=chunk.layout.valid)
        if router_losses is not None:
            router_losses.append(output.aux_loss)
        selected = output.logits
        targets = completion_ids[chunk.source_row, chunk.source_col]
        values, ent, _ = target_scores(selected, targets, settings.temperature, settings.top_k, settings.top_p,
                                       model.mask_token_id if settings.exclude_mask_token else None,
                                       entropy=compute_entropy, top_p_first=model.top_p_first)
        logps = logps.index_put((chunk.source_row, chunk.source_col), values)
        if compute_entropy:
            entropies = entropies.index_put((chunk.source_row, chunk.source_col), ent)
    return logps, entropies


def _collecting(router_losses: list[torch.Tensor] | None) -> dict:
    """``score_chunks``'s ``router_losses`` argument when the losses are collected; nothing otherwise, so that plain
    scoring keeps its five-argument call."""
    return {} if router_losses is None else {"router_losses": router_losses}


def row_canvas(committed: torch.Tensor, block_size: int | None) -> torch.Tensor | None:
    """The completion columns scored states show for each row of a block model ``[B, C]``: up to its last
    committed token (None for full attention, whose sampler saw every column of the shared canvas).

    A batch's completions are right-padded to its longest canvas. Behind a row's last committed token lie only
    blocks it never committed (after a stop) or that padding; with the rollout's block size no scored block sees
    them, but a larger training block (``training_block_size``, e.g. 4 -> 8) would show them as masks, so that a
    response's log-probs would depend on the other responses of its batch. Leaving them out makes every row score
    as it would alone. Used by the ``trajectory`` estimator; the masking ones use ``rollout_canvas``."""
    if block_size is None or committed.shape[1] == 0:
        return None
    return _through_last_committed(committed, torch.arange(committed.shape[1], device=committed.device))


def rollout_canvas(committed: torch.Tensor, prompt_mask: torch.Tensor,
                   rollout_block: int | None) -> torch.Tensor | None:
    """The completion columns ``[B, C]`` the masking estimators show for each row of a block model: up to the end of
    the rollout block (``rollout_block``, aligned from the row's position 0 as the sampler aligns it) that holds its
    last committed token; None for full attention (``rollout_block`` None), whose sampler saw the whole canvas.

    The sampler commits whole blocks and stops after the block holding a stop token, so behind that block lie only
    blocks the row never reached and the right padding up to the batch's longest canvas. No committed token was
    ever sampled next to them, yet a training block larger than the rollout's would show them as masks, and how many
    depends on the other rows of the batch. Positions inside the rollout block of the last committed token stay:
    the sampler saw any it left uncommitted as masks (dLLM-RL's rows show them so too)."""
    if rollout_block is None or committed.shape[1] == 0:
        return None
    return _through_last_committed(committed, completion_blocks(prompt_mask, committed.shape[1], rollout_block))


def _through_last_committed(committed: torch.Tensor, units: torch.Tensor) -> torch.Tensor:
    """The columns whose unit (``units``: each column's index, or its block) is at most that of the row's last
    committed token; none for a row without one."""
    last = torch.where(committed, units, -1).max(-1, keepdim=True).values
    return units <= last


def _masked_groups(masked: torch.Tensor, blocks: torch.Tensor | None, committed: torch.Tensor) -> torch.Tensor:
    """Groups for a one-shot masked state: visible tokens first, masked tokens after (per block for block
    models, so each block gets its own noisy copy)."""
    base = blocks * 2 if blocks is not None else torch.zeros_like(masked, dtype=torch.long)
    groups = base + masked.long()
    return torch.where(committed, groups, torch.full_like(groups, NOT_COMMITTED))


def estimate_logprobs(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    unmask_step: torch.Tensor,
    settings: EstimatorSettings,
    seeds: torch.Tensor | None = None,
    compute_entropy: bool = False,
    router_losses: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token log-probs of ``completion_ids`` (the full sampler canvas) under ``settings.name``.
    ``router_losses``: a list that gets the load-balancing loss of every forward (see ``score_chunks``)."""
    settings.validate()
    block_size = (settings.block_size or model.block_size) if model.block_size is not None else None
    mask_id = model.mask_token_id
    committed = unmask_step >= 0
    blocks = completion_blocks(prompt_mask, completion_ids.shape[1], block_size)

    def run(groups, scored=None, prompt_noise=None, canvas=None):
        chunks = build_scoring_chunks(prompt_ids, prompt_mask, completion_ids, groups, mask_id, block_size,
                                      settings.token_budget, 0, scored, prompt_noise, canvas)
        return score_chunks(model, chunks, completion_ids, settings, compute_entropy, **_collecting(router_losses))

    if settings.name == "trajectory":
        groups = trajectory_groups(unmask_step, prompt_mask, settings.shrinkage, block_size)
        logps, entropies = run(groups, canvas=row_canvas(committed, block_size))
        return logps, entropies, committed

    if seeds is None:
        raise ValueError(f"the {settings.name!r} estimator needs per-row seeds for its random masks.")
    masks = draw_masks(settings, committed, seeds, prompt_ids.shape[1])
    canvas = rollout_canvas(committed, prompt_mask,
                            (settings.rollout_block_length or model.block_size) if block_size is not None else None)
    if settings.name == "mean_field":
        everything = torch.ones_like(committed)
        logps, entropies = run(_masked_groups(everything, blocks, committed), prompt_noise=masks["prompt_noise"],
                               canvas=canvas)
        return logps, entropies, committed
    if settings.name in MULTI_MASK_ESTIMATORS:
        return _score_drawn_masks(model, prompt_ids, prompt_mask, completion_ids, committed, blocks, block_size,
                                  masks, settings, compute_entropy, router_losses, canvas)
    first, t = masks["masked"], masks["t"]
    second = ~first & committed
    full_logps, entropies = run(_masked_groups(torch.ones_like(committed), blocks, committed), canvas=canvas)
    first_logps, _ = run(_masked_groups(first, blocks, committed), scored=first, canvas=canvas)
    second_logps, _ = run(_masked_groups(second, blocks, committed), scored=second, canvas=canvas)
    weighted = torch.where(first, first_logps / t[:, None], second_logps / (1 - t[:, None]))
    return 0.5 * (full_logps + weighted), entropies, committed


def draw_masks(settings: EstimatorSettings, committed: torch.Tensor, seeds: torch.Tensor, prompt_width: int) -> dict:
    """The estimator's random draws, from generators seeded by ``seeds[row]`` (CPU, then moved). A row's draws
    depend on its seed alone, not on how wide its batch is padded: column j of a completion (and, for
    ``mean_field``, the j-th prompt token from the prompt's end) gets the same draw whatever the other rows of its
    batch or process are, so a run on two processes scores the masks one process with twice the batch scores.

    ``masked``: tokens masked (``coupled``: ``[B, C]``, the first of the complementary pair, ``draw < t``;
    ``random_masking`` / ``coupled_pairs``: ``[B, m * C]``, mask ``k`` in columns ``k * C ...``, for
    ``coupled_pairs`` the first half of pair ``k``); ``t``: ``[B]`` (``coupled``) or ``[B, m]`` (``per_row``
    sampling); ``prompt_noise`` ``[B, P]`` (``mean_field``); ``scored``: the tokens that get an estimate;
    ``row`` (``random_masking`` / ``coupled_pairs``): for each scored token, the index within its response of the
    dLLM-RL training row that trains it (mask ``k`` is row ``k``; pair ``k`` is rows ``2k`` and ``2k + 1``), -1
    elsewhere. Which tokens an estimator scores is a function of these alone, so the trainer can know it before
    any forward.
    """
    seeds = [int(s) for s in seeds.tolist()]
    width, device = committed.shape[1], committed.device
    out = {"masked": None, "t": None, "prompt_noise": None, "scored": committed, "row": None}
    if settings.name in MULTI_MASK_ESTIMATORS:
        masked, ratios = _sample_masks(settings, seeds, width)
        masks_per_response = settings.masks_per_response
        live = committed.repeat(1, masks_per_response)
        masked = masked.flatten(1).to(device) & live
        index = torch.arange(masks_per_response, device=device).repeat_interleave(width)[None].expand_as(live)
        out["masked"] = masked
        if settings.random_mask_sampling == "per_row":
            out["t"] = ratios.to(device)
        if settings.name == "random_masking":
            out["scored"], out["row"] = masked, torch.where(masked, index, -1)
        else:
            out["scored"], out["row"] = live, torch.where(live, 2 * index + (~masked).long(), -1)
    elif settings.name == "coupled":  # t first, then column j's draw: the j-th after it, for any width
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        low, high = settings.coupled_low, settings.coupled_high
        t = torch.stack([low + (high - low) * torch.rand((), generator=g) for g in generators])
        draws = torch.stack([torch.rand(width, generator=g) for g in generators])
        out["t"] = t.to(device)
        out["masked"] = (draws < t[:, None]).to(device) & committed
    elif settings.name == "mean_field":
        # prompts are left-padded: the draws are laid out from the prompt's end, so padding only adds draws in front
        generators = [torch.Generator().manual_seed(s) for s in seeds]
        noise = torch.stack([torch.rand(prompt_width, generator=g).flip(0) for g in generators])
        out["prompt_noise"] = (noise < settings.prompt_mask_prob).to(device)
    return out


def _sample_masks(settings: EstimatorSettings, seeds: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``masks_per_response`` masks per row, ``[B, m, C]``, and their ratios ``[B, m]`` (CPU).

    ``per_token``: each token masked with its own probability ``u ~ U(low, high)`` (dLLM-RL's block models,
    ``train/rl_trado.py``; the ratios returned are NaN); ``per_row``: one ``t ~ U(low, high)`` per mask, each token
    masked with probability ``t`` (dLLM-RL's full-attention models, ``train/rl_dream.py``, ``rl_llada.py``). Each
    sequence of column draws comes from a generator of its own (``_draw_stream``: per row seed, mask and kind), so
    column j's draws are the same for any ``width``, and a row's masks never depend on the other rows.
    """
    low, high = settings.mask_low, settings.mask_high
    masks = torch.zeros(len(seeds), settings.masks_per_response, width, dtype=torch.bool)
    ratios = torch.full(masks.shape[:2], float("nan"))
    for row, seed in enumerate(seeds):
        for k in range(settings.masks_per_response):
            draws = _draw_stream(seed, k, "mask")
            if settings.random_mask_sampling == "per_token":
                threshold = low + (high - low) * torch.rand(width, generator=_draw_stream(seed, k, "threshold"))
            else:  # the ratio first, then the columns' draws
                threshold = ratios[row, k] = low + (high - low) * torch.rand((), generator=draws)
            masks[row, k] = torch.rand(width, generator=draws) < threshold
    return masks, ratios


def _draw_stream(seed: int, mask: int, kind: str) -> torch.Generator:
    """A generator for one sequence of draws of one row (``seed``): mask ``mask``'s ``kind`` ("mask", "threshold")."""
    digest = hashlib.sha256(f"{seed}:{mask}:{kind}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _score_drawn_masks(model, prompt_ids, prompt_mask, completion_ids, committed, blocks, block_size, masks,
                       settings: EstimatorSettings, compute_entropy: bool,
                       router_losses: list[torch.Tensor] | None = None, canvas: torch.Tensor | None = None):
    """``random_masking`` / ``coupled_pairs``: every drawn mask (pair half) is one state; all of them are scored in
    one packed pass over the batch tiled once per state, then laid out ``[B, m * C]``. ``canvas``: each row's
    columns (``rollout_canvas``; None: all)."""
    batch, width = committed.shape
    m = settings.masks_per_response
    masked = masks["masked"].view(batch, m, width).transpose(0, 1).reshape(m * batch, width)
    live = committed.repeat(m, 1)
    states = masked if settings.name == "random_masking" else torch.cat([masked, live & ~masked])
    copies = states.shape[0] // batch
    tiled_blocks = None if blocks is None else blocks.repeat(copies, 1)
    tiled_completion = completion_ids.repeat(copies, 1)
    groups = _masked_groups(states, tiled_blocks, committed.repeat(copies, 1))
    chunks = build_scoring_chunks(prompt_ids.repeat(copies, 1), prompt_mask.repeat(copies, 1), tiled_completion,
                                  groups, model.mask_token_id, block_size, settings.token_budget,
                                  0, states, None, None if canvas is None else canvas.repeat(copies, 1))
    logps, entropies = score_chunks(model, chunks, tiled_completion, settings, compute_entropy,
                                    **_collecting(router_losses))

    def per_response(values):  # [copies * B, C] -> [B, m * C], a pair's halves merged (they are disjoint)
        if values is None:
            return None
        if settings.name == "coupled_pairs":
            values = torch.where(masked, values[: m * batch], values[m * batch:])
        return values.view(m, batch, width).transpose(0, 1).reshape(batch, m * width)

    return per_response(logps), per_response(entropies), masks["scored"]


def row_sizes(rows: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sizes of dLLM-RL training rows: ``(tokens_per_row, rows_per_response)``.

    ``rows`` ``[B, W]`` from ``draw_masks(...)["row"]`` (-1 = no row); ``keep`` ``[B, W]`` the tokens the loss keeps
    (e.g. the completion mask, tiled per mask). ``tokens_per_row`` ``[B, W]``: the number of kept tokens in each
    token's row (0 where not kept): the official full-attention loss divides a row by it. ``rows_per_response``
    ``[B]``: the non-empty rows of each response, the official row count (dLLM-RL drops empty rows).
    """
    kept = torch.where((keep > 0) & (rows >= 0), rows, -1)
    n_rows = int(kept.max()) + 1 if bool((kept >= 0).any()) else 1
    counts = torch.zeros(rows.shape[0], n_rows + 1, dtype=torch.long, device=rows.device)
    counts.scatter_add_(1, kept + 1, torch.ones_like(kept))
    counts = counts[:, 1:]
    tokens = torch.where(kept >= 0, counts.gather(1, kept.clamp(min=0)), 0)
    return tokens.float(), (counts > 0).sum(1)
