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

from ..states import CLEAN, NOT_COMMITTED, AttentionLayout, block_index, positions_from_padding, state_before_step


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


def _chunks_from_rows(rows: list[dict], pad_id: int, token_budget: int | None) -> list[ScoringChunk]:
    """Pad variable-length packed rows into chunks whose padded size stays within ``token_budget``."""
    chunks, current = [], []

    def flush():
        if not current:
            return
        width = max(r["ids"].shape[0] for r in current)
        device = current[0]["ids"].device
        n = len(current)
        ids = torch.full((n, width), pad_id, dtype=torch.long, device=device)
        pos = torch.zeros((n, width), dtype=torch.long, device=device)
        block = torch.zeros((n, width), dtype=torch.long, device=device)
        copy = torch.full((n, width), CLEAN, dtype=torch.long, device=device)
        valid = torch.zeros((n, width), dtype=torch.bool, device=device)
        rows_, cols_, srows, scols = [], [], [], []
        for i, r in enumerate(current):
            length = r["ids"].shape[0]
            ids[i, :length], pos[i, :length] = r["ids"], r["pos"]
            block[i, :length], copy[i, :length], valid[i, :length] = r["block"], r["copy"], True
            rows_.append(torch.full_like(r["targets"], i))
            cols_.append(r["targets"])
            srows.append(torch.full_like(r["targets"], r["source_row"]))
            scols.append(r["source_cols"])
        chunks.append(ScoringChunk(ids, pos, AttentionLayout(block, copy, valid), torch.cat(rows_), torch.cat(cols_),
                                   torch.cat(srows), torch.cat(scols)))
        current.clear()

    for row in rows:
        candidate = current + [row]
        size = len(candidate) * max(r["ids"].shape[0] for r in candidate)
        if current and token_budget is not None and size > token_budget:
            flush()
        current.append(row)
    flush()
    return chunks


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
) -> list[ScoringChunk]:
    """Chunks that score completion tokens given the state before their group.

    ``prompt_ids`` / ``prompt_mask`` ``[B, P]`` left-padded; ``completion_ids`` / ``groups`` ``[B, C]`` (the whole
    sampler canvas: every completion column existed during sampling). ``block_size`` None = full attention.
    ``scored`` ``[B, C]`` limits the targets (default: every token with a group); groups without a scored token
    get no row or copy. ``prompt_noise`` ``[B, P]`` masks those prompt tokens in every row (d1's estimator).
    """
    batch, prompt_width = prompt_ids.shape
    if prompt_noise is not None:
        prompt_ids = prompt_ids.masked_fill(prompt_noise.bool() & prompt_mask.bool(), mask_token_id)
    if scored is None:
        scored = groups >= 0
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    valid = torch.cat([prompt_mask.bool(), torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    generated = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool),
                           torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    full_groups = torch.cat([torch.full_like(prompt_ids, NOT_COMMITTED), groups], dim=1)
    full_scored = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool), scored.bool() & (groups >= 0)], dim=1)
    positions = positions_from_padding(valid)
    rows = []
    for r in range(batch):
        keep = valid[r]
        r_ids, r_pos, r_gen, r_groups = ids[r][keep], positions[r][keep], generated[r][keep], full_groups[r][keep]
        r_scored = full_scored[r][keep]
        offset = int((~keep).sum())  # left padding removed: completion col c sits at (P - offset) + c
        n_groups = int(r_groups.max()) + 1 if bool((r_groups >= 0).any()) else 0
        if n_groups == 0 or not bool(r_scored.any()):
            continue
        completion_start = prompt_width - offset
        live_groups = [g for g in range(n_groups) if bool((r_scored & (r_groups == g)).any())]
        if block_size is None:
            for g in live_groups:
                state = state_before_step(r_ids[None], r_groups[None], r_gen[None], g, mask_token_id)[0]
                targets = (r_scored & (r_groups == g)).nonzero().squeeze(-1)
                rows.append({"ids": state, "pos": r_pos, "block": torch.zeros_like(r_pos),
                             "copy": torch.full_like(r_pos, CLEAN), "targets": targets, "source_row": r,
                             "source_cols": targets - completion_start})
            continue
        blocks = block_index(r_pos, block_size)
        pieces_ids, pieces_pos, pieces_block, targets, source_cols = [r_ids], [r_pos], [blocks], [], []
        pieces_copy = [torch.full_like(r_pos, CLEAN)]
        cursor = len(r_ids)
        for g in live_groups:
            in_group = r_scored & (r_groups == g)
            b = int(blocks[in_group][0])
            cols = (blocks == b).nonzero().squeeze(-1)
            state = state_before_step(r_ids[None], r_groups[None], r_gen[None], g, mask_token_id)[0][cols]
            pieces_ids.append(state)
            pieces_pos.append(r_pos[cols])
            pieces_block.append(blocks[cols])
            local = in_group[cols].nonzero().squeeze(-1)
            targets.append(cursor + local)
            source_cols.append(cols[local] - completion_start)
            pieces_copy.append(torch.full_like(cols, len(pieces_copy) - 1))
            cursor += len(cols)
        rows.append({"ids": torch.cat(pieces_ids), "pos": torch.cat(pieces_pos), "block": torch.cat(pieces_block),
                     "copy": torch.cat(pieces_copy), "targets": torch.cat(targets), "source_row": r,
                     "source_cols": torch.cat(source_cols)})
    return _chunks_from_rows(rows, pad_token_id, token_budget)
