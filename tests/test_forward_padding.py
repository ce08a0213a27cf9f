"""A plain ``model(input_ids, attention_mask)`` call on a left-padded batch gives each row's real tokens the logits
they have alone, for every family. Block models (SDAR, SDAR-MoE) take their blocks from the positions: with the
transformers default ``arange`` positions (the release's), a pad count that is not a multiple of the block size put
pads and real tokens in one block and changed the logits (by 1.7 on the tiny models)."""

import pytest
import torch
from numerics import assert_close_fp32

from trl_diffusion.testing import left_pad, tiny_model, tiny_moe_model

ROWS = [[5, 17, 33, 90, 100, 7, 64, 12, 3], [40, 41, 42, 43]]  # 5 pads: not a multiple of the block size (4)


def _model(family):
    model = tiny_moe_model(family) if family.endswith("_moe") else tiny_model(family)
    return model.double()


@pytest.mark.parametrize("family", ["sdar", "sdar_moe", "llada", "llada_moe", "dream"])
def test_a_left_padded_row_has_the_logits_it_has_alone(family):
    model = _model(family)
    ids, mask = left_pad(ROWS)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        for row, tokens in enumerate(ROWS):
            alone = model(torch.tensor([tokens])).logits[0]
            assert_close_fp32(batched[row, ids.shape[1] - len(tokens):], alone)


def test_explicit_arange_positions_still_give_the_releases_block_layout():
    # the release's behaviour stays reachable: pass the positions it uses
    model = _model("sdar")
    ids, mask = left_pad(ROWS)
    arange = torch.arange(ids.shape[1])[None].expand(len(ROWS), -1)
    with torch.no_grad():
        released = model(ids, attention_mask=mask, position_ids=arange).logits[1, 5:]
        alone = model(torch.tensor([ROWS[1]])).logits[0]
    assert (released - alone).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["sdar", "sdar_moe"])
@pytest.mark.parametrize("mask_later", [True, False])
def test_a_cached_prefix_continues_each_row_after_its_last_real_position(family, mask_later):
    # the cache keeps which keys are padding, so a later call may leave the mask out: its default positions must
    # continue where the row's cached ones end (they restarted at past + 0 for every row)
    from trl_diffusion import DiffusionCache

    model = _model(family)
    rows = [ROWS[0] + [9, 11, 13], ROWS[1]]  # 8 pads
    block = torch.tensor([[3, 3, 3, 3], [3, 3, 3, 3]])
    ids, mask = left_pad(rows)
    with torch.no_grad():
        cache = DiffusionCache()
        model(ids, attention_mask=mask, past_key_values=cache, store_kv=True)
        later = torch.cat([mask, torch.ones_like(block)], 1) if mask_later else None
        batched = model(block, attention_mask=later, past_key_values=cache).logits
        for row, tokens in enumerate(rows):
            alone_cache = DiffusionCache()
            model(torch.tensor([tokens]), past_key_values=alone_cache, store_kv=True)
            alone = model(block[row : row + 1], past_key_values=alone_cache).logits[0]
            assert_close_fp32(batched[row], alone)
