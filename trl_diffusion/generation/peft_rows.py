"""peft's per-row forward arguments during diffusion decoding.

``PeftModel.generate(..., adapter_names=[...])`` (one adapter per prompt) hands the names to every LoRA layer
through forward pre-hooks, fixed for the whole call. The sampler's working batch is not fixed: finished rows leave
it, and classifier-free guidance runs ``[conditional | unconditional]`` in one forward. A hook of ours, run after
peft's, gives each layer the names of the rows its forward actually holds."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class WorkingRows:
    """The prompts (batch rows) the sampler's working batch holds, in order; ``rows`` follows the batch."""

    def __init__(self, batch: int, cuda_graphs: bool) -> None:
        self.batch = batch
        self.rows = list(range(batch))
        self.cuda_graphs = cuda_graphs

    def hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Forward pre-hook of a peft layer: replace the call's ``adapter_names`` by those of the working rows."""
        if kwargs.get("alora_offsets") is not None:
            raise ValueError("aLoRA adapters (alora_invocation_tokens / alora_offsets) activate after an invocation "
                             "sequence of a causal decode; diffusion generate() does not support them.")
        names = kwargs.get("adapter_names")
        if names is None:
            return None
        if len(names) != self.batch:
            raise ValueError(f"adapter_names has {len(names)} names for {self.batch} rows; give one per returned row "
                             "(with num_return_sequences, each prompt's name once per sequence).")
        if self.cuda_graphs:  # per_row_adapter_names missed peft's hooks (a peft version that sets them otherwise)
            raise ValueError("adapter_names (mixed-adapter batches) cannot be replayed as CUDA graphs; pass "
                             "cuda_graphs='off'.")
        names = [names[row] for row in self.rows]
        inputs = args[0] if args else None
        if isinstance(inputs, torch.Tensor) and inputs.dim() and inputs.shape[0] % len(names) == 0:
            names = names * (inputs.shape[0] // len(names))  # classifier-free guidance: the rows, twice
        return args, {**kwargs, "adapter_names": names}


@contextmanager
def follow_working_rows(model: torch.nn.Module, batch: int, cuda_graphs: bool) -> Iterator[WorkingRows]:
    """For the call: hook every peft layer of ``model`` (none when peft is not in use) so that per-row peft
    arguments follow the yielded ``WorkingRows``."""
    rows = WorkingRows(batch, cuda_graphs)
    handles = [layer.register_forward_pre_hook(rows.hook, with_kwargs=True) for layer in _peft_layers(model)]
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


def per_row_adapter_names(model: torch.nn.Module) -> bool:
    """Whether this call runs a mixed-adapter batch: ``PeftModel.generate(adapter_names=...)`` has hooked the names
    into ``model``'s peft layers. A captured step would keep the first batch's names, so such a call decodes
    eagerly."""
    return any(_is_adapter_names_hook(hook)
               for layer in _peft_layers(model) for hook in layer._forward_pre_hooks.values())


def drop_adapter_name_hooks(model: torch.nn.Module) -> None:
    """Remove the per-row ``adapter_names`` hooks peft put on ``model``'s layers for a ``generate`` call. peft
    (0.21, 0.22) removes them after its ``yield`` without ``try`` / ``finally``, so a call that raised left them on and
    every later forward ran that call's adapters row by row (or failed on another batch size)."""
    for layer in _peft_layers(model):
        for key in [key for key, hook in layer._forward_pre_hooks.items() if _is_adapter_names_hook(hook)]:
            del layer._forward_pre_hooks[key]
            layer._forward_pre_hooks_with_kwargs.pop(key, None)


def _is_adapter_names_hook(hook) -> bool:
    return isinstance(hook, functools.partial) and "adapter_names" in hook.keywords


def _peft_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules peft hands per-row arguments to: its tuner layers and ``modules_to_save`` wrappers."""
    if "peft" not in sys.modules:  # a model with peft layers has imported it
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return [module for module in model.modules() if isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))]
