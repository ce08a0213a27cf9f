"""generate() argument combinations found by the pairwise combination audit: transformers' ``num_return_sequences``
(a generation config's was silently ignored, a call's refused)."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from trl_diffusion.testing import left_pad, tiny_model

PROMPTS = [[20, 21, 22, 23, 24], [30]]  # left-padded: the second row is all padding but one token
SAMPLED = dict(max_new_tokens=6, block_length=4, denoising_steps=2, temperature=1.0, stop_token_ids=[],
               return_dict_in_generate=True)


def row_generators(seeds):
    return [torch.Generator().manual_seed(seed) for seed in seeds]


@pytest.mark.parametrize("family,cache", [("sdar", True), ("llada", "dual"), ("dream", False)])
def test_num_return_sequences_in_the_call_gives_consecutive_copies(family, cache):
    # a call's num_return_sequences was a TypeError ("unexpected arguments")
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    out = model.generate(ids, mask, num_return_sequences=2, generator=row_generators(range(4)), use_cache=cache,
                         **SAMPLED)
    assert out.sequences.shape[0] == 4
    width = ids.shape[1]
    for row in range(4):  # as transformers: prompt i's sequences are rows 2i and 2i + 1
        prompt = PROMPTS[row // 2]
        alone = model.generate(torch.tensor([prompt]), generator=row_generators([row]), use_cache=cache, **SAMPLED)
        n = alone.sequences.shape[1] - len(prompt)
        assert out.sequences[row, width - len(prompt):width + n].tolist() == alone.sequences[0].tolist()
        assert out.unmask_step[row, width:width + n].tolist() == alone.unmask_step[0, len(prompt):].tolist()


def test_num_return_sequences_of_the_generation_config_is_read():
    # a generation config's num_return_sequences=3 was ignored: one sequence per prompt came back
    model = tiny_model("llada")
    ids, mask = left_pad(PROMPTS)
    model.generation_config = GenerationConfig(num_return_sequences=3, do_sample=True, max_new_tokens=4,
                                               block_length=4)
    assert model.generate(ids, mask).shape == (6, ids.shape[1] + 4)
    assert model.generate(ids, mask, num_return_sequences=1).shape == (2, ids.shape[1] + 4)  # the call wins
    # greedy copies would be identical: refused, as transformers refuses it; random commit orders make them differ
    with pytest.raises(ValueError, match="num_return_sequences=3 with greedy decoding"):
        model.generate(ids, mask, temperature=0.0, stop_token_ids=[])
    drawn = model.generate(ids, mask, temperature=0.0, remasking_strategy="random", stop_token_ids=[],
                           generator=torch.Generator().manual_seed(0))
    assert drawn.shape == (6, ids.shape[1] + 4) and torch.equal(drawn[:3, : ids.shape[1]], ids[[0, 0, 0]])


@pytest.mark.parametrize("value", [0, -1, 2.0, True])
def test_bad_num_return_sequences_is_refused(value):
    with pytest.raises(ValueError, match="num_return_sequences"):
        tiny_model("llada").generate(torch.tensor([PROMPTS[0]]), max_new_tokens=4, block_length=4,
                                     num_return_sequences=value)


def test_internal_callers_take_one_sequence_per_prompt_whatever_the_config_says():
    # the library's own callers manage their samples: a checkpoint's num_return_sequences must not multiply them
    from trl_diffusion.data.arithmetic import generate_completions
    from trl_diffusion.testing import build_tokenizer

    model = tiny_model("sdar")
    model.generation_config.num_return_sequences = 3
    texts = generate_completions(model, build_tokenizer(), ["What is 1+1?", "What is 2+2?"], chat_template=False,
                                 max_new_tokens=4)
    assert len(texts) == 2


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_a_generation_config_steps_without_alg_is_dreams_origin_schedule(family):
    # a config's `steps` was read only beside an `alg`: alone it was ignored (block-wise, one token per step), while
    # the same `steps` in the call switched to Dream's linspace schedule with its default alg, "origin"
    model = tiny_model(family)
    ids = torch.tensor([PROMPTS[0]])
    call = model.generate(ids, max_new_tokens=8, steps=4, generator=torch.Generator().manual_seed(0),
                          return_dict_in_generate=True, stop_token_ids=[])
    model.generation_config = GenerationConfig(steps=4, max_new_tokens=8)
    config = model.generate(ids, generator=torch.Generator().manual_seed(0), return_dict_in_generate=True,
                            stop_token_ids=[])
    assert config.num_forward_passes == call.num_forward_passes == 4
    assert torch.equal(config.sequences, call.sequences)
    blockwise = model.generate(ids, denoising_steps=8, block_length=8, generator=torch.Generator().manual_seed(0),
                               return_dict_in_generate=True, stop_token_ids=[])  # a block-wise call turns it off
    assert blockwise.num_forward_passes == 8


def test_do_sample_with_a_zero_temperature_is_refused():
    # a call's do_sample=True under a generation config with temperature 0 decoded greedily, silently; transformers
    # refuses the pair too
    model = tiny_model("dream")
    model.generation_config = GenerationConfig(temperature=0.0, max_new_tokens=4, block_length=4)
    ids = torch.tensor([PROMPTS[0]])
    with pytest.raises(ValueError, match="do_sample=True with temperature 0"):
        model.generate(ids, do_sample=True)
    with pytest.raises(ValueError, match="do_sample=True with temperature 0"):
        model.generate(ids, do_sample=True, temperature=0.0)
    assert model.generate(ids, do_sample=True, temperature=0.7).shape == (1, len(PROMPTS[0]) + 4)
    assert model.generate(ids, do_sample=False).shape == (1, len(PROMPTS[0]) + 4)


def test_a_saved_released_generation_config_keeps_its_diffusion_fields_for_plain_transformers(tmp_path):
    # Dream's and LLaDA's released generation_config.json say `_from_model_config: true`; saved back as loaded, a
    # plain GenerationConfig.from_pretrained then dropped every field it does not know (alg, steps, eps, ...)
    from test_review2_loading import write_released
    from transformers import AutoModelForCausalLM

    write_released("dream", tmp_path / "release")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "release")
    assert (model.generation_config.alg, model.generation_config.steps) == ("origin", 512)
    model.save_pretrained(tmp_path / "saved")
    plain = GenerationConfig.from_pretrained(tmp_path / "saved")
    assert (getattr(plain, "alg", None), getattr(plain, "steps", None), getattr(plain, "eps", None)) == (
        "origin", 512, 0.001)
