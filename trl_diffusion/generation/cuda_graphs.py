"""CUDA-graph replay of the cached samplers' denoising steps (``cuda_graphs="auto"``, the default, on CUDA).

Never run in CI (no GPU there): ``tests/test_static_cache.py`` checks everything but the capture itself on the CPU
(with the capture replaced by eager replay) and has GPU-marked tests that compare it with the eager path (all
passed on an H200 on 2026-12-04; 6.8x the eager batch-1 speed). The eager ``ModelRunner`` stays the reference.

A denoising step (forward over the block against the static cache, sampling, commit selection, trajectory
writes) has static shapes and no host synchronisation, so it is captured once per batch shape and replayed: one
launch per step instead of thousands of kernel launches. The graphs read and write fixed buffers; a block's state
is copied into them before its steps and back after, and each step's quota (uniform schedule) or fraction (Dream's
linspace schedule) is written to a device buffer before the replay.

* SDAR's exact cache (``ExactCacheGraphRunner``): two graphs, a plain step and a block's first step that also
  writes the previous block's final keys (``ModelRunner._commit_and_step``). The forward attends over the whole
  cache (a fixed read window) with a mask that hides the slots after the block.
* LLaDA's and Dream's prefix and dual caches (``WindowCacheGraphRunner``): a block's first step runs eagerly (its
  forward over the whole canvas refreshes the cache); the later steps, a forward over the live window against the
  whole cache, are replayed. The dual window (the block; for Dream, also the column before it) keeps its width,
  so one capture serves every block; the prefix window (the block and every column after it) shrinks from block
  to block, so each block captures its own.

Randomness: greedy decoding and per-row generator lists (their uniforms are drawn on each generator's device, host or
model's, and copied into buffers before each replay) give the eager results; with ``generator=None`` the default CUDA
generator draws inside the graph (the same distribution, another stream). If a capture fails the runner warns and
decodes eagerly, and so do later calls in the process.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from .denoise import Block, ModelRunner, denoise_step, draw_noise

STATE = ("tokens", "unmask_step", "logprobs", "steps_taken")
"""The block buffers a step writes (copied back to the canvas after the block)."""
LOADED = (*STATE, "generated", "active")
"""The block buffers a step reads."""


CAPTURE_FAILED = False
"""Set when a capture failed in this process: later calls decode eagerly (see ``GraphRunner._fall_back``)."""


def runner_class(settings, device: torch.device, generator) -> type[ModelRunner]:
    """The runner class for this call: a graph runner where ``cuda_graphs="auto"`` applies, else the eager one."""
    single_generator = generator is not None and not isinstance(generator, (list, tuple))
    if (settings.cuda_graphs != "auto" or device.type != "cuda" or settings.cfg_scale or CAPTURE_FAILED
            or (single_generator and settings.draws_randomness)):
        return ModelRunner
    return {"exact": ExactCacheGraphRunner, "prefix": WindowCacheGraphRunner, "dual": WindowCacheGraphRunner}.get(
        settings.cache_mode, ModelRunner)


def cuda_graph_capturable(model) -> bool:
    """Whether ``model``'s forward can be captured: not where it reads its data on the host, as a mixture-of-experts
    dispatch does (the experts that got tokens; ``cuda_graph_capturable = False`` on the model class)."""
    return bool(getattr(model, "cuda_graph_capturable", True))


def spread_over_devices(model) -> bool:
    """Whether ``model``'s weights span several devices or are offloaded (``device_map`` with several devices, CPU /
    disk offload hooks): a captured step would copy between devices or from the host inside the graph, so such a
    model decodes eagerly."""
    devices = {parameter.device for parameter in model.parameters()}
    device_map = getattr(model, "hf_device_map", None) or {}
    return len(devices) > 1 or len(set(device_map.values())) > 1 or any(d.type == "meta" for d in devices)


class GraphRunner(ModelRunner):
    """What the graph runners share: the block's buffers, the step's schedule and noise buffers, capture, and the
    fall-back to the eager loop if a capture fails. Subclasses add their forward's inputs (``_input_buffers``)."""

    def __init__(self, model, settings, state, block_causal: bool) -> None:
        super().__init__(model, settings, state, block_causal)
        self._shape: tuple[int, int] | None = None
        self._failed = False

    def _buffers(self, block: Block) -> None:
        """Static buffers for ``[rows, length]`` blocks (graphs captured for another shape are dropped)."""
        rows, length = block.tokens.shape
        device = block.tokens.device
        self._shape, self._graphs, self._logits_shape = (rows, length), {}, None
        self._buf = Block(start=0, end=0, **{name: getattr(block, name).clone() for name in LOADED})
        self._quota = torch.zeros((), dtype=torch.long, device=device)
        self._fraction = torch.zeros((), dtype=torch.float32, device=device)
        self._input_buffers(rows, length, device)

    def _input_buffers(self, rows: int, length: int, device: torch.device) -> None:
        raise NotImplementedError

    def _load_state(self, block: Block) -> None:
        for name in LOADED:
            getattr(self._buf, name).copy_(getattr(block, name))

    def _store(self, block: Block) -> None:
        for name in STATE:
            getattr(block, name).copy_(getattr(self._buf, name))

    def _size_noise(self, logits_shape: tuple[int, ...]) -> None:
        """Noise buffers for steps with ``logits_shape`` (zeros; draws nothing).

        With ``generator=None`` and sampling (not LLaDA's Gumbel draw), ``sample_tokens`` would call
        ``torch.multinomial``, whose argument checks read values back to the host (``.item()``): illegal while a
        graph is captured. The token uniforms get a buffer instead, refilled from the default CUDA generator inside
        the graph (``_capture``), and ``sample_tokens`` takes its inverse-CDF path: an exact sample of the same
        distribution."""
        self._logits_shape = logits_shape
        self._noise = draw_noise(self.settings, logits_shape, self.state.generator, self._quota.device,
                                 [False] * logits_shape[0])
        self._draw_tokens = (self.state.generator is None and bool(self.settings.temperature)
                             and not self.settings.gumbel_float64)
        if self._draw_tokens:
            self._noise.tokens = torch.zeros(logits_shape[:-1], dtype=torch.float32, device=self._quota.device)

    def _capture(self, key, forward: Callable[[], torch.Tensor]):
        """The graph of one kind of step (``key``): ``forward``'s logits through ``denoise_step`` on the buffers,
        captured the first time it is needed."""
        if key not in self._graphs:
            linspace = self.settings.schedule == "linspace"

            def step() -> None:
                if self._draw_tokens:  # inside the graph: each replay draws new uniforms (see _size_noise)
                    self._noise.tokens.uniform_()
                denoise_step(self._buf, forward(), self.settings, self.mask_id, self.state.generator, self._noise,
                             quota=None if linspace else self._quota, fraction=self._fraction if linspace else None)

            self._graphs[key] = self._record(step)
        return self._graphs[key]

    def _record(self, body: Callable[[], None]):
        """Warm ``body`` up on a side stream of the buffers' device, undo the warm-up's writes, capture it there.

        ``CUDAGraph.capture_begin`` / ``capture_end`` rather than ``torch.cuda.graph``: the latter also runs
        ``gc.collect()`` and empties the allocator's cache at every capture (the prefix cache captures every
        block), and a capture that fails in its ``__exit__`` would leave the capture stream current. Here the
        stream context is restored whatever happens. ``thread_local``: CUDA calls of other threads (data loader,
        NCCL watchdog) cannot spoil the capture."""
        device = self._quota.device
        saved = [getattr(self._buf, name).clone() for name in STATE]
        with torch.cuda.device(device):
            main, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                body()
            main.wait_stream(side)
            for name, value in zip(STATE, saved):
                getattr(self._buf, name).copy_(value)
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    body()
                except BaseException:
                    # end the capture (the stream leaves capture mode), but report the error that broke it: after
                    # a failed operation, capture_end only says "operation failed due to a previous error"
                    try:
                        graph.capture_end()
                    except RuntimeError:
                        pass
                    raise
                graph.capture_end()
            main.wait_stream(side)
        return graph

    def _replay(self, graph, step: int, row_steps: list[int], quotas: list[int] | None,
                fractions: list[float] | None) -> None:
        """Write step ``step``'s quota or fraction and the per-row uniforms (drawn as eagerly) into
        their buffers, then replay."""
        if quotas is not None:
            self._quota.fill_(quotas[step])
        if fractions is not None:
            self._fraction.fill_(fractions[step])
        fresh = draw_noise(self.settings, self._logits_shape, self.state.generator, self._quota.device,
                           [planned > step for planned in row_steps])
        for name in ("tokens", "confidence", "commit"):
            if getattr(fresh, name) is not None:
                getattr(self._noise, name).copy_(getattr(fresh, name))
        if self._quota.device.type == "cuda":  # a graph launches on the current device's stream
            with torch.cuda.device(self._quota.device):
                graph.replay()
        else:  # the CPU tests, whose "graphs" are eager calls
            graph.replay()
        self.calls += 1

    def _fall_back(self, error: RuntimeError) -> None:
        """Decode eagerly from here on, in this process: a failed capture can leave CUDA state behind (its memory
        pool is never released), so later calls do not try again."""
        global CAPTURE_FAILED
        CAPTURE_FAILED = True
        self._failed = True
        if self._quota.device.type == "cuda":
            torch.cuda.synchronize(self._quota.device)
        warnings.warn(f"CUDA-graph capture failed ({error}); decoding eagerly, here and in later generate() calls "
                      "of this process. Pass cuda_graphs='off' to skip the attempt.", stacklevel=3)

    def select_rows(self, state, rows: torch.Tensor) -> None:
        super().select_rows(state, rows)
        self._shape = None  # buffers and graphs follow the new batch size


