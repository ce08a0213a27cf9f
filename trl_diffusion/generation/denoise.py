"""One block of diffusion decoding: the host-side step plan, the device-side denoising step, and the model
runner of each cache mode.

The split keeps the decode loop free of host synchronisation. Everything the host decides (how many steps a
block runs, how many tokens each step commits) follows from the layout and the schedule alone, so it is known
before the block starts; everything that depends on model outputs (which tokens, which positions, whether a row
still has masks) stays on the device, as per-row masks. A row whose block is finished rides along unchanged.
The one exception is the CPU, where the host is the device and a data-dependent block stops once it is done
(``PROBE_DEVICES``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..models.cache import StaticDiffusionCache
from ..states import attention_mask_from_positions
from .sampling import (
    Generators,
    confidence_scores,
    guided_logits,
    ranking_inputs,
    sample_tokens,
    select_commits,
    token_noise_shape,
    uniform,
    uniform_quota,
)

DATA_DEPENDENT_STEPS = ("low_confidence_dynamic", "origin")
"""Strategies whose number of steps per block depends on the model's outputs (the rest are fixed by the
schedule); for them a block runs the schedule's upper bound and finished rows ride along."""

PROBE_DEVICES = ("cpu",)
"""Devices on which the loop reads back, after each step of a data-dependent block, whether any mask is left:
on the CPU the host is the device, so the read waits for nothing and saves the remaining forwards."""


class BlockSchedule:
    """Host-side plan of a block: each step's quota (uniform schedule) or commit fraction (Dream's linspace
    schedule), and how many steps a block needs, from the number of masks each active row has in it."""

    def __init__(self, settings) -> None:
        self.settings = settings
        self.steps = settings.denoising_steps
        self._known: dict[tuple[int, int], int] = {}
        if settings.schedule == "linspace":
            # Dream computes the fractions in float32 from a float32 linspace; keep those exact values
            t = torch.linspace(1, settings.eps, self.steps + 1)
            self.fractions = (1 - t[1:] / t[:-1]).tolist()[:-1] + [1.0]
        else:
            self.fractions = None

    def quotas(self, length: int) -> list[int] | None:
        return None if self.fractions is not None else uniform_quota(length, self.steps)

    def steps_needed(self, masks: int, length: int) -> int:
        """Steps until a row with ``masks`` masks in a block of ``length`` has none left (for the strategies in
        ``DATA_DEPENDENT_STEPS``: an upper bound). Mirrors the device-side commit rule exactly."""
        key = (masks, length)
        if key not in self._known:
            self._known[key] = self._steps_needed(masks, length)
        return self._known[key]

    def _steps_needed(self, masks: int, length: int) -> int:
        if masks <= 0:
            return 0
        if self.fractions is None:  # every step commits min(quota, masks left); dynamic commits at least that
            left = masks
            for step, quota in enumerate(uniform_quota(length, self.steps)):
                left -= min(quota, left)
                if left == 0:
                    return step + 1
            return self.steps
        if self.settings.remasking_strategy == "origin":  # random; the last step (fraction 1) commits the rest
            return self.steps
        left = masks
        for step, fraction in enumerate(self.fractions):
            left -= int(np.float32(left) * np.float32(fraction))  # float32 product, truncated, as on the device
            if left == 0:
                return step + 1
        return self.steps



@dataclass
class Block:
    """The decoding state of one block ``[B, L]`` (views into the canvas, or static buffers for graph replay);
    ``denoise_step`` updates it in place."""

    start: int
    end: int
    tokens: torch.Tensor
    generated: torch.Tensor
    unmask_step: torch.Tensor
    logprobs: torch.Tensor
    steps_taken: torch.Tensor
    active: torch.Tensor


@dataclass
class StepNoise:
    """Uniforms a step draws from a per-row generator list, drawn before the step (same order and values as
    drawing them inside it), so that the step itself has only device work."""

    tokens: torch.Tensor | None = None
    confidence: torch.Tensor | None = None
    commit: torch.Tensor | None = None


def draw_noise(settings, logits_shape: tuple[int, ...], generator: Generators, device,
               rows: list[bool]) -> StepNoise:
    """The draws of one step from a per-row generator list, in the order the step would make them (tokens, then
    the commit rule's). Only ``rows`` draw: those whose own plan for the block includes this step, so that a
    row's stream does not depend on how many steps other rows of its batch need."""
    if not isinstance(generator, (list, tuple)):
        return StepNoise()
    noise = StepNoise()
    token_draw = token_noise_shape(logits_shape, settings.temperature, settings.gumbel_float64)
    if token_draw is not None:
        noise.tokens = uniform(token_draw[0], generator, device, token_draw[1], rows)
    shape = tuple(logits_shape[:-1])
    origin = settings.schedule == "linspace" and settings.remasking_strategy == "origin"
    if origin or settings.remasking_strategy == "random":
        noise.confidence = uniform(shape, generator, device, rows=rows)
    if settings.alg_temp and not origin:
        noise.commit = uniform(shape, generator, device, rows=rows)
    return noise


