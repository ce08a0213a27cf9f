"""The sparse mixture-of-experts MLP shared by SDAR-MoE and LLaDA-MoE (one implementation of the routing and dispatch).

Both releases route the same way (the OLMoE / Qwen3-MoE block of transformers 4.x): a router ``gate``
(``Linear(hidden, num_experts)``, no bias), the softmax of its logits in float32, the top-k experts per token, and
the token's output is the routing-weighted sum of its experts' SwiGLU outputs ``experts.{E}.{gate,up,down}_proj``,
summed in ascending expert order. They differ only in two switches, parameters of ``SparseMoeBlock``:

* ``norm_topk_prob``: renormalise the top-k weights to sum to 1 (SDAR-MoE: the config's field; LLaDA-MoE: never,
  its released block hard-codes ``False`` whatever the config says);
* ``expert_bias``: a per-expert bias buffer (``mlp.expert_bias``, LLaDA-MoE's ``moe_router_enable_expert_bias``)
  added to the softmax probabilities before the top-k; the *biased* values are both what is ranked and the weights
  (as LLaDA-MoE's released block computes them: ``routing_weights += expert_bias`` before ``topk``).

Which experts got tokens is read on the host, so a model holding this block cannot be captured as a CUDA graph
(``cuda_graph_capturable = False`` on its class) and returns no router logits (``check_router_logits``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import SwiGLUMLP

__all__ = ["SparseMoeBlock", "SwiGLUMLP", "check_router_logits", "pop_router_logits_flag"]


def check_router_logits(config, requested=None, model_name: str = "this mixture-of-experts model") -> None:
    """Refuse router logits (``output_router_logits``), asked for by a call or set on the config after loading."""
    if requested or getattr(config, "output_router_logits", False):
        raise ValueError(
            f"{model_name}: output_router_logits=True is not supported: trl_diffusion computes no auxiliary "
            "load-balancing loss and returns no router logits. Leave output_router_logits False (the released "
            "checkpoints' value; TRL's trainers then add no router loss either, and training uses the diffusion "
            "loss alone)."
        )


def pop_router_logits_flag(kwargs: dict, config_name: str) -> None:
    """A config's ``output_router_logits``: ``True`` is refused; ``False`` (the released value) is accepted and not
    kept as an attribute, since TRL's trainers read the attribute's presence as "this model returns router logits"."""
    check_router_logits(None, kwargs.pop("output_router_logits", False), config_name)


class SparseMoeBlock(nn.Module):
    """Router ``gate`` + ``experts`` (+ ``expert_bias``): each token's output is the routing-weighted sum of its top-k
    experts' (see the module docstring for the two switches)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 norm_topk_prob: bool = False, expert_bias: bool = False, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {hidden_act!r}.")
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = bool(norm_topk_prob)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUMLP(hidden_size, intermediate_size) for _ in range(num_experts))
        if expert_bias:  # persistent: LLaDA-MoE's released block saves it with the weights
            self.register_buffer("expert_bias", torch.zeros(num_experts))
        else:
            self.expert_bias = None

    def route(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, experts)`` ``[T, top_k]`` for tokens ``hidden`` ``[T, H]``: the top-k (descending) of the
        float32 softmax of the router logits, plus ``expert_bias`` when there is one, renormalised when
        ``norm_topk_prob``; the weights cast to ``hidden``'s dtype."""
        scores = F.softmax(self.gate(hidden), dim=-1, dtype=torch.float32)
        if self.expert_bias is not None:  # in float32, as the release's in-place `routing_weights += expert_bias`
            scores = (scores + self.expert_bias).to(torch.float32)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
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
