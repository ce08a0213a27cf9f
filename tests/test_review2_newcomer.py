"""A new user who knows TRL and transformers: the things such a user passes to the trainers and the examples the
way TRL takes them (a model as a path, a model object with or without a tokenizer, TRL's config classes, the
example scripts' ``ModelConfig`` flags, reward functions on datasets with other column names) either work or stop
early with an error saying what to do."""

from __future__ import annotations

import pytest
from datasets import Dataset

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

CPU = dict(bf16=False, use_cpu=True, report_to="none")
PROMPTS = Dataset.from_list([{"prompt": f"What is {i}+1?\n", "completion": f"{i + 1}", "answer": f"{i + 1}"}
                             for i in range(8)])


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_a_path_object_is_a_model_path(tmp_path):
    """``EMBEDDED_MODEL`` is a ``pathlib.Path``; passed as ``model`` it is loaded like its string (before, TRL took
    it for a model object: ``'PosixPath' object has no attribute 'config'``, and the SFT trainer said a PosixPath
    "is not a diffusion language model")."""
    rl = TraceRLTrainer(EMBEDDED_MODEL, zero_reward, train_dataset=PROMPTS,
                        args=TraceRLConfig(str(tmp_path / "rl"), per_device_train_batch_size=8, num_generations=4,
                                           max_completion_length=16, **CPU))
    assert rl.model.config.model_type == "sdar" and rl.processing_class.mask_token == "<|MASK|>"
    sft = DiffusionSFTTrainer(EMBEDDED_MODEL, args=DiffusionSFTConfig(str(tmp_path / "sft"), **CPU),
                              train_dataset=PROMPTS.remove_columns("answer"))
    assert sft.model.config.model_type == "sdar" and sft.objective == "block"


@pytest.mark.parametrize("trainer", ["sft", "tracerl", "value"])
def test_a_model_built_in_memory_needs_its_tokenizer(tmp_path, trainer):
    """A model built from a config (``tiny_model``, ``AutoModelForCausalLM.from_config``) has no path TRL could load
    a tokenizer from; without ``processing_class`` the error says to pass it (before: the Hub client's ``Repo id
    must use alphanumeric chars ... ''``)."""
    model = tiny_model("sdar")
    with pytest.raises(ValueError, match="pass processing_class="):
        if trainer == "sft":
            DiffusionSFTTrainer(model, args=DiffusionSFTConfig(str(tmp_path), **CPU), train_dataset=PROMPTS)
        elif trainer == "tracerl":
            TraceRLTrainer(model, zero_reward, TraceRLConfig(str(tmp_path), per_device_train_batch_size=8,
                                                             num_generations=4, max_completion_length=16, **CPU),
                           PROMPTS)
        else:
            DiffusionValueTrainer(DiffusionValueModel.from_policy(model), args=DiffusionValueConfig(str(tmp_path),
                                                                                                    **CPU))
    # with the tokenizer it is built as before
    trainer_ = TraceRLTrainer(model, zero_reward, TraceRLConfig(str(tmp_path), per_device_train_batch_size=8,
                                                                num_generations=4, max_completion_length=16, **CPU),
                              PROMPTS, processing_class=build_tokenizer())
    assert trainer_.processing_class.mask_token == "<|MASK|>"
