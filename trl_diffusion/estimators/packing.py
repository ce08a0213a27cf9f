"""Layouts that score many trajectory states in few forwards (shared by the policy estimators and the value
model).

A response's committed tokens are split into *groups*: consecutive denoising steps merged ``shrinkage`` at a
time (within each block for block-causal models, over the whole response otherwise, as TraceRL does). The
state before group ``g`` shows every token of an earlier group and masks every other generated position; the
targets of group ``g`` are its own tokens.

* Block-causal models: one packed row per response, ``[prompt | clean completion | noisy copies]``, one noisy
  copy of a block per group. A copy sees the clean blocks before its block and itself; the clean part is
  block-causal and never sees a copy (``states.may_attend``). Copies reuse the positions of their block.
* Full-attention models: one row per (response, group), each the whole sequence in that state.

Rows are cut into chunks of at most ``token_budget`` tokens (one forward each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..states import CLEAN, NOT_COMMITTED, AttentionLayout, block_index, state_before_step


@dataclass
class ScoringChunk:
    """One forward: inputs, the attention layout (``layout.attention_mask(backend)`` is the mask), plus where its
    targets come from (``source_row``, ``source_col`` in the completion) and where they sit in this chunk
    (``chunk_row``, ``chunk_col``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    layout: AttentionLayout
    chunk_row: torch.Tensor
    chunk_col: torch.Tensor
    source_row: torch.Tensor
    source_col: torch.Tensor


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def build_scoring_chunks(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    groups: torch.Tensor,
    mask_token_id: int,
    block_size: int | None,
    token_budget: int | None = None,
    pad_token_id: int = 0,
    scored: torch.Tensor | None = None,
    prompt_noise: torch.Tensor | None = None,
    completion_mask: torch.Tensor | None = None,
) -> list[ScoringChunk]:
    """Chunks that score completion tokens given the state before their group.

    ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` left-padded; ``completion_ids`` / ``groups`` ``[B, C]`` (the whole
    sampler canvas: every completion column existed during sampling). ``block_size`` None = full attention.
    ``scored`` ``[B, C]`` limits the targets (default: every token with a group); groups without a scored token
    get no row or copy. ``prompt_noise`` ``[B, P]`` masks those prompt tokens in every row (d1's estimator).
    ``completion_mask`` ``[B, C]``: the columns that belong to each row's canvas (default: all); the rest is
    right padding of rows with shorter canvases and is left out of every state.

    Block-causal rows keep their clean part only up to the last block that holds a copy: a copy sees clean blocks
    strictly before its own, so later clean tokens would be seen by nothing that is scored. Built with tensor
    operations over the whole batch (each row's real tokens are compacted first, so a position is its index).
    """
    batch, prompt_width = prompt_ids.shape
    device = completion_ids.device
    if prompt_noise is not None:
        prompt_ids = prompt_ids.masked_fill(prompt_noise.bool() & prompt_mask.bool(), mask_token_id)
    if scored is None:
        scored = groups >= 0
    no = torch.zeros_like(prompt_mask, dtype=torch.bool)
    yes = torch.ones_like(completion_ids, dtype=torch.bool) if completion_mask is None else completion_mask.bool()
    valid = torch.cat([prompt_mask.bool(), yes], dim=1)
    order = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices  # each row's real tokens first
    ids = torch.cat([prompt_ids, completion_ids], dim=1).gather(1, order)
    token_group = torch.cat([torch.full_like(prompt_ids, NOT_COMMITTED), groups], dim=1).gather(1, order)
    target = torch.cat([no, scored.bool() & (groups >= 0) & yes], dim=1).gather(1, order)
    generated = torch.cat([no, yes], dim=1).gather(1, order)
    source_col = order - prompt_width  # completion column of each compact position
    n_valid = valid.sum(1)
    if not bool(target.any()):
        return []

    # live (row, group) pairs, sorted by row then group: one noisy state each
    rows_of, pos_of = target.nonzero(as_tuple=True)
    n_groups = int(token_group.max()) + 1
    pair_key = torch.unique(rows_of * n_groups + token_group[rows_of, pos_of])
    pair_row, pair_group = torch.div(pair_key, n_groups, rounding_mode="floor"), pair_key % n_groups
    n_pairs = len(pair_key)
    if block_size is None:  # one whole row per pair, in the state before its group
        seg_out, seg_src, seg_group = torch.arange(n_pairs, device=device), pair_row, pair_group
        seg_start, seg_len = torch.zeros_like(pair_row), n_valid[pair_row]
        seg_copy = torch.full_like(pair_row, CLEAN)
    else:  # per row: [clean part | one copy of its block per pair]
        first_pos = torch.full((batch * n_groups,), ids.shape[1], dtype=torch.long, device=device)
        first_pos = first_pos.scatter_reduce(0, rows_of * n_groups + token_group[rows_of, pos_of], pos_of, "amin")
        pair_block = torch.div(first_pos[pair_key], block_size, rounding_mode="floor")
        out_rows, pair_out, pairs_per_row = torch.unique(pair_row, return_inverse=True, return_counts=True)
        last_block = torch.zeros_like(out_rows).scatter_reduce(0, pair_out, pair_block, "amax")
        copy_start = pair_block * block_size
        n_out = len(out_rows)
        seg_out = torch.cat([torch.arange(n_out, device=device), pair_out])
        seg_src = torch.cat([out_rows, pair_row])
        seg_group = torch.cat([torch.full_like(out_rows, NOT_COMMITTED), pair_group])
        seg_start = torch.cat([torch.zeros_like(out_rows), copy_start])
        seg_len = torch.cat([torch.minimum(n_valid[out_rows], last_block * block_size),
                             torch.minimum(n_valid[pair_row], copy_start + block_size) - copy_start])
        copy_rank = torch.arange(n_pairs, device=device) - _exclusive_cumsum(pairs_per_row)[pair_out]
        seg_copy = torch.cat([torch.full_like(out_rows, CLEAN), copy_rank])
        seg_order = torch.argsort(seg_out * 2 + (seg_group >= 0).long(), stable=True)  # clean part first
        seg_out, seg_src, seg_group, seg_start, seg_len, seg_copy = (
            t[seg_order] for t in (seg_out, seg_src, seg_group, seg_start, seg_len, seg_copy))

    # every token of every packed row, in order
    n_rows = int(seg_out.max()) + 1
    row_len = torch.zeros(n_rows, dtype=torch.long, device=device).index_add_(0, seg_out, seg_len)
    slot_seg = torch.repeat_interleave(torch.arange(len(seg_len), device=device), seg_len)
    slot = torch.arange(len(slot_seg), device=device)
    pos = seg_start[slot_seg] + slot - _exclusive_cumsum(seg_len)[slot_seg]
    out_row, src_row, state = seg_out[slot_seg], seg_src[slot_seg], seg_group[slot_seg]
    col = slot - _exclusive_cumsum(row_len)[out_row]
    group = token_group[src_row, pos]
    in_state = state >= 0
    clean_ids = ids[src_row, pos]
    state_ids = state_before_step(clean_ids[:, None], group[:, None], generated[src_row, pos][:, None], state,
                                  mask_token_id)[:, 0]
    slot_ids = torch.where(in_state, state_ids, clean_ids)
    is_target = in_state & (group == state) & target[src_row, pos]
    slot_block = block_index(pos, block_size) if block_size is not None else torch.zeros_like(pos)
    slot_copy = seg_copy[slot_seg]

    chunks = []
    bounds = torch.cat([torch.zeros(1, dtype=torch.long, device=device), torch.cumsum(row_len, 0)]).tolist()
    lengths = row_len.tolist()  # on the host once: no device sync per chunk
    for first, last in row_chunks(lengths, token_budget):
        part = slice(bounds[first], bounds[last])
        n, width = last - first, max(lengths[first:last])
        where = (out_row[part] - first, col[part])
        chunk_ids = torch.full((n, width), pad_token_id, dtype=torch.long, device=device).index_put(where,
                                                                                                   slot_ids[part])
        zeros = torch.zeros((n, width), dtype=torch.long, device=device)
        layout = AttentionLayout(zeros.index_put(where, slot_block[part]),
                                 torch.full_like(zeros, CLEAN).index_put(where, slot_copy[part]),
                                 torch.zeros((n, width), dtype=torch.bool, device=device).index_put(
                                     where, torch.ones_like(pos[part], dtype=torch.bool)))
        targets = is_target[part]
        chunks.append(ScoringChunk(chunk_ids, zeros.index_put(where, pos[part]), layout, where[0][targets],
                                   where[1][targets], src_row[part][targets],
                                   source_col[src_row[part][targets], pos[part][targets]]))
    return chunks


def row_chunks(lengths: list[int], token_budget: int | None) -> list[tuple[int, int]]:
    """Consecutive ``[first, last)`` row ranges whose padded size (rows x longest row) stays within
    ``token_budget`` (a row longer than the budget gets a chunk of its own)."""
    ranges, first, longest = [], 0, 0
    for i, length in enumerate(lengths):
        longest_with = max(longest, length)
        if i > first and token_budget is not None and (i - first + 1) * longest_with > token_budget:
            ranges.append((first, i))
            first, longest_with = i, length
        longest = longest_with
    ranges.append((first, len(lengths)))
    return ranges
