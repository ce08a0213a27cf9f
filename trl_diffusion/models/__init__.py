"""Model families and their registration with the transformers Auto classes."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM, AutoTokenizer
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .cache import DiffusionCache
from .common import (
    DiffusionModelMixin,
    check_router_aux_loss_coef,
    check_tokenizer,
    check_trains_parameters,
    model_argument,
)
from .dream import DreamConfig, DreamModel, DreamTokenizer
from .kernels import set_fused_kernels
from .llada import LLaDAConfig, LLaDAModelLM
from .llada_moe import LLaDAMoEConfig, LLaDAMoEModel, LLaDAMoEModelLM
from .remote_code import carry_remote_code, carry_tokenizer_code
from .sdar import SDARConfig, SDARForCausalLM, SDARModel
from .sdar_moe import SDARMoeConfig, SDARMoeForCausalLM, SDARMoeModel

FAMILIES = {
    "sdar": (SDARConfig, SDARForCausalLM),
    "sdar_moe": (SDARMoeConfig, SDARMoeForCausalLM),
    "llada": (LLaDAConfig, LLaDAModelLM),
    "llada_moe": (LLaDAMoEConfig, LLaDAMoEModelLM),
    "Dream": (DreamConfig, DreamModel),
}
"""Config and model class per family, keyed by the config's ``model_type``, except LLaDA-MoE's: its ``config.json``
says ``"llada"`` like the dense model's, and ``LLaDAConfig``'s loading hands such dicts to ``LLaDAMoEConfig``, which
the Auto model classes map to ``LLaDAMoEModelLM``."""

CONFIG_ALIASES = {"lladamoe": LLaDAMoEConfig}
"""Further ``model_type`` values ``AutoConfig`` reads: ``"lladamoe"``, what dllm tells its users to write into
LLaDA-MoE's ``config.json`` (the config still saves ``"llada"``, the released value)."""


LORA_TARGET_MODULES = {
    "sdar": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # the experts' projections (and a dense layer's) by the same names; the router, `mlp.gate`, matches none of them
    "sdar_moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "Dream": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    # dense LLaDA's names, then LLaDA-MoE's (its config saves model_type "llada" too; a name a model lacks matches none
    # of its modules): attention and the experts' (and dense layers', shared expert's) projections, never `mlp.gate`
    "llada": ["q_proj", "k_proj", "v_proj", "attn_out", "ff_proj", "up_proj", "o_proj", "gate_proj", "down_proj"],
}
r"""peft's default LoRA targets per ``model_type``: the attention and MLP projections (for SDAR-MoE and LLaDA-MoE, the
experts' and not the router's). Dense LLaDA's MLP output projection is named ``ff_out`` like its LM head
(``transformer.ff_out``), and a name matches both, so it is left out by default (TRL refuses adapters on the LM head);
target it with a regex such as ``r".*blocks\.\d+\.ff_out"``."""


def register_models() -> None:
    """Register every family with AutoConfig, AutoModel, AutoModelForCausalLM and AutoModelForMaskedLM, and
    Dream's tokenizer class with AutoTokenizer.

    ``AutoModel`` maps to the model *with* its LM head, as Dream's and LLaDA's ``auto_map`` do (``DreamModel`` and
    ``LLaDAModelLM`` are LM-head classes), so ``AutoModel.from_pretrained`` keeps loading released weights. SDAR's
    ``auto_map`` sends ``AutoModel`` to its backbone (``SDARModel``); here it too gives the LM (``SDARModel`` is
    importable for the backbone alone), so that one call loads every family the same way.
    """
    for family, (config_cls, model_cls) in FAMILIES.items():
        if family == config_cls.model_type:  # LLaDA-MoE's "llada" is LLaDAConfig's key (it dispatches)
            AutoConfig.register(family, config_cls, exist_ok=True)
        for auto in (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM):
            auto.register(config_cls, model_cls, exist_ok=True)
        if model_cls.logits_shift:
            # transformers' Trainer shifts the labels of label smoothing only for the class names listed here: Dream's
            # logits[i] predicts token i + 1 (the causal convention), so unlisted it smoothed each token's own logit.
            # The key is not a transformers model type, so the Auto classes never import a module for it.
            MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault(config_cls.model_type, model_cls.__name__)
    for model_type, config_cls in CONFIG_ALIASES.items():
        # AutoConfig.register insists on config_cls.model_type == model_type; the alias keeps the released one
        CONFIG_MAPPING.register(model_type, config_cls, exist_ok=True)
    # Dream's released tokenizer_config.json names `DreamTokenizer` (remote code); ours is the same Qwen2 tokenizer
    AutoTokenizer.register(DreamConfig, DreamTokenizer, exist_ok=True)
    from peft.utils import constants

    constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.update(LORA_TARGET_MODULES)


__all__ = [
    "CONFIG_ALIASES",
    "FAMILIES",
    "DiffusionCache",
    "DiffusionModelMixin",
    "carry_remote_code",
    "carry_tokenizer_code",
    "check_router_aux_loss_coef",
    "check_tokenizer",
    "check_trains_parameters",
    "model_argument",
    "DreamConfig",
    "DreamModel",
    "DreamTokenizer",
    "LLaDAConfig",
    "LLaDAModelLM",
    "LLaDAMoEConfig",
    "LLaDAMoEModel",
    "LLaDAMoEModelLM",
    "SDARConfig",
    "SDARForCausalLM",
    "SDARModel",
    "SDARMoeConfig",
    "SDARMoeForCausalLM",
    "SDARMoeModel",
    "register_models",
    "set_fused_kernels",
]
