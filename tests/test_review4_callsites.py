"""Regression tests from a review of the package's own ``generate()`` call sites (held-out accuracy, the eval
harness): a loaded checkpoint's ``generation_config`` must not change what a call site documents it decodes."""

import json

import pytest
import torch
from test_review2_loading import RELEASED_GENERATION  # the released generation_config.json files
from transformers import AutoModelForCausalLM, GenerationConfig

from trl_diffusion.data.arithmetic import _chat_prompt, _completion_text, generate_completions, make_problems
from trl_diffusion.testing import build_tokenizer, tiny_model

PROMPTS = [p.prompt for p in make_problems(0, 14, seed=3)[1][6:]]


def released(family: str, directory) -> object:
    """The tiny seeded model saved with its family's released generation_config.json, loaded back."""
    tiny_model(family).save_pretrained(directory)
    (directory / "generation_config.json").write_text(json.dumps(RELEASED_GENERATION[family]))
    return AutoModelForCausalLM.from_pretrained(directory).eval()


def reference_completions(family: str, prompts: list[str], **settings) -> list[str]:
    """The completions of ``generate()`` on the same weights with an empty generation config and every argument
    given: what the call site documents it decodes (one left-padded batch: each row decodes as it would alone)."""
    model, tokenizer = tiny_model(family), build_tokenizer()
    model.generation_config = GenerationConfig()
    enc = tokenizer([_chat_prompt(tokenizer, p) for p in prompts], return_tensors="pt", padding=True,
                    add_special_tokens=False)
    out = model.generate(enc["input_ids"], attention_mask=enc["attention_mask"], **settings)
    return [_completion_text(tokenizer, row[enc["input_ids"].shape[1]:]) for row in out]


def held_out_reference(family: str, prompts: list[str]) -> list[str]:
    """The held-out measure's documented decoding: greedy, 16 tokens, the model's block (16 without one),
    ``low_confidence_static`` with one token per step."""
    block = 4 if family == "sdar" else 16
    return reference_completions(family, prompts, max_new_tokens=16, block_length=block, denoising_steps=block,
                                 remasking_strategy="low_confidence_static", temperature=0.0)


def test_held_out_greedy_ignores_a_released_sdar_generation_config(tmp_path):
    # SDAR / TraDo's generation_config.json holds Qwen3's top_k 20 / top_p 0.95. The held-out measure (greedy) did not
    # pass top_k / top_p, so they filtered the distribution its confidences come from: 3 of these 8 completions
    # differed from greedy decoding
    model = released("sdar", tmp_path)
    assert model.generation_config.top_k == 20
    assert generate_completions(model, build_tokenizer(), PROMPTS) == held_out_reference("sdar", PROMPTS)


def test_held_out_greedy_under_dreams_released_generation_config(tmp_path):
    # its alg "origin" / steps 512 give way to the held-out measure's remasking_strategy / denoising_steps
    model = released("dream", tmp_path)
    assert generate_completions(model, build_tokenizer(), PROMPTS) == held_out_reference("dream", PROMPTS)


@pytest.mark.parametrize("family, values", [
    ("sdar", {"alg_temp": 0.5}),
    ("llada", {"cfg_scale": 1.0}),
    ("llada", {"use_cache": "prefix"}),  # what a TraceRL policy saved with rollout_cache="prefix" holds
    ("dream", {"use_cache": "dual", "alg_temp": 0.5}),
])
def test_held_out_greedy_ignores_stray_generation_config_values(family, values):
    # each of these changed all 8 completions (approximate cache, random commit order, guidance); a saved TraceRL
    # policy's generation_config.json keeps alg_temp / cfg_scale and holds its rollout_cache
    model = tiny_model(family)
    model.generation_config = GenerationConfig(**values)
    assert generate_completions(model, build_tokenizer(), PROMPTS) == held_out_reference(family, PROMPTS)


@pytest.mark.parametrize("dream_args", [{"alg": "entropy", "steps": 8}, {"steps": 8}, {"alg": "topk_margin"}])
def test_held_out_measure_takes_dreams_alg_and_steps(dream_args):
    # generate_kwargs "override the defaults", but Dream's published arguments failed with errors about arguments the
    # caller never gave ("give either alg or remasking_strategy", "either steps or denoising_steps")
    model, prompts = tiny_model("dream"), PROMPTS[:4]
    strategy = {} if "alg" in dream_args else {"remasking_strategy": "low_confidence_static"}
    expected = reference_completions("dream", prompts, max_new_tokens=16, block_length=16, temperature=0.0,
                                     **strategy, **dream_args)
    assert generate_completions(model, build_tokenizer(), prompts, **dream_args) == expected


@pytest.mark.parametrize("arguments, name", [({"steps": 0}, "steps"), ({"steps": -4}, "steps"),
                                             ({"max_new_tokens": 0}, "max_new_tokens"),
                                             ({"block_length": 0}, "block_length")])
def test_dream_schedule_refuses_non_positive_values(arguments, name):
    # under Dream's released generation_config (alg "origin", steps 512) a call's steps=0 (e.g. `trl-diffusion eval
    # --steps 0`) silently became the config's 512 steps; max_new_tokens=0 / block_length=0 crashed with
    # ZeroDivisionError before any check
    model = tiny_model("dream")
    model.generation_config = GenerationConfig(alg="origin", steps=512, eps=1e-3)
    with pytest.raises(ValueError, match=name):
        model.generate(torch.tensor([[5, 6, 7]]), **{"max_new_tokens": 16, **arguments})
