"""transformers' cache arguments of a forward, for every family: ``cache=`` (transformers >= 5.24's name for
``past_key_values``, under which the output hands the cache back) was swallowed by ``**kwargs``, so a cached pass
silently ran without its prefix; ``use_cache=True`` returned no cache. Positions of the wrong length were broadcast
over the input."""

import pytest
import torch
from numerics import assert_close_fp32

from trl_diffusion import DiffusionCache
from trl_diffusion.testing import tiny_model, tiny_moe_model

FAMILIES = ["sdar", "sdar_moe", "llada", "llada_moe", "dream"]
PREFIX = torch.tensor([[5, 17, 33, 90, 100, 7, 64, 12]])
BLOCK = torch.tensor([[3, 3, 3, 3]])


def _model(family):
    model = tiny_moe_model(family) if family.endswith("_moe") else tiny_model(family)
    return model.double().eval()


def _prefilled(model):
    cache = DiffusionCache()
    model(PREFIX, past_key_values=cache, store_kv=True)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_cache_is_read_as_past_key_values(family):
    model = _model(family)
    expected = model(BLOCK, past_key_values=_prefilled(model)).logits
    assert (expected - model(BLOCK).logits).abs().max() > 1e-2  # the prefix matters
    assert_close_fp32(model(BLOCK, cache=_prefilled(model)).logits, expected)
    assert_close_fp32(model.model(BLOCK, cache=_prefilled(model)).last_hidden_state,
                      model.model(BLOCK, past_key_values=_prefilled(model)).last_hidden_state)
    with pytest.raises(ValueError, match="either past_key_values or cache"):
        model(BLOCK, past_key_values=_prefilled(model), cache=_prefilled(model))


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_use_cache_returns_the_cache_of_the_pass(family):
    model = _model(family)
    out = model(PREFIX, use_cache=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    assert isinstance(cache, DiffusionCache) and cache.get_seq_length() == PREFIX.shape[1]
    assert_close_fp32(model(BLOCK, past_key_values=cache).logits,
                      model(BLOCK, past_key_values=_prefilled(model)).logits)
    given = _prefilled(model)  # a given cache gets this pass's keys appended, as in transformers
    model(BLOCK, past_key_values=given, use_cache=True)
    assert given.get_seq_length() == PREFIX.shape[1] + BLOCK.shape[1]
    for off in (False, None):  # the default: a diffusion pass reads a cache without writing it
        read_only = _prefilled(model)
        assert model(BLOCK, past_key_values=read_only, use_cache=off).logits is not None
        assert read_only.get_seq_length() == PREFIX.shape[1]


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_position_ids_of_another_length_are_refused(family):
    model = _model(family)
    for positions in (torch.tensor([[0]]), torch.arange(9)[None], torch.arange(8)[None].expand(3, -1)):
        with pytest.raises(ValueError, match=r"position_ids must be \[1, 8\]"):
            model(PREFIX, position_ids=positions)
    model(PREFIX, position_ids=torch.arange(8))  # one row of positions for every row, as before


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_the_released_num_logits_to_keep_is_read_as_logits_to_keep(family):
    """Dream's and LLaDA-MoE's released forwards name it ``num_logits_to_keep``; it was swallowed by ``**kwargs``:
    every position's logits came back, so ``logits[:, 0]`` read the first position instead of the kept one."""
    model = _model(family)
    full = model(PREFIX).logits
    kept = model(PREFIX, num_logits_to_keep=2).logits
    assert kept.shape == (1, 2, full.shape[-1])
    assert_close_fp32(kept, full[:, -2:])
    with pytest.raises(ValueError, match="give either num_logits_to_keep"):
        model(PREFIX, num_logits_to_keep=2, logits_to_keep=1)
