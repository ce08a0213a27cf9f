"""Dream / DiffuCoder: a Qwen2 decoder (q/k/v biases) with full bidirectional attention.

Logits are shifted by one position as in the releases: the token at position ``i`` is predicted from
``logits[i - 1]`` (``logits_shift = True``; ``align_logits`` undoes it). The embedding has
``padding_idx = pad_token_id`` like the release, so the pad row gets no gradient.
"""

from __future__ import annotations

import torch
from torch import nn

from ...generation.mixin import DiffusionGenerationMixin
from ..cache import DiffusionCache
from ..common import DiffusionModelMixin, DiffusionPreTrainedModel, QwenStyleBackbone, causal_lm_output
from .configuration_dream import DreamConfig


class DreamPreTrainedModel(DiffusionPreTrainedModel):
    config_class = DreamConfig
    config: DreamConfig
    _no_split_modules = ["QwenStyleDecoderLayer"]


class DreamBaseModel(DreamPreTrainedModel, QwenStyleBackbone):
    qkv_bias = True
    diffusion_block_size = None

    def _embedding_padding_idx(self, config) -> int | None:
        pad = config.pad_token_id
        return pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None


class DreamModel(DreamPreTrainedModel, DiffusionModelMixin, DiffusionGenerationMixin):
    """The released class name (``architectures: ["DreamModel"]``) is the model with the LM head."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    logits_shift = True

    def __init__(self, config: DreamConfig) -> None:
        super().__init__(config)
        self.model = DreamBaseModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, value):
        self.lm_head = value

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: DiffusionCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        store_kv: bool = False,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ):
        """Raw (shifted) logits, as the release returns them; ``labels`` are compared after ``align_logits``."""
        if isinstance(attention_mask, str):  # the release's generate passes "full" for unpadded input
            attention_mask = None
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            store_kv=store_kv,
            output_hidden_states=output_hidden_states,
        )
        hidden = out.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return causal_lm_output(self, out, self.lm_head(hidden), labels)
