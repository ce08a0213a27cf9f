"""Our configs keep TRL's default (activation checkpointing on) without transformers >= 5.24's FutureWarning for
the old name, and either name given explicitly works as in transformers."""

import warnings

import pytest
from trl import TrlParser

from trl_diffusion.checkpointing_default import HAS_ACTIVATION_CHECKPOINTING
from trl_diffusion.trainers import DiffusionSFTConfig, TraceRLConfig
from trl_diffusion.value import DiffusionValueConfig

CONFIGS = [TraceRLConfig, DiffusionSFTConfig, DiffusionValueConfig]


def build(config_class, tmp_path, **kwargs):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = config_class(output_dir=str(tmp_path), use_cpu=True, bf16=False, **kwargs)
    deprecations = [w for w in caught if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)]
    return config, deprecations


@pytest.mark.parametrize("config_class", CONFIGS)
def test_checkpointing_is_on_by_default_without_a_deprecation_warning(config_class, tmp_path):
    config, deprecations = build(config_class, tmp_path)
    assert config.gradient_checkpointing is True
    if HAS_ACTIVATION_CHECKPOINTING:
        assert config.activation_checkpointing is True and deprecations == []


@pytest.mark.parametrize("config_class", CONFIGS)
def test_either_name_turns_checkpointing_off(config_class, tmp_path):
    config, _ = build(config_class, tmp_path, gradient_checkpointing=False)
    assert config.gradient_checkpointing is False
    if HAS_ACTIVATION_CHECKPOINTING:
        assert config.activation_checkpointing is False
        config, deprecations = build(config_class, tmp_path, activation_checkpointing=False)
        assert config.gradient_checkpointing is False and config.activation_checkpointing is False
        assert deprecations == []


@pytest.mark.parametrize("flags,expected", [([], True), (["--gradient_checkpointing", "false"], False),
                                            (["--gradient_checkpointing", "true"], True)])
def test_command_line_checkpointing(flags, expected, tmp_path):
    (config,) = TrlParser(dataclass_types=[TraceRLConfig]).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false", *flags])
    assert config.gradient_checkpointing is expected
