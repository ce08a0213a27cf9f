"""Config values that were accepted and went wrong later (helper s28):

1. ``--use_cache false`` left the string ``"false"`` in ``TraceRLConfig.use_cache``, which the Trainer copies into
   ``model.config.use_cache`` (saved configs held the truthy ``"false"``).
2. The deprecated ``use_cache`` silently replaced an explicit, different ``rollout_cache``.
3. A NaN or infinite ``beta`` (and NaN clip ranges, ...) trained NaN weights while the logged loss read 0.0.
4. ``examples/code.py --timeout 0`` (or ``inf``, ``--memory_mb 0``) was a traceback after the model had loaded.
5. ``EvalConfig`` took a bad ``use_cache`` / ``remasking_strategy`` / ``cuda_graphs`` until the model had loaded.
6. ``--scale_rewards false`` / ``true`` (TRL's documented False / True) was refused.
"""

from __future__ import annotations

import importlib
import math
import warnings

import pytest
from example_scripts import load_example
from test_newcomer_audit import error_line
from trl import TrlParser

from trl_diffusion.cli import main
from trl_diffusion.eval import EvalConfig
from trl_diffusion.trainers.tracerl_config import TraceRLConfig

NAN, INF = math.nan, math.inf


def config(tmp_path, **overrides) -> TraceRLConfig:
    return TraceRLConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, **overrides)


def parse(tmp_path, *flags) -> TraceRLConfig:
    (args,) = TrlParser([TraceRLConfig]).parse_args_and_config(
        ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true", *flags])
    return args


# ------------------------------------------------------------------------------------------- 1. use_cache a bool
@pytest.mark.parametrize("value", ["false", "False", False])
def test_use_cache_false_in_any_form_is_the_boolean(tmp_path, value):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = config(tmp_path, use_cache=value)
    assert args.use_cache is False and args.rollout_cache == "auto"
    assert not [w for w in caught if "rollout_cache" in str(w.message)]  # False names no cache: nothing moved


def test_use_cache_false_from_the_command_line_is_the_boolean(tmp_path):
    args = parse(tmp_path, "--use_cache", "false")
    assert args.use_cache is False and args.rollout_cache == "auto"


# ------------------------------------------------------------------------------- 2. use_cache vs rollout_cache
@pytest.mark.parametrize("rollout_cache, use_cache", [(False, True), ("prefix", "dual"), (True, "dual")])
def test_use_cache_disagreeing_with_rollout_cache_is_refused(tmp_path, rollout_cache, use_cache):
    with pytest.raises(ValueError, match="disagree; pass only rollout_cache"):
        config(tmp_path, rollout_cache=rollout_cache, use_cache=use_cache)


def test_use_cache_and_rollout_cache_disagreeing_names_both(tmp_path):
    with pytest.raises(ValueError, match=r"rollout_cache=False and use_cache=True .*pass only rollout_cache"):
        config(tmp_path, rollout_cache=False, use_cache=True)


@pytest.mark.parametrize("rollout_cache, use_cache, expected", [("auto", "prefix", "prefix"), ("dual", "dual", "dual"),
                                                                 (True, "true", True)])
def test_use_cache_alone_or_agreeing_still_warns(tmp_path, rollout_cache, use_cache, expected):
    with pytest.warns(FutureWarning, match="use rollout_cache="):
        args = config(tmp_path, rollout_cache=rollout_cache, use_cache=use_cache)
    assert args.rollout_cache == expected and args.use_cache is False


# ----------------------------------------------------------------------------------------- 3. loss numbers
@pytest.mark.parametrize("name, value", [
    ("beta", NAN), ("beta", INF), ("beta", -0.01), ("epsilon", NAN), ("epsilon", -0.2), ("epsilon_high", NAN),
    ("delta", NAN), ("off_policy_mask_threshold", NAN), ("entropy_coef", NAN), ("entropy_coef", INF),
    ("sapo_temperature_pos", INF), ("vespo_k_neg", NAN), ("top_entropy_quantile", NAN),
    ("top_entropy_quantile", 1.5), ("ref_model_mixup_alpha", NAN),
])
def test_a_loss_number_that_breaks_training_is_refused(tmp_path, name, value):
    with pytest.raises(ValueError, match=f"^{name} must"):
        config(tmp_path, **{name: value})


@pytest.mark.parametrize("name, value", [("beta", 0.0), ("epsilon", INF), ("epsilon_high", INF), ("delta", INF),
                                         ("off_policy_mask_threshold", INF), ("log_ratio_clip", INF),
                                         ("cliprange_value", INF)])
def test_no_limit_and_no_kl_stay_allowed(tmp_path, name, value):
    assert getattr(config(tmp_path, **{name: value}), name) == value


def test_beta_nan_from_the_command_line_is_refused(tmp_path):
    with pytest.raises(ValueError, match="beta must be a finite number"):
        parse(tmp_path, "--beta", "nan")


# ------------------------------------------------------------------------------------ 4. code.py sandbox limits
@pytest.mark.parametrize("argv, message", [(["--timeout", "0"], "timeout must be finite and > 0, got 0.0"),
                                           (["--timeout", "inf"], "timeout must be finite and > 0, got inf"),
                                           (["--memory_mb", "0"], "memory_mb must be an int >= 1, got 0")])
def test_code_example_sandbox_limits_are_one_line_exit_2(capsys, argv, message):
    """``error_line`` parses only: the line comes before any model is loaded."""
    assert error_line(capsys, load_example("code").make_parser(), argv).endswith(f"error: {message}.")


# -------------------------------------------------------------------------------------- 5. EvalConfig values
@pytest.mark.parametrize("field, value, message", [("use_cache", "yes", "use_cache must be one of"),
                                                   ("remasking_strategy", "bogus", "remasking_strategy must be one"),
                                                   ("cuda_graphs", "on", "cuda_graphs must be one of")])
def test_eval_generation_values_are_checked_when_built(field, value, message):
    with pytest.raises(ValueError, match=message):
        EvalConfig(output_dir="", **{field: value})


@pytest.mark.parametrize("field, value", [("use_cache", True), ("use_cache", "dual"), ("use_cache", "FALSE"),
                                          ("remasking_strategy", "low_confidence_static"), ("cuda_graphs", "off")])
def test_eval_generation_values_that_exist_are_taken(field, value):
    assert getattr(EvalConfig(output_dir="", **{field: value}), field) == value


def test_eval_command_refuses_a_bad_cache_before_loading(monkeypatch, capsys):
    module = importlib.import_module("trl_diffusion.eval.evaluate")

    def no_load(config):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(module, "load_model_and_tokenizer", no_load)
    assert main(["eval", "--use_cache", "yes", "--progress", "false", "--output_dir", ""]) == 2
    assert "trl-diffusion eval: error: use_cache must be one of" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------- 6. scale_rewards
@pytest.mark.parametrize("value, expected", [("false", "none"), ("FALSE", "none"), ("true", "group"),
                                             ("True", "group"), (False, "none"), (True, "group"), ("batch", "batch")])
def test_scale_rewards_takes_true_and_false_as_strings(tmp_path, value, expected):
    assert config(tmp_path, scale_rewards=value).scale_rewards == expected


def test_scale_rewards_false_from_the_command_line(tmp_path):
    assert parse(tmp_path, "--scale_rewards", "false").scale_rewards == "none"
    with pytest.raises(ValueError, match="scale_rewards must be 'group', 'batch' or 'none'"):
        parse(tmp_path, "--scale_rewards", "maybe")
