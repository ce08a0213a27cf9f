"""SDAR-MoE (SDAR-30B-A3B-Chat / -Sci): SDAR's block-causal Qwen3 decoder with Qwen3-MoE's sparse MLP blocks.

Attention, RoPE, norms, the KV cache and the generation mixin are SDAR's (``QwenStyleBackbone``); only the MLP of
the sparse layers differs (``SDARMoeConfig.layer_is_sparse``): a router ``mlp.gate`` (``Linear(hidden,
num_experts)``, no bias) and ``num_experts`` SwiGLU experts ``mlp.experts.{E}.{gate,up,down}_proj``, the released
state-dict names. Each token goes to its ``num_experts_per_tok`` experts with the weights of the Qwen3-MoE reference:
softmax of the router logits in float32, top-k, renormalised to sum to 1 when ``norm_topk_prob``, cast to the
activation dtype; the expert outputs are weighted and summed per token in ascending expert order, so the
arithmetic, and bfloat16 rounding, follow the reference's.

The dispatch depends on the data (which experts got tokens is read on the host), so the model is not captured as a
CUDA graph (``cuda_graph_capturable``), and no auxiliary load-balancing loss is computed (``output_router_logits``
is refused).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from ...generation.mixin import DiffusionGenerationMixin
from ..common import DiffusionModelMixin, DiffusionPreTrainedModel, QwenStyleBackbone, QwenStyleLM
from .configuration_sdar_moe import SDARMoeConfig


def check_router_logits(config, requested=None) -> None:
    """Refuse router logits (``output_router_logits``), asked for by a call or set on the config after loading."""
    if requested or getattr(config, "output_router_logits", False):
        raise ValueError(
            "SDAR-MoE: output_router_logits=True is not supported: trl_diffusion computes no auxiliary "
            "load-balancing loss and returns no router logits. Leave output_router_logits False (the released "
            "checkpoints' value; TRL's trainers then add no router loss either)."
        )


class SDARMoeMLP(nn.Module):
    """One SwiGLU expert: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SDARMoeSparseMoeBlock(nn.Module):
    """Router ``gate`` + ``experts``: each token's output is the routing-weighted sum of its top-k experts'."""

    def __init__(self, config: SDARMoeConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}.")
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SDARMoeMLP(config.hidden_size, config.moe_intermediate_size) for _ in range(config.num_experts)
        )

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)`` ``[T, top_k]`` for tokens ``hidden`` ``[T, H]``: the top-k of the float32 softmax of
        the router logits (descending), renormalised when ``norm_topk_prob``, weights cast to ``hidden``'s dtype."""
        probs = F.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(hidden.dtype), experts

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        tokens = hidden.shape[0]
        weights, experts = self.route(hidden)
        # (slot, token) pairs of every expert, slot-major as in the reference's one-hot mask, from one stable sort
        chosen = experts.t().reshape(-1)  # position = slot * tokens + token
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=self.num_experts).tolist()  # the one host sync of the dispatch
        every = self._run_every_expert()
        out = torch.zeros_like(hidden)
        for index, positions in enumerate(order.split(counts)):
            if not counts[index] and not every:
                continue
            slot, token = positions // tokens, positions % tokens
            expert_out = self.experts[index](hidden[token]) * weights[token, slot, None]
            out.index_add_(0, token, expert_out.to(out.dtype))
        return out.reshape(shape)

    def _run_every_expert(self) -> bool:
        """Whether experts without tokens run too (on no tokens: nothing changes). While gradients are recorded
        every expert then takes part in the backward pass (a zero gradient), which DDP needs; under DeepSpeed ZeRO-3
        (partitioned weights, ``ds_id``) every process gathers every expert's weights in the same order, whichever
        tokens it routed, as the gathers are collectives."""
        return torch.is_grad_enabled() or hasattr(self.gate.weight, "ds_id")


class SDARMoePreTrainedModel(DiffusionPreTrainedModel):
    config_class = SDARMoeConfig
    config: SDARMoeConfig
    _no_split_modules = ["QwenStyleDecoderLayer"]


class SDARMoeModel(SDARMoePreTrainedModel, QwenStyleBackbone):
    """The backbone (``embed_tokens`` / ``layers`` / ``norm``), the release's ``SDARMoeModel``."""

    qk_norm = True

    def __init__(self, config: SDARMoeConfig, **kwargs) -> None:
        check_router_logits(config, kwargs.pop("output_router_logits", None))
        super().__init__(config, **kwargs)

    @property
    def diffusion_block_size(self) -> int:
        return self.config.block_size

    def _layer_mlp(self, config: SDARMoeConfig, layer_idx: int) -> nn.Module | None:
        return SDARMoeSparseMoeBlock(config) if config.layer_is_sparse(layer_idx) else None

    @functools.wraps(QwenStyleBackbone.forward)
    def forward(self, *args, **kwargs):
        check_router_logits(self.config, kwargs.get("output_router_logits"))
        return QwenStyleBackbone.forward(self, *args, **kwargs)


class SDARMoeForCausalLM(QwenStyleLM, SDARMoePreTrainedModel, DiffusionGenerationMixin):
    """``model`` (``SDARMoeModel``) + ``lm_head``, the release's ``SDARMoeForCausalLM``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    backbone_class = SDARMoeModel
    cuda_graph_capturable = False
    """The expert dispatch is data-dependent: ``generate(cuda_graphs="auto")`` decodes eagerly."""

    def __init__(self, config: SDARMoeConfig, **kwargs) -> None:
        check_router_logits(config, kwargs.pop("output_router_logits", None))
        super().__init__(config, **kwargs)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @functools.wraps(DiffusionModelMixin.forward)
    def forward(self, *args, **kwargs):
        check_router_logits(self.config, kwargs.get("output_router_logits"))
        return DiffusionModelMixin.forward(self, *args, **kwargs)
