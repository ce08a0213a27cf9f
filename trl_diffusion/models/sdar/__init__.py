from .configuration_sdar import SDARConfig
from .modeling_sdar import SDARForCausalLM, SDARModel, SDARPreTrainedModel

__all__ = ["SDARConfig", "SDARForCausalLM", "SDARModel", "SDARPreTrainedModel"]
