from .configuration_dream import DreamConfig
from .modeling_dream import DreamBaseModel, DreamModel, DreamPreTrainedModel
from .tokenization_dream import DreamTokenizer

__all__ = ["DreamBaseModel", "DreamConfig", "DreamModel", "DreamPreTrainedModel", "DreamTokenizer"]
