"""Scoring forwards recomputed in the backward pass, so that the backward holds one forward's activations.

Packed scoring cuts a micro-batch's rows into forwards of at most ``scoring_token_budget`` tokens, but autograd keeps
every forward's activations until the loss is back-propagated: the peak is the whole micro-batch's (with the
full-attention trajectory estimator, one row per merged step of every response). Checkpointing each forward as a
whole (``torch.utils.checkpoint``, non-reentrant) keeps only its inputs; the backward pass runs it again just before
back-propagating through it, one forward at a time. Gradients are unchanged (the random state of the forward, e.g.
LoRA dropout, is restored for the recomputation); the cost is one more forward per scoring forward. With layer-wise
gradient checkpointing also on, the recomputed forward keeps each layer's input only, as it does now.

The checkpoint wraps the *unwrapped* model's ``forward``, inside any DDP wrapper, as activation checkpointing is
applied in PyTorch's distributed recipes: the wrapper's forward (DDP's reducer bookkeeping) runs once, and the
gradient of each parameter still reaches it once per backward, summed over the forwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint


@contextmanager
def recomputed_forwards(module: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Inside, every forward of ``module`` (the unwrapped model; the DDP wrapper around it may be what is called)
    that runs with gradients enabled is checkpointed as a whole; forwards without gradients run as they are. A no-op
    when not ``enabled``."""
    if not enabled:
        yield
        return
    had_own = "forward" in vars(module)  # e.g. accelerate's mixed-precision wrapper, set on the instance
    forward = module.forward

    def run(input_ids: torch.Tensor, kwargs: dict):
        return forward(input_ids=input_ids, **kwargs)

    def checkpointed(input_ids: torch.Tensor | None = None, **kwargs):
        if not torch.is_grad_enabled():
            return forward(input_ids=input_ids, **kwargs)
        # the ids go in positionally: checkpoint reads the device whose random state it restores from its tensor
        # arguments (keyword arguments are not looked at)
        return checkpoint(run, input_ids, kwargs, use_reentrant=False)

    module.forward = checkpointed
    try:
        yield
    finally:
        if had_own:
            module.forward = forward
        else:
            del module.forward


def check_recomputed_forwards(enabled: bool, fsdp: bool, zero_stage: int | None, option: str) -> None:
    """Refuse ``option`` (the config field that turns recomputed forwards on) under FSDP and DeepSpeed ZeRO-3, which
    gather the sharded weights in hooks around the wrapped module's forward: the recomputation calls the module's
    own forward, outside them. (DDP and ZeRO-1/2 keep whole weights and reduce gradients once per parameter per
    backward, as without recomputation.)"""
    if enabled and (fsdp or zero_stage == 3):
        raise ValueError(
            f"{option}=True is not supported with {'FSDP' if fsdp else 'DeepSpeed ZeRO-3'}: the forward recomputed in "
            "the backward pass would run outside the hooks that gather the sharded weights. Use "
            "gradient_checkpointing there (with a smaller scoring_token_budget or per_device_train_batch_size).")
