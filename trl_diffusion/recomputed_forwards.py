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


def check_recomputed_forwards(enabled: bool, fsdp: bool, zero_stage: int | None, option: str,
                              model: torch.nn.Module) -> None:
    """Refuse ``option`` (the config field that turns recomputed forwards on) where the recomputation would read
    weights that are not there: under FSDP, whose root unit gathers the weights outside the wrapped blocks
    (embeddings, head, final norm) in hooks around the root module's forward, which the recomputation (that forward,
    called again in the backward pass) runs without; and under DeepSpeed ZeRO-3 for a model with weights of its own
    on the root module, for the same reason. ZeRO-3 gathers every other module's weights in that module's own
    hooks, which the recomputed forward runs again (as with layer checkpointing): checked against DDP on two CPU
    processes (tests/test_deepspeed.py). DDP and ZeRO-1/2 keep whole weights and reduce gradients once per
    parameter per backward, as without recomputation."""
    if not enabled:
        return
    if fsdp:
        raise ValueError(
            f"{option}=True is not supported with FSDP: the forward recomputed in the backward pass would run outside "
            "the hooks that gather the root unit's sharded weights. Use gradient_checkpointing there (with a smaller "
            "scoring_token_budget or per_device_train_batch_size), or DeepSpeed ZeRO-3.")
    own = [name for name, _ in model.named_parameters(recurse=False)]
    if zero_stage == 3 and own:
        raise ValueError(
            f"{option}=True is not supported with DeepSpeed ZeRO-3 for {type(model).__name__}, which holds weights on "
            f"its root module ({', '.join(own)}): the forward recomputed in the backward pass would run outside the "
            "hooks that gather them. Use gradient_checkpointing there.")
