"""Model families and their registration with the transformers Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

from .cache import DiffusionCache
from .common import DiffusionModelMixin
from .dream import DreamConfig, DreamModel
from .llada import LLaDAConfig, LLaDAModelLM
from .sdar import SDARConfig, SDARForCausalLM, SDARModel

FAMILIES = {
    "sdar": (SDARConfig, SDARForCausalLM),
    "llada": (LLaDAConfig, LLaDAModelLM),
    "Dream": (DreamConfig, DreamModel),
}


def register_models() -> None:
    """Register every family with AutoConfig, AutoModel, AutoModelForCausalLM and AutoModelForMaskedLM.

    ``AutoModel`` maps to the model *with* its LM head, as the releases' ``auto_map`` does (``DreamModel`` and
    ``LLaDAModelLM`` are LM-head classes), so ``AutoModel.from_pretrained`` keeps loading released weights.
    """
    for model_type, (config_cls, model_cls) in FAMILIES.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        for auto in (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM):
            auto.register(config_cls, model_cls, exist_ok=True)


__all__ = [
    "FAMILIES",
    "DiffusionCache",
    "DiffusionModelMixin",
    "DreamConfig",
    "DreamModel",
    "LLaDAConfig",
    "LLaDAModelLM",
    "SDARConfig",
    "SDARForCausalLM",
    "SDARModel",
    "register_models",
]
