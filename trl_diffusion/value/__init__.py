"""Diffusion value model: a backbone plus a scalar head scoring trajectory states, step-level GAE, and a trainer
that fits it on stored trajectories before RL."""

from ..states import completion_blocks
from .advantages import (
    clipped_value_loss,
    dense_steps,
    discounted_reverse_cumsum,
    outcome_token_rewards,
    step_gae,
    step_means,
    summarize_value_statistics,
    value_statistics,
)
from .value_config import DiffusionValueConfig
from .value_model import DiffusionValueModel, ValueOutput, token_values
from .value_trainer import DiffusionValueTrainer, TrajectoryCollator

__all__ = [
    "DiffusionValueConfig",
    "DiffusionValueModel",
    "DiffusionValueTrainer",
    "TrajectoryCollator",
    "ValueOutput",
    "clipped_value_loss",
    "completion_blocks",
    "dense_steps",
    "discounted_reverse_cumsum",
    "outcome_token_rewards",
    "step_gae",
    "step_means",
    "summarize_value_statistics",
    "token_values",
    "value_statistics",
]
