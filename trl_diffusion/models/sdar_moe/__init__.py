from .configuration_sdar_moe import SDARMoeConfig
from .modeling_sdar_moe import SDARMoeForCausalLM, SDARMoeModel, SDARMoePreTrainedModel, SDARMoeSparseMoeBlock

__all__ = ["SDARMoeConfig", "SDARMoeForCausalLM", "SDARMoeModel", "SDARMoePreTrainedModel", "SDARMoeSparseMoeBlock"]
