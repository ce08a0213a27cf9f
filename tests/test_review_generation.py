"""generate()'s argument resolution as a transformers user meets it: call > generation_config > family defaults,
transformers' ``max_length`` / ``do_sample``, and Dream's ``steps`` / ``alg`` next to the block-wise arguments."""

import pytest
import torch
from transformers import GenerationConfig

from trl_diffusion import TraceRLConfig
from trl_diffusion.testing import EOS_ID, IM_END_ID, tiny_model

PROMPT = torch.tensor([[20, 21, 22, 23, 24]])
DREAM_RELEASE_CONFIG = dict(alg="origin", steps=512, temperature=0.0, eps=1e-3)  # Dream-v0-Instruct-7B's


def settings_of(model, **kwargs):
    return model._resolve_settings(kwargs, PROMPT.shape[1])[0]


def test_call_block_arguments_beat_dreams_alg_and_steps_from_the_config():
    """Dream's released generation_config.json holds alg/steps; a call's denoising_steps must still count."""
    model = tiny_model("dream")
    model.generation_config = GenerationConfig(**DREAM_RELEASE_CONFIG)
    out = model.generate(PROMPT, max_new_tokens=8, block_length=4, denoising_steps=2, stop_token_ids=[],
                         return_dict_in_generate=True)
    assert out.denoising_steps.tolist() == [4]  # 2 blocks x 2 steps (was 256 steps per block of Dream's schedule)
    assert (out.unmask_step[0, PROMPT.shape[1]:] >= 0).all()
    settings = settings_of(model, max_new_tokens=8, block_length=4, denoising_steps=2)
    assert (settings.schedule, settings.remasking_strategy, settings.denoising_steps) == (
        "uniform", "low_confidence_static", 2)
    settings = settings_of(model, max_new_tokens=8, remasking_strategy="entropy")
    assert (settings.schedule, settings.remasking_strategy) == ("uniform", "entropy")
    settings = settings_of(model, max_new_tokens=8)  # nothing block-wise in the call: the config's Dream settings
    assert (settings.schedule, settings.remasking_strategy, settings.denoising_steps) == ("linspace", "origin", 512)


def test_call_strategy_with_steps_and_call_steps_with_alg():
    model = tiny_model("dream")
    settings = settings_of(model, max_new_tokens=8, steps=8, remasking_strategy="topk_margin")
    assert (settings.schedule, settings.remasking_strategy, settings.denoising_steps) == ("linspace", "topk_margin", 8)
    settings = settings_of(model, max_new_tokens=8, block_length=4, alg="entropy", denoising_steps=2)
    assert (settings.schedule, settings.remasking_strategy, settings.denoising_steps) == ("linspace", "entropy", 2)


@pytest.mark.parametrize("kwargs,match", [
    (dict(alg="entropy", remasking_strategy="random"), "either alg"),
    (dict(steps=8, denoising_steps=4), "either steps"),
    (dict(steps=8, remasking_strategy="sequential"), "linspace"),
    (dict(steps=8, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.5), "linspace"),
])
def test_conflicting_dream_and_block_arguments_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_model("dream").generate(PROMPT, max_new_tokens=8, **kwargs)


@pytest.mark.parametrize("family,block_length", [("llada", 4), ("dream", 8), ("sdar", 2)])
def test_block_length_alone_decodes_one_token_per_step(family, block_length):
    """denoising_steps follows the block length chosen (it was the family's block size, e.g. 32 > 4: an error)."""
    out = tiny_model(family).generate(PROMPT, max_new_tokens=8, block_length=block_length, temperature=0.0,
                                      stop_token_ids=[], return_dict_in_generate=True)
    generated = int((out.unmask_step >= 0).sum())
    assert generated >= 8
    assert out.denoising_steps.tolist() == [generated]


