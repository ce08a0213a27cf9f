"""Diffusion SFT objectives as pure functions.

Each objective turns a batch of clean rows (``input_ids``, ``labels`` with -100 on prompt and padding,
``valid`` = the 2-D padding mask) into a ``ScoringBatch``: the rows the model reads (noisy copies, layouts),
their position ids and boolean attention mask, and per-position targets and loss weights. ``diffusion_loss``
then scores the targets with one forward and returns ``sum(weight * NLL) / normaliser``.

Randomness comes only from the per-sample ``torch.Generator`` list passed in (one per row, see
``sample_generators``), and every sample draws only as many numbers as it has real tokens, so a sample gets the
same noise whatever batch it lands in (gradient accumulation 1 x 4 equals 4 x 1) and a slow reference
computation fed the same generators sees the same masks.

Packed rows (``packing`` / ``padding_free``) hold several documents, given as ``documents`` ``[B, L]`` (document
id per position, -1 on padding) with ``position_ids`` restarting at 0 per document. The objectives that support
them (``block``, ``random_masking``, ``complementary``) then take one generator per document, draw each
document's noise exactly as an unpacked row of it would, and no token attends to another document: a packed
batch scores every document as the unpacked batch does.

Only ``labels != -100`` positions (the completion, or assistant turns) are ever masked or scored; the prompt is
always clean context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..estimators.packing import build_scoring_chunks, row_chunks
from ..generation.sampling import target_scores
from ..states import (
    NOT_COMMITTED,
    AttentionLayout,
    block_index,
    blocks_from_prompt_end,
    blocks_with,
    noisy_clean_layout,
    noisy_columns,
    positions_from_padding,
    resolve_model_attention_backend,
    state_before_step,
    step_groups,
)

OBJECTIVES = ("block", "random_masking", "semi_ar", "complementary", "trajectory")
PACKED_OBJECTIVES = ("block", "random_masking", "complementary")
"""Objectives that train on packed rows (several documents a row)."""
PER_TOKEN_OBJECTIVES = ("block", "random_masking", "semi_ar")
"""Objectives that can draw one mask ratio per token (dLLM-RL's SFT) instead of one per sample."""
MASK_RATIO_SAMPLING = ("per_sample", "per_token")
LOSS_NORMALIZATIONS = ("tokens", "row_masked", "row_tokens", "row_length")
"""``tokens``: TRL's, the summed loss over the accumulated batch's loss tokens; ``row_masked`` / ``row_tokens`` /
``row_length``: each training row's summed loss over its masked tokens (dLLM-RL's full-attention SFT) / its sample's
loss tokens (LLaDA's SFT) / a fixed length (dLLM-RL's block SFT: its padded response length), averaged over rows."""
LOSS_WEIGHTINGS = ("elbo", "none")
IGNORE_INDEX = -100


@dataclass
class ScoringBatch:
    """What one forward scores. ``targets`` are position-aligned (-100 = not scored); ``weights`` are 0 there.
    ``layout`` gives the attention mask (None: the model's default, full attention over every token)."""

    input_ids: torch.LongTensor
    position_ids: torch.LongTensor
    layout: AttentionLayout | None
    targets: torch.LongTensor
    weights: torch.Tensor


@dataclass
class TokenScores:
    """Per-position log-probability of the target, entropy of the prediction and whether the target is the
    argmax; all zero where ``scored`` is False. ``aux_loss``: the forward's load-balancing loss over its real tokens
    (mixture-of-experts models, when ``score_tokens`` is asked for it; None otherwise)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor
    is_top1: torch.Tensor
    scored: torch.Tensor
    aux_loss: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------------------
# Noise
# ------------------------------------------------------------------------------------------------------------


def sample_seed(base_seed: int, epoch: int, sample_index: int) -> int:
    """A seed that depends only on (run seed, epoch, sample): the same sample gets the same noise however the
    batch is split, and fresh noise every epoch."""
    return (((base_seed * 1_000_003) + epoch) * 1_000_000_007 + sample_index) % (2**63 - 1)


def document_seed(base_seed: int, epoch: int, sample_index: int, offset: int = 0) -> int:
    """``sample_seed`` of a sample, or of the part of it that starts at token ``offset`` (a fragment that packing
    split off: a fresh seed, so two fragments of one sample do not share their noise)."""
    seed = sample_seed(base_seed, epoch, sample_index)
    return seed if offset == 0 else (seed * 1_000_003 + offset) % (2**63 - 1)


def sample_generators(sample_indices: list[int], base_seed: int, epoch: int,
                      offsets: list[int] | None = None) -> list[torch.Generator]:
    """One CPU generator per row (or per document of packed rows), seeded by ``document_seed``."""
    offsets = offsets if offsets is not None else [0] * len(sample_indices)
    return [torch.Generator().manual_seed(document_seed(base_seed, epoch, int(i), int(o)))
            for i, o in zip(sample_indices, offsets, strict=True)]


def mask_ratio(u: torch.Tensor, eps: float, high: float = 1.0) -> torch.Tensor:
    """Mask probability ``eps + (high - eps) * u`` for ``u ~ U(0, 1)`` (LLaDA / SDAR: ``(1 - eps) t + eps``)."""
    return eps + (high - eps) * u


def draw_noise(generator: torch.Generator, num_ratios: int, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_ratios`` uniforms, then one uniform per real token of the row (``valid`` ``[L]``), in order;
    padding gets 1.0 (never masked). The draws do not depend on how much padding the batch adds."""
    valid = valid.bool().cpu()
    ratios = torch.rand(num_ratios, generator=generator)
    uniforms = torch.ones(valid.shape[-1])
    uniforms[valid] = torch.rand(int(valid.sum()), generator=generator)
    return ratios, uniforms


def draw_token_noise(generator: torch.Generator, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token masking (dLLM-RL's SFT): one uniform per real token of the row (its own mask probability, before
    scaling to the ratio range), then one more per real token (masked when below its probability), in order.
    Padding gets probability 0 and uniform 1 (never masked)."""
    valid = valid.bool().cpu()
    count = int(valid.sum())
    probabilities, uniforms = torch.zeros(valid.shape[-1]), torch.ones(valid.shape[-1])
    probabilities[valid] = torch.rand(count, generator=generator)
    uniforms[valid] = torch.rand(count, generator=generator)
    return probabilities, uniforms


def _weights(masked: torch.Tensor, ratio: torch.Tensor, weighting: str) -> torch.Tensor:
    """``1 / ratio`` (ELBO) or 1 on masked positions, 0 elsewhere."""
    if weighting not in LOSS_WEIGHTINGS:
        raise ValueError(f"unknown loss_weighting {weighting!r}; choose one of {LOSS_WEIGHTINGS}.")
    scale = 1.0 / ratio if weighting == "elbo" else torch.ones_like(ratio)
    return torch.where(masked, scale, 0.0)  # not masked * scale: 0 * inf is NaN where a ratio is 0


def _check_generators(generators: list[torch.Generator], batch: int) -> None:
    if len(generators) != batch:
        raise ValueError(f"need one generator per row: got {len(generators)} for {batch} rows.")


def _attention(positions: torch.Tensor, valid: torch.Tensor, block_size: int | None,
               documents: torch.Tensor | None = None) -> AttentionLayout | None:
    """Block-causal (``block_size``) or full attention over the row (over each document of a packed row), padding
    keys hidden; None when that is the model's own default (full attention, nothing padded, nothing packed)."""
    if block_size is None and bool(valid.all()) and documents is None:
        return None
    return AttentionLayout.plain(positions, valid, block_size, documents)


def _document_columns(documents: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``(document id, its columns in order)`` for every document of a row (``documents`` ``[L]``, -1 = none), by
    increasing id: one stable sort of the row, not one pass over it per document."""
    columns = (documents >= 0).nonzero().flatten()
    columns = columns[torch.argsort(documents[columns], stable=True)]
    ids, counts = torch.unique_consecutive(documents[columns], return_counts=True)
    return list(zip(ids.tolist(), columns.split(counts.tolist()), strict=True))


def _random_mask(input_ids, labels, valid, generators, eps, high=1.0, documents=None, per_token=False):
    """Per-document ratio p and a Bernoulli(p) mask over its completion positions (``per_token``: each position
    with its own p); returns the mask and every position's ratio ``[B, L]``. Ratios lie in ``[eps, high]``.
    Without ``documents`` each row is one document (one generator per row)."""
    rows = torch.arange(input_ids.shape[0])[:, None].expand(input_ids.shape)
    documents = rows if documents is None else documents.cpu()
    count = int(documents.max()) + 1 if documents.numel() else 0
    if len(generators) != count:
        raise ValueError(f"need one generator per document: got {len(generators)} for {count} documents.")
    valid_cpu = valid.bool().cpu()
    ratios, uniforms, token_ratios = torch.empty(count), torch.ones(input_ids.shape), torch.ones(input_ids.shape)
    for row in range(input_ids.shape[0]):
        for document, columns in _document_columns(documents[row]):
            where = columns[valid_cpu[row, columns]]  # the document's real tokens, in order
            every = torch.ones(len(where), dtype=torch.bool)
            if per_token:
                probabilities, document_uniforms = draw_token_noise(generators[document], every)
                token_ratios[row, where] = mask_ratio(probabilities, eps, high)
            else:
                ratio, document_uniforms = draw_noise(generators[document], 1, every)
                ratios[document] = ratio[0]
            uniforms[row, where] = document_uniforms
    if per_token:
        ratio = token_ratios.to(input_ids.device)
    else:
        ratio = mask_ratio(ratios, eps, high)[documents.clamp(min=0)].to(input_ids.device)
    masked = (labels != IGNORE_INDEX) & (uniforms.to(input_ids.device) < ratio)
    return masked, ratio


def _masked_targets(input_ids: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    return torch.where(masked, input_ids, torch.full_like(input_ids, IGNORE_INDEX))


def _rows(noisy, clean, masked, weights, valid, block_size, positions=None, documents=None) -> ScoringBatch:
    """Rows scored as they stand (full attention), or as ``[x_t | x_0]`` for block models, whose noisy copy holds
    only the blocks with a masked token (the others would be scored by nobody and seen by nobody). Packed rows
    bring their ``positions`` and ``documents``; other rows are placed by their padding."""
    positions = positions_from_padding(valid) if positions is None else positions
    targets = _masked_targets(clean, masked)
    if block_size is None:
        return ScoringBatch(noisy, positions, _attention(positions, valid, None, documents), targets, weights)
    columns = noisy_columns(blocks_with(masked, positions, block_size, documents) & valid.bool())
    ids, pos, mask = noisy_clean_layout(noisy, clean, positions, valid, block_size, columns, documents)
    built = columns >= 0
    noisy_targets = torch.where(built, targets.gather(-1, columns.clamp(min=0)), IGNORE_INDEX)
    noisy_weights = torch.where(built, weights.gather(-1, columns.clamp(min=0)), 0.0)
    return ScoringBatch(ids, pos, mask, torch.cat([noisy_targets, torch.full_like(targets, IGNORE_INDEX)], -1),
                        torch.cat([noisy_weights, weights * 0], -1))


# ------------------------------------------------------------------------------------------------------------
# Objectives
# ------------------------------------------------------------------------------------------------------------


def block_objective(
    input_ids, labels, valid, mask_token_id: int, block_size: int, generators, eps: float = 1e-3,
    weighting: str = "elbo", position_ids=None, documents=None, high: float = 1.0, per_token: bool = False,
) -> ScoringBatch:
    """SDAR / BD3-LM: ``[x_t | x_0]`` in one forward. Per sample ``t ~ U(eps, high)`` (``per_token``: per
    completion token), each completion token masked with probability t; the noisy copy of a block sees itself and
    the clean earlier blocks."""
    masked, ratio = _random_mask(input_ids, labels, valid, generators, eps, high, documents, per_token)
    noisy = input_ids.masked_fill(masked, mask_token_id)
    return _rows(noisy, input_ids, masked, _weights(masked, ratio, weighting), valid, block_size, position_ids,
                 documents)


def random_masking_objective(
    input_ids, labels, valid, mask_token_id: int, generators, eps: float = 1e-3, weighting: str = "elbo",
    position_ids=None, documents=None, high: float = 1.0, per_token: bool = False,
) -> ScoringBatch:
    """LLaDA / Dream masked-diffusion ELBO: per sample ``t ~ U(eps, high)`` (``per_token``: per completion token),
    mask completion tokens with probability t, score the masked ones (weight 1/t) under full attention."""
    masked, ratio = _random_mask(input_ids, labels, valid, generators, eps, high, documents, per_token)
    noisy = input_ids.masked_fill(masked, mask_token_id)
    return _rows(noisy, input_ids, masked, _weights(masked, ratio, weighting), valid, None, position_ids, documents)


def complementary_objective(
    input_ids, labels, valid, mask_token_id: int, generators, block_size: int | None = None, eps: float = 1e-3,
    weighting: str = "elbo", position_ids=None, documents=None, high: float | None = None,
) -> ScoringBatch:
    """Coupled masks (DiffuCoder): a mask M with ratio ``t ~ U(eps, high)`` (default ``high = 1 - eps``) and its
    complement over the completion, as two rows per sample, so every completion token is scored exactly once per
    pair. ELBO weights ``1 / (2t)`` and ``1 / (2(1 - t))`` average the two unbiased estimates."""
    high = 1.0 - eps if high is None else high
    masked, ratio = _random_mask(input_ids, labels, valid, generators, eps, high, documents=documents)
    complement = (labels != IGNORE_INDEX) & ~masked
    w1 = _weights(masked, ratio, weighting)
    w2 = _weights(complement, 1.0 - ratio, weighting)
    if weighting == "elbo":
        w1, w2 = w1 / 2, w2 / 2
    pair = torch.stack([masked, complement], 1).flatten(0, 1)
    weights = torch.stack([w1, w2], 1).flatten(0, 1)
    clean = input_ids.repeat_interleave(2, 0)
    noisy = clean.masked_fill(pair, mask_token_id)
    return _rows(noisy, clean, pair, weights, valid.repeat_interleave(2, 0), block_size, _twice(position_ids),
                 _twice(documents))


def _twice(rows: torch.Tensor | None) -> torch.Tensor | None:
    """Every row twice in a row (the mask and complement rows of a sample), or None."""
    return None if rows is None else rows.repeat_interleave(2, 0)


def semi_ar_objective(
    input_ids, labels, valid, mask_token_id: int, block_length: int, generators, eps: float = 1e-3,
    weighting: str = "elbo", high: float = 1.0, per_token: bool = False,
) -> ScoringBatch:
    """Semi-autoregressive SFT for full-attention models: blocks of ``block_length`` from the end of the prompt;
    one row per (sample, block b): blocks before b clean, block b masked with its own ``t_b ~ U(eps, high)``
    (``per_token``: each token with its own t, dLLM-RL's) (scored, weight 1/t_b), blocks after b fully masked (not
    scored). The blocks cover a row's labels from the first to the last as one span: rows with several labelled
    spans (assistant-only multi-turn) have no decoding state to match, and ``DiffusionSFTTrainer`` refuses them
    (``sft_trainer._span_counts``) before they get here."""
    batch = input_ids.shape[0]
    _check_generators(generators, batch)
    completion = labels != IGNORE_INDEX
    block = blocks_from_prompt_end(completion, block_length)
    rows_ids, rows_masked, rows_weights, rows_valid, rows_clean = [], [], [], [], []
    for row in range(batch):
        n_blocks = int(block[row].max()) + 1
        if per_token:  # one ratio per token, the same for every block's row
            probabilities, uniforms = draw_token_noise(generators[row], valid[row])
            ratios = mask_ratio(probabilities, eps, high).to(input_ids.device)[None].expand(max(n_blocks, 1), -1)
        else:  # one ratio per block
            ratios, uniforms = draw_noise(generators[row], n_blocks, valid[row])
            ratios = mask_ratio(ratios, eps, high).to(input_ids.device)
        uniforms = uniforms.to(input_ids.device)
        for b in range(max(n_blocks, 1)):
            if n_blocks == 0:  # nothing to score: one clean row keeps the batch non-empty
                masked = torch.zeros_like(completion[row])
                hidden, weight = masked, masked.float()
            else:
                masked = completion[row] & (block[row] == b) & (uniforms < ratios[b])
                hidden = masked | (completion[row] & (block[row] > b))
                weight = _weights(masked, ratios[b], weighting)
            rows_ids.append(input_ids[row].masked_fill(hidden, mask_token_id))
            rows_masked.append(masked)
            rows_weights.append(weight)
            rows_valid.append(valid[row])
            rows_clean.append(input_ids[row])
    stack = torch.stack
    return _rows(stack(rows_ids), stack(rows_clean), stack(rows_masked), stack(rows_weights), stack(rows_valid), None)


def never_committed_tail(generated: torch.Tensor, unmask_step: torch.Tensor) -> torch.Tensor:
    """The never-committed canvas tail of every row ``[B, L]``: the ``generated`` positions with ``unmask_step`` < 0
    (``states.NOT_COMMITTED``) after the row's last committed one. A rollout that stopped early leaves them
    (``generate()``'s -1 after the stop): masks in every state the sampler visited, which shaped the other tokens'
    logits, so a trajectory row keeps them, masked and unscored, as TraceRL and the value model do.

    The rule is the value trainer's: no -1 before a row's last committed position (no sampler leaves one: it stops
    between blocks), and a row with generated positions commits at least one of them (a row whose steps are all
    missing has nothing to train on). Either is refused, naming the rule."""
    generated = generated.bool()
    uncommitted = generated & (unmask_step < 0)
    committed = generated & ~uncommitted
    committed_later = committed.flip(-1).cumsum(-1).flip(-1) > 0  # a committed position here or after it
    tail = uncommitted & ~committed_later
    if bool((uncommitted & committed_later).any()):
        raise ValueError(
            "trajectory rows: a completion token has unmask_step -1 (never committed) before its row's last committed "
            "token. Only a trailing run of -1 is allowed: the canvas positions a rollout that stopped early never "
            "committed (generate()'s -1 after the stop), which are masked in every state and not scored. Every other "
            "completion token needs the sampler's step (>= 0)."
        )
    if bool((generated.any(-1) & ~committed.any(-1)).any()):
        raise ValueError(
            "trajectory rows: a row's completion has no committed token (every unmask_step is -1; a row without an "
            "'unmask_step' entry reads so), so there is nothing to train on; give each completion token the "
            "sampler's step that committed it."
        )
    return tail


def trajectory_objective(
    input_ids, labels, valid, unmask_step, mask_token_id: int, block_size: int | None = None, shrinkage: int = 1,
    generated: torch.Tensor | None = None,
) -> ScoringBatch:
    """Train on the states a recorded rollout actually visited: every committed completion token scored given the
    state before its (merged) denoising step, ``states.state_before_step``. Steps are merged ``shrinkage`` at a time,
    within each block for block-causal models (``states.step_groups``, as TraceRL). ``unmask_step`` ``[B, L]`` is
    the sampler's step per position.

    A row's canvas is its labelled completion plus ``generated`` ``[B, L]`` (optional; ``DiffusionDataCollator``
    moves the canvas tail out of the labels into it, so that only scored tokens are counted as loss tokens). Its
    positions with step -1 after the row's last committed one (``never_committed_tail``: a rollout that stopped
    early) are masked in every state and not scored, whether labelled or not; any other canvas position needs a
    step >= 0.

    Block-causal models whose rows are rollouts (the canvas one run to the row's end, its blocks committed one
    after another, as the block sampler commits them) get TraceRL's packed layout (``estimators.packing``: one row
    per sample, the clean sequence plus one noisy copy of a block per step); other rows get one whole row per
    state (``trajectory_state_rows``). Both score every token under the same state, so they give the same loss."""
    completion = labels != IGNORE_INDEX
    canvas = completion if generated is None else completion | generated.bool()
    tail = never_committed_tail(canvas, unmask_step)
    if bool((canvas & ~completion & ~tail).any()):
        raise ValueError("trajectory objective: `generated` positions without a label must be the never-committed "
                         "canvas tail (unmask_step -1 after the row's last committed token).")
    scored = canvas & ~tail
    positions = positions_from_padding(valid)
    blocks = block_index(positions, block_size) if block_size is not None else None  # merge within blocks, as TraceRL
    committed_steps = torch.where(scored, unmask_step, torch.full_like(unmask_step, NOT_COMMITTED))
    steps = step_groups(committed_steps, shrinkage, blocks)
    if (block_size is not None and bool(scored.any()) and _completion_ends_rows(canvas, valid)
            and _blocks_in_order(committed_steps, blocks)):
        return _packed_trajectory(input_ids, canvas, valid, steps, mask_token_id, block_size)
    return trajectory_state_rows(input_ids, scored, valid, steps, mask_token_id, block_size, generated=canvas)


def _completion_ends_rows(completion: torch.Tensor, valid: torch.Tensor) -> bool:
    """Whether each row's completion is one run of positions reaching the row's last real token (or empty)."""
    valid = valid.bool()
    cols = torch.arange(valid.shape[1], device=valid.device)
    last_real = torch.where(valid, cols, -1).max(-1).values
    first = torch.where(completion, cols, valid.shape[1]).min(-1).values
    span = (cols >= first[:, None]) & (cols <= last_real[:, None])
    return bool(torch.equal(completion & valid, span & valid & completion.any(-1, keepdim=True)))


def _blocks_in_order(unmask_step: torch.Tensor, blocks: torch.Tensor) -> bool:
    """Whether every row commits its blocks one after another: each block's steps all come after every step of the
    blocks before it (then a block's states see the earlier blocks clean, which the packed layout assumes)."""
    committed = unmask_step >= 0
    rows = torch.arange(unmask_step.shape[0], device=unmask_step.device)[:, None].expand_as(unmask_step)
    width = int(blocks.max()) + 1
    key = (rows * width + blocks)[committed]
    last = torch.full((unmask_step.shape[0] * width,), -1, device=unmask_step.device)
    last = last.scatter_reduce(0, key, unmask_step[committed], "amax").view(-1, width)
    first = torch.full_like(last.view(-1), 2**62).scatter_reduce(0, key, unmask_step[committed], "amin")
    first = first.view(-1, width)
    before = torch.cummax(last, dim=1).values  # latest step of this block and every block before it
    used = first < 2**62
    return bool((~used[:, 1:] | (first[:, 1:] > before[:, :-1])).all())


def _packed_trajectory(input_ids, completion, valid, steps, mask_token_id: int, block_size: int) -> ScoringBatch:
    """``trajectory_objective`` for block-causal ``prompt + completion`` rows, in TraceRL's packed layout: split
    each row at its first completion (canvas) token into a left-padded prompt and a right-padded completion, build
    the scoring row with ``estimators.packing.build_scoring_chunks`` (one chunk) and put the targets in place. A
    never-committed tail (``steps`` -1) is part of the canvas: masked in every state, scored nowhere."""
    width = input_ids.shape[1]
    cols = torch.arange(width, device=input_ids.device)
    valid = valid.bool()
    first = torch.where(completion, cols, width).min(-1).values
    end = torch.where(valid, cols, -1).max(-1).values + 1
    prompt_cols = first[:, None] - int(first.max()) + cols[: int(first.max())]
    completion_cols = first[:, None] + cols[: int((end - first).max())]
    prompt_mask = (prompt_cols >= 0) & _take(valid, prompt_cols, False)
    completion_mask = completion_cols < end[:, None]
    chunk = build_scoring_chunks(_take(input_ids, prompt_cols, 0), prompt_mask.long(),
                                 _take(input_ids, completion_cols, 0), _take(steps, completion_cols, NOT_COMMITTED),
                                 mask_token_id, block_size, completion_mask=completion_mask)[0]
    targets = torch.full_like(chunk.input_ids, IGNORE_INDEX)
    targets[chunk.chunk_row, chunk.chunk_col] = input_ids[chunk.source_row, first[chunk.source_row] + chunk.source_col]
    return ScoringBatch(chunk.input_ids, chunk.position_ids, chunk.layout, targets, (targets != IGNORE_INDEX).float())


def _take(rows: torch.Tensor, columns: torch.Tensor, fill) -> torch.Tensor:
    """``rows`` gathered at ``columns`` ``[B, K]``; ``fill`` where a column lies outside the row."""
    inside = (columns >= 0) & (columns < rows.shape[1])
    return torch.where(inside, rows.gather(1, columns.clamp(0, rows.shape[1] - 1)), torch.full_like(columns, fill,
                                                                                                     dtype=rows.dtype))


def trajectory_state_rows(input_ids, completion, valid, steps, mask_token_id: int,
                          block_size: int | None = None, generated: torch.Tensor | None = None) -> ScoringBatch:
    """One row per (row, merged step ``steps``): the whole row in the state before that step
    (``states.state_before_step``), scoring the ``completion`` tokens committed at it; the slow obvious layout.
    ``generated`` (default ``completion``): the rows' canvas positions; those without a step (a never-committed
    tail) are masks in every state."""
    generated = completion if generated is None else generated.bool()
    positions = positions_from_padding(valid)
    rows = {"ids": [], "pos": [], "valid": [], "targets": []}
    for row in range(input_ids.shape[0]):
        row_steps = torch.unique(steps[row][completion[row]]).tolist() or [None]
        for step in row_steps:
            if step is None:  # nothing to score: one clean row keeps the batch non-empty
                state, scored = input_ids[row], torch.zeros_like(completion[row])
            else:
                state = state_before_step(input_ids[row : row + 1], steps[row : row + 1], generated[row : row + 1],
                                          step, mask_token_id)[0]
                scored = completion[row] & (steps[row] == step)
            rows["ids"].append(state)
            rows["pos"].append(positions[row])
            rows["valid"].append(valid[row])
            rows["targets"].append(_masked_targets(input_ids[row], scored))
    ids, pos, row_valid, targets = (torch.stack(rows[k]) for k in ("ids", "pos", "valid", "targets"))
    weights = (targets != IGNORE_INDEX).float()
    return ScoringBatch(ids, pos, _attention(pos, row_valid.bool(), block_size), targets, weights)


# ------------------------------------------------------------------------------------------------------------
# Scoring and loss
# ------------------------------------------------------------------------------------------------------------


def score_tokens(
    model, batch: ScoringBatch, logits_shift: bool = False, mask_token_id: int | None = None,
    attention_backend: str = "auto", router_loss: bool = False,
) -> TokenScores:
    """One forward over ``batch``; log-prob, entropy and top-1 of every target (fp32, only at scored
    positions). ``logits_shift`` (Dream): position i is predicted from logits[i-1], so position 0 is never
    scored. With ``mask_token_id`` the mask token is removed from the distribution, exactly as the sampler
    removes it (``generation.sampling.sampling_logits``), so training and decoding share one distribution.
    ``attention_backend`` (``states.ATTENTION_BACKENDS``) says how the layout's mask is built. The LM head runs
    only at the scored positions (``logits_to_keep``). ``router_loss`` (mixture-of-experts models; the trainer
    decides, whatever the model config says): also the forward's load-balancing ``aux_loss``, over the tokens it
    really processed (the layout's ``valid``: a packed or padded row's padding is left out)."""
    mask = None
    if batch.layout is not None:
        backend = resolve_model_attention_backend(attention_backend, model, batch.input_ids.device)
        mask = batch.layout.attention_mask(backend)
    scored = scorable(batch, logits_shift)
    rows, cols = scored.nonzero(as_tuple=True)  # row-major, the order of batch.targets[scored]
    output = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids,
                   logits_to_keep=(rows, cols - 1 if logits_shift else cols), output_router_logits=router_loss,
                   router_loss_mask=None if batch.layout is None else batch.layout.valid)
    picked, entropy, top1 = target_scores(output.logits, batch.targets[scored], mask_token_id=mask_token_id,
                                          entropy=True, entropy_grad=False, top1=True)
    zeros = torch.zeros(scored.shape, dtype=picked.dtype, device=picked.device)
    return TokenScores(
        log_probs=zeros.masked_scatter(scored, picked),
        entropy=zeros.detach().masked_scatter(scored, entropy),
        is_top1=torch.zeros_like(scored).masked_scatter(scored, top1),
        scored=scored,
        aux_loss=output.aux_loss if router_loss else None,
    )


def split_rows(batch: ScoringBatch, token_budget: int | None) -> list[ScoringBatch]:
    """``batch`` cut into consecutive row ranges of at most ``token_budget`` padded tokens (rows x width; a row
    wider than the budget alone), one forward each; ``[batch]`` itself when it fits or without a budget."""
    rows, width = batch.input_ids.shape
    ranges = row_chunks([width] * rows, token_budget)
    if len(ranges) == 1:
        return [batch]
    return [ScoringBatch(batch.input_ids[first:last], batch.position_ids[first:last],
                         None if batch.layout is None else batch.layout.rows(first, last),
                         batch.targets[first:last], batch.weights[first:last]) for first, last in ranges]


def joined_scores(parts: list[TokenScores]) -> TokenScores:
    """The token scores of the forwards ``split_rows`` made, as one batch's (detached: for metrics); ``aux_loss`` is
    the mean of the forwards' (GRPO's rule for a batch scored in several forwards)."""
    if len(parts) == 1:
        return parts[0]
    aux = [part.aux_loss.detach() for part in parts if part.aux_loss is not None]
    return TokenScores(
        log_probs=torch.cat([part.log_probs.detach() for part in parts]),
        entropy=torch.cat([part.entropy for part in parts]),
        is_top1=torch.cat([part.is_top1 for part in parts]),
        scored=torch.cat([part.scored for part in parts]),
        aux_loss=torch.stack(aux).mean() if aux else None,
    )


def scorable(batch: ScoringBatch, logits_shift: bool = False) -> torch.Tensor:
    """The positions ``score_tokens`` scores: the targets, less (``logits_shift``) the first token of a row or of a
    packed row's document, which nothing predicts."""
    scored = batch.targets != IGNORE_INDEX
    if logits_shift:
        scored[:, 0] = False
        scored &= batch.position_ids != 0
    return scored


def count_loss_tokens(labels: torch.Tensor, logits_shift: bool = False) -> torch.Tensor:
    """Number of scorable tokens in a collated batch: the normaliser ``num_items_in_batch`` must equal."""
    return (labels[..., 1:] if logits_shift else labels).ne(IGNORE_INDEX).sum()


def diffusion_loss(
    model, batch: ScoringBatch, normaliser: torch.Tensor | int, logits_shift: bool = False,
    mask_token_id: int | None = None, loss_type: str = "nll", attention_backend: str = "auto",
    router_loss: bool = False,
) -> tuple[torch.Tensor, TokenScores]:
    """``sum(weight * -log p(target)) / normaliser`` and the token scores (see ``score_tokens``; with
    ``router_loss`` they carry the forward's load-balancing ``aux_loss``, which the caller weighs and adds).
    ``loss_type="dft"`` multiplies each token's loss by its detached probability (TRL's DFT)."""
    scores = score_tokens(model, batch, logits_shift, mask_token_id, attention_backend, router_loss)
    per_token = -scores.log_probs * batch.weights.to(scores.log_probs.dtype)
    if loss_type == "dft":
        per_token = per_token * scores.log_probs.detach().exp()
    elif loss_type != "nll":
        raise ValueError(f"unknown loss_type {loss_type!r}; choose 'nll' or 'dft'.")
    normaliser = torch.as_tensor(normaliser, device=per_token.device).clamp(min=1)
    return per_token.sum() / normaliser, scores


def per_row_weights(batch: ScoringBatch, normalization: str, sample_tokens: torch.Tensor | None = None,
                    logits_shift: bool = False, length: int | None = None) -> torch.Tensor:
    """``batch.weights`` divided, row by row, by the row's masked (scored) token count (``row_masked``), by
    ``sample_tokens`` ``[rows]``, the loss-token count of the sample each row comes from (``row_tokens``), or by
    ``length`` for every row (``row_length``); a row with nothing to divide by keeps weight 0. Summed and divided
    by ``rows_averaged``, the loss is the official per-row mean."""
    if normalization == "row_masked":  # a masked token nothing predicts (``logits_shift``) is not counted
        counts = scorable(batch, logits_shift).sum(-1)
    elif normalization == "row_tokens":
        if sample_tokens is None or len(sample_tokens) != batch.targets.shape[0]:
            raise ValueError("row_tokens needs the loss-token count of each row's sample (one row per sample).")
        counts = sample_tokens
    elif normalization == "row_length":
        if length is None or length < 1:
            raise ValueError(f"row_length needs a length >= 1, got {length!r}.")
        counts = torch.full((batch.targets.shape[0],), length)
    else:
        raise ValueError(f"unknown per-row normalization {normalization!r}; choose one of {LOSS_NORMALIZATIONS[1:]}.")
    return batch.weights / counts.clamp(min=1).to(batch.weights)[:, None]


def rows_averaged(batch: ScoringBatch, normalization: str, logits_shift: bool = False) -> int:
    """How many rows the per-row mean of ``per_row_weights`` divides by. ``row_masked`` and ``row_length``: the rows
    with a scored token (a row with none has no loss to average; dLLM-RL's SFT drops such rows when it builds them,
    ``keep = p_mask.any(dim=1)``). ``row_tokens``: every row (LLaDA's SFT averages over its whole batch)."""
    if normalization in ("row_masked", "row_length"):
        return int(scorable(batch, logits_shift).any(-1).sum())
    return batch.targets.shape[0]


def build_objective(
    objective: str, input_ids, labels, valid, generators, *, mask_token_id: int, block_size: int | None,
    eps: float = 1e-3, weighting: str = "elbo", semi_ar_block_length: int = 32, unmask_step=None, shrinkage: int = 1,
    position_ids=None, documents=None, high: float | None = None, per_token: bool = False, generated=None,
) -> ScoringBatch:
    """Dispatch by name; ``block_size`` is the model's block-causal block size (None = full attention). Packed
    rows give ``documents`` and their ``position_ids`` (``PACKED_OBJECTIVES`` only) and one generator per
    document. Mask ratios lie in ``[eps, high]`` (default ``high``: 1, ``complementary`` 1 - eps), one per sample
    or, with ``per_token`` (``PER_TOKEN_OBJECTIVES``), one per completion token. ``generated`` (``trajectory``
    only): each row's canvas, its never-committed tail included (see ``trajectory_objective``)."""
    if per_token and objective not in PER_TOKEN_OBJECTIVES:
        raise ValueError(f"per-token mask ratios apply to {PER_TOKEN_OBJECTIVES}, not to {objective!r}.")
    noise = {"high": 1.0 if high is None else high, "per_token": per_token}
    if documents is not None:
        if objective not in PACKED_OBJECTIVES:
            raise ValueError(f"the {objective!r} objective does not take packed rows (packing / padding_free); "
                             f"packed rows train with {PACKED_OBJECTIVES}.")
        if position_ids is None:
            raise ValueError("packed rows need their position_ids (restarting at 0 for every document).")
    packed = {"position_ids": position_ids, "documents": documents}
    if objective == "block":
        if block_size is None:
            raise ValueError("the 'block' objective needs a block-causal model (block_size).")
        return block_objective(input_ids, labels, valid, mask_token_id, block_size, generators, eps, weighting,
                               **packed, **noise)
    if objective == "random_masking":
        return random_masking_objective(input_ids, labels, valid, mask_token_id, generators, eps, weighting, **packed,
                                        **noise)
    if objective == "semi_ar":
        return semi_ar_objective(input_ids, labels, valid, mask_token_id, semi_ar_block_length, generators, eps,
                                 weighting, **noise)
    if objective == "complementary":
        return complementary_objective(input_ids, labels, valid, mask_token_id, generators, block_size, eps, weighting,
                                       **packed, high=high)
    if objective == "trajectory":
        if unmask_step is None:
            raise ValueError("the 'trajectory' objective needs the recorded `unmask_step` of every row.")
        return trajectory_objective(input_ids, labels, valid, unmask_step, mask_token_id, block_size, shrinkage,
                                    generated)
    raise ValueError(f"unknown diffusion objective {objective!r}; choose one of {OBJECTIVES}.")
