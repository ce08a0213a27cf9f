from .configuration_dream import DreamConfig
from .modeling_dream import DreamBaseModel, DreamModel, DreamPreTrainedModel

__all__ = ["DreamBaseModel", "DreamConfig", "DreamModel", "DreamPreTrainedModel"]
