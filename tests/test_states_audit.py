"""Seeded fuzz of ``trl_diffusion.states`` against slow, obvious reference rules (Python loops over query i and key
j): the training layouts (plain, packed, ``[x_t | x_0]`` with noisy copies) as dense SDPA masks and as flex
``BlockMask`` element masks on every real query, the positions-based model mask, merged-step groups, and the
block alignment shared by the sampler's canvas and the estimators. Finally a packed noisy row through a tiny SDAR
model (SDPA and flex, forward only on CPU) against each document scored alone."""

import random

import torch
from torch.nn.attention.flex_attention import create_mask

from trl_diffusion.states import (
    AttentionLayout,
    CanvasLayout,
    attention_mask_from_positions,
    blocks_with,
    completion_blocks,
    noisy_clean_attention_layout,
    noisy_clean_layout,
    noisy_columns,
    positions_from_padding,
    step_groups,
)
from trl_diffusion.testing import MASK_ID, tiny_model


def random_row_layout(rng: random.Random, packed: bool, left: bool):
    """``positions, documents, valid [B, L]``: rows of documents (positions restarting per document), padded on the
    right (or, unpacked, on the left), rows of different lengths; a row may be all padding."""
    batch = rng.randint(1, 3)
    rows = [[rng.randint(1, 9) for _ in range(rng.randint(0, 3) if packed else rng.randint(0, 1))]
            for _ in range(batch)]
    lengths = [sum(r) for r in rows]
    width = max(1, max(lengths) + rng.randint(0, 3))
    positions = torch.zeros(batch, width, dtype=torch.long)
    documents = torch.full((batch, width), -1)
    document = 0
    for b, row in enumerate(rows):
        col = width - lengths[b] if left else 0
        for size in row:
            positions[b, col:col + size] = torch.arange(size)
            documents[b, col:col + size] = document
            col, document = col + size, document + 1
    return positions, documents, documents >= 0


