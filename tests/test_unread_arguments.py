"""Call arguments that the chosen decoding does not read were ignored without a word: ``confidence_threshold`` with a
strategy other than ``low_confidence_dynamic`` and ``eps`` on block-wise decoding. They now warn (a config file
layered under command-line options passes them on, so an error would punish a harmless setting). TraceRL's rollouts
pass the threshold only to the strategy that reads it. A call's ``None`` means "not given" (the generation config's
value applies), as docs/generation.md says."""

from __future__ import annotations

import contextlib
import logging
import warnings

import pytest
import torch
from datasets import Dataset
from transformers import GenerationConfig

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model

IDS = torch.tensor([[10, 11, 12, 13, 14]])


def decode(model, **kwargs):
    return model.generate(IDS, max_new_tokens=8, block_length=4, generator=torch.Generator().manual_seed(0),
                          return_dict_in_generate=True, **kwargs)


def test_a_threshold_the_strategy_does_not_read_warns(caplog):
    model = tiny_model("sdar")
    plain = decode(model, remasking_strategy="low_confidence_static", temperature=1.0)
    with caplog.at_level(logging.WARNING):
        out = decode(model, remasking_strategy="low_confidence_static", temperature=1.0, confidence_threshold=0.37)
    assert torch.equal(out.sequences, plain.sequences)  # ignored ...
    assert "confidence_threshold=0.37 is read by remasking_strategy='low_confidence_dynamic' only; this call " \
           "decodes with 'low_confidence_static'" in caplog.text  # ... with a word
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        decode(model, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.41)
        decode(model, alg="entropy", steps=8)  # Dream's alg and a generation config's threshold: nothing to say
    assert "confidence_threshold" not in caplog.text


def test_eps_on_block_wise_decoding_warns(caplog):
    model = tiny_model("dream")
    with caplog.at_level(logging.WARNING):
        decode(model, denoising_steps=2, eps=0.23)
    assert "eps=0.23 is read by Dream's linspace schedule only" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        linspace = decode(model, steps=8, alg="entropy", eps=0.29)
    assert "eps=" not in caplog.text
    assert not torch.equal(linspace.unmask_step, decode(model, steps=8, alg="entropy", eps=0.9).unmask_step)


@pytest.mark.parametrize("name, value, off", [("top_k", 2, 0), ("top_p", 0.3, 1.0)])
def test_a_calls_none_takes_the_generation_configs_value(name, value, off):
    model = tiny_model("sdar")
    model.generation_config = GenerationConfig(do_sample=True, **{name: value})
    configured, none = decode(model), decode(model, **{name: None})
    assert torch.equal(none.sequences, configured.sequences)
    assert not torch.equal(decode(model, **{name: off}).token_logprobs, configured.token_logprobs)


@pytest.mark.parametrize("strategy, passed", [("low_confidence_static", False), ("low_confidence_dynamic", True)])
def test_rollouts_pass_the_threshold_only_to_the_dynamic_strategy(tmp_path, strategy, passed):
    with pytest.warns(UserWarning, match="ignores it") if not passed else contextlib.nullcontext():
        args = TraceRLConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                             remasking_strategy=strategy, confidence_threshold=0.6, use_cpu=True, bf16=False,
                             report_to="none", dynamic_group_filtering="none")
    trainer = TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                             train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 4}),
                             processing_class=build_tokenizer())
    assert ("confidence_threshold" in trainer._rollout_sampler()) is passed
    saved = trainer._rollout_generation_config()
    assert (getattr(saved, "confidence_threshold", None) == 0.6) is passed  # a static run: the model's (none here)


def test_the_config_warns_about_a_threshold_its_strategy_does_not_read(tmp_path):
    common = dict(per_device_train_batch_size=4, num_generations=4, use_cpu=True, bf16=False, report_to="none")
    with pytest.warns(UserWarning, match=r"confidence_threshold=0\.6 is read by remasking_strategy="
                                         r"'low_confidence_dynamic' only; the rollouts' 'random' ignores it"):
        TraceRLConfig(str(tmp_path), remasking_strategy="random", confidence_threshold=0.6, **common)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        TraceRLConfig(str(tmp_path), remasking_strategy="random", **common)  # the default 0.9: a recipe's, quiet
        TraceRLConfig(str(tmp_path), confidence_threshold=0.6, **common)  # the dynamic default strategy reads it
