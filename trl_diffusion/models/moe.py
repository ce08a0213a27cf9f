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
(``cuda_graph_capturable = False`` on its class).

Router logits and the auxiliary load-balancing loss (``output_router_logits``, a config field and a forward argument
of both families, as in transformers' mixture-of-experts models): the block returns its router logits when asked,
the backbone collects them (``MoeModelOutputWithPast.router_logits``: one ``[tokens, num_experts]`` float32 tensor
per sparse layer), and the LM (``MoeLMMixin``) adds ``aux_loss = load_balancing_loss(...)``. The loss is defined
once, here, and counts the tokens ``router_token_mask`` picks: the caller's ``router_loss_mask`` (what the trainers
pass: the real tokens of their packed rows), else a 2-D (padding) ``attention_mask``, else every token; a 3-/4-D
or flex-attention mask says who attends to whom, not which tokens are padding, so it counts every token. The
router logits change nothing else: the logits are the same with and without them. Decoding never asks for them
(the generation loops pass ``output_router_logits=False``, whatever the config says).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from ..zero3 import is_partitioned
from .common import CACHE_FIELD, SwiGLUMLP

__all__ = ["MoeLMMixin", "Routing", "SparseMoeBlock", "SwiGLUMLP", "load_balancing_loss", "router_token_mask"]


def load_balancing_loss(router_logits: Sequence[torch.Tensor], num_experts: int, top_k: int,
                        token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The Switch Transformer load-balancing loss (arXiv 2101.03961, eqs. 4-6) of ``router_logits`` (one
    ``[tokens, num_experts]`` tensor per sparse layer), as transformers' ``load_balancing_loss_func`` of Qwen3-MoE
    and OLMoE defines it (and LLaDA-MoE's release copies):

    ``num_experts * sum_e f_e * P_e``, over every (layer, counted token) pair pooled: ``f_e`` the fraction of the
    top-k slots that go to expert ``e`` (the top-k of the softmax of the logits; the fractions sum to ``top_k``),
    ``P_e`` the mean softmax probability of ``e``. Perfectly balanced routing gives ``top_k``. The softmax is taken in
    float32; ``f`` carries no gradient (a top-k), so the gradient reaches the routers through ``P``.

    ``token_mask`` (``[B, L]`` or ``[tokens]``, True / 1 = the token counts, the same tokens in every layer; rows in
    the logits' row-major order): the tokens to count, default every token. Nothing counted gives 0 (transformers
    would divide 0 by 0). Returns a float32 scalar on the first layer's device; no layer gives 0.
    """
    if not router_logits:
        return torch.zeros(())
    device = router_logits[0].device
    weight = None if token_mask is None else token_mask.reshape(-1).to(device=device, dtype=torch.float32)
    assigned = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probability = torch.zeros(num_experts, dtype=torch.float32, device=device)
    counted = torch.zeros((), dtype=torch.float32, device=device)
    for logits in router_logits:
        probs = F.softmax(logits.to(device=device, dtype=torch.float32), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        token_weight = torch.ones(probs.shape[0], device=device) if weight is None else weight
        assigned = assigned.index_add(0, chosen.reshape(-1), token_weight.repeat_interleave(top_k))
        probability = probability + (probs * token_weight[:, None]).sum(0)
        counted = counted + token_weight.sum()
    counted = counted.clamp(min=1.0)  # a 0/1 mask counts whole tokens: exact unless nothing counts
    return (assigned / counted * (probability / counted)).sum() * num_experts


def router_token_mask(attention_mask, router_loss_mask: torch.Tensor | None,
                      tokens: tuple[int, int]) -> torch.Tensor | None:
    """The tokens an LM's ``aux_loss`` counts, ``[B, L]`` for a forward over ``tokens = (B, L)`` query tokens (None:
    every token): the caller's ``router_loss_mask``, else a 2-D key-padding ``attention_mask`` (its last ``L``
    columns: with a cache it covers the cached keys first), else every token (a 3-/4-D or flex-attention mask says
    who sees whom, not which tokens are padding)."""
    if router_loss_mask is not None:
        if tuple(router_loss_mask.shape) != tuple(tokens):
            raise ValueError(f"router_loss_mask must be [B, L] = {tuple(tokens)} (the tokens the load-balancing loss "
                             f"counts), got {tuple(router_loss_mask.shape)}.")
        return router_loss_mask
    if torch.is_tensor(attention_mask) and attention_mask.dim() == 2:
        return attention_mask[:, -tokens[1]:]
    return None


class Routing(NamedTuple):
    """The routing of ``T`` tokens (``SparseMoeBlock.route``)."""

    weights: torch.Tensor
    """``[T, top_k]``, in the activations' dtype: each chosen expert's weight in the token's output."""
    experts: torch.Tensor
    """``[T, top_k]``: the chosen experts, by descending score."""
    logits: torch.Tensor
    """``[T, num_experts]``: the router logits (the gate's output, in the activations' dtype)."""


