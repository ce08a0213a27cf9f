"""Behavioural claims of docs/tracerl.md and docs/value.md that no other test exercised: the value optimizer's
settings (constant learning rate, TRL's AdamW hyper-parameters), ``value_batch_size=None``, a NaN
``value/explained_variance`` when the returns do not vary, ``from_official`` accepting DiffuCoder's ``coupled``
with an explicit batch layout, and ``DiffusionValueConfig``'s learning-rate default."""

import math

import pytest
from test_value import PROMPTS, make_trainer

from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueConfig


def constant_reward(completions, **kwargs) -> list[float]:
    return [1.0] * len(completions)


def count_calls(trainer: TraceRLTrainer) -> list:
    """Record every ``value_optimizer.step`` call of ``trainer``."""
    calls, step = [], trainer.value_optimizer.step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    trainer.value_optimizer.step = counted
    return calls


def test_value_optimizer_keeps_a_constant_rate_and_trls_adamw_settings(tmp_path):
    """value.md: the value model's AdamW uses `value_learning_rate`, constant (`lr_scheduler_type` and warm-up apply
    to the policy only), with TRL's betas / eps / weight decay (the policy optimizer's groups)."""
    trainer = make_trainer(tmp_path, lr_scheduler_type="linear", warmup_steps=1, max_steps=3, adam_beta1=0.8,
                           adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.05, value_learning_rate=3e-3)
    steps = count_calls(trainer)
    trainer.train()
    assert len(steps) == 3  # one value step per generation batch here, so three value updates were taken
    policy_lrs = [log["learning_rate"] for log in trainer.state.log_history if "learning_rate" in log]
    assert len(set(policy_lrs)) > 1  # the policy's schedule did move
    decayed, not_decayed = trainer.value_optimizer.param_groups  # as the policy's: no decay on norms and biases
    for group in (decayed, not_decayed):
        assert group["lr"] == 3e-3
        assert group["betas"] == (0.8, 0.95)
        assert group["eps"] == 1e-6
    assert decayed["weight_decay"] == 0.05 and not_decayed["weight_decay"] == 0.0


@pytest.mark.parametrize(("value_batch_size", "expected"), [(None, 2), (256, 1)])
def test_value_batch_size_none_takes_the_policys_step_count(tmp_path, value_batch_size, expected):
    """value.md: `value_batch_size=None` takes steps_per_generation // gradient_accumulation_steps value steps per
    generation batch; the default 256 rows per step gives ceil(rows / 256) = 1 on these few rows."""
    trainer = make_trainer(tmp_path, steps_per_generation=2, gradient_accumulation_steps=1,
                           value_batch_size=value_batch_size)
    steps = count_calls(trainer)
    inputs = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
    trainer._generate_and_score_completions(inputs)
    assert len(steps) == expected
    assert len(trainer._metrics["train"]["value/loss"]) == 1  # one epoch, logged once


def test_explained_variance_is_nan_when_the_returns_do_not_vary(tmp_path):
    """value.md: `value/explained_variance` is NaN when the returns do not vary (all rewards equal), while
    `value/mean` stays a number (0 from the zero-initialised head)."""
    trainer = make_trainer(tmp_path, reward=constant_reward)
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
    assert bool((output["advantages"] == 0).all())  # every return is 0
    metrics = trainer._metrics["train"]
    assert math.isnan(metrics["value/explained_variance"][-1])
    assert metrics["value/mean"][-1] == 0.0


def test_explained_variance_is_a_number_when_the_returns_vary(tmp_path):
    """The contrast to the NaN case: varying rewards give a finite explained variance."""
    trainer = make_trainer(tmp_path)
    output = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS])
    assert bool((output["advantages"] != 0).any())
    assert math.isfinite(trainer._metrics["train"]["value/explained_variance"][-1])


def test_from_official_accepts_diffucoders_coupled_with_a_batch_layout():
    """tracerl.md: `from_official` refuses DiffuCoder's `coupled` unless the batch layout is given; given, it keeps
    the estimator and the layout, and the rest of the preset."""
    args = TraceRLConfig.from_official("dream", likelihood_estimator="coupled", per_device_train_batch_size=2,
                                       gradient_accumulation_steps=4, output_dir="x", use_cpu=True)
    assert args.likelihood_estimator == "coupled"
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert args.kl_weighting == "row_sum" and args.top_p == 0.9  # the Dream preset is still applied,
    assert args.shrinkage == 1  # but not TraceRL's shrinkage (8), which no masking estimator reads


def test_diffusion_value_config_learning_rate_defaults_to_5e_6():
    """value.md: `DiffusionValueConfig`'s `learning_rate` defaults to 5e-6 (TRL's base default is 5e-5)."""
    assert DiffusionValueConfig(output_dir="x", use_cpu=True, bf16=False).learning_rate == 5e-6
    assert TraceRLConfig(output_dir="x", use_cpu=True, bf16=False).value_learning_rate == 5e-6