def masks_left(block: Block, mask_id: int) -> torch.Tensor:
    """``[B, L]``: the positions of the block an active row still has to commit."""
    return block.generated & block.tokens.eq(mask_id) & block.active[:, None]


def denoise_step(block: Block, logits: torch.Tensor, settings, mask_id: int, generator: Generators,
                 noise: StepNoise, quota: int | torch.Tensor | None = None,
                 fraction: float | torch.Tensor | None = None) -> None:
    """Sample every masked position of the block from ``logits`` ``[B, L, V]``, choose the commits, and write
    tokens, ``unmask_step`` and log-probs in place. Device work only: no host synchronisation, no branch on
    tensor values. ``quota`` (uniform schedule) or ``fraction`` (linspace schedule) is this step's setting."""
    masked = masks_left(block, mask_id)
    tokens, token_lp, log_dist = sample_tokens(logits, settings.temperature, settings.top_k, settings.top_p,
                                               generator, settings.gumbel_float64, mask_id, noise.tokens,
                                               settings.top_p_first)
    strategy = settings.remasking_strategy
    if fraction is not None and strategy == "origin":
        draw = uniform(masked.shape, generator, masked.device) if noise.confidence is None else noise.confidence
        commit = masked & (draw < fraction)
    else:
        # LLaDA ranks by the raw softmax (settings.raw_confidence), the other families by the sampling distribution
        ranked_lp, ranked_dist = ranking_inputs(strategy, logits, tokens, token_lp, log_dist, settings.raw_confidence)
        confidence = confidence_scores(strategy, ranked_lp, ranked_dist, generator, noise.confidence)
        if fraction is not None:
            quota, strategy = (masked.sum(-1).float() * fraction).long(), "low_confidence_static"
        commit = select_commits(strategy, confidence, masked, quota, settings.confidence_threshold,
                                settings.alg_temp, generator, noise.commit)
    block.tokens.copy_(torch.where(commit, tokens, block.tokens))
    block.unmask_step.copy_(torch.where(commit, block.steps_taken[:, None], block.unmask_step))
    block.logprobs.copy_(torch.where(commit, token_lp, block.logprobs))
    block.steps_taken.add_(masked.any(-1))