class SparseMoeBlock(nn.Module):
    """Router ``gate`` + ``experts`` (+ ``expert_bias``): each token's output is the routing-weighted sum of its top-k
    experts' (see the module docstring for the two switches)."""

    routes_tokens = True
    """Its ``forward`` takes ``output_router_logits`` (``common.mlp_output`` reads this)."""

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

    def route(self, hidden: torch.Tensor) -> Routing:
        """The routing of tokens ``hidden`` ``[T, H]``: the router logits, and the top-k (descending) of their float32
        softmax, plus ``expert_bias`` when there is one, renormalised when ``norm_topk_prob``; the weights cast to
        ``hidden``'s dtype."""
        logits = self.gate(hidden)
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.expert_bias is not None:  # in float32, as the release's in-place `routing_weights += expert_bias`
            scores = (scores + self.expert_bias).to(torch.float32)
        weights, experts = torch.topk(scores, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights.to(hidden.dtype), experts, logits)

    def forward(self, hidden_states: torch.Tensor,
                output_router_logits: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The block's output; with ``output_router_logits``, also the router logits ``[tokens, num_experts]`` in
        float32 (the gate's output, upcast exactly: the values the routing's softmax reads), for the load-balancing
        loss. Asking for them changes nothing else."""
        shape = hidden_states.shape
        hidden = hidden_states.reshape(-1, shape[-1])
        tokens = hidden.shape[0]
        weights, experts, router_logits = self.route(hidden)
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
        out = out.reshape(shape)
        return (out, router_logits.float()) if output_router_logits else out

    def _run_every_expert(self) -> bool:
        """Whether experts without tokens run too (on no tokens: nothing changes). While gradients are recorded
        every expert then takes part in the backward pass (a zero gradient), which DDP needs; under DeepSpeed ZeRO-3
        (partitioned weights) every process gathers every expert's weights in the same order, whichever
        tokens it routed, as the gathers are collectives."""
        return torch.is_grad_enabled() or is_partitioned(self.gate.weight)


class MoeLMMixin:
    """What the LM classes of SDAR-MoE and LLaDA-MoE add to ``DiffusionModelMixin.forward`` (listed before it): the
    auxiliary load-balancing loss of a forward that returned router logits. ``aux_loss`` is ``load_balancing_loss``
    over the sparse layers' router logits and the tokens ``router_token_mask`` picks, with the config's
    ``num_experts`` / ``num_experts_per_tok``; as in transformers' Qwen3-MoE and OLMoE, a loss computed from
    ``labels`` gets ``router_aux_loss_coef * aux_loss`` added. The top-k of the loss is the plain softmax's, without
    LLaDA-MoE's ``expert_bias`` (as the release's loss function computes it)."""

    def _moe_output(self, output, router_logits: tuple[torch.Tensor, ...] | None, attention_mask,
                    router_loss_mask: torch.Tensor | None, tokens: tuple[int, int]) -> MoeCausalLMOutputWithPast:
        """``output`` (the ``CausalLMOutputWithPast`` of a forward over ``tokens = (B, L)`` tokens) as transformers'
        mixture-of-experts output; given ``router_logits`` (None: not asked for), with them, their ``aux_loss`` over
        the tokens ``router_token_mask`` picks, and the weighted aux loss added to ``loss`` (when there is one)."""
        loss, aux_loss = output.loss, None
        if router_logits is not None:
            config = self.config
            token_mask = router_token_mask(attention_mask, router_loss_mask, tokens)
            aux_loss = load_balancing_loss(router_logits, config.num_experts, config.num_experts_per_tok, token_mask)
            aux_loss = aux_loss.to(output.logits.device)
            if loss is not None:
                loss = loss + config.router_aux_loss_coef * aux_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=output.logits,
                                         hidden_states=output.hidden_states, router_logits=router_logits,
                                         **{CACHE_FIELD: getattr(output, CACHE_FIELD)})
