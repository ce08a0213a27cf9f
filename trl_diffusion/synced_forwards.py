"""The same number of forward passes on every process where the weights are gathered by collectives.

Under FSDP and DeepSpeed ZeRO-3 every forward of the model all-gathers its sharded weights, a collective that each
process must enter the same number of times. Diffusion decoding runs a data-dependent number of forwards (rows stop
at different blocks; dynamic decoding takes a different number of steps per block), and packed scoring a
data-dependent number of chunks, so one process would wait forever in a collective the others never reach.
transformers solves this for autoregressive ``generate`` with ``synced_gpus``; these are the same two moves for our
loops: announce every real forward and run dummy forwards until no process runs real ones (decoding), or agree on
the number of forwards up front and pad with dummies that contribute zero (scoring, where the backward pass must
pair up too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


def needs_synced_forwards(model) -> bool:
    """Whether ``model``'s forwards are collectives across processes (transformers' rule for ``synced_gpus``:
    DeepSpeed ZeRO-3 or an FSDP-managed module, with more than one process)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.integrations.fsdp import is_fsdp_managed_module

    return bool(is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model))


@contextmanager
def synced_forwards(model, enabled: bool, dummy_input_ids: torch.Tensor) -> Iterator[None]:
    """Inside, every forward of ``model`` first tells the other processes that it runs one (an all-reduce that comes
    before the model's own collectives). On leaving, this process runs forwards of ``dummy_input_ids`` for as long
    as any other process still runs real ones, so every process runs the same number of forwards. Outputs are
    unchanged; a no-op when not ``enabled``."""
    if not enabled:
        yield
        return
    device = dummy_input_ids.device

    def announce(module, args) -> None:
        dist.all_reduce(torch.ones((), device=device))

    handle = model.register_forward_pre_hook(announce, prepend=True)  # before FSDP's / ZeRO-3's gathering hooks
    try:
        yield
    finally:
        handle.remove()
    while True:  # reached only without an error: the others are still decoding until all of them announce none
        running = torch.zeros((), device=device)
        dist.all_reduce(running)
        if running.item() == 0:
            return
        with torch.no_grad():
            model(input_ids=dummy_input_ids, output_router_logits=False)


def agreed_forward_count(count: int, device: torch.device, enabled: bool) -> int:
    """The largest ``count`` over the processes (``count`` itself when not ``enabled``)."""
    if not enabled:
        return count
    largest = torch.tensor(count, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return int(largest.item())


def zero_forward_term(model, input_ids: torch.Tensor) -> torch.Tensor:
    """A forward of ``input_ids`` that contributes exactly zero: added to a loss it keeps the forward in the
    autograd graph, so its backward (and the collectives of both) runs on this process as on the others."""
    output = model(input_ids=input_ids, output_router_logits=False)
    return output[0].float().sum() * 0.0
