"""Reward functions for GRPO-style training of diffusion language models, in TRL's reward-function format.

Every reward has the signature ``fn(completions, **kwargs) -> list[float | None]``: ``completions`` are strings or
chat-message lists, dataset columns arrive as keyword lists, and TRL's extra keywords (``prompts``,
``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric``) are accepted. ``None`` marks a row that cannot
be scored (no gold answer / no tests), which TRL excludes. See ``docs/rewards.md``.
"""

from .code_reward import CodeExecutionReward, build_tests, code_execution_reward, extract_code, make_code_reward
from .dllm_rl_code import (
    OfficialCodeReward,
    extract_code_official,
    make_official_code_reward,
    official_code_outcomes,
    official_code_reward,
)
from .format_reward import (
    ThinkFormatReward,
    boxed_format_reward,
    completion_to_text,
    last_boxed_content,
    think_format_reward,
)
from .math_reward import (
    MathAccuracyReward,
    OfficialMathReward,
    extract_gold_answer,
    gold_text,
    make_official_math_reward,
    math_accuracy_reward,
    official_math_reward,
)
from .sandbox import SandboxLimits, SandboxResult, isolation_report, run_tests

REWARD_FUNCTIONS = (
    "math_accuracy_reward",
    "official_math_reward",
    "code_execution_reward",
    "official_code_reward",
    "boxed_format_reward",
    "think_format_reward",
)
"""The ready reward functions (TRL's ``reward_func(completions, **columns)``), which ``--reward_funcs`` accepts by
name; the classes and ``make_*`` factories build configured ones from Python."""

__all__ = [
    "REWARD_FUNCTIONS",
    "CodeExecutionReward",
    "MathAccuracyReward",
    "OfficialCodeReward",
    "OfficialMathReward",
    "SandboxLimits",
    "SandboxResult",
    "ThinkFormatReward",
    "boxed_format_reward",
    "build_tests",
    "code_execution_reward",
    "completion_to_text",
    "extract_code",
    "extract_code_official",
    "extract_gold_answer",
    "gold_text",
    "isolation_report",
    "last_boxed_content",
    "make_code_reward",
    "make_official_code_reward",
    "make_official_math_reward",
    "math_accuracy_reward",
    "official_code_outcomes",
    "official_code_reward",
    "official_math_reward",
    "run_tests",
    "think_format_reward",
]
