"""SDAR / TraDo: a Qwen3 decoder (q/k RMSNorm per head, no biases) with block-causal attention.

Inside a block of ``config.block_size`` tokens attention is bidirectional; across blocks it is causal; blocks
are aligned from absolute position 0. Logits are not shifted: ``logits[i]`` predicts token ``i``.
"""

from __future__ import annotations

import torch
from torch import nn

from ...generation.mixin import DiffusionGenerationMixin
from ..cache import DiffusionCache
from ..common import DiffusionModelMixin, DiffusionPreTrainedModel, QwenStyleBackbone, causal_lm_output
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


class SDARForCausalLM(SDARPreTrainedModel, DiffusionModelMixin, DiffusionGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: SDARConfig) -> None:
        super().__init__(config)
        self.model = SDARModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

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
        """``attention_mask``: None, 2-D key padding, or a custom 3-/4-D mask (see ``resolve_attention_mask``).
        ``past_key_values``: a ``DiffusionCache`` read by every pass and written only when ``store_kv``."""
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
