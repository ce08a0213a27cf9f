"""SDAR / TraDo: a Qwen3 decoder (q/k RMSNorm per head, no biases) with block-causal attention.

Inside a block of ``config.block_size`` tokens attention is bidirectional; across blocks it is causal; blocks
are aligned from absolute position 0. Logits are not shifted: ``logits[i]`` predicts token ``i``.
"""

from __future__ import annotations

from ...generation.mixin import DiffusionGenerationMixin
from ..common import DiffusionPreTrainedModel, QwenStyleBackbone, QwenStyleLM
from .configuration_sdar import SDARConfig, block_size_of


class SDARPreTrainedModel(DiffusionPreTrainedModel):
    config_class = SDARConfig
    config: SDARConfig
    _no_split_modules = ["QwenStyleDecoderLayer"]


class SDARModel(SDARPreTrainedModel, QwenStyleBackbone):
    qk_norm = True

    def __init__(self, config: SDARConfig) -> None:
        config.check_buildable()  # from_pretrained's keyword arguments are set after the config's own checks
        super().__init__(config)

    @property
    def diffusion_block_size(self) -> int:
        return block_size_of(self.config)


class SDARForCausalLM(QwenStyleLM, SDARPreTrainedModel, DiffusionGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    backbone_class = SDARModel

    @property
    def block_size(self) -> int:
        return block_size_of(self.config)
