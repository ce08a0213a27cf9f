"""A ``GenerationConfig`` passed to ``generate()`` is merged with the model's, as transformers merges them (the
passed config's unset fields come from ``model.generation_config``); it used to replace it, dropping a checkpoint's
stop ids and sampler settings. transformers' decoding options that diffusion decoding does not implement are refused
in a generation config too (they were refused as call arguments but ignored in a config)."""

import pytest
import torch
from transformers import GenerationConfig

from trl_diffusion.testing import tiny_model

IDS = torch.tensor([[10, 11, 12, 13, 14]])


def decode(model, **kwargs):
    return model.generate(IDS, generator=torch.Generator().manual_seed(0), return_dict_in_generate=True, **kwargs)


def test_a_passed_config_keeps_the_models_settings_it_leaves_unset():
    model = tiny_model("sdar")
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.9, denoising_steps=2,
                                               remasking_strategy="low_confidence_static")
    by_keyword = decode(model, max_new_tokens=8)
    by_config = decode(model, generation_config=GenerationConfig(max_new_tokens=8))
    assert torch.equal(by_config.sequences, by_keyword.sequences)
    four_steps = decode(model, max_new_tokens=8, denoising_steps=4)
    assert int(by_config.num_forward_passes) == int(by_keyword.num_forward_passes) \
        < int(four_steps.num_forward_passes)  # the model's denoising_steps=2 applied
    greedy = decode(model, max_new_tokens=8, temperature=0.0, denoising_steps=4)
    passed = decode(model, generation_config=GenerationConfig(max_new_tokens=8, do_sample=False, denoising_steps=4))
    assert torch.equal(passed.sequences, greedy.sequences)  # what the passed config sets wins


def test_the_first_place_that_names_stop_ids_decides():
    model = tiny_model("llada")
    free = decode(model, max_new_tokens=12, block_length=4, temperature=0.0, stop_token_ids=[])
    completion = free.sequences[0, IDS.shape[1]:].tolist()
    first = completion[0]  # in block 0: stopping on it leaves blocks 1 and 2 padding
    model.generation_config = GenerationConfig(stop_token_ids=[completion[-1]])
    out = decode(model, max_new_tokens=12, block_length=4, temperature=0.0, pad_token_id=99,
                 generation_config=GenerationConfig(eos_token_id=first))
    assert out.sequences[0, IDS.shape[1] + 4:].eq(99).all()  # the passed config's eos beats the model's stop ids


@pytest.mark.parametrize("field,value", [("num_beams", 4), ("repetition_penalty", 1.3), ("min_new_tokens", 4),
                                         ("bad_words_ids", [[5]]), ("output_scores", True), ("min_p", 0.1),
                                         # were ignored silently: no hidden states, no top_h filter
                                         ("output_attentions", True), ("output_hidden_states", True),
                                         ("top_h", 0.3), ("dola_layers", "high"), ("token_healing", True),
                                         ("force_words_ids", [[5]]),
                                         # accepted and ignored before: TraceRLConfig already refused the first
                                         ("cache_implementation", "static"), ("remove_invalid_values", True),
                                         ("renormalize_logits", True), ("low_memory", True), ("use_mtp", True)])
def test_unimplemented_decoding_options_in_a_config_are_refused(field, value):
    model = tiny_model("sdar")
    with pytest.raises(ValueError, match=f"generation_config sets {field}="):
        model.generate(IDS, generation_config=GenerationConfig(max_new_tokens=4, **{field: value}))



@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.05), ("num_beams", 4)])
def test_the_models_own_unimplemented_options_are_ignored_with_a_warning(field, value, caplog):
    """A checkpoint's file may carry them (Qwen2.5's repetition_penalty 1.05): refusing would stop every caller
    (rollouts, eval, pipelines), none of which can unset it by argument."""
    model = tiny_model("sdar")
    plain = model.generate(IDS, max_new_tokens=4, temperature=0.0)
    setattr(model.generation_config, field, value)
    with caplog.at_level("WARNING"):
        assert torch.equal(model.generate(IDS, max_new_tokens=4, temperature=0.0), plain)
    assert f"model.generation_config sets {field}={value!r}" in caplog.text


def test_do_sample_with_temperature_zero_is_refused_from_any_place():
    model = tiny_model("sdar")
    with pytest.raises(ValueError, match="do_sample=True with temperature 0"):
        model.generate(IDS, generation_config=GenerationConfig(do_sample=True, temperature=0.0, max_new_tokens=4))
    model.generation_config.temperature = 0.0
    with pytest.raises(ValueError, match="do_sample=True with temperature 0"):
        model.generate(IDS, max_new_tokens=4, generation_config=GenerationConfig(do_sample=True))


def test_neutral_values_of_those_options_decode_as_unset():
    """Released configs may spell them out at their neutral values (num_beams 1, repetition_penalty 1.0)."""
    model = tiny_model("sdar")
    plain = model.generate(IDS, max_new_tokens=4, temperature=0.0)
    neutral = GenerationConfig(max_new_tokens=4, num_beams=1, repetition_penalty=1.0, min_length=0,
                               output_scores=False)
    assert torch.equal(model.generate(IDS, temperature=0.0, generation_config=neutral), plain)