class ModelRunner:
    """Runs the model for one cache mode over a block: ``begin`` (per-block masks; the full-canvas refresh of
    the prefix/dual caches), ``logits(step)`` (position-aligned logits of the block's columns) and ``end`` (the
    exact cache remembers the finished block, whose keys the next block's first forward writes). Caches are
    ``StaticDiffusionCache``s whose slots are canvas columns.

    * ``none``: every step runs the whole canvas (SDAR: up to the block's end, block-causal).
    * ``exact`` (SDAR): the prompt's full blocks are prefilled once; each step runs the block's columns against
      the cached earlier blocks; the finished block's clean keys are written by the next block's first step,
      which runs ``[finished block | new block]`` in one forward (no separate commit pass; the last block's keys
      are never needed).
    * ``prefix`` / ``dual`` (LLaDA, Dream; Fast-dLLM style, approximate): at the block start the whole canvas
      runs once and its keys fill the cache; later steps run only the live columns (``prefix``: the block and
      everything after it; ``dual``: the block) and overwrite just their slots.
    """

    def __init__(self, model, settings, state, block_causal: bool) -> None:
        self.model, self.settings, self.state = model, settings, state
        self.mode = settings.cache_mode
        self.attention_block = settings.block_length if block_causal else None
        self.shift = 1 if model.logits_shift else 0
        self.mask_id = model.mask_token_id
        self.width = state.canvas.shape[1]
        self.cache = StaticDiffusionCache(self.width) if self.mode != "none" else None
        self.uncommitted: Block | None = None  # exact cache: the finished block whose final keys are not cached yet
        self.calls = 0

    def forward(self, cols: slice, mask, keep: int | torch.Tensor = 0) -> torch.Tensor:
        """Logits of the canvas columns ``cols`` (the last ``keep`` of them if ``keep``, or the columns of ``cols``
        a 1-D index tensor ``keep`` names). Never with router logits
        (a mixture-of-experts config may say ``output_router_logits``: a training setting)."""
        state = self.state
        ids, pos = state.canvas[:, cols], state.positions[:, cols]
        self.calls += 1
        # guidance runs without a cache (SamplingSettings refuses one): past_key_values is None then
        return guided_logits(self.model, ids, mask, pos, state.prompt_cols[:, cols], self.settings.cfg_scale,
                             past_key_values=self.cache, logits_to_keep=keep)

    def _key_mask(self, queries: int, keys: int) -> torch.Tensor | None:
        """Every query sees the first ``keys`` columns except padding (None when no row has any). For the exact
        cache's block queries this is also the block-causal mask: every key is in an earlier block or theirs."""
        if not self.state.padded:
            return None
        valid = self.state.valid[:, :keys]
        return valid[:, None, None, :].expand(valid.shape[0], 1, queries, keys)

    def _place(self, lo: int, hi: int, read: int) -> None:
        self.cache.place(torch.arange(lo, hi, device=self.state.canvas.device), read)

    def prefill(self, end: int) -> None:
        """Exact cache: cache the prompt's full blocks (columns ``[0, end)``)."""
        if self.mode != "exact" or end == 0:
            return
        pos, valid = self.state.positions[:, :end], self.state.valid[:, :end]
        self._place(0, end, end)
        self.forward(slice(0, end), attention_mask_from_positions(pos, pos, valid, self.attention_block), keep=1)

    def begin(self, block: Block) -> None:
        start, end, width, shift = block.start, block.end, self.width, self.shift
        length = end - start
        if self.mode == "exact":
            self._block_mask = self._key_mask(length, end)
        elif self.mode == "none" and self.attention_block is not None:
            pos, valid = self.state.positions[:, :end], self.state.valid[:, :end]
            self._block_mask = attention_mask_from_positions(pos, pos, valid, self.attention_block)
        else:  # full attention: the LM head runs on the block's (shifted) columns only, not on the whole canvas
            device = self.state.canvas.device
            self._block_cols = torch.arange(start - shift, end - shift, device=device)
            if self.mode == "none":
                self._block_mask = self._key_mask(width, width)
                return
            live_end = end if self.mode == "dual" else width
            self._live = slice(start - shift, live_end)
            self._live_block_cols = torch.arange(length, device=device)  # the block's columns of the live window
            self._place(0, width, width)
            self._first_logits = self.forward(slice(0, width), self._key_mask(width, width), keep=self._block_cols)
            self._block_mask = self._key_mask(live_end - (start - shift), width)

    def logits(self, block: Block, step: int) -> torch.Tensor:
        start, end, length = block.start, block.end, block.end - block.start
        if self.mode == "exact" and step == 0 and self.uncommitted is not None:
            return self._commit_and_step(block)
        if self.mode == "exact":
            self._place(start, end, end)
            return self.forward(slice(start, end), self._block_mask)
        if self.mode == "none" and self.attention_block is not None:
            return self.forward(slice(0, end), self._block_mask, keep=length)
        if self.mode == "none":
            return self.forward(slice(0, self.width), self._block_mask, keep=self._block_cols)
        if step == 0:
            return self._first_logits
        self._place(self._live.start, self._live.stop, self.width)
        return self.forward(self._live, self._block_mask, keep=self._live_block_cols)

    def _commit_and_step(self, block: Block) -> torch.Tensor:
        """Exact cache: one forward over ``[previous block, clean | this block]`` writes the previous block's
        final keys into the cache (its queries see only earlier blocks, as a separate commit pass would) and is
        this block's first denoising step (its queries see the cache, the previous block and themselves)."""
        first, end = self.uncommitted.start, block.end
        self.uncommitted = None
        pos, valid = self.state.positions, self.state.valid
        mask = attention_mask_from_positions(pos[:, first:end], pos[:, :end], valid[:, :end], self.attention_block)
        self._place(first, end, end)
        return self.forward(slice(first, end), mask, keep=end - block.start)

    def end(self, block: Block) -> None:
        if self.mode == "exact":  # its keys are written by the next block's first forward (none if it is the last)
            self.uncommitted = block

    def run_block(self, block: Block, row_steps: list[int], quotas: list[int] | None,
                  fractions: list[float] | None) -> None:
        """The denoising steps of ``block``: as many as the row that needs most (``row_steps``: each row's plan,
        fixed before the block, so there is no host synchronisation inside it)."""
        self.begin(block)
        self.run_steps(block, row_steps, quotas, fractions)
        self.end(block)

    def run_steps(self, block: Block, row_steps: list[int], quotas: list[int] | None,
                  fractions: list[float] | None, first: int = 0, last: int | None = None) -> None:
        """Steps ``first`` to ``last - 1`` of a begun block (by default to its end), eagerly. Where the host is the
        device (``PROBE_DEVICES``), reading whether the block is done costs nothing, so a block run to its end whose
        rows all finished early (dynamic / origin) stops there; the draws its rows had planned are still made, so
        that a row's random stream does not depend on when its batch stopped."""
        steps = max(row_steps) if last is None else last
        probe = (last is None and block.tokens.device.type in PROBE_DEVICES
                 and self.settings.remasking_strategy in DATA_DEPENDENT_STEPS)
        for step in range(first, steps):
            logits = self.logits(block, step)
            shape = tuple(logits.shape)
            noise = draw_noise(self.settings, shape, self.state.generator, logits.device,
                               [planned > step for planned in row_steps])
            denoise_step(block, logits, self.settings, self.mask_id, self.state.generator, noise,
                         quota=None if quotas is None else quotas[step],
                         fraction=None if fractions is None else fractions[step])
            if probe and step + 1 < steps and not bool(masks_left(block, self.mask_id).any()):
                for later in range(step + 1, steps):
                    draw_noise(self.settings, shape, self.state.generator, logits.device,
                               [planned > later for planned in row_steps])
                break

    def select_rows(self, state, rows: torch.Tensor) -> None:
        """Follow the working batch after finished rows left it (``rows``: the kept rows of the old batch)."""
        self.state = state
        if self.cache is not None:
            self.cache.select_rows(rows)
