"""Review of our own config fields (the ones DiffusionSFTConfig, TraceRLConfig, DiffusionValueConfig and EvalConfig
add to TRL's): a wrong-typed or out-of-range value given programmatically was accepted and failed late or silently
misbehaved; each is now refused at construction with an error naming the field."""

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from datasets import Dataset
from trl import GRPOConfig, TrlParser

from trl_diffusion.cli import main
from trl_diffusion.eval import EvalConfig
from trl_diffusion.states import check_field_types
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig
from trl_diffusion.trainers.tracerl_config import GRPO_LOSS_TYPES, TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

CPU = dict(output_dir="unused", use_cpu=True, bf16=False, report_to=[])
CONFIGS = {"sft": DiffusionSFTConfig, "tracerl": TraceRLConfig, "value": DiffusionValueConfig}


def make(kind, **fields):
    if kind == "eval":
        return EvalConfig(**fields)
    return CONFIGS[kind](**CPU, **fields)


# ------------------------------------------------------------------------------------------------ field types


@pytest.mark.parametrize("kind, name, value, expected", [
    ("sft", "mask_eps", "1e-3", "a float"),
    ("sft", "block_size", True, "an int or None"),  # bool is not an int
    ("sft", "pad_to_length_with_eos", "false", "a bool"),  # a non-empty string is truthy: it padded
    ("tracerl", "value_batch_size", 64.0, "an int or None"),
    ("tracerl", "shrinkage", 2.0, "an int"),
    ("tracerl", "exclude_mask_token_from_softmax", 0, "a bool"),
    ("tracerl", "scoring_temperature", "1.0", "a float or None"),
    ("value", "truncate_at_eos", "false", "a bool"),
    ("value", "gamma", "0.9", "a float"),
    ("eval", "num_samples", 4.0, "an int"),
    ("eval", "stop_token_ids", [1, "2"], "a list of int or None"),
    ("eval", "progress", "no", "a bool"),
])
def test_wrong_typed_own_fields_are_refused(kind, name, value, expected):
    """Each of these was accepted (e.g. value_batch_size=64.0 or truncate_at_eos='false') and failed or misbehaved
    later; the error names the field, the value and the expected type."""
    with pytest.raises(ValueError, match=re.escape(f"{name} must be {expected}, got {value!r}")):
        make(kind, **{name: value})


@pytest.mark.parametrize("kind, fields", [
    ("tracerl", dict(gamma=1, lam=0, value_learning_rate=1, value_batch_size=np.int64(8), log_ratio_clip=None)),
    ("value", dict(gamma=0, shrinkage=np.int32(2), training_block_size=None)),
    ("eval", dict(code_timeout=5, temperature=0, pass_k=(1,), stop_token_ids=[np.int64(3)])),
    ("sft", dict(mask_eps=np.float32(0.01), block_size=None)),
])
def test_right_typed_values_pass_and_wrong_ones_still_fail(kind, fields):
    """An int is a float, numpy scalars are numbers, None is fine for an Optional field; one wrong-typed field
    among them is still found."""
    config = make(kind, **fields)
    assert {k: getattr(config, k) for k in fields} == fields
    name = next(iter(fields))
    with pytest.raises(ValueError, match=f"^{name} must be"):
        make(kind, **{**fields, name: str(fields[name])})


def test_only_fields_our_class_adds_are_checked():
    """check_field_types leaves the TRL base class's fields to TRL and checks the subclass's own."""

    @dataclasses.dataclass
    class Base:
        steps: int = 1

    @dataclasses.dataclass
    class Ours(Base):
        ratio: float = 0.5
        flags: list[bool] | None = None

    check_field_types(Ours(steps="3"), Base)  # the base's field: not ours to check
    with pytest.raises(ValueError, match=r"^steps must be an int, got '3' \(str\)"):
        check_field_types(Ours(steps="3"))  # no base: every field is ours
    with pytest.raises(ValueError, match=r"^ratio must be a float, got True \(bool\)"):
        check_field_types(Ours(ratio=True), Base)
    with pytest.raises(ValueError, match=r"^flags must be a list of bool or None, got \[1\]"):
        check_field_types(Ours(flags=[1]), Base)


def test_base_fields_our_class_redeclares_are_checked():
    """A TRL field we redeclare with our own default (TraceRL's beta / use_bias_correction_kl, the value config's
    learning_rate / remove_unused_columns) is ours to check too."""
    from trl_diffusion import DiffusionValueConfig, TraceRLConfig

    for make, name, value in [(TraceRLConfig, "beta", "0.01"), (TraceRLConfig, "use_bias_correction_kl", "true"),
                              (DiffusionValueConfig, "learning_rate", "1e-5"),
                              (DiffusionValueConfig, "remove_unused_columns", 0)]:
        with pytest.raises(ValueError, match=f"^{name} must be"):
            make(**CPU, **{name: value})


# ------------------------------------------------------------------------------------ --diffusion_objective None


def test_diffusion_objective_none_from_the_command_line():
    """The help listed None as a choice, but argparse compared the string 'None' with the object None and exited with
    'invalid choice'."""
    parser = TrlParser(dataclass_types=[DiffusionSFTConfig])
    for text, expected in [("None", None), ("none", None), ("block", "block")]:
        (config,) = parser.parse_args_and_config(
            args=["--output_dir", "unused", "--use_cpu", "true", "--bf16", "false", "--diffusion_objective", text])
        assert config.diffusion_objective == expected
        assert DiffusionSFTConfig(**CPU, diffusion_objective=text).diffusion_objective == expected


