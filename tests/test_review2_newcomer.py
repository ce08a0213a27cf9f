"""A new user who knows TRL and transformers: the things such a user passes to the trainers and the examples the
way TRL takes them (a model as a path, a model object with or without a tokenizer, TRL's config classes, the
example scripts' ``ModelConfig`` flags, reward functions on datasets with other column names) either work or stop
early with an error saying what to do."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from test_cli import load_example

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.rewards import OfficialMathReward, math_accuracy_reward
from trl_diffusion.scripts.utils import parse_script_args
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


class _Built(Exception):
    """Raised by a stand-in trainer: the example got as far as building its trainer."""


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    """A tiny SDAR saved in bfloat16, with its tokenizer."""
    folder = tmp_path_factory.mktemp("bf16-sdar")
    tiny_model("sdar").to(torch.bfloat16).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.parametrize("name", ["math", "sft", "code"])
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_examples_load_the_model_in_the_dtype_asked_for(monkeypatch, tmp_path, bf16_checkpoint, name, dtype):
    """TRL's ``ModelConfig.dtype`` (default float32, as TRL's scripts load it: float32 weights under bf16 mixed
    precision) is honoured by every example; ``auto`` keeps the checkpoint's. Before, ``examples/sft.py`` and
    ``examples/code.py`` ignored ``--dtype`` and trained a bf16 checkpoint in pure bf16 (an Adam step of lr 1e-5 is
    below bf16's resolution on most weights)."""
    example = load_example(name)
    seen = {}

    def stand_in(model, *args, **kwargs):
        seen["dtype"] = model.dtype
        raise _Built

    monkeypatch.setattr(example, "DiffusionSFTTrainer" if name == "sft" else "TraceRLTrainer", stand_in)
    argv = ["--model_name_or_path", str(bf16_checkpoint), "--dtype", dtype, "--output_dir", str(tmp_path)]
    if name != "sft":
        argv += ["--num_generations", "2", "--per_device_train_batch_size", "2"]
    parsed = parse_script_args(example.make_parser(), argv)
    with pytest.raises(_Built):
        example.main(*parsed)
    assert seen["dtype"] == (torch.float32 if dtype == "float32" else torch.bfloat16)


@pytest.mark.parametrize("flag", ["--trust_remote_code", "--attn_implementation", "--load_in_4bit"])
def test_example_flags_that_would_be_ignored_are_refused(capsys, flag):
    """TRL flags the examples do not apply stop the run with one line saying why, instead of being ignored."""
    value = "flash_attention_2" if flag == "--attn_implementation" else "true"
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(load_example("sft").make_parser(), [flag, value])
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert f": error: {flag}: not used by the example scripts" in message


def test_grpo_cache_implementation_is_refused_not_ignored():
    """GRPO's ``cache_implementation`` configures transformers' autoregressive ``generate``; diffusion rollouts never
    read it (before, ``cache_implementation="static"`` was accepted and changed nothing). The error names the field
    that does set the rollout cache."""
    with pytest.raises(ValueError, match=r"\['cache_implementation'\].*rollout_cache"):
        TraceRLConfig("unused", cache_implementation="static", **CPU)


@pytest.mark.parametrize("reward", [math_accuracy_reward, OfficialMathReward()], ids=["math_accuracy", "official"])
def test_math_reward_without_any_gold_column_says_which_columns_it_reads(reward):
    """A TRL dataset whose gold column has another name (``ground_truth``): before, every reward was ``None`` and the
    run trained on nothing (TRL only warns that all reward functions returned None). A row without a gold answer in
    a column that exists still scores ``None``."""
    kwargs = dict(prompts=["q"], completion_ids=[[1]], trainer_state=None)
    with pytest.raises(ValueError, match=r"'answer' or 'solution'.*\['ground_truth'\].*rename_column"):
        reward([r"\boxed{2}"], ground_truth=["2"], **kwargs)
    assert reward([r"\boxed{2}", r"\boxed{2}"], answer=["2", None], **{**kwargs, "prompts": ["q", "q"],
                                                                         "completion_ids": [[1], [1]]}) == [1.0, None]
