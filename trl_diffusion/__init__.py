"""trl_diffusion: post-training for diffusion language models on top of TRL."""

from .models import (
    DiffusionCache,
    DreamConfig,
    DreamModel,
    LLaDAConfig,
    LLaDAModelLM,
    LLaDAMoEConfig,
    LLaDAMoEModelLM,
    SDARConfig,
    SDARForCausalLM,
    SDARMoeConfig,
    SDARMoeForCausalLM,
    register_models,
    set_fused_kernels,
)

register_models()

from .trainers import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer  # noqa: E402
from .value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer  # noqa: E402

__version__ = "0.1.0.dev0"

__all__ = [
    "DiffusionCache",
    "DiffusionSFTConfig",
    "DiffusionSFTTrainer",
    "DiffusionValueConfig",
    "DiffusionValueModel",
    "DiffusionValueTrainer",
    "DreamConfig",
    "DreamModel",
    "LLaDAConfig",
    "LLaDAModelLM",
    "LLaDAMoEConfig",
    "LLaDAMoEModelLM",
    "SDARConfig",
    "SDARForCausalLM",
    "SDARMoeConfig",
    "SDARMoeForCausalLM",
    "TraceRLConfig",
    "TraceRLTrainer",
    "register_models",
    "set_fused_kernels",
]
