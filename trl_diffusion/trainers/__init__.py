"""Trainers: diffusion SFT and TraceRL (with its likelihood estimators)."""

from .diffusion_losses import OBJECTIVES, ScoringBatch, build_objective, diffusion_loss, score_tokens
from .sft_config import DiffusionSFTConfig
from .sft_trainer import DiffusionSFTTrainer
from .tracerl_config import TraceRLConfig
from .tracerl_trainer import TraceRLTrainer

__all__ = [
    "OBJECTIVES",
    "DiffusionSFTConfig",
    "DiffusionSFTTrainer",
    "ScoringBatch",
    "TraceRLConfig",
    "TraceRLTrainer",
    "build_objective",
    "diffusion_loss",
    "score_tokens",
]
