"""Datasets: the synthetic arithmetic task (and, beside it, benchmark loaders)."""

from .arithmetic import (
    ArithmeticProblem,
    arithmetic_reward,
    evaluate_accuracy,
    extract_boxed,
    generate_completions,
    make_problems,
    score_completion,
    to_dataset,
)
from .loading import load_training_dataset

__all__ = [
    "ArithmeticProblem",
    "arithmetic_reward",
    "evaluate_accuracy",
    "extract_boxed",
    "generate_completions",
    "load_training_dataset",
    "make_problems",
    "score_completion",
    "to_dataset",
]
