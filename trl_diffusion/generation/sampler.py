"""Block-wise diffusion decoding for every family: the loop that walks a batch through its states and
records the trajectory (``unmask_step``) and the sampler's per-token log-probs."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ..models.cache import DiffusionCache
from ..states import NOT_COMMITTED, CanvasLayout, attention_mask_from_positions
from .sampling import (
    REMASKING_STRATEGIES,
    Generators,
    confidence_scores,
    sample_tokens,
    select_commits,
    uniform,
    uniform_quota,
)

CACHE_MODES = ("none", "exact", "prefix", "dual")


@dataclass
class DiffusionGenerationOutput(ModelOutput):
    """``sequences``: left-padded prompt + completion (right-padded with the pad token).
    ``unmask_step``: per position, the row's denoising step that committed it (-1: prompt, padding, never).
    ``token_logprobs``: log-prob of each committed token under the sampling distribution at its step (0 else).
    ``num_forward_passes``: model calls for the batch. ``tokens_per_step``: per row, generated tokens / steps.
    ``denoising_steps``: per row, the number of denoising steps it took."""

    sequences: torch.LongTensor | None = None
    unmask_step: torch.LongTensor | None = None
    token_logprobs: torch.FloatTensor | None = None
    num_forward_passes: int | None = None
    tokens_per_step: torch.FloatTensor | None = None
    denoising_steps: torch.LongTensor | None = None


@dataclass
class SamplingSettings:
    """Resolved, validated decoding settings (see ``DiffusionGenerationMixin.generate`` for their meaning)."""

    max_new_tokens: int
    block_length: int
    denoising_steps: int
    remasking_strategy: str = "low_confidence_static"
    confidence_threshold: float | None = None
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    cache_mode: str = "none"
    stop_token_ids: tuple[int, ...] = ()
    schedule: str = "uniform"
    eps: float = 1e-3
    alg_temp: float | None = None
    cfg_scale: float = 0.0
    gumbel_float64: bool = False
    pad_token_id: int = 0

    def validate(self) -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}.")
        if self.block_length <= 0:
            raise ValueError(f"block_length must be positive, got {self.block_length}.")
        if self.denoising_steps <= 0:
            raise ValueError(f"denoising_steps must be positive, got {self.denoising_steps}.")
        if self.schedule == "uniform" and self.denoising_steps > self.block_length:
            raise ValueError(
                f"denoising_steps ({self.denoising_steps}) exceeds block_length ({self.block_length}): a step "
                "would commit no token."
            )
        if self.remasking_strategy not in REMASKING_STRATEGIES:
            raise ValueError(
                f"unknown remasking_strategy {self.remasking_strategy!r}; choose one of {REMASKING_STRATEGIES}."
            )
        if self.remasking_strategy == "low_confidence_dynamic" and self.confidence_threshold is None:
            raise ValueError("remasking_strategy='low_confidence_dynamic' needs confidence_threshold.")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {self.cache_mode!r}; choose one of {CACHE_MODES}.")
        if not 0 <= self.temperature < math.inf:  # NaN fails every comparison
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}.")
        if self.top_k is not None and (not isinstance(self.top_k, numbers.Integral) or self.top_k < 0):
            raise ValueError(f"top_k must be an integer >= 0 (0 or None = no top-k filtering), got {self.top_k!r}.")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.confidence_threshold is not None and not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold must lie in [0, 1], got {self.confidence_threshold}.")
        if self.alg_temp is not None and not 0 <= self.alg_temp < math.inf:
            raise ValueError(f"alg_temp must be finite and >= 0, got {self.alg_temp}.")
        if not 0 <= self.eps < 1:
            raise ValueError(f"eps must lie in [0, 1), got {self.eps}.")
        if not 0 <= self.cfg_scale < math.inf:
            raise ValueError(f"cfg_scale must be finite and >= 0, got {self.cfg_scale}.")
        if self.cfg_scale and self.cache_mode != "none":
            raise ValueError("classifier-free guidance (cfg_scale > 0) runs without a KV cache.")


class _Forward:
    """Runs the model on some canvas columns, with the mask those columns need and an optional cache."""

    def __init__(self, model, canvas, positions, valid, attention_block, settings, prompt_cols):
        self.model, self.canvas, self.positions, self.valid = model, canvas, positions, valid
        self.attention_block = attention_block
        self.cfg_scale = settings.cfg_scale
        self.prompt_cols = prompt_cols
        self.mask_id = model.mask_token_id
        self.calls = 0

    def __call__(self, cols: torch.Tensor, cache: DiffusionCache | None = None, cache_cols=None, store=False):
        key_cols = cols if cache_cols is None else torch.cat([cache_cols, cols])
        q_pos = self.positions[:, cols]
        key_valid = self.valid[:, key_cols]
        if self.attention_block is None and bool(key_valid.all()):
            mask = None
        else:
            mask = attention_mask_from_positions(q_pos, self.positions[:, key_cols], key_valid, self.attention_block)
        ids = self.canvas[:, cols]
        self.calls += 1
        if not self.cfg_scale:
            return self.model(input_ids=ids, attention_mask=mask, position_ids=q_pos, past_key_values=cache,
                              store_kv=store).logits
        unconditional = ids.masked_fill(self.prompt_cols[:, cols], self.mask_id)
        both = self.model(
            input_ids=torch.cat([ids, unconditional]),
            attention_mask=None if mask is None else torch.cat([mask, mask]),
            position_ids=torch.cat([q_pos, q_pos]),
        ).logits
        cond, uncond = both.chunk(2)
        return uncond + (self.cfg_scale + 1) * (cond - uncond)


def diffusion_generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, settings: SamplingSettings,
    generator: Generators = None,
) -> DiffusionGenerationOutput:
    """Decode ``max_new_tokens`` per row block by block; see ``DiffusionGenerationMixin.generate``."""
    settings.validate()
    attention_mask = check_generation_inputs(model, input_ids, attention_mask, settings, generator)
    device = input_ids.device
    mask_id = model.mask_token_id
    if bool((input_ids.eq(mask_id) & attention_mask).any()):
        raise ValueError(f"the prompt contains the mask token (id {mask_id}); remove it before generating.")
    lengths = attention_mask.sum(-1).tolist()
    if min(lengths) == 0:
        raise ValueError("a prompt is empty (its attention_mask is all zeros).")
    block_causal = model.block_size is not None
    if block_causal and settings.cache_mode in ("prefix", "dual"):
        raise ValueError(f"cache mode {settings.cache_mode!r} is for full-attention models; SDAR's cache is exact.")
    if not block_causal and settings.cache_mode == "exact":
        raise ValueError("the exact KV cache needs block-causal attention; use 'prefix' or 'dual' for this model.")
    layout = CanvasLayout(lengths, settings.max_new_tokens, settings.block_length, block_causal)
    max_positions = _max_positions(model.config)
    longest = max(lengths) + settings.max_new_tokens + (settings.block_length if block_causal else 0)
    if max_positions is not None and longest > max_positions:
        raise ValueError(
            f"prompt ({max(lengths)} tokens) + max_new_tokens ({settings.max_new_tokens}) exceeds the model's "
            f"{max_positions} positions."
        )

    batch = input_ids.shape[0]
    generated, valid = layout.masks(device)
    positions = layout.positions(device)
    canvas = torch.full((batch, layout.width), settings.pad_token_id, dtype=torch.long, device=device)
    prompt_cols = torch.zeros_like(generated)
    for row in range(batch):
        prompt = input_ids[row][attention_mask[row]]
        canvas[row, layout.left_pad[row] : layout.gen_start[row]] = prompt
        prompt_cols[row, layout.left_pad[row] : layout.gen_start[row]] = True
    canvas[generated] = mask_id
    unmask_step = torch.full_like(canvas, NOT_COMMITTED)
    logprobs = torch.zeros(canvas.shape, dtype=torch.float32, device=device)
    steps_taken = torch.zeros(batch, dtype=torch.long, device=device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=device)
    stop_ids = torch.tensor(list(settings.stop_token_ids) or [-1], device=device)
    shift = 1 if model.logits_shift else 0
    attention_block = settings.block_length if block_causal else None
    forward = _Forward(model, canvas, positions, valid, attention_block, settings, prompt_cols)
    all_cols = torch.arange(layout.width, device=device)

    cache, cache_cols = None, None
    if settings.cache_mode == "exact":
        cache, cache_cols = DiffusionCache(), all_cols[: layout.prefill_end]
        if layout.prefill_end > 0:
            forward(cache_cols, cache, None, store=True)

    for start in layout.block_starts:
        end = layout.block_end(start)
        block = all_cols[start:end]
        active = ~stopped & (generated[:, start:end] & canvas[:, start:end].eq(mask_id)).any(-1)
        if not bool(active.any()):
            break
        if settings.cache_mode in ("prefix", "dual"):
            live_end = end if settings.cache_mode == "dual" else layout.width
            live = all_cols[start - shift : live_end]
            outside = torch.cat([all_cols[: start - shift], all_cols[live_end:]])
            cache = DiffusionCache()
            first_logits = forward(all_cols, cache, None, store=True)
            cache.keep_columns(outside)
            cache_cols = outside
        quotas = uniform_quota(end - start, settings.denoising_steps) if settings.schedule == "uniform" else None
        timesteps = torch.linspace(1, settings.eps, settings.denoising_steps + 1)
        for step in range(settings.denoising_steps):
            masked = generated[:, start:end] & canvas[:, start:end].eq(mask_id) & active[:, None]
            if not bool(masked.any()):
                break
            step_generator = _drawing_rows(generator, masked.any(-1))
            if settings.cache_mode == "exact":
                raw = forward(block, cache, cache_cols)
                logits = raw
            elif settings.cache_mode in ("prefix", "dual"):
                raw = first_logits[:, start - shift :] if step == 0 else forward(live, cache, cache_cols)
                logits = raw[:, : end - start + shift]
                logits = logits[:, :-1] if shift else logits
            else:
                raw = forward(all_cols[:end] if block_causal else all_cols)
                logits = raw[:, start - shift : end - shift]
            tokens, token_lp, log_dist = sample_tokens(
                logits, settings.temperature, settings.top_k, settings.top_p, step_generator, settings.gumbel_float64,
                mask_id,
            )
            if settings.schedule == "linspace":
                # Dream computes the fraction in float32 from a float32 linspace; keep that for parity
                last = step == settings.denoising_steps - 1
                fraction = torch.ones(()) if last else 1 - timesteps[step + 1] / timesteps[step]
                if settings.remasking_strategy == "origin":
                    draw = uniform(masked.shape, step_generator, device)
                    commit = masked & (draw < float(fraction))
                else:
                    quota = (masked.sum(-1).float() * fraction.to(device)).long()
                    confidence = confidence_scores(settings.remasking_strategy, token_lp, log_dist, step_generator)
                    commit = select_commits("low_confidence_static", confidence, masked, quota,
                                            alg_temp=settings.alg_temp, generator=step_generator)
            else:
                quota = torch.full((batch,), quotas[step], device=device)
                confidence = confidence_scores(settings.remasking_strategy, token_lp, log_dist, step_generator)
                commit = select_commits(settings.remasking_strategy, confidence, masked, quota,
                                        settings.confidence_threshold, settings.alg_temp, step_generator)
            region = canvas[:, start:end]
            canvas[:, start:end] = torch.where(commit, tokens, region)
            row_step = steps_taken[:, None].expand_as(commit)
            unmask_step[:, start:end] = torch.where(commit, row_step, unmask_step[:, start:end])
            logprobs[:, start:end] = torch.where(commit, token_lp, logprobs[:, start:end])
            steps_taken += masked.any(-1).long()
        if settings.cache_mode == "exact":
            forward(block, cache, cache_cols, store=True)
            cache_cols = torch.cat([cache_cols, block])
        block_done = generated[:, : end] & ~canvas[:, : end].eq(mask_id)
        hit_stop = (torch.isin(canvas[:, :end], stop_ids) & block_done).any(-1)
        stopped |= hit_stop & active

    return _to_output(input_ids, attention_mask, layout, canvas, generated, unmask_step, logprobs, steps_taken,
                      forward.calls, mask_id, settings.pad_token_id)


def check_generation_inputs(model, input_ids, attention_mask, settings: SamplingSettings,
                            generator: Generators) -> torch.Tensor:
    """Raise a ValueError naming the argument for inputs the model would fail on (or silently misread) inside
    torch; returns the attention mask as booleans (all True when none is given)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {type(input_ids).__name__}"
                         f"{f' of {input_ids.dtype}' if isinstance(input_ids, torch.Tensor) else ''}.")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, prompt length], got shape {tuple(input_ids.shape)}"
                         f"{'; use input_ids[None] for one prompt' if input_ids.dim() == 1 else ''}.")
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); give at least one non-empty prompt.")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    elif not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, got {shape}.")
    attention_mask = attention_mask.bool()
    vocab = model.get_input_embeddings().num_embeddings
    used = input_ids[attention_mask]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= vocab):
        bad = used[(used < 0) | (used >= vocab)]
        raise ValueError(f"input_ids holds token ids outside [0, {vocab}) (the model's vocabulary), e.g. "
                         f"{bad[:5].tolist()}.")
    if not 0 <= settings.pad_token_id < vocab:
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab}), got {settings.pad_token_id}.")
    if isinstance(generator, (list, tuple)) and len(generator) != input_ids.shape[0]:
        raise ValueError(f"generator is a list of {len(generator)} generators for {input_ids.shape[0]} prompts; "
                         "give one per prompt (or a single generator).")
    return attention_mask
