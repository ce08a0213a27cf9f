"""How a trainer gets log pi(completion) from a diffusion model: five estimators behind one switch, the packed
layouts they score with, and the slow per-step replay they are tested against."""

from ..states import step_groups
from .likelihood import (
    ESTIMATORS,
    MASK_SAMPLING,
    MULTI_MASK_ESTIMATORS,
    EstimatorSettings,
    check_mask_options,
    draw_masks,
    estimate_logprobs,
    row_sizes,
    score_chunks,
)
from .packing import ScoringChunk, build_scoring_chunks
from .trajectory import replay_logprobs, trajectory_layout

__all__ = [
    "ESTIMATORS",
    "MASK_SAMPLING",
    "MULTI_MASK_ESTIMATORS",
    "EstimatorSettings",
    "ScoringChunk",
    "build_scoring_chunks",
    "check_mask_options",
    "draw_masks",
    "estimate_logprobs",
    "replay_logprobs",
    "row_sizes",
    "score_chunks",
    "step_groups",
    "trajectory_layout",
]
