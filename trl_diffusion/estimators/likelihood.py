"""Likelihood estimators: how a trainer gets per-token log pi(completion) from a diffusion model.

All four share one signature and return ``(logps, entropies, scored)`` ``[B, C]``; ``scored`` marks the tokens
that received an estimate (the others carry 0 and must be left out of the loss).

* ``trajectory`` (TraceRL): every committed token given the state the sampler committed it from, steps merged
  ``shrinkage`` at a time. At the first iteration on a fresh rollout this equals the sampler's log-probs.
* ``random_masking`` (dLLM-RL / d1-style baseline): each completion token masked with probability
  ``u ~ U(low, high)`` drawn per token; masked tokens are scored given the rest.
* ``coupled`` (DiffuCoder): ``t ~ U(low, high)``, a mask and its complement plus the fully masked completion;
  ``log pi(o_k) = (log p_0(o_k) + w_k log p_{M|~M}(o_k)) / 2`` with ``w_k = 1/t`` or ``1/(1-t)``. Every token is
  scored exactly once in the complementary pair.
* ``mean_field`` (d1 diffu-GRPO): the whole completion masked and prompt tokens masked with probability
  ``prompt_mask_prob``; one state, every token scored.

Random masks come from one ``torch.Generator`` per row seeded with ``seeds[row]``, so old, new and reference
log-probs (and a resumed run) see the same masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..generation.sampling import sampling_logits
from ..states import NOT_COMMITTED, completion_blocks, resolve_model_attention_backend, trajectory_groups
from .packing import build_scoring_chunks

ESTIMATORS = ("trajectory", "random_masking", "coupled", "mean_field")


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

    def validate(self) -> None:
        if self.name not in ESTIMATORS:
            raise ValueError(f"unknown likelihood_estimator {self.name!r}; choose one of {ESTIMATORS}.")
        if self.shrinkage < 1:
            raise ValueError(f"shrinkage must be >= 1, got {self.shrinkage}.")
        if not 0 < self.mask_low <= self.mask_high < 1 or not 0 < self.coupled_low <= self.coupled_high < 1:
            raise ValueError("masking ratios must satisfy 0 < low <= high < 1.")


def score_chunks(model, chunks, completion_ids, settings: EstimatorSettings, compute_entropy: bool):
    """Run each chunk and scatter the target tokens' log-probs (and entropies) back to ``[B, C]``. The LM head runs
    only at the targets (``logits_to_keep``), never over a whole packed row."""
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    shift = 1 if model.logits_shift else 0
    if shift and model.block_size is not None:
        raise ValueError("packed scoring of shifted logits on a block-causal model is not supported.")
    backend = resolve_model_attention_backend(settings.attention_backend, model, completion_ids.device)
    for chunk in chunks:
        mask = chunk.layout.attention_mask(backend)
        selected = model(input_ids=chunk.input_ids, attention_mask=mask, position_ids=chunk.position_ids,
                         logits_to_keep=(chunk.chunk_row, chunk.chunk_col - shift)).logits
        log_dist = sampling_logits(selected, settings.temperature, settings.top_k, settings.top_p,
                                   model.mask_token_id).log_softmax(-1)
        targets = completion_ids[chunk.source_row, chunk.source_col]
        values = log_dist.gather(-1, targets[:, None]).squeeze(-1)
        logps = logps.index_put((chunk.source_row, chunk.source_col), values)
        if compute_entropy:
            probs = log_dist.exp()
            ent = -(probs * log_dist.masked_fill(probs == 0, 0.0)).sum(-1)
            entropies = entropies.index_put((chunk.source_row, chunk.source_col), ent)
    return logps, entropies


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
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per-token log-probs of ``completion_ids`` (the full sampler canvas) under ``settings.name``."""
    settings.validate()
    block_size = (settings.block_size or model.block_size) if model.block_size is not None else None
    mask_id = model.mask_token_id
    committed = unmask_step >= 0
    blocks = completion_blocks(prompt_mask, completion_ids.shape[1], block_size)
    pad_id = int(prompt_ids.new_tensor(0))

    def run(groups, scored=None, prompt_noise=None):
        chunks = build_scoring_chunks(prompt_ids, prompt_mask, completion_ids, groups, mask_id, block_size,
                                      settings.token_budget, pad_id, scored, prompt_noise)
        return score_chunks(model, chunks, completion_ids, settings, compute_entropy)

    if settings.name == "trajectory":
        groups = trajectory_groups(unmask_step, prompt_mask, settings.shrinkage, block_size)
        logps, entropies = run(groups)
        return logps, entropies, committed

    if seeds is None:
        raise ValueError(f"the {settings.name!r} estimator needs per-row seeds for its random masks.")
    masks = draw_masks(settings, committed, seeds, prompt_ids.shape[1])
    if settings.name == "mean_field":
        everything = torch.ones_like(committed)
        logps, entropies = run(_masked_groups(everything, blocks, committed), prompt_noise=masks["prompt_noise"])
        return logps, entropies, committed
    if settings.name == "random_masking":
        masked = masks["masked"]
        logps, entropies = run(_masked_groups(masked, blocks, committed), scored=masked)
        return logps, entropies, masked
    first, t = masks["masked"], masks["t"]
    second = ~first & committed
    full_logps, entropies = run(_masked_groups(torch.ones_like(committed), blocks, committed))
    first_logps, _ = run(_masked_groups(first, blocks, committed), scored=first)
    second_logps, _ = run(_masked_groups(second, blocks, committed), scored=second)
    weighted = torch.where(first, first_logps / t[:, None], second_logps / (1 - t[:, None]))
    return 0.5 * (full_logps + weighted), entropies, committed


def draw_masks(settings: EstimatorSettings, committed: torch.Tensor, seeds: torch.Tensor, prompt_width: int) -> dict:
    """The estimator's random draws, from one generator per row seeded by ``seeds[row]`` (CPU, then moved).

    ``masked`` ``[B, C]``: tokens masked (``random_masking``: each with prob ``u ~ U(low, high)``; ``coupled``: the
    first of the complementary pair, ``draw < t``); ``t`` ``[B]`` (``coupled``); ``prompt_noise`` ``[B, P]``
    (``mean_field``). Which tokens an estimator scores is a function of these alone, so the trainer can know it
    before any forward.
    """
    generators = [torch.Generator().manual_seed(int(s)) for s in seeds.tolist()]
    width, device = committed.shape[1], committed.device
    out = {"masked": None, "t": None, "prompt_noise": None, "scored": committed}
    if settings.name == "random_masking":
        low, high = settings.mask_low, settings.mask_high
        probs = torch.stack([low + (high - low) * torch.rand(width, generator=g) for g in generators])
        draws = torch.stack([torch.rand(width, generator=g) for g in generators])
        out["masked"] = (draws < probs).to(device) & committed
        out["scored"] = out["masked"]
    elif settings.name == "coupled":
        low, high = settings.coupled_low, settings.coupled_high
        t = torch.stack([low + (high - low) * torch.rand((), generator=g) for g in generators])
        draws = torch.stack([torch.rand(width, generator=g) for g in generators])
        out["t"] = t.to(device)
        out["masked"] = (draws < t[:, None]).to(device) & committed
    elif settings.name == "mean_field":
        noise = torch.stack([torch.rand(prompt_width, generator=g) for g in generators])
        out["prompt_noise"] = (noise < settings.prompt_mask_prob).to(device)
    return out
