"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base / -Instruct): an OLMoE-like decoder with full bidirectional attention.

The released ``modeling_lladamoe.py`` is transformers' OLMoE modeling made bidirectional, with the state-dict names of
the Qwen-style families, so the backbone is ``QwenStyleBackbone`` (embedding, attention, RoPE, norms, the KV cache and
the generation mixin are Dream's and SDAR's code):

* ``model.embed_tokens`` (``padding_idx = pad_token_id``), ``model.layers.N.input_layernorm`` /
  ``post_attention_layernorm``, ``model.norm``, a separate ``lm_head`` (tied only when ``tie_word_embeddings``);
  logits are not shifted;
* attention ``self_attn.{q,k,v,o}_proj`` (no biases), grouped-query when ``num_key_value_heads < num_attention_heads``,
  head size ``hidden_size // num_attention_heads``; with ``qk_layernorm`` an RMSNorm over each head of q and k
  (``self_attn.{q,k}_norm``, weight ``[head_dim]``, as Qwen3, not OLMoE's norm over the whole projection), then
  ``clip_qkv`` clamps q, k and v, then RoPE (HF rotate-half, whole head, tables cast to the activation dtype);
  bidirectional, with an optional key-padding mask (the release ignores masks: the same for unpadded input);
* the MLP of layer ``i``: the dense SwiGLU ``mlp.{gate,up,down}_proj`` of ``dense_intermediate_size`` when
  ``moe_layer_freq[i] == 0``, else the shared sparse block (``moe.SparseMoeBlock``): router ``mlp.gate``, experts
  ``mlp.experts.E.*`` of ``expert_intermediate_size``, softmax in float32 (+ ``mlp.expert_bias`` when
  ``moe_router_enable_expert_bias``), top-k, never renormalised; plus, on sparse layers when
  ``shared_expert_intermediate_size`` is set, a shared SwiGLU expert ``shared_expert.*`` (a member of the layer, not
  of ``mlp``) on the same normed input, added to the experts' sum.

As for SDAR-MoE, the expert dispatch reads on the host which experts got tokens: no CUDA-graph capture
(``cuda_graph_capturable``); ``output_router_logits`` (the forward's, else the config's) returns the sparse layers'
router logits and the auxiliary load-balancing loss ``aux_loss`` of the release (OLMoE's; see ``moe.py``).
"""

from __future__ import annotations

from torch import nn
from transformers import initialization as init

from ...generation.mixin import DiffusionGenerationMixin
from ..common import (
    DiffusionPreTrainedModel,
    QwenStyleBackbone,
    QwenStyleDecoderLayer,
    QwenStyleLM,
    mlp_output,
)
from ..moe import MoeLMMixin, SparseMoeBlock, SwiGLUMLP
from .configuration_llada_moe import LLaDAMoEConfig


class LLaDAMoEDecoderLayer(QwenStyleDecoderLayer):
    """Pre-norm attention + MLP, plus the optional shared expert of a sparse layer (``shared_expert``)."""

    def __init__(self, config: LLaDAMoEConfig, layer_idx: int) -> None:
        hidden, sparse = config.hidden_size, config.layer_is_sparse(layer_idx)
        if sparse:
            mlp = SparseMoeBlock(hidden, config.expert_intermediate_size, config.num_experts,
                                 config.num_experts_per_tok, norm_topk_prob=False,
                                 expert_bias=bool(config.moe_router_enable_expert_bias), hidden_act=config.hidden_act)
        else:
            mlp = SwiGLUMLP(hidden, config.dense_intermediate_size)
        super().__init__(config, layer_idx, qkv_bias=False, qk_norm=bool(config.qk_layernorm), mlp=mlp)
        shared = config.shared_expert_intermediate_size
        self.shared_expert = SwiGLUMLP(hidden, shared) if sparse and shared is not None else None

    def forward(self, hidden_states, rope, mask, cache=None, store=False, output_router_logits: bool = False):
        """The layer's output; with ``output_router_logits``, ``(output, router_logits)`` (None for a dense
        layer)."""
        attended = self.self_attn(self.input_layernorm(hidden_states), rope, mask, cache, store)
        h, normed = self.post_attention_layernorm(attended, residual=hidden_states)
        out, router_logits = mlp_output(self.mlp, normed, output_router_logits)
        if self.shared_expert is not None:
            out = out + self.shared_expert(normed)
        return (h + out, router_logits) if output_router_logits else h + out


class LLaDAMoEPreTrainedModel(DiffusionPreTrainedModel):
    config_class = LLaDAMoEConfig
    config: LLaDAMoEConfig
    _no_split_modules = ["LLaDAMoEDecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, SparseMoeBlock) and module.expert_bias is not None:
            init.zeros_(module.expert_bias)  # the release's initial bias (respects a loaded one)


class LLaDAMoEModel(LLaDAMoEPreTrainedModel, QwenStyleBackbone):
    """The backbone (``embed_tokens`` / ``layers`` / ``norm``), the release's ``LLaDAMoEModel``."""

    diffusion_block_size = None

    def __init__(self, config: LLaDAMoEConfig, **kwargs) -> None:
        config.check_buildable()
        super().__init__(config, **kwargs)

    def _decoder_layer(self, config: LLaDAMoEConfig, layer_idx: int) -> nn.Module:
        return LLaDAMoEDecoderLayer(config, layer_idx)


class LLaDAMoEModelLM(MoeLMMixin, QwenStyleLM, LLaDAMoEPreTrainedModel, DiffusionGenerationMixin):
    """``model`` (``LLaDAMoEModel``) + ``lm_head``, the released class name (``architectures: ["LLaDAMoEModelLM"]``,
    what its ``auto_map`` gives ``AutoModel`` and ``AutoModelForCausalLM``); with router logits, the release's
    ``aux_loss`` (``moe.MoeLMMixin``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    backbone_class = LLaDAMoEModel
    cuda_graph_capturable = False
    """The expert dispatch is data-dependent: ``generate(cuda_graphs="auto")`` decodes eagerly."""
