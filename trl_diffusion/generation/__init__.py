"""Diffusion decoding: ``model.generate()`` for every family and the pieces it is built from."""

from .mixin import DiffusionGenerationMixin
from .sampler import DiffusionGenerationOutput, SamplingSettings, diffusion_generate
from .sampling import REMASKING_STRATEGIES, sample_tokens, sampling_logits

__all__ = [
    "REMASKING_STRATEGIES",
    "DiffusionGenerationMixin",
    "DiffusionGenerationOutput",
    "SamplingSettings",
    "diffusion_generate",
    "sample_tokens",
    "sampling_logits",
]