def _drawing_rows(generator: Generators, has_masks: torch.Tensor) -> Generators:
    """Per-row generators for one step: a row with nothing left to commit draws from a throwaway generator, so
    its own generator advances only on the steps it takes, as it would alone (not in step with its batch)."""
    if not isinstance(generator, (list, tuple)):
        return generator
    return [g if drawing else torch.Generator() for g, drawing in zip(generator, has_masks.tolist())]


def _max_positions(config) -> int | None:
    return getattr(config, "max_position_embeddings", None) or getattr(config, "max_sequence_length", None)


def _to_output(input_ids, attention_mask, layout, canvas, generated, unmask_step, logprobs, steps_taken, calls,
               mask_id, pad_id) -> DiffusionGenerationOutput:
    """Lay the canvas back out as ``[input as given | completion | right padding]``."""
    batch, prompt_width = input_ids.shape
    completion_lengths = [end - start for start, end in zip(layout.gen_start, layout.gen_end)]
    width = prompt_width + max(completion_lengths)
    device = input_ids.device
    sequences = torch.full((batch, width), pad_id, dtype=torch.long, device=device)
    steps = torch.full_like(sequences, NOT_COMMITTED)
    lps = torch.zeros(sequences.shape, dtype=torch.float32, device=device)
    sequences[:, :prompt_width] = input_ids
    for row in range(batch):
        s, e = layout.gen_start[row], layout.gen_end[row]
        n = e - s
        committed = unmask_step[row, s:e] >= 0
        sequences[row, prompt_width : prompt_width + n] = torch.where(committed, canvas[row, s:e], pad_id)
        steps[row, prompt_width : prompt_width + n] = unmask_step[row, s:e]
        lps[row, prompt_width : prompt_width + n] = logprobs[row, s:e]
    n_generated = (steps >= 0).sum(-1)
    tokens_per_step = n_generated.float() / steps_taken.clamp(min=1).float()
    return DiffusionGenerationOutput(
        sequences=sequences,
        unmask_step=steps,
        token_logprobs=lps,
        num_forward_passes=calls,
        tokens_per_step=tokens_per_step,
        denoising_steps=steps_taken,
    )


def steps_for_dream(total_steps: int, max_new_tokens: int, block_length: int) -> int:
    """Dream's ``steps`` counts the whole generation; convert it to steps per block."""
    blocks = math.ceil(max_new_tokens / block_length)
    if total_steps % blocks:
        raise ValueError(f"steps ({total_steps}) must be divisible by the number of blocks ({blocks}).")
    return total_steps // blocks
