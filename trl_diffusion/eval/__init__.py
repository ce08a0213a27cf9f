"""Benchmark evaluation: ``evaluate()`` (also ``trl-diffusion eval``) on MATH-500, GSM8K, AIME 2024, HumanEval /
MBPP / LiveCodeBench-style code sets, local files or the synthetic arithmetic task. See ``docs/evaluation.md``."""

from .datasets import (
    FORMATS,
    HUB_DATASETS,
    PROMPT_PRESETS,
    EvalProblem,
    detect_format,
    load_eval_problems,
    problems_from_rows,
)
from .evaluate import EvalConfig, evaluate, pass_at_k, score_completions

__all__ = [
    "FORMATS",
    "HUB_DATASETS",
    "PROMPT_PRESETS",
    "EvalConfig",
    "EvalProblem",
    "detect_format",
    "evaluate",
    "load_eval_problems",
    "pass_at_k",
    "problems_from_rows",
    "score_completions",
]
