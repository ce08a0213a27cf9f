"""Contracts of the configuration classes that no other test pinned: a validation's exact boundary, a preset's
layout rule, a refusal that names its field. Each test builds configs only (no model), so the file runs fast."""

import pytest

from trl_diffusion.trainers import DiffusionSFTConfig
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.value import DiffusionValueConfig

CPU = {"use_cpu": True, "bf16": False, "report_to": []}


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """The configs' relative output_dir lands in tmp_path (a config may create it), not in the checkout."""
    monkeypatch.chdir(tmp_path)


def tracerl(**fields):
    return TraceRLConfig("out", **CPU, **fields)


def sft(**fields):
    return DiffusionSFTConfig("out", **CPU, **fields)


# ------------------------------------------------------------------------------------------------ TraceRLConfig


def test_group_accuracy_band_above_one_is_refused():
    """A band past 1 is no accuracy (a percentage typed by mistake?): refused rather than silently read as 1."""
    tracerl(group_accuracy_low=0.2, group_accuracy_high=1.0)
    with pytest.raises(ValueError, match="group_accuracy_high <= 1"):
        tracerl(group_accuracy_low=0.2, group_accuracy_high=1.5)


def test_default_accuracy_band_is_dllm_rl_filter():
    """Default filter = dLLM-RL's: groups with accuracy < 0.2 or > 0.8 leave the loss (reward/rl_reward.py 112-114)."""
    args = tracerl()
    assert (args.dynamic_group_filtering, args.group_accuracy_low, args.group_accuracy_high) == (
        "accuracy_band", 0.2, 0.8)


# ------------------------------------------------------------------------------------------------ DiffusionSFTConfig


def test_sft_mask_eps_of_one_half_is_refused():
    """mask_eps must lie in (0, 0.5): from 0.5 on, complementary's U(mask_eps, 1 - mask_eps) is empty or inverted."""
    sft(mask_eps=0.499)
    for value in (0.5, 0.9):
        with pytest.raises(ValueError, match="mask_eps must be in"):
            sft(mask_eps=value)


def test_sft_eos_padding_is_refused_for_the_trajectory_objective():
    """Recorded rollouts fix the completion tokens and their steps, so EOS padding would be silently dropped."""
    with pytest.raises(ValueError, match="pad_to_length_with_eos does not apply to 'trajectory'"):
        sft(diffusion_objective="trajectory", pad_to_length_with_eos=True, max_length=64)


# ------------------------------------------------------------------------------------------------ DiffusionValueConfig


def test_value_gamma_above_one_is_refused():
    """A discount above 1 makes the value targets grow with the number of denoising steps instead of staying at R."""
    DiffusionValueConfig("out", **CPU, gamma=1.0)
    with pytest.raises(ValueError, match=r"gamma must lie in \[0, 1\]"):
        DiffusionValueConfig("out", **CPU, gamma=1.5)


def test_value_shrinkage_below_one_is_refused():
    """Shrinkage merges s >= 1 denoising steps per state: 0 is refused when the config is built, not in training."""
    with pytest.raises(ValueError, match="shrinkage must be >= 1"):
        DiffusionValueConfig("out", **CPU, shrinkage=0)


# ------------------------------------------------------------------------------------------------ from_official


def test_official_layout_breaks_a_tie_towards_the_larger_accumulation():
    """Equally near layouts resolve to the larger accumulation, so a run keeps at least dLLM-RL's rows per step."""
    # dream on 8 processes wants 2048 rows / 128 per response / 8 = 2 micro-steps; 24 responses = 3 micro-steps,
    # whose divisors 1 and 3 are equally near
    args = TraceRLConfig.from_official("dream", output_dir="out", num_processes=8, generation_batch_size=24, **CPU)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 3)
