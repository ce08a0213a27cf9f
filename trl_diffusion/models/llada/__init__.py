from .configuration_llada import LLaDAConfig
from .modeling_llada import LLaDAModel, LLaDAModelLM, LLaDAPreTrainedModel

__all__ = ["LLaDAConfig", "LLaDAModel", "LLaDAModelLM", "LLaDAPreTrainedModel"]
