"""generate() arguments of the types transformers users pass: integer prompts other than int64, falsy ``do_sample``
values, a 0-d tensor ``top_k``, a ``cuda_graphs`` that is not one of the names, and a ``generation_config`` that is
not a ``GenerationConfig`` (each was silently wrong or failed inside torch)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GenerationConfig

from trl_diffusion import TraceRLConfig
from trl_diffusion.generation import sampler
from trl_diffusion.testing import left_pad, tiny_model

GREEDY = dict(max_new_tokens=6, block_length=4, temperature=0.0, stop_token_ids=[])


@pytest.mark.parametrize("family,cache", [("sdar", True), ("llada", "dual"), ("dream", False)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_prompts_of_any_width_decode_as_int64(family, cache, dtype):
    # int32 prompts passed the input check, then failed in the canvas copy ("Index put requires the source and
    # destination dtypes match"); transformers takes them and returns int64
    model = tiny_model(family)
    ids, mask = left_pad([[20, 21, 22, 23, 24], [30, 31]])
    expected = model.generate(ids, mask, use_cache=cache, **GREEDY)
    got = model.generate(ids.to(dtype), mask, use_cache=cache, **GREEDY)
    assert got.dtype == torch.int64
    assert torch.equal(got, expected)


@pytest.mark.parametrize("falsy", [0, np.False_, torch.tensor(False)])
def test_a_falsy_do_sample_is_greedy_as_false_is(falsy):
    # only `do_sample is False` forced greedy: 0 or a numpy / tensor False sampled at the config's temperature
    # (SDAR's and TraDo's released generation configs: do_sample true, temperature 0.7)
    model = tiny_model("sdar")
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, max_new_tokens=8, block_length=4,
                                               stop_token_ids=[])
    settings, _ = model._resolve_settings({"do_sample": falsy})
    assert settings.temperature == 0.0
    ids = torch.tensor([[20, 21, 22]])
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(model.generate(ids, do_sample=falsy, generator=generator), model.generate(ids, do_sample=False))
    settings, _ = model._resolve_settings({"do_sample": np.True_, "temperature": 0.5})
    assert settings.temperature == 0.5


def test_top_k_takes_a_0_d_tensor_as_the_other_integer_arguments_do():
    model = tiny_model("sdar")
    ids = torch.tensor([[20, 21, 22]])
    kw = dict(max_new_tokens=8, temperature=1.0, stop_token_ids=[])
    tensor_k = model.generate(ids, top_k=torch.tensor(5), generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(tensor_k, model.generate(ids, top_k=5, generator=torch.Generator().manual_seed(0), **kw))
    for bad in (2.5, True, torch.tensor(5.0)):
        with pytest.raises(ValueError, match="top_k must be (None or )?an integer"):
            model.generate(ids, top_k=bad, **kw)
    with pytest.raises(ValueError, match="top_k must be None or an integer >= 0"):
        model.generate(ids, top_k=-1, **kw)


@pytest.mark.parametrize("value", [False, True, 0, "", "on", None])
def test_cuda_graphs_is_one_of_its_names(monkeypatch, value):
    # `pick("cuda_graphs") or "auto"` turned False, 0 and "" into "auto": graphs on, where False reads as off
    model = tiny_model("sdar")
    seen = []
    monkeypatch.setattr(sampler, "runner_class",
                        lambda settings, *args: seen.append(settings.cuda_graphs) or sampler.ModelRunner)
    ids = torch.tensor([[20, 21, 22]])
    if value is None:  # unset: the default
        model.generate(ids, cuda_graphs=value, use_cache=True, **GREEDY)
        assert seen == ["auto"]
        return
    hint = "quote it" if isinstance(value, bool) else ""
    with pytest.raises(ValueError, match=f"cuda_graphs must be one of .*{hint}"):
        model.generate(ids, cuda_graphs=value, use_cache=True, **GREEDY)
    assert not seen


def test_rollout_cuda_graphs_false_names_the_yaml_reading(tmp_path):
    # an unquoted `rollout_cuda_graphs: off` in a YAML config arrives as False
    with pytest.raises(ValueError, match="rollout_cuda_graphs must be one of .*quote it.*got False"):
        TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, rollout_cuda_graphs=False)


@pytest.mark.parametrize("config", [{"max_new_tokens": 4}, "greedy"])
def test_a_generation_config_that_is_not_a_generation_config_is_refused(config):
    # a dict was read field by field with getattr, so every setting in it was dropped (128 new tokens for 4 asked)
    model = tiny_model("llada")
    with pytest.raises(TypeError, match="generation_config must be a transformers GenerationConfig"):
        model.generate(torch.tensor([[20, 21, 22]]), generation_config=config)


@pytest.mark.parametrize("stops", [dict(stop_token_ids=[151645, 151643]), dict(eos_token_id=10**6),
                                   dict(stop_token_ids=[-1])])
def test_stop_ids_the_model_cannot_produce_are_refused(stops):
    """TraDo's ``stop_token_ids 151645 151643`` given to a model with a smaller vocabulary (LLaDA-8B's 126,464; here
    the tiny model's) was accepted: no row could ever stop, so every completion ran to full length, silently."""
    model = tiny_model("sdar")
    with pytest.raises(ValueError, match=r"stop token ids .* are not token ids of this model"):
        settings = {k: v for k, v in GREEDY.items() if k != "stop_token_ids"}  # which beat eos_token_id
        model.generate(torch.tensor([[20, 21]]), **{**settings, **stops})


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_replay_scores_a_rollout_whose_padding_holds_any_id(family):
    """Padding may hold any id (generate() never reads it and copies it through), but ``replay_logprobs`` looked the
    returned sequences up whole: IndexError for padding of -100."""
    from trl_diffusion.estimators import replay_logprobs

    model = tiny_model(family).double()
    ids, mask = left_pad([[11], [20, 21, 22, 23, 24]], pad_id=-100)
    generators = [torch.Generator().manual_seed(i) for i in range(2)]
    out = model.generate(ids, mask, max_new_tokens=6, block_length=4, temperature=1.0, stop_token_ids=[],
                         generator=generators, return_dict_in_generate=True)
    replayed = replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4)
    committed = out.unmask_step >= 0
    torch.testing.assert_close(replayed[committed].double(), out.token_logprobs[committed].double(), rtol=1e-5,
                               atol=1e-6)