# ------------------------------------------------------------------------------------------------ TraceRL fields


def test_loss_type_must_be_tracerl_or_one_of_trls_grpo_loss_types():
    """An unknown loss_type (e.g. a typo) was accepted and failed at the first loss computation, after a rollout. The
    allowed GRPO types restate those TRL's GRPOConfig help lists (a TRL upgrade that adds one shows here)."""
    with pytest.raises(ValueError, match=r"loss_type must be one of \('tracerl', 'grpo', .*'vespo'\), got 'ppo'"):
        TraceRLConfig(**CPU, loss_type="ppo")
    for loss_type in ("tracerl", *GRPO_LOSS_TYPES):
        assert TraceRLConfig(**CPU, loss_type=loss_type).loss_type == loss_type
    help_text = next(f for f in dataclasses.fields(GRPOConfig) if f.name == "loss_type").metadata["help"]
    listed = re.search(r"Supported values are (.*?)\. ", help_text).group(1)
    assert set(GRPO_LOSS_TYPES) == set(re.findall(r"'(\w+)'", listed))


@pytest.mark.parametrize("value", [math.inf, math.nan, 0.0, -1e-6])
def test_value_learning_rate_must_be_finite_and_positive(value):
    """value_learning_rate=inf was accepted (only NaN and <= 0 were refused): the value model's first AdamW step
    made its weights -inf / NaN."""
    with pytest.raises(ValueError, match="value_learning_rate must be a finite number > 0"):
        TraceRLConfig(**CPU, value_learning_rate=value)


# ------------------------------------------------------------------------------------------------ training_block_size


def tracerl_trainer(tmp_path, family, **overrides):
    args = TraceRLConfig(**{**CPU, "output_dir": str(tmp_path)}, per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, max_steps=1, block_length=4, denoising_steps=2, save_strategy="no",
                         gradient_checkpointing=False, disable_tqdm=True, dynamic_group_filtering="none", **overrides)
    return TraceRLTrainer(tiny_model(family).train(), lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=build_tokenizer())


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_tracerl_training_block_size_on_a_full_attention_model_is_an_error(tmp_path, family):
    """Full-attention policies are scored without blocks: training_block_size=8 was silently ignored."""
    with pytest.raises(ValueError, match="training_block_size=8 was set, but the model has full attention"):
        tracerl_trainer(tmp_path, family, training_block_size=8)
    assert tracerl_trainer(tmp_path, family).estimator_settings.block_size == 4  # unset: the rollout's, unused


def test_value_training_block_size_on_a_full_attention_model_is_an_error(tmp_path):
    """A full-attention value model is scored without blocks: training_block_size=4 was silently ignored."""
    tokenizer = build_tokenizer()
    args = DiffusionValueConfig(**{**CPU, "output_dir": str(tmp_path)}, training_block_size=4)
    with pytest.raises(ValueError, match="training_block_size=4 was set, but the model has full attention"):
        DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("llada")), args=args,
                              processing_class=tokenizer)
    trainer = DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")), args=args,
                                    processing_class=tokenizer)
    assert trainer.args.training_block_size == 4


# ------------------------------------------------------------------------------------------------ EvalConfig


@pytest.mark.parametrize("fields, message", [
    (dict(code_timeout=0.0), "code_timeout must be a finite number of seconds > 0"),
    (dict(code_timeout=math.inf), "code_timeout must be a finite number of seconds > 0"),
    (dict(code_timeout=math.nan), "code_timeout must be a finite number of seconds > 0"),
    (dict(code_memory_mb=0), "code_memory_mb must be >= 1"),
    (dict(code_workers=0), "code_workers must be >= 1"),
    (dict(dtype="fp16"), "dtype must be one of"),
    (dict(device="gpu"), "device must be a torch device"),
    (dict(device="cuda:x"), "device must be a torch device"),
    (dict(stop_token_ids=[2, -1]), r"stop_token_ids must all be >= 0, got \[-1\]"),
])
def test_eval_config_ranges(fields, message):
    """Each was accepted: code_workers=0 silently ran one sandbox, code_timeout=inf failed (OverflowError) when the
    first code completion was scored, after generation, code_memory_mb=0 gave every program a zero memory limit,
    dtype='fp16' failed at load (AttributeError), device='gpu' after the dataset loaded, and a negative stop id
    never matches a token."""
    with pytest.raises(ValueError, match=message):
        EvalConfig(**fields)
    config = EvalConfig(code_timeout=0.5, code_memory_mb=1, code_workers=1, dtype="float16", device="cuda:1",
                        stop_token_ids=[0, 2])
    with pytest.raises(ValueError, match=message):  # evaluate() applies overrides with dataclasses.replace
        dataclasses.replace(config, **fields)
    assert torch.device(config.device).index == 1


def test_eval_command_line_range_error_is_one_line(capsys):
    assert main(["eval", "--code_workers", "0", "--progress", "false", "--output_dir", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["trl-diffusion eval: error: code_workers must be >= 1, got 0."]
