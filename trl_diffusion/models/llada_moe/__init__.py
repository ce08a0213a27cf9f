from .configuration_llada_moe import LLADA_MOE_MASK_TOKEN_ID, LLaDAMoEConfig, is_llada_moe_config
from .modeling_llada_moe import LLaDAMoEDecoderLayer, LLaDAMoEModel, LLaDAMoEModelLM, LLaDAMoEPreTrainedModel

__all__ = ["LLADA_MOE_MASK_TOKEN_ID", "LLaDAMoEConfig", "LLaDAMoEDecoderLayer", "LLaDAMoEModel", "LLaDAMoEModelLM",
           "LLaDAMoEPreTrainedModel", "is_llada_moe_config"]