def reference_noisy_clean(positions, documents, valid, block_size, columns, packed):
    """The rule, token by token: clean sees clean of its own and earlier blocks; a noisy copy sees its own block's
    noisy tokens and the clean tokens of earlier blocks; nobody sees padding or another document; padding queries
    are opened to every key (dense convention)."""
    batch, length = positions.shape
    tokens = []
    for b in range(batch):
        row = []
        for j in range(columns.shape[1]):
            c = int(columns[b, j])
            row.append((False, True, -2, 0) if c < 0 else
                       (bool(valid[b, c]), True, int(documents[b, c]), int(positions[b, c]) // block_size))
        row += [(bool(valid[b, c]), False, int(documents[b, c]), int(positions[b, c]) // block_size)
                for c in range(length)]
        tokens.append(row)
    n = len(tokens[0])
    out = torch.zeros(batch, n, n, dtype=torch.bool)
    for b in range(batch):
        for i, (q_valid, q_noisy, q_doc, q_block) in enumerate(tokens[b]):
            for j, (k_valid, k_noisy, k_doc, k_block) in enumerate(tokens[b]):
                if not q_valid:
                    out[b, i, j] = True
                    continue
                if not k_valid or (packed and q_doc != k_doc):
                    continue
                if not q_noisy and not k_noisy:
                    out[b, i, j] = k_block <= q_block
                elif q_noisy and not k_noisy:
                    out[b, i, j] = k_block < q_block
                elif q_noisy and k_noisy:
                    out[b, i, j] = k_block == q_block
    return out


def reference_plain(positions, documents, valid, block_size, packed):
    batch, length = positions.shape
    out = torch.zeros(batch, length, length, dtype=torch.bool)
    for b in range(batch):
        for i in range(length):
            for j in range(length):
                if not valid[b, i]:
                    out[b, i, j] = True
                    continue
                ok = bool(valid[b, j]) and (not packed or bool(documents[b, i] == documents[b, j]))
                if block_size is not None:
                    ok = ok and int(positions[b, j]) // block_size <= int(positions[b, i]) // block_size
                out[b, i, j] = ok
    return out


def flex_elements(layout):
    block_mask = layout.block_mask()
    batch, length = layout.block.shape
    return create_mask(block_mask.mask_mod, batch, 1, length, length, device="cpu")[:, 0]


def check_both_backends(layout, reference):
    dense = layout.dense()[:, 0]
    assert torch.equal(dense, reference)
    flex = flex_elements(layout)
    assert torch.equal(flex[layout.valid], dense[layout.valid])  # every real query: the same keys
    assert not flex[~layout.valid].any()  # padding queries see nothing under flex


def test_training_layouts_match_the_reference_rule_under_both_backends():
    crossings = 0  # not vacuous: packed rows whose document rule matters
    for seed in range(60):
        rng = random.Random(seed)
        packed = rng.random() < 0.6
        left = not packed and rng.random() < 0.5
        positions, documents, valid = random_row_layout(rng, packed, left)
        if left:
            positions = positions_from_padding(valid)
        block_size = rng.randint(1, 8)
        docs = documents if packed else None
        keep = torch.rand(positions.shape, generator=torch.Generator().manual_seed(seed)) < rng.random()
        columns = noisy_columns(keep) if rng.random() < 0.7 else None
        all_columns = torch.arange(positions.shape[1]).expand_as(positions) if columns is None else columns
        with torch.no_grad():
            layout = noisy_clean_attention_layout(positions, valid, block_size, columns, docs)
            reference = reference_noisy_clean(positions, documents, valid, block_size, all_columns, packed)
            check_both_backends(layout, reference)
            if packed:
                crossings += not torch.equal(
                    noisy_clean_attention_layout(positions, valid, block_size, columns).dense()[:, 0], reference)
            for blocks in (None, block_size):
                layout = AttentionLayout.plain(positions, valid, blocks, docs)
                check_both_backends(layout, reference_plain(positions, documents, valid, blocks, packed))
    assert crossings >= 10


def test_positions_mask_matches_the_reference_rule():
    for seed in range(80):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        batch, q_len, k_len = rng.randint(1, 3), rng.randint(1, 9), rng.randint(1, 12)
        q_pos = torch.randint(0, 20, (batch, q_len), generator=gen)
        k_pos = torch.randint(0, 20, (batch, k_len), generator=gen)
        k_valid = torch.rand(batch, k_len, generator=gen) < 0.7 if rng.random() < 0.8 else None
        block_size = rng.choice([None, 1, 2, 3, 4, 5, 8])
        mask = attention_mask_from_positions(q_pos, k_pos, k_valid, block_size)[:, 0]
        for b in range(batch):
            for i in range(q_len):
                row = [(k_valid is None or bool(k_valid[b, j]))
                       and (block_size is None or int(k_pos[b, j]) // block_size <= int(q_pos[b, i]) // block_size)
                       for j in range(k_len)]
                expected = row if any(row) else [True] * k_len  # an empty row is opened (finite, never read)
                assert mask[b, i].tolist() == expected, (seed, b, i)


def reference_step_groups(steps, shrinkage, blocks):
    out = torch.full_like(steps, -1)
    for b in range(steps.shape[0]):
        committed = [i for i in range(steps.shape[1]) if steps[b, i] >= 0]
        block_of = {i: int(blocks[b, i]) if blocks is not None else 0 for i in committed}
        groups = []
        for block in sorted(set(block_of.values())):
            distinct = sorted({int(steps[b, i]) for i in committed if block_of[i] == block})
            groups += [(chunk[0], block, chunk) for chunk in
                       (distinct[k:k + shrinkage] for k in range(0, len(distinct), shrinkage))]
        groups.sort(key=lambda g: (g[0], g[1]))
        group_of = {(block, s): gid for gid, (_, block, chunk) in enumerate(groups) for s in chunk}
        for i in committed:
            out[b, i] = group_of[(block_of[i], int(steps[b, i]))]
    return out


def test_step_groups_match_the_reference():
    for seed in range(80):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        batch, length = rng.randint(1, 3), rng.randint(1, 14)
        steps = torch.randint(-1, 8, (batch, length), generator=gen)
        blocks = torch.randint(0, 3, (batch, length), generator=gen).sort(-1).values if rng.random() < 0.6 else None
        shrinkage = rng.randint(1, 4)
        assert torch.equal(step_groups(steps, shrinkage, blocks), reference_step_groups(steps, shrinkage, blocks))


def test_sampler_canvas_and_completion_blocks_agree():
    """Block-causal: the canvas's blocks start at multiples of the block in every row's own positions, and the
    block of each generated column is the one ``completion_blocks`` (estimators, TraceRL) gives it."""
    for seed in range(150):
        rng = random.Random(seed)
        batch, block, new = rng.randint(1, 4), rng.randint(1, 8), rng.randint(1, 20)
        lengths = [rng.randint(1, 17) for _ in range(batch)]
        width = max(lengths)
        prompt_mask = torch.tensor([[False] * (width - p) + [True] * p for p in lengths])
        for causal in (True, False):
            layout = CanvasLayout(lengths, new, block, causal)
            positions = layout.positions("cpu")
            for b in range(batch):
                pad, start, end = layout.left_pad[b], layout.gen_start[b], layout.gen_end[b]
                assert positions[b, pad:end].tolist() == list(range(end - pad))
                assert end - start >= new
                if causal:
                    assert all((s - pad) % block == 0 for s in layout.block_starts)
                    blocks = completion_blocks(prompt_mask, end - start, block)[b].tolist()
                    assert blocks == [(c - pad) // block for c in range(start, end)]
                    assert all(any(s <= c < layout.block_end(s) for s in layout.block_starts)
                               for c in range(start, end))
                else:
                    assert start == width == layout.block_starts[0]


def test_packed_noisy_rows_score_each_document_as_alone_under_both_backends():
    for seed in range(6):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        block_size = rng.randint(1, 5)
        model = tiny_model("sdar", block_size=block_size).eval()
        positions, documents, valid = random_row_layout(rng, packed=True, left=False)
        clean = torch.randint(3, 50, positions.shape, generator=gen)
        masked = (torch.rand(positions.shape, generator=gen) < 0.5) & valid
        noisy = torch.where(masked, MASK_ID, clean)
        columns = noisy_columns(blocks_with(masked, positions, block_size, documents) & valid)
        ids, pos, layout = noisy_clean_layout(noisy, clean, positions, valid, block_size, columns, documents)
        n_noisy = columns.shape[1]
        with torch.no_grad():
            logits = {backend: model(input_ids=ids, position_ids=pos, attention_mask=mask).logits
                      for backend, mask in (("sdpa", layout.dense()), ("flex", layout.block_mask()))}
            torch.testing.assert_close(logits["flex"][layout.valid], logits["sdpa"][layout.valid],
                                       atol=1e-5, rtol=1e-5)
            for b in range(positions.shape[0]):
                for document in documents[b][valid[b]].unique().tolist():
                    cols = (documents[b] == document).nonzero().flatten()
                    first, size = int(cols[0]), len(cols)
                    alone = model(input_ids=clean[b, cols][None], position_ids=torch.arange(size)[None]).logits[0]
                    torch.testing.assert_close(logits["sdpa"][b, n_noisy + first:n_noisy + first + size], alone,
                                               atol=1e-4, rtol=1e-4)
                    for j in range(n_noisy):
                        c = int(columns[b, j])
                        if not first <= c < first + size:
                            continue
                        i = c - first
                        start, end = (i // block_size) * block_size, min(size, (i // block_size + 1) * block_size)
                        state = torch.cat([clean[b, cols[:start]], noisy[b, cols[start:end]]])[None]
                        expected = model(input_ids=state, position_ids=torch.arange(end)[None]).logits[0, i]
                        torch.testing.assert_close(logits["sdpa"][b, j], expected, atol=1e-4, rtol=1e-4)
