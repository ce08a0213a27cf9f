"""CUDA-graph replay of SDAR's exact-cache denoising steps (``cuda_graphs="auto"`` on CUDA).

UNMEASURED: written for CUDA and never run in CI (no GPU there). ``tests/test_static_cache.py`` checks
everything but the capture itself on the CPU (with the capture replaced by eager replay) and has GPU-marked
tests that compare it with the eager path. The eager ``ModelRunner`` stays the reference.

A denoising step (forward over the block against the static cache, sampling, commit selection, trajectory
writes) has static shapes and no host synchronisation, so it is captured once per batch shape and replayed: one
launch per step instead of thousands of kernel launches. Two graphs: a plain step, and a block's first step that
also writes the previous block's final keys (``ModelRunner._commit_and_step``). The graphs read and write fixed
buffers; a block's state is copied into them before its steps and back after. The forward attends over the
whole cache (a fixed read window) with a mask that hides the slots after the block. Randomness: greedy decoding
and per-row generator lists (their uniforms are drawn on the host and copied into buffers before each replay)
give the eager results; with ``generator=None`` the default CUDA generator draws inside the graph (the same
distribution, another stream). If a capture fails the runner warns and decodes eagerly.
"""

from __future__ import annotations

import warnings

import torch

from .denoise import Block, ModelRunner, StepNoise, denoise_step, draw_noise

STATE = ("tokens", "unmask_step", "logprobs", "steps_taken")
"""The block buffers a step writes (copied back to the canvas after the block)."""


def graphs_apply(settings, device: torch.device, generator) -> bool:
    """Whether ``cuda_graphs="auto"`` replays captured steps for this call."""
    single_generator = generator is not None and not isinstance(generator, (list, tuple))
    return (settings.cuda_graphs == "auto" and device.type == "cuda" and settings.cache_mode == "exact"
            and settings.schedule == "uniform" and not settings.cfg_scale
            and not (single_generator and settings.draws_randomness))


class CudaGraphRunner(ModelRunner):
    """``ModelRunner`` for the exact cache whose denoising steps are replayed CUDA graphs."""

    def __init__(self, model, settings, state, block_causal: bool) -> None:
        super().__init__(model, settings, state, block_causal)
        self._shape: tuple[int, int] | None = None
        self._failed = False

    def _buffers(self, block: Block) -> None:
        """Static buffers for ``[rows, length]`` blocks (graphs captured for another shape are dropped)."""
        rows, length = block.tokens.shape
        device = block.tokens.device
        self._shape, self._graphs, self._logits_shape = (rows, length), {}, None
        self._buf = Block(start=0, end=0, tokens=block.tokens.clone(), generated=block.generated.clone(),
                          unmask_step=block.unmask_step.clone(), logprobs=block.logprobs.clone(),
                          steps_taken=block.steps_taken.clone(), active=block.active.clone())
        self._previous = torch.zeros_like(block.tokens)  # the previous block's final tokens
        self._positions = torch.zeros(rows, 2 * length, dtype=torch.long, device=device)  # [previous | this]
        self._slots = torch.zeros(2 * length, dtype=torch.long, device=device)
        self._masks = {fused: torch.zeros(rows, 1, (1 + fused) * length, self.width, dtype=torch.bool,
                                          device=device) for fused in (False, True)}
        self._quota = torch.zeros((), dtype=torch.long, device=device)
        self._noise = StepNoise()

    def _load(self, block: Block, previous: Block | None) -> None:
        buf, state, length = self._buf, self.state, self._shape[1]
        for name in (*STATE, "generated", "active"):
            getattr(buf, name).copy_(getattr(block, name))
        device = self._slots.device
        cols = torch.arange(self.width, device=device)
        self._positions[:, length:].copy_(state.positions[:, block.start:block.end])
        self._slots[length:].copy_(torch.arange(block.start, block.end, device=device))
        self._masks[False].copy_((state.valid & (cols < block.end))[:, None, None, :].expand_as(self._masks[False]))
        if previous is None:
            return
        self._previous.copy_(state.canvas[:, previous.start:previous.end])
        self._positions[:, :length].copy_(state.positions[:, previous.start:previous.end])
        self._slots[:length].copy_(torch.arange(previous.start, previous.end, device=device))
        query_end = torch.cat([torch.full((length,), previous.end, device=device),
                               torch.full((length,), block.end, device=device)])
        self._masks[True].copy_((state.valid[:, None, :] & (cols < query_end[:, None]))[:, None])

    def _store(self, block: Block) -> None:
        for name in STATE:
            getattr(block, name).copy_(getattr(self._buf, name))

    def _forward(self, fused: bool) -> torch.Tensor:
        length = self._shape[1]
        if fused:
            self.cache.place(self._slots, self.width)
            ids, positions = torch.cat([self._previous, self._buf.tokens], dim=1), self._positions
        else:
            self.cache.place(self._slots[length:], self.width)
            ids, positions = self._buf.tokens, self._positions[:, length:]
        return self.model(input_ids=ids, attention_mask=self._masks[fused], position_ids=positions,
                          past_key_values=self.cache, logits_to_keep=length).logits

    def _graph(self, fused: bool):
        """The captured step (``fused``: the first step that also commits the previous block), captured once."""
        if fused not in self._graphs:
            if self._logits_shape is None:  # size the noise buffers (zeros; draws nothing)
                self._logits_shape = (*self._shape, self._forward(False).shape[-1])
                self._noise = draw_noise(self.settings, self._logits_shape, self.state.generator,
                                         self._slots.device, [False] * self._shape[0])
            self._graphs[fused] = self._record(lambda: denoise_step(
                self._buf, self._forward(fused), self.settings, self.mask_id, self.state.generator, self._noise,
                quota=self._quota))
        return self._graphs[fused]

    def _record(self, body):
        """Warm ``body`` up on a side stream, undo the warm-up's writes, capture it."""
        saved = [getattr(self._buf, name).clone() for name in STATE]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            body()
        torch.cuda.current_stream().wait_stream(side)
        for name, value in zip(STATE, saved):
            getattr(self._buf, name).copy_(value)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            body()
        return graph

    def run_block(self, block: Block, row_steps: list[int], quotas: list[int] | None,
                  fractions: list[float] | None) -> None:
        if self._failed:
            return super().run_block(block, row_steps, quotas, fractions)
        if self._shape != tuple(block.tokens.shape):
            self._buffers(block)
        previous = self.uncommitted
        self._load(block, previous)
        steps = max(row_steps)
        try:
            graphs = [self._graph(previous is not None and step == 0) for step in range(min(steps, 2))]
        except RuntimeError as error:  # unmeasured path: never let it break generation
            warnings.warn(f"CUDA-graph capture failed ({error}); decoding eagerly. Pass cuda_graphs='off' to "
                          "skip the attempt.", stacklevel=2)
            self._failed = True
            return super().run_block(block, row_steps, quotas, fractions)
        for step in range(steps):
            self._quota.fill_(quotas[step])
            fresh = draw_noise(self.settings, self._logits_shape, self.state.generator, self._slots.device,
                               [planned > step for planned in row_steps])
            for name in ("tokens", "confidence", "commit"):  # per-row uniforms drawn on the host, as eagerly
                if getattr(fresh, name) is not None:
                    getattr(self._noise, name).copy_(getattr(fresh, name))
            graphs[min(step, 1)].replay()
            self.calls += 1
        self._store(block)
        self.uncommitted = block

    def select_rows(self, state, rows: torch.Tensor) -> None:
        super().select_rows(state, rows)
        self._shape = None  # buffers and graphs follow the new batch size
