"""SDAR / TraDo: a Qwen3 decoder (q/k RMSNorm per head, no biases) with block-causal attention.

Inside a block of ``config.block_size`` tokens attention is bidirectional; across blocks it is causal; blocks
are aligned from absolute position 0. Logits are not shifted: ``logits[i]`` predicts token ``i``.
"""

from __future__ import annotations

from ...generation.mixin import DiffusionGenerationMixin
from ..common import DiffusionPreTrainedModel, QwenStyleBackbone, QwenStyleLM
from .configuration_sdar import SDARConfig


class SDARPreTrainedModel(DiffusionPreTrainedModel):
    config_class = SDARConfig
    config: SDARConfig
    _no_split_modules = ["QwenStyleDecoderLayer"]


class SDARModel(SDARPreTrainedModel, QwenStyleBackbone):
    qk_norm = True

    @property
    def diffusion_block_size(self) -> int:
        return self.config.block_size


class SDARForCausalLM(QwenStyleLM, SDARPreTrainedModel, DiffusionGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    backbone_class = SDARModel

    @property
    def block_size(self) -> int:
        return self.config.block_size
