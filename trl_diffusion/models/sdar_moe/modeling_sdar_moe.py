"""SDAR-MoE (SDAR-30B-A3B-Chat / -Sci): SDAR's block-causal Qwen3 decoder with Qwen3-MoE's sparse MLP blocks.

Attention, RoPE, norms, the KV cache and the generation mixin are SDAR's (``QwenStyleBackbone``); only the MLP of
the sparse layers differs (``SDARMoeConfig.layer_is_sparse``): a router ``mlp.gate`` (``Linear(hidden,
num_experts)``, no bias) and ``num_experts`` SwiGLU experts ``mlp.experts.{E}.{gate,up,down}_proj``, the released
state-dict names. Each token goes to its ``num_experts_per_tok`` experts with the weights of the Qwen3-MoE reference:
softmax of the router logits in float32, top-k, renormalised to sum to 1 when ``norm_topk_prob``, cast to the
activation dtype; the expert outputs are weighted and summed per token in ascending expert order, so the
arithmetic, and bfloat16 rounding, follow the reference's.

The dispatch depends on the data (which experts got tokens is read on the host), so the model is not captured as a
CUDA graph (``cuda_graph_capturable``). ``output_router_logits`` (the forward's, else the config's) returns the
sparse layers' router logits and Qwen3-MoE's auxiliary load-balancing loss ``aux_loss`` (see ``moe.py``).
"""

from __future__ import annotations

from torch import nn

from ...generation.mixin import DiffusionGenerationMixin
from ..common import DiffusionPreTrainedModel, QwenStyleBackbone, QwenStyleLM
from ..moe import MoeLMMixin, SparseMoeBlock
from ..sdar.configuration_sdar import block_size_of
from .configuration_sdar_moe import SDARMoeConfig


class SDARMoeSparseMoeBlock(SparseMoeBlock):
    """Router ``gate`` + ``experts``: each token's output is the routing-weighted sum of its top-k experts' (the shared
    ``moe.SparseMoeBlock`` with Qwen3-MoE's switches: ``norm_topk_prob`` from the config, no expert bias)."""

    def __init__(self, config: SDARMoeConfig) -> None:
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                         config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob, expert_bias=False,
                         hidden_act=config.hidden_act)


class SDARMoePreTrainedModel(DiffusionPreTrainedModel):
    config_class = SDARMoeConfig
    config: SDARMoeConfig
    _no_split_modules = ["QwenStyleDecoderLayer"]


class SDARMoeModel(SDARMoePreTrainedModel, QwenStyleBackbone):
    """The backbone (``embed_tokens`` / ``layers`` / ``norm``), the release's ``SDARMoeModel``."""

    qk_norm = True

    def __init__(self, config: SDARMoeConfig) -> None:
        config.check_buildable()  # from_pretrained's keyword arguments are set after the config's own checks
        super().__init__(config)

    @property
    def diffusion_block_size(self) -> int:
        return block_size_of(self.config)

    def _layer_mlp(self, config: SDARMoeConfig, layer_idx: int) -> nn.Module | None:
        return SDARMoeSparseMoeBlock(config) if config.layer_is_sparse(layer_idx) else None


class SDARMoeForCausalLM(MoeLMMixin, QwenStyleLM, SDARMoePreTrainedModel, DiffusionGenerationMixin):
    """``model`` (``SDARMoeModel``) + ``lm_head``, the release's ``SDARMoeForCausalLM``; with router logits,
    Qwen3-MoE's ``aux_loss`` (``moe.MoeLMMixin``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    backbone_class = SDARMoeModel
    cuda_graph_capturable = False
    """The expert dispatch is data-dependent: ``generate(cuda_graphs="auto")`` decodes eagerly."""

    @property
    def block_size(self) -> int:
        return block_size_of(self.config)
