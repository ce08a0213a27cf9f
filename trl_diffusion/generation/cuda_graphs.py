"""CUDA-graph replay of SDAR's exact-cache denoising step (``cuda_graphs="auto"`` on CUDA).

UNMEASURED: written for CUDA and never run in CI (no GPU there); ``tests/test_static_cache.py`` has GPU-marked
tests that compare it with the eager path. The eager ``ModelRunner`` stays the reference.

A block's step (forward over the block against the static cache, sampling, commit selection, trajectory writes)
has static shapes and no host synchronisation, so it is captured once per batch shape and replayed: one launch
per step instead of thousands of kernel launches. The graph reads and writes fixed buffers; the block's state is
copied into them before its steps and back after. The forward attends over the whole cache (a fixed read window)
with a mask that hides the slots after the block. Randomness: greedy decoding and per-row generator lists (their
uniforms are drawn on the host and copied into a buffer before each replay) give exactly the eager results; with
``generator=None`` the default CUDA generator is used inside the graph (the same distribution, another stream).
If capture fails the runner warns and falls back to the eager step.
"""

from __future__ import annotations

import warnings

import torch

from .denoise import Block, ModelRunner, StepNoise, denoise_step, draw_noise


def graphs_apply(settings, device: torch.device, generator) -> bool:
    """Whether ``cuda_graphs="auto"`` replays captured steps for this call."""
    single_generator = generator is not None and not isinstance(generator, (list, tuple))
    return (settings.cuda_graphs == "auto" and device.type == "cuda" and settings.cache_mode == "exact"
            and settings.schedule == "uniform" and not settings.cfg_scale
            and not (single_generator and settings.draws_randomness))


class CudaGraphRunner(ModelRunner):
    """``ModelRunner`` for the exact cache whose denoising step and commit pass are CUDA graphs."""

    def __init__(self, model, settings, state, block_causal: bool) -> None:
        super().__init__(model, settings, state, block_causal)
        self._shape = None
        self._failed = False

    def _buffers(self, block: Block) -> None:
        """Static buffers for ``[rows, length]`` blocks (dropping graphs captured for another shape)."""
        rows, length = block.tokens.shape
        device = block.tokens.device
        self._shape = (rows, length)
        self._graphs = None
        self._buf = Block(start=0, end=0, tokens=block.tokens.clone(), generated=block.generated.clone(),
                          unmask_step=block.unmask_step.clone(), logprobs=block.logprobs.clone(),
                          steps_taken=block.steps_taken.clone(), active=block.active.clone())
        self._positions = torch.zeros_like(block.tokens)
        self._slots = torch.zeros(length, dtype=torch.long, device=device)
        self._mask = torch.zeros(rows, 1, length, self.width, dtype=torch.bool, device=device)
        self._quota = torch.zeros((), dtype=torch.long, device=device)
        self._noise = StepNoise()

    def _load(self, block: Block) -> None:
        buf, state = self._buf, self.state
        for name in ("tokens", "generated", "unmask_step", "logprobs", "steps_taken", "active"):
            getattr(buf, name).copy_(getattr(block, name))
        self._positions.copy_(state.positions[:, block.start:block.end])
        self._slots.copy_(torch.arange(block.start, block.end, device=self._slots.device))
        cols = torch.arange(self.width, device=self._mask.device)
        self._mask.copy_((state.valid & (cols < block.end))[:, None, None, :].expand_as(self._mask))

    def _store(self, block: Block) -> None:
        for name in ("tokens", "unmask_step", "logprobs", "steps_taken"):
            getattr(block, name).copy_(getattr(self._buf, name))

    def _forward(self, keep: int) -> torch.Tensor:
        self.cache.place(self._slots, self.width)
        return self.model(input_ids=self._buf.tokens, attention_mask=self._mask, position_ids=self._positions,
                          past_key_values=self.cache, logits_to_keep=keep).logits

    def _step(self) -> None:
        denoise_step(self._buf, self._forward(0), self.settings, self.mask_id, self.state.generator, self._noise,
                     quota=self._quota)

    def _capture(self) -> None:
        """Size the noise buffers from one forward, then record the graphs."""
        self._logits_shape = (*self._shape, self._forward(0).shape[-1])
        self._noise = draw_noise(self.settings, self._logits_shape, self.state.generator, self._slots.device,
                                 [False] * self._shape[0])  # zero buffers of the right shapes; draws nothing
        self._graphs = self._record()

    def _record(self) -> tuple:
        """Warm up on a side stream, undo the warm-up's writes, capture the step and the commit pass."""
        saved = {name: getattr(self._buf, name).clone() for name in ("tokens", "unmask_step", "logprobs",
                                                                      "steps_taken")}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step()
            self._forward(1)
        torch.cuda.current_stream().wait_stream(side)
        for name, value in saved.items():
            getattr(self._buf, name).copy_(value)
        step, commit = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(step):
            self._step()
        with torch.cuda.graph(commit, pool=step.pool()):
            self._forward(1)
        return step, commit

    def run_block(self, block: Block, row_steps: list[int], quotas: list[int] | None,
                  fractions: list[float] | None) -> None:
        if self._failed:
            return super().run_block(block, row_steps, quotas, fractions)
        if self._shape != tuple(block.tokens.shape):
            self._buffers(block)
        self._load(block)
        if self._graphs is None:
            try:
                self._capture()
            except RuntimeError as error:  # unmeasured path: never let it break generation
                warnings.warn(f"CUDA-graph capture failed ({error}); decoding eagerly. Pass cuda_graphs='off' to "
                              "skip the attempt.", stacklevel=2)
                self._failed = True
                return super().run_block(block, row_steps, quotas, fractions)
        step, commit = self._graphs
        for index in range(max(row_steps)):
            self._quota.fill_(quotas[index])
            fresh = draw_noise(self.settings, self._logits_shape, self.state.generator, self._slots.device,
                               [steps > index for steps in row_steps])
            for name in ("tokens", "confidence", "commit"):  # per-row uniforms drawn on the host, as eagerly
                if getattr(fresh, name) is not None:
                    getattr(self._noise, name).copy_(getattr(fresh, name))
            step.replay()
            self.calls += 1
        commit.replay()
        self.calls += 1
        self._store(block)

    def select_rows(self, state, rows: torch.Tensor) -> None:
        super().select_rows(state, rows)
        self._shape = None  # buffers and graphs follow the new batch size
