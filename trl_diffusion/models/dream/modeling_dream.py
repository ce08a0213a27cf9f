"""Dream / DiffuCoder: a Qwen2 decoder (q/k/v biases) with full bidirectional attention.

Logits are shifted by one position as in the releases: the token at position ``i`` is predicted from
``logits[i - 1]`` (``logits_shift = True``; ``align_logits`` undoes it). The embedding has
``padding_idx = pad_token_id`` like the release, so the pad row gets no gradient.
"""

from __future__ import annotations

from ...generation.mixin import DiffusionGenerationMixin
from ..common import DiffusionPreTrainedModel, QwenStyleBackbone, QwenStyleLM
from .configuration_dream import DreamConfig


class DreamPreTrainedModel(DiffusionPreTrainedModel):
    config_class = DreamConfig
    config: DreamConfig
    _no_split_modules = ["QwenStyleDecoderLayer"]


class DreamBaseModel(DreamPreTrainedModel, QwenStyleBackbone):
    qkv_bias = True
    diffusion_block_size = None


class DreamModel(QwenStyleLM, DreamPreTrainedModel, DiffusionGenerationMixin):
    """The released class name (``architectures: ["DreamModel"]``) is the model with the LM head."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    backbone_class = DreamBaseModel
    logits_shift = True
    top_p_first = True  # Dream's sample_tokens: top-p, then top-k