class ExactCacheGraphRunner(GraphRunner):
    """SDAR's exact cache: every step of a block is a replayed graph (a block's first step also commits the
    previous block's keys)."""

    def _input_buffers(self, rows: int, length: int, device: torch.device) -> None:
        self._previous = torch.zeros(rows, length, dtype=torch.long, device=device)  # the previous block's tokens
        self._positions = torch.zeros(rows, 2 * length, dtype=torch.long, device=device)  # [previous | this]
        self._slots = torch.zeros(2 * length, dtype=torch.long, device=device)
        self._masks = {fused: torch.zeros(rows, 1, (1 + fused) * length, self.width, dtype=torch.bool,
                                          device=device) for fused in (False, True)}

    def _load(self, block: Block, previous: Block | None) -> None:
        self._load_state(block)
        state, length = self.state, self._shape[1]
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

    def _forward(self, fused: bool) -> torch.Tensor:
        length = self._shape[1]
        if fused:
            self.cache.place(self._slots, self.width)
            ids, positions = torch.cat([self._previous, self._buf.tokens], dim=1), self._positions
        else:
            self.cache.place(self._slots[length:], self.width)
            ids, positions = self._buf.tokens, self._positions[:, length:]
        return self.model(input_ids=ids, attention_mask=self._masks[fused], position_ids=positions,
                          past_key_values=self.cache, logits_to_keep=length, output_router_logits=False).logits

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
            if self._logits_shape is None:
                self._size_noise((*self._shape, self._forward(False).shape[-1]))
            graphs = [self._capture(fused, lambda fused=fused: self._forward(fused))
                      for fused in [previous is not None and step == 0 for step in range(min(steps, 2))]]
        except RuntimeError as error:  # never let a failed capture break generation
            self._fall_back(error)
            return super().run_block(block, row_steps, quotas, fractions)
        for step in range(steps):
            self._replay(graphs[min(step, 1)], step, row_steps, quotas, fractions)
        self._store(block)
        self.uncommitted = block


