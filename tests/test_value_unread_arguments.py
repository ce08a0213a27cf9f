"""Value-model inputs that were accepted and ignored without a word: keyword arguments of
``DiffusionValueModel.forward`` (``logits_to_keep`` for ``values_to_keep``, ``return_dict=False``), the config's
``output_hidden_states``, the loading arguments of ``from_policy`` given with a model object, and TraceRL's value
fields on a trainer without a value model. Also ``evaluate_accuracy`` with several sequences per prompt, whose texts
were zipped with the wrong problems."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.data import evaluate_accuracy, generate_completions, make_problems
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueModel

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_value_forward_refuses_what_it_would_ignore(family):
    value = DiffusionValueModel.from_policy(tiny_model(family))
    with pytest.raises(TypeError, match=r"unexpected arguments \['logits_to_keep'\] \(values_to_keep picks"):
        value(input_ids=IDS, logits_to_keep=1)
    with pytest.raises(TypeError, match=r"unexpected arguments \['labels'\]"):
        value(input_ids=IDS, labels=IDS)
    with pytest.raises(ValueError, match="return_dict=False is not supported"):
        value(input_ids=IDS, return_dict=False)
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        value(input_ids=IDS, output_attentions=True)
    kept = value(input_ids=IDS, values_to_keep=1, output_router_logits=False, return_dict=True).value
    assert kept.shape == (1, 1)


def test_value_forward_reads_the_configs_output_hidden_states():
    value = DiffusionValueModel.from_policy(tiny_model("sdar"))
    assert value(input_ids=IDS).hidden_states is None
    value.config.output_hidden_states = True  # as from_pretrained(..., output_hidden_states=True) sets it
    assert len(value(input_ids=IDS).hidden_states) == value.config.num_hidden_layers + 1
    assert value(input_ids=IDS, output_hidden_states=False).hidden_states is None


def test_from_policy_refuses_loading_arguments_with_a_model_object():
    policy = tiny_model("sdar").to(torch.bfloat16)
    with pytest.raises(TypeError, match=r"loading arguments \['dtype'\], which apply to a path only"):
        DiffusionValueModel.from_policy(policy, dtype=torch.float32)
    assert DiffusionValueModel.from_policy(policy).dtype == torch.bfloat16


def test_value_fields_without_a_value_model_warn(tmp_path, caplog):
    def build(**fields):
        args = TraceRLConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                             max_completion_length=8, use_cpu=True, bf16=False, report_to="none", **fields)
        return TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                              train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 4}),
                              processing_class=build_tokenizer())

    with caplog.at_level(logging.WARNING):
        build(gamma=0.5, value_learning_rate=1e-3)
    assert "gamma=0.5, value_learning_rate=0.001 set the value model's training, but this trainer has none" \
        in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        build()
    assert "value model's training" not in caplog.text


def test_evaluate_accuracy_refuses_what_would_misalign_its_texts():
    model, tokenizer, problems = tiny_model("sdar"), build_tokenizer(), make_problems(2, 2, seed=0)[1]
    with pytest.raises(ValueError, match="num_return_sequences=2: one completion per prompt"):
        evaluate_accuracy(model, tokenizer, problems, num_return_sequences=2, temperature=0.5)
    for batch_size in (0, -1, 2.0):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            generate_completions(model, tokenizer, [p.prompt for p in problems], batch_size=batch_size)
