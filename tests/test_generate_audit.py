"""generate() argument handling found by the generation audit: Dream's ``alg_temp`` with block-wise strategies,
Dream's ``steps`` / ``alg`` on a block-causal model, argument types, and tiny temperatures."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from trl_diffusion.generation.sampling import MIN_TEMPERATURE, select_commits
from trl_diffusion.testing import tiny_model

PROMPT = torch.tensor([[10, 11, 12, 13, 14]])
DYNAMIC = dict(max_new_tokens=8, block_length=4, denoising_steps=4, remasking_strategy="low_confidence_dynamic",
               confidence_threshold=0.0, temperature=0.0, return_dict_in_generate=True, eos_token_id=[])


@pytest.fixture(scope="module")
def models():
    return {family: tiny_model(family) for family in ("sdar", "llada", "dream")}


# ------------------------------------------------------------------------------------------------ 1. alg_temp


def test_dynamic_threshold_holds_with_alg_temp_in_the_call(models):
    # alg_temp > 0 turned the dynamic strategy into the static quota: threshold 0 commits every mask of a block in
    # its first step (2 blocks: 2 steps, 4 tokens per step), but it took 8 steps, one token each
    out = models["dream"].generate(PROMPT, alg_temp=0.5, generator=torch.Generator().manual_seed(0), **DYNAMIC)
    assert out.denoising_steps.tolist() == [2]
    assert out.tokens_per_step.tolist() == [4.0]


def test_generation_config_alg_temp_leaves_the_calls_strategy_alone(models):
    # a Dream-style generation_config with alg_temp changed the call's low_confidence_dynamic (threshold ignored,
    # commit order drawn at random): the output must be the one without it
    model = models["dream"]
    expected = model.generate(PROMPT, **DYNAMIC)
    model.generation_config = GenerationConfig(alg="entropy", alg_temp=0.5, steps=8)
    try:
        got = model.generate(PROMPT, generator=torch.Generator().manual_seed(0), **DYNAMIC)
        static = model._resolve_settings(dict(max_new_tokens=8, remasking_strategy="low_confidence_static"), 5)[0]
        dream = model._resolve_settings(dict(max_new_tokens=8), 5)[0]  # the config's own alg: its alg_temp applies
        dream_call = model._resolve_settings(dict(max_new_tokens=8, alg="topk_margin", steps=8), 5)[0]
    finally:
        model.generation_config = GenerationConfig()
    assert torch.equal(got.sequences, expected.sequences) and torch.equal(got.unmask_step, expected.unmask_step)
    assert not static.alg_temp
    assert dream.alg_temp == 0.5 and dream.remasking_strategy == "entropy"
    assert dream_call.alg_temp == 0.5 and dream_call.remasking_strategy == "topk_margin"


def test_select_commits_dynamic_with_alg_temp_keeps_the_threshold():
    confidence = torch.tensor([[0.95, 0.1, 0.92, 0.2, 0.99]])
    masked = torch.tensor([[True, True, True, True, False]])
    for seed in range(5):
        chosen = select_commits("low_confidence_dynamic", confidence, masked, 1, threshold=0.9, alg_temp=0.5,
                                generator=torch.Generator().manual_seed(seed))
        assert chosen[0, [0, 2]].all() and not chosen[0, 4]  # above the threshold: committed; never a non-mask
        assert 2 <= int(chosen.sum()) <= 3  # at most the quota (1) beyond those


def test_alg_temp_with_sequential_is_refused(models):
    # sequential commits the leftmost masks: alg_temp was silently ignored
    with pytest.raises(ValueError, match="alg_temp"):
        models["llada"].generate(PROMPT, max_new_tokens=8, block_length=4, remasking_strategy="sequential",
                                 alg_temp=0.5)


# ------------------------------------------------------------------------------------------ 2. steps / alg on SDAR


def test_dream_steps_on_sdar_keep_the_models_block(models):
    # block_length became max_new_tokens (16): SDAR attended in blocks of 16 (trained: 4) and returned 26 columns
    model, ids = models["sdar"], torch.tensor([[10, 11, 12, 13, 14, 15]])
    kw = dict(max_new_tokens=16, steps=16, alg="entropy", temperature=0.0, return_dict_in_generate=True,
              eos_token_id=[])
    assert model._resolve_settings(dict(kw), 6)[0].block_length == model.block_size == 4
    out = model.generate(ids, **kw)
    given = model.generate(ids, block_length=4, **kw)
    assert out.sequences.shape[1] - ids.shape[1] == 18  # 16 new tokens, rounded up to SDAR's last block
    assert torch.equal(out.sequences, given.sequences) and torch.equal(out.unmask_step, given.unmask_step)


def test_dream_alg_on_sdar_without_steps_needs_no_divisible_length(models):
    # Dream's default steps (max_new_tokens) over 5 blocks of 4: one token per step on average, no divisibility error
    settings = models["sdar"]._resolve_settings(dict(max_new_tokens=18, alg="maskgit_plus"), 3)[0]
    assert (settings.block_length, settings.denoising_steps, settings.schedule) == (4, 4, "linspace")


def test_dream_keeps_one_block_for_steps(models):
    settings = models["dream"]._resolve_settings(dict(max_new_tokens=16, steps=8, alg="entropy"), 5)[0]
    assert (settings.block_length, settings.denoising_steps) == (16, 8)


# ------------------------------------------------------------------------------------------------ 3. argument types


@pytest.mark.parametrize("eos", [np.int64(5), torch.tensor(5), torch.tensor([5]), np.array([5, 9]), [np.int32(5)]])
def test_eos_token_id_accepts_numpy_and_tensor_ids(models, eos):
    model = models["llada"]
    kw = dict(max_new_tokens=8, block_length=4, temperature=0.0, return_dict_in_generate=True)
    expected = model._resolve_settings(dict(eos_token_id=[int(e) for e in np.atleast_1d(np.asarray(eos))]), 3)[0]
    settings = model._resolve_settings(dict(eos_token_id=eos), 3)[0]
    assert settings.stop_token_ids == expected.stop_token_ids
    assert all(type(t) is int for t in settings.stop_token_ids)
    model.generate(PROMPT, eos_token_id=eos, **kw)  # crashed with TypeError (not iterable)


def test_stop_token_ids_accepts_a_tensor(models):
    settings = models["sdar"]._resolve_settings(dict(stop_token_ids=torch.tensor([3, 4])), 3)[0]
    assert settings.stop_token_ids == (3, 4)


@pytest.mark.parametrize(("name", "value"), [
    ("max_new_tokens", 4.7), ("max_new_tokens", 8.0), ("max_new_tokens", True), ("block_length", 2.5),
    ("block_length", True), ("denoising_steps", 2.9), ("denoising_steps", True), ("max_length", 12.5),
    ("steps", 8.5), ("eos_token_id", 5.5), ("eos_token_id", True), ("eos_token_id", torch.tensor(5.0)),
    ("stop_token_ids", [1.5]), ("pad_token_id", 2.5), ("top_k", True),
])
def test_non_integer_arguments_are_refused(models, name, value):
    # int() truncated the floats silently (block_length=2.5 decoded with blocks of 2), bools counted as 1, and
    # top_k=True failed inside torch.topk
    kw = {"max_new_tokens": 8, "block_length": 4, "temperature": 1.0, name: value}
    if name == "max_length":
        del kw["max_new_tokens"]
    with pytest.raises(ValueError, match=name):
        models["llada"].generate(PROMPT, **kw)


# ------------------------------------------------------------------------------------------------ 4. tiny temperatures


@pytest.mark.parametrize("family", ["llada", "sdar"])
@pytest.mark.parametrize("temperature", [1e-38, 1e-30, MIN_TEMPERATURE / 2])
def test_tiny_temperature_is_refused(models, family, temperature):
    # 1e-38 gave NaN log-probs (LLaDA) or a torch.multinomial error (SDAR)
    with pytest.raises(ValueError, match="temperature"):
        models[family].generate(PROMPT, max_new_tokens=8, block_length=4, temperature=temperature, eos_token_id=[])


def test_tiny_alg_temp_is_refused(models):
    with pytest.raises(ValueError, match="alg_temp"):
        models["dream"].generate(PROMPT, max_new_tokens=8, steps=8, alg="entropy", alg_temp=1e-38)


@pytest.mark.parametrize("family", ["llada", "sdar", "dream"])
def test_smallest_accepted_temperature_gives_finite_logprobs(models, family):
    out = models[family].generate(PROMPT, max_new_tokens=8, block_length=4, temperature=MIN_TEMPERATURE,
                                  generator=torch.Generator().manual_seed(0), return_dict_in_generate=True,
                                  eos_token_id=[])
    committed = out.unmask_step >= 0
    assert committed.sum() >= 8 and torch.isfinite(out.token_logprobs[committed]).all()