class WindowCacheGraphRunner(GraphRunner):
    """LLaDA's and Dream's prefix and dual caches: a block's first step runs eagerly (the whole-canvas forward that
    refreshes the cache); its later steps, a forward over the live window (``begin`` sets it: dual, the block;
    prefix, the block and every column after it; Dream, also the column before) against the whole cache, are a
    replayed graph. The dual window keeps its width, so one capture serves every block; the prefix window
    shrinks, so each block captures its own (and the previous block's graph is dropped)."""

    def _input_buffers(self, rows: int, length: int, device: torch.device) -> None:
        self._width = None

    def _window_buffers(self) -> None:
        """Inputs of a forward over the live window (a new capture when its width changes)."""
        live, rows, device = self._live, self._shape[0], self._quota.device
        width = live.stop - live.start
        if width == self._width:
            return
        self._width, self._graphs = width, {}
        self._ids = torch.zeros(rows, width, dtype=torch.long, device=device)  # the block's part is replaced
        self._positions = torch.zeros(rows, width, dtype=torch.long, device=device)
        self._slots = torch.zeros(width, dtype=torch.long, device=device)
        self._mask = (torch.zeros(rows, 1, width, self.width, dtype=torch.bool, device=device)
                      if self.state.padded else None)

    def _load(self, block: Block) -> None:
        """Copy in the block's state and the window's inputs (``begin`` set the window and its mask)."""
        self._load_state(block)
        self._window_buffers()
        live, state = self._live, self.state
        self._ids.copy_(state.canvas[:, live])
        self._positions.copy_(state.positions[:, live])
        self._slots.copy_(torch.arange(live.start, live.stop, device=self._slots.device))
        if self._mask is not None:
            self._mask.copy_(self._block_mask)

    def _forward(self) -> torch.Tensor:
        self.cache.place(self._slots, self.width)
        length, shift = self._shape[1], self.shift
        ids = torch.cat([self._ids[:, :shift], self._buf.tokens, self._ids[:, shift + length:]], dim=1)
        logits = self.model(input_ids=ids, attention_mask=self._mask, position_ids=self._positions,
                            past_key_values=self.cache, output_router_logits=False).logits
        return logits[:, :length]

    def run_block(self, block: Block, row_steps: list[int], quotas: list[int] | None,
                  fractions: list[float] | None) -> None:
        if self._failed:
            return super().run_block(block, row_steps, quotas, fractions)
        self.begin(block)
        steps = max(row_steps)
        self.run_steps(block, row_steps, quotas, fractions, last=min(steps, 1))
        if steps <= 1:
            return
        if self._shape != tuple(block.tokens.shape):
            self._buffers(block)
        self._load(block)
        try:
            if self._logits_shape is None:
                self._size_noise(tuple(self._first_logits.shape))
            graph = self._capture("step", self._forward)
        except RuntimeError as error:  # never let a failed capture break generation
            self._fall_back(error)
            return self.run_steps(block, row_steps, quotas, fractions, first=1)
        for step in range(1, steps):
            self._replay(graph, step, row_steps, quotas, fractions)
        self._store(block)
