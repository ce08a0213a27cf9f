"""The elementwise chains of a decoder layer (RMSNorm with its weight, a residual add with the norm after it, the
rotary rotation of q and k, SwiGLU's ``silu(gate) * up``), each a pure function of tensors, run eagerly (the
reference, and the default) or compiled by ``torch.compile`` (``set_fused_kernels``).

Why: on a GPU a small decoding step is bound by its number of kernels, not by its arithmetic (the H200 profile of a
batch-1 SDAR-4B step: about 1,500 kernels, 8.3 ms, against about 2 ms to read the weights), and a training step
spends about a quarter of its time in elementwise kernels that each read and write whole activations. Eagerly, a
layer of a decoding step dispatches 31 operations, each one kernel; with the chains compiled, 12 operations and 7
fused kernels (counted on the CPU: ``benchmarks/generation.py --count_ops [--fused_kernels]``). Compiled kernels
compute a half-precision chain in float32 and round once at its end, where the eager chain (and the released
models) round after every operation: values differ in the last bits of half precision.

Each function is called by the module that owns its weights (``RMSNorm`` calls ``rms_norm`` / ``add_rms_norm``
with its own weight), so wrappers that gather a module's weights around its forward (DeepSpeed ZeRO-3, FSDP) see
nothing unusual.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipped when it would do nothing (a no-op cast still costs a dispatch, which adds up in a
    small decode step)."""
    return x if x.dtype == dtype else x.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm with the variance in fp32 and the result cast back before scaling (as all three releases do):
    ``weight * (x32 * rsqrt(mean(x32^2) + eps)).to(dtype)``. ``F.rms_norm`` computes its part in fp32 for half
    inputs and returns the input's dtype, so ``x`` goes in as it is: on a CPU the same bits as casting it to fp32
    and back around the call (tested, forward and backward), on CUDA one fused kernel instead of two full-size
    casts around it (four norms a layer). The weight is not passed to ``F.rms_norm``, even in float32: on a CPU
    (torch 2.13) that call took 655 µs on a ``[1, 2052, 128]`` input, against 167 µs for the two operations here."""
    return weight * F.rms_norm(x, x.shape[-1:], eps=eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(residual + x, rms_norm(residual + x))``: a residual connection and the norm that reads it."""
    summed = residual + x
    return summed, rms_norm(summed, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, full_precision: bool) -> torch.Tensor:
    """RoPE of ``x`` ``[B, H, L, D]``, HF's rotate-half convention written as ``x * cos + x.roll(D / 2) *
    signed_sin`` (``common.rotary_cos_sin``); in fp32 and cast back when ``full_precision`` (LLaDA), else in the
    tables' dtype (the caller casts them to ``x``'s)."""
    if full_precision:
        x32 = cast(x, torch.float32)
        return cast(x32 * cos + x32.roll(x.shape[-1] // 2, -1) * signed_sin, x.dtype)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


def rotate_pair(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                full_precision: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotate`` of a layer's queries and keys with the same tables (one function: one compiled region)."""
    return rotate(q, cos, signed_sin, full_precision), rotate(k, cos, signed_sin, full_precision)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up``."""
    return F.silu(gate) * up


class Kernels(NamedTuple):
    """The functions a layer calls for its elementwise chains."""

    rms_norm: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotate_pair: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_mul: Callable[..., torch.Tensor]


EAGER = Kernels(rms_norm, add_rms_norm, rotate_pair, silu_mul)

RECOMPILE_LIMIT = 64
"""Compilations per chain before dynamo gives up (see ``compiled_kernels``)."""


@functools.cache
def compiled_kernels(backend: str) -> Kernels:
    """``EAGER``'s functions through ``torch.compile`` with ``backend``, made once per process and backend.

    ``dynamic=True``: batch and length change from call to call (prompt prefill, denoising steps, packed training
    rows), and one dynamic kernel serves them all rather than a compilation per shape. ``fullgraph=True``: a graph
    break would be a silent slow path; these functions have none.

    Each chain still compiles once per kind of input: its rank (a norm over hidden states or over heads), dtype,
    gradient mode and whether its input requires a gradient, and the norm's ``eps``. A TraceRL run (policy,
    reference, value model; rollouts, scoring and backward) reaches more kinds than dynamo's default of 8
    compilations per function, after which ``fullgraph`` would fail, so dynamo's ``recompile_limit`` is raised to
    at least ``RECOMPILE_LIMIT`` (a process-wide setting)."""
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # its name in torch < 2.7
    setattr(config, limit, max(getattr(config, limit), RECOMPILE_LIMIT))
    return Kernels(*(torch.compile(fn, backend=backend, dynamic=True, fullgraph=True) for fn in EAGER))


class UsesKernels:
    """Mixed into the modules with elementwise chains: ``fused_kernels`` (None: eager, else a ``torch.compile``
    backend) chooses the functions ``kernels`` returns. Set through ``set_fused_kernels``."""

    fused_kernels: str | None = None

    @property
    def kernels(self) -> Kernels:
        return EAGER if self.fused_kernels is None else compiled_kernels(self.fused_kernels)


FUSED_KERNELS_HELP = (
    "Compile the layers' elementwise chains (RMSNorm, residual add + norm, RoPE, SwiGLU) with torch.compile "
    "(inductor) into fused kernels, for the trained model's forwards and generate() (models.set_fused_kernels). "
    "Fewer, larger GPU kernels; half-precision values differ from eager (the releases) in their last bits; a "
    "first-call compile of some seconds. False: the model runs as it was given (eager by default)."
)
"""The ``help`` of the trainers' ``fused_kernels`` field."""


def apply_fused_kernels(enabled: bool, *models: nn.Module | None) -> None:
    """A trainer's ``fused_kernels``: when ``enabled``, ``set_fused_kernels`` on each model given (None skipped);
    otherwise nothing changes."""
    if enabled:
        for model in models:
            if model is not None:
                set_fused_kernels(model)


def set_fused_kernels(model: nn.Module, backend: str | None = "inductor") -> int:
    """Run ``model``'s elementwise chains compiled with ``backend`` (``"inductor"``: fused GPU kernels), or eagerly
    again (``None``). ``model`` may be wrapped (PEFT, a value model, DDP): every module below it that has such
    chains follows. Returns how many modules changed; a model without any (not one of this package's families) is
    a ``ValueError``.

    Compilation happens at a chain's first call with each new kind of input (dtype, gradient mode), some seconds on
    a GPU per function; a CUDA-graph capture of ``generate`` warms its step up first, so it captures compiled
    kernels. Off by default: see the module docstring for how values differ."""
    if backend is not None and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ValueError(f"backend must be None or a torch.compile backend ('inductor' for fused kernels; one of "
                         f"{torch._dynamo.list_backends(exclude_tags=())}), got {backend!r}.")
    modules = [module for module in model.modules() if isinstance(module, UsesKernels)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no layers with fused kernels: set_fused_kernels applies to the "
                         "models of trl_diffusion (SDAR/TraDo, LLaDA, Dream and their mixture-of-experts variants).")
    for module in modules:
        module.fused_kernels = backend
    return len(modules)
