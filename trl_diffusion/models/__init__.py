"""Model families and their registration with the transformers Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer

from .cache import DiffusionCache
from .common import DiffusionModelMixin, check_tokenizer, model_argument
from .dream import DreamConfig, DreamModel, DreamTokenizer
from .llada import LLaDAConfig, LLaDAModelLM
from .remote_code import carry_remote_code, carry_tokenizer_code
from .sdar import SDARConfig, SDARForCausalLM, SDARModel
from .sdar_moe import SDARMoeConfig, SDARMoeForCausalLM, SDARMoeModel

FAMILIES = {
    "sdar": (SDARConfig, SDARForCausalLM),
    "sdar_moe": (SDARMoeConfig, SDARMoeForCausalLM),
    "llada": (LLaDAConfig, LLaDAModelLM),
    "Dream": (DreamConfig, DreamModel),
}


LORA_TARGET_MODULES = {
    "sdar": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # the experts' projections (and a dense layer's) by the same names; the router, `mlp.gate`, matches none of them
    "sdar_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "Dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj"],
}
r"""peft's default LoRA targets per family: the attention and MLP projections (for SDAR-MoE, the experts' and not
the router's). LLaDA's MLP output projection is named ``ff_out`` like its LM head (``transformer.ff_out``), and a name
matches both, so it is left out by default (TRL refuses adapters on the LM head); target it with a regex such as
``r".*blocks\.\d+\.ff_out"``."""


def register_models() -> None:
    """Register every family with AutoConfig, AutoModel, AutoModelForCausalLM and AutoModelForMaskedLM, and
    Dream's tokenizer class with AutoTokenizer.

    ``AutoModel`` maps to the model *with* its LM head, as Dream's and LLaDA's ``auto_map`` do (``DreamModel`` and
    ``LLaDAModelLM`` are LM-head classes), so ``AutoModel.from_pretrained`` keeps loading released weights. SDAR's
    ``auto_map`` sends ``AutoModel`` to its backbone (``SDARModel``); here it too gives the LM (``SDARModel`` is
    importable for the backbone alone), so that one call loads every family the same way.
    """
    for model_type, (config_cls, model_cls) in FAMILIES.items():
        AutoConfig.register(model_type, config_cls, exist_ok=True)
        for auto in (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM):
            auto.register(config_cls, model_cls, exist_ok=True)
    # Dream's released tokenizer_config.json names `DreamTokenizer` (remote code); ours is the same Qwen2 tokenizer
    AutoTokenizer.register(DreamConfig, DreamTokenizer, exist_ok=True)
    from peft.utils import constants

    constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.update(LORA_TARGET_MODULES)


__all__ = [
    "FAMILIES",
    "DiffusionCache",
    "DiffusionModelMixin",
    "carry_remote_code",
    "carry_tokenizer_code",
    "check_tokenizer",
    "model_argument",
    "DreamConfig",
    "DreamModel",
    "DreamTokenizer",
    "LLaDAConfig",
    "LLaDAModelLM",
    "SDARConfig",
    "SDARForCausalLM",
    "SDARModel",
    "SDARMoeConfig",
    "SDARMoeForCausalLM",
    "SDARMoeModel",
    "register_models",
]
