"""Whole weights of a model that DeepSpeed ZeRO-3 partitioned, in one place.

Under ZeRO-3 each parameter holds only this process's partition (DeepSpeed marks it with a ``ds_id``), both for a
model DeepSpeed's engine prepared and for one transformers loaded while a ZeRO-3 configuration is active
(``zero.Init``). Reading or writing whole weights then means gathering them, a collective every process enters.
Elsewhere these helpers change nothing and import no DeepSpeed.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def is_partitioned(parameter: torch.Tensor) -> bool:
    """Whether ``parameter`` holds only this process's ZeRO-3 partition."""
    return hasattr(parameter, "ds_id")


def has_partitioned_parameters(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a ZeRO-3 partition."""
    return any(is_partitioned(parameter) for parameter in model.parameters())


def gathered(parameters: list[torch.Tensor], modifier_rank: int | None = None) -> contextlib.AbstractContextManager:
    """DeepSpeed's ``GatheredParameters``: whole ``parameters`` inside (what ``modifier_rank`` writes there is
    partitioned again on leaving; None: read only). A no-op when none of them is partitioned."""
    if not any(is_partitioned(parameter) for parameter in parameters):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(parameters, modifier_rank=modifier_rank)


def whole_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with whole tensors, gathered (and copied) where ZeRO-3 partitioned them; every process
    calls it then. ``DiffusionValueModel.from_policy`` copies a policy so, and TraceRL, which keeps its value model
    whole on every process under DeepSpeed (it averages the value model's gradients itself), loads one so."""
    if not has_partitioned_parameters(model):
        return model.state_dict()
    with gathered(list(model.parameters())):
        return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