def test_max_length_counts_the_prompt_as_in_transformers():
    model = tiny_model("llada")
    width = PROMPT.shape[1]
    assert model.generate(PROMPT, max_length=width + 6, block_length=6).shape == (1, width + 6)
    model.generation_config = GenerationConfig(max_length=width + 4)
    assert model.generate(PROMPT, block_length=4).shape == (1, width + 4)  # was 128 new tokens
    assert model.generate(PROMPT, max_new_tokens=2, block_length=2).shape == (1, width + 2)  # max_new_tokens wins
    with pytest.raises(ValueError, match="max_length"):
        model.generate(PROMPT, max_length=width)


def test_do_sample_false_is_greedy_whatever_the_temperature():
    model = tiny_model("sdar")
    kwargs = dict(max_new_tokens=12, stop_token_ids=[])

    def run(**kw):
        return model.generate(PROMPT, generator=torch.Generator().manual_seed(0), **kwargs, **kw)

    greedy, sampled = run(temperature=0.0), run(temperature=1.0)
    assert not torch.equal(greedy, sampled)
    assert torch.equal(run(temperature=1.0, do_sample=False), greedy)
    assert torch.equal(run(generation_config=GenerationConfig(do_sample=False, temperature=1.0)), greedy)
    model.generation_config = GenerationConfig(do_sample=False)
    assert torch.equal(run(), greedy)
    assert torch.equal(run(temperature=1.0), sampled)  # a call's temperature beats the config's do_sample


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_nothing_about_sampling_is_greedy_as_in_transformers(family):
    """No temperature and no do_sample (call or config; LLaDA's released generation_config.json names neither) is
    greedy, as transformers' generate() and LLaDA's reference generate(); do_sample=True alone samples at 1.0, and a
    config's temperature without do_sample still samples at it."""
    model = tiny_model(family)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=EOS_ID)  # LLaDA's release: ids only
    kwargs = dict(max_new_tokens=8, block_length=4, stop_token_ids=[])

    def run(**kw):
        return model.generate(PROMPT, generator=torch.Generator().manual_seed(0), **kwargs, **kw)

    greedy, sampled = run(temperature=0.0), run(temperature=1.0)
    assert not torch.equal(greedy, sampled)
    assert settings_of(model, **kwargs).temperature == 0.0
    assert torch.equal(run(), greedy)
    assert torch.equal(run(do_sample=True), sampled)
    model.generation_config = GenerationConfig(temperature=1.0)
    assert torch.equal(run(), sampled)


def test_stop_token_ids_from_the_generation_config():
    model = tiny_model("sdar")
    model.generation_config.stop_token_ids = [IM_END_ID]
    assert settings_of(model).stop_token_ids == (IM_END_ID,)
    assert settings_of(model, eos_token_id=EOS_ID).stop_token_ids == (EOS_ID,)  # the call's eos wins
    assert settings_of(model, stop_token_ids=[]).stop_token_ids == ()


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_a_generation_that_fills_the_context_exactly_is_allowed(family):
    """8 prompt + 8 new tokens on a 16-position model (SDAR: whole blocks of 4) fit; one more token does not.
    (The check used to add a whole block for SDAR, rejecting a generation that fits.)"""
    positions = {"sdar": dict(max_position_embeddings=16), "llada": dict(max_sequence_length=16)}[family]
    model = tiny_model(family, **positions)
    prompts = torch.tensor([list(range(20, 28)), list(range(30, 38))])
    out = model.generate(prompts, max_new_tokens=8, block_length=4, stop_token_ids=[])
    assert out.shape == (2, 16)
    with pytest.raises(ValueError, match="positions"):
        model.generate(prompts, max_new_tokens=9, block_length=4)


def test_origin_needs_dreams_linspace_schedule():
    """'origin' over per-block denoising steps would silently decode as low_confidence_static."""
    model = tiny_model("dream")
    with pytest.raises(ValueError, match="origin"):
        model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, block_length=4, denoising_steps=4,
                       remasking_strategy="origin")
    with pytest.raises(ValueError, match="origin"):
        TraceRLConfig(output_dir="unused", remasking_strategy="origin", use_cpu=True, bf16=False)
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=8, alg="origin", steps=8, temperature=0.0,
                         return_dict_in_generate=True)
    assert int((out.unmask_step >= 0).sum()) == 8