def test_a_generator_list_is_counted_against_the_returned_rows():
    model = tiny_model("sdar")
    with pytest.raises(ValueError, match="2 generators for 6 returned rows"):
        model.generate(torch.tensor([[20, 21], [22, 23]]), num_return_sequences=3,
                       generator=[torch.Generator(), torch.Generator()], **{**GREEDY, "temperature": 1.0})


def test_top_p_takes_a_0_d_tensor_and_tracerl_refuses_none(tmp_path):
    # the shared sampling check refused the 0-d tensor generate() took before; TraceRLConfig(top_p=None) passed it,
    # and the rollouts then used the checkpoint's generation_config top_p
    model = tiny_model("sdar")
    ids = torch.tensor([[20, 21, 22]])
    kw = dict(max_new_tokens=8, temperature=1.0, stop_token_ids=[])
    tensor_p = model.generate(ids, top_p=torch.tensor(0.9), generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(tensor_p, model.generate(ids, top_p=0.9, generator=torch.Generator().manual_seed(0), **kw))
    assert torch.equal(model.generate(ids, top_p=torch.tensor(1), generator=torch.Generator().manual_seed(0), **kw),
                       model.generate(ids, top_p=1.0, generator=torch.Generator().manual_seed(0), **kw))
    with pytest.raises(ValueError, match="top_p must be a number in"):
        TraceRLConfig(output_dir=str(tmp_path), top_p=None, report_to="none", use_cpu=True)
