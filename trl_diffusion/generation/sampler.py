"""Block-wise diffusion decoding for every family: the loop that walks a batch through its states and
records the trajectory (``unmask_step``) and the sampler's per-token log-probs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput, logging

from ..mask_token import mask_token_name
from ..states import NOT_COMMITTED, CanvasLayout, max_positions
from ..synced_forwards import needs_synced_forwards, synced_forwards
from ..vocabulary import check_mask_token_id, embedding_rows
from .cuda_graphs import GraphRunner, cuda_graph_capturable, runner_class, spread_over_devices
from .denoise import Block, BlockSchedule, ModelRunner
from .peft_rows import WorkingRows, follow_working_rows, per_row_adapter_names
from .sampling import MIN_TEMPERATURE, REMASKING_STRATEGIES, Generators, check_sampling_filters, checked_cfg_scale

logger = logging.get_logger(__name__)

CACHE_MODES = ("none", "exact", "prefix", "dual")
CUDA_GRAPH_MODES = ("auto", "off")


def check_cuda_graphs(name: str, value) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is one of ``CUDA_GRAPH_MODES``. A bool gets its own hint:
    ``False`` reads as "off" but is not taken as it (YAML turns an unquoted ``off`` into False)."""
    if value in CUDA_GRAPH_MODES and isinstance(value, str):
        return
    hint = (" (the strings; an unquoted off in a YAML file is read as False: quote it)"
            if isinstance(value, bool) else "")
    raise ValueError(f"{name} must be one of {CUDA_GRAPH_MODES}{hint}, got {value!r}.")


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
    raw_confidence: bool = False
    top_p_first: bool = False
    pad_token_id: int = 0
    cuda_graphs: str = "auto"

    @property
    def draws_randomness(self) -> bool:
        """Whether a step draws random numbers (sampling, random commit rules)."""
        origin = self.remasking_strategy == "origin" and self.schedule == "linspace"
        return bool(self.temperature or self.alg_temp or origin or self.remasking_strategy == "random")

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
        if self.schedule == "linspace" and self.remasking_strategy in ("sequential", "low_confidence_dynamic"):
            raise ValueError(
                f"remasking_strategy={self.remasking_strategy!r} does not go with Dream's `steps` / `alg` (linspace "
                "schedule, which commits a fraction of the masks by confidence); use denoising_steps instead."
            )
        if self.remasking_strategy == "origin" and self.schedule != "linspace":
            raise ValueError(
                "remasking_strategy='origin' is Dream's random commit rule over its linspace schedule: pass "
                "alg='origin' and steps (over the whole generation) instead; with denoising_steps per block use "
                "'random' or a confidence strategy."
            )
        if self.remasking_strategy == "low_confidence_dynamic" and self.confidence_threshold is None:
            raise ValueError("remasking_strategy='low_confidence_dynamic' needs confidence_threshold.")
        if self.cache_mode not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {self.cache_mode!r}; choose one of {CACHE_MODES}.")
        check_sampling_filters(self.temperature, self.top_k, self.top_p, zero_means="greedy")
        if self.confidence_threshold is not None and not 0 <= self.confidence_threshold <= 1:
            raise ValueError(f"confidence_threshold must lie in [0, 1], got {self.confidence_threshold}.")
        if self.alg_temp is not None and not 0 <= self.alg_temp < math.inf:
            raise ValueError(f"alg_temp must be finite and >= 0, got {self.alg_temp}.")
        if self.alg_temp is not None and 0 < self.alg_temp < MIN_TEMPERATURE:
            raise ValueError(f"alg_temp must be 0 (none) or at least {MIN_TEMPERATURE}, got {self.alg_temp}.")
        if self.alg_temp and self.remasking_strategy == "sequential":
            raise ValueError(f"alg_temp ({self.alg_temp}) has no effect with remasking_strategy='sequential' (it "
                             "commits the leftmost masks, not by confidence); drop alg_temp or pick another strategy.")
        if not 0 <= self.eps < 1:
            raise ValueError(f"eps must lie in [0, 1), got {self.eps}.")
        checked_cfg_scale(self.cfg_scale)  # generate() and replay_logprobs' rule
        check_cuda_graphs("cuda_graphs", self.cuda_graphs)
        if self.cfg_scale and self.cache_mode != "none":
            raise ValueError("classifier-free guidance (cfg_scale > 0) runs without a KV cache, which the call asks "
                             "for: pass use_cache=False (or leave it unset).")


@dataclass
class _Canvas:
    """The working batch: per-row canvas, trajectory and stop state ``[rows, width]`` plus the layout tensors.
    Rows that cannot commit anything more may leave it (``select``); ``rows`` maps working rows to batch rows."""

    rows: list[int]
    canvas: torch.Tensor
    unmask_step: torch.Tensor
    logprobs: torch.Tensor
    steps_taken: torch.Tensor
    stopped: torch.Tensor
    generated: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    prompt_cols: torch.Tensor
    gen_start: torch.Tensor
    gen_end: torch.Tensor
    generator: Generators
    padded: bool

    RESULTS = ("canvas", "unmask_step", "logprobs", "steps_taken", "stopped")
    PER_ROW = RESULTS + ("generated", "valid", "positions", "prompt_cols", "gen_start", "gen_end")

    def select(self, keep: list[int], into: _Canvas) -> _Canvas:
        """Write this batch's results into ``into`` (the full batch), then keep only the working rows ``keep``."""
        self.write_into(into)
        index = torch.tensor(keep, device=self.canvas.device)
        kept = {name: getattr(self, name).index_select(0, index) for name in self.PER_ROW}
        generator = [self.generator[i] for i in keep] if isinstance(self.generator, (list, tuple)) else self.generator
        return _Canvas(rows=[self.rows[i] for i in keep], generator=generator, padded=self.padded, **kept)

    def write_into(self, full: _Canvas) -> None:
        if full is self:
            return
        index = torch.tensor(self.rows, device=self.canvas.device)
        for name in self.RESULTS:
            getattr(full, name)[index] = getattr(self, name)


def _initial_canvas(input_ids, attention_mask, layout, mask_id, pad_id, generator) -> _Canvas:
    device = input_ids.device
    batch = input_ids.shape[0]
    generated, valid = layout.masks(device)
    canvas = torch.full((batch, layout.width), pad_id, dtype=torch.long, device=device)
    # the k-th real token of a row goes to column left_pad + k (one gather of the indices: setup, not the loop)
    rows, cols = attention_mask.nonzero(as_tuple=True)
    rank = attention_mask.long().cumsum(-1)[rows, cols] - 1
    dest = torch.tensor(layout.left_pad, device=device)[rows] + rank
    canvas[rows, dest] = input_ids[rows, cols]
    prompt_cols = torch.zeros_like(generated)
    prompt_cols[rows, dest] = True
    canvas.masked_fill_(generated, mask_id)
    return _Canvas(
        rows=list(range(batch)), canvas=canvas, unmask_step=torch.full_like(canvas, NOT_COMMITTED),
        logprobs=torch.zeros(canvas.shape, dtype=torch.float32, device=device),
        steps_taken=torch.zeros(batch, dtype=torch.long, device=device),
        stopped=torch.zeros(batch, dtype=torch.bool, device=device), generated=generated, valid=valid,
        positions=layout.positions(device), prompt_cols=prompt_cols,
        gen_start=torch.tensor(layout.gen_start, device=device), gen_end=torch.tensor(layout.gen_end, device=device),
        generator=generator, padded=any(layout.left_pad) or len(set(layout.gen_end)) > 1,
    )


COMPACT_BELOW = 0.75
"""Finished rows leave the working batch once the rows still decoding are at most this fraction of it (unless
one generator shared by all rows draws random numbers: its stream would shift)."""


def diffusion_generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, settings: SamplingSettings,
    generator: Generators = None, synced_gpus: bool | None = None,
) -> DiffusionGenerationOutput:
    """Decode ``max_new_tokens`` per row block by block; see ``DiffusionGenerationMixin.generate``.

    The host touches the device's results at most once per block (the per-row stop flags, and only when there
    are stop tokens): the number of steps of a block follows from the layout and the schedule, and everything
    that depends on model outputs stays on the device as per-row masks."""
    if settings.cuda_graphs not in ("auto", "off") and not cuda_graph_capturable(model):
        raise ValueError(f"cuda_graphs={settings.cuda_graphs!r}: {type(model).__name__} cannot be captured as a CUDA "
                         "graph (its mixture-of-experts dispatch reads on the host which experts got tokens); pass "
                         "cuda_graphs='off', or 'auto', which decodes it eagerly.")
    settings.validate()
    attention_mask = check_generation_inputs(model, input_ids, attention_mask, settings, generator)
    input_ids = input_ids.long()  # int32 / uint8 prompts, as transformers takes them; the canvas is int64
    device = input_ids.device
    mask_id = check_mask_token_id(model)
    if bool((input_ids.eq(mask_id) & attention_mask).any()):
        raise ValueError(f"the prompt contains {mask_token_name(mask_id)}, which the model would read as a position "
                         "to fill; remove it before generating.")
    lengths = attention_mask.sum(-1).tolist()
    if min(lengths) == 0:
        raise ValueError("a prompt is empty (its attention_mask is all zeros).")
    block_causal = model.block_size is not None
    if block_causal and settings.cache_mode in ("prefix", "dual"):
        raise ValueError(f"cache mode {settings.cache_mode!r} is for full-attention models; SDAR's cache is exact.")
    if not block_causal and settings.cache_mode == "exact":
        raise ValueError("the exact KV cache needs block-causal attention; use 'prefix' or 'dual' for this model.")
    layout = CanvasLayout(lengths, settings.max_new_tokens, settings.block_length, block_causal)
    model_positions = max_positions(model.config)
    longest = max(layout.row_positions())
    if model_positions is not None and longest > model_positions:
        raise ValueError(
            f"prompt ({max(lengths)} tokens) + max_new_tokens ({settings.max_new_tokens}) "
            f"{'rounded up to whole blocks ' if block_causal else ''}needs {longest} positions; the model has "
            f"{model_positions}."
        )

    full = state = _initial_canvas(input_ids, attention_mask, layout, mask_id, settings.pad_token_id, generator)
    synced = needs_synced_forwards(model) if synced_gpus is None else synced_gpus
    if synced and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        raise ValueError("synced_gpus=True keeps the processes' forwards in step; it needs an initialised "
                         "torch.distributed process group.")
    runner_type = runner_class(settings, device, generator)
    if issubclass(runner_type, GraphRunner) and (synced or spread_over_devices(model)):
        runner_type = ModelRunner  # a captured step would copy between devices, or hold the processes' collectives
    if issubclass(runner_type, GraphRunner) and not cuda_graph_capturable(model):
        logger.info_once(f"cuda_graphs='auto': {type(model).__name__} decodes eagerly (its mixture-of-experts "
                         "dispatch depends on the data, which a CUDA graph cannot capture).")
        runner_type = ModelRunner
    if issubclass(runner_type, GraphRunner) and per_row_adapter_names(model):
        logger.info_once("cuda_graphs='auto': a mixed-adapter batch (adapter_names) decodes eagerly (a captured step "
                         "would keep one batch's adapter names).")
        runner_type = ModelRunner
    runner = runner_type(model, settings, state, block_causal)
    # one generator shared by the rows draws for every row of the batch: dropping rows would shift its stream
    compactable = isinstance(generator, (list, tuple)) or not settings.draws_randomness
    with (synced_forwards(model, synced, input_ids[:1, -1:]),
          follow_working_rows(model, len(state.rows), issubclass(runner_type, GraphRunner)) as working):
        runner.prefill(layout.prefill_end)
        state = _decode_blocks(state, full, runner, layout, settings, compactable, working)
    state.write_into(full)
    return _to_output(input_ids, layout, full.canvas, full.unmask_step, full.logprobs, full.steps_taken, runner.calls,
                      settings.pad_token_id)


def _decode_blocks(state: _Canvas, full: _Canvas, runner, layout: CanvasLayout, settings: SamplingSettings,
                   compactable: bool, working: WorkingRows) -> _Canvas:
    """Run the blocks in order; finished rows leave the working batch (``working`` follows it). Returns the
    working batch at the end."""
    mask_id = runner.mask_id
    device = state.canvas.device
    stop_ids = torch.tensor(list(settings.stop_token_ids), device=device) if settings.stop_token_ids else None
    schedule = BlockSchedule(settings)
    for start in layout.block_starts:
        end = layout.block_end(start)
        masks = [max(0, min(layout.gen_end[r], end) - max(layout.gen_start[r], start)) for r in state.rows]
        stopped = state.stopped.tolist() if stop_ids is not None else [False] * len(masks)  # once per block
        live = [m > 0 and not s for m, s in zip(masks, stopped)]
        if not any(live):
            break
        if compactable and sum(live) <= COMPACT_BELOW * len(live):
            keep = [i for i, alive in enumerate(live) if alive]
            state = state.select(keep, full)
            runner.select_rows(state, torch.tensor(keep, device=device))
            working.rows = state.rows
            masks, live = [masks[i] for i in keep], [True] * len(keep)
        row_steps = [schedule.steps_needed(m, end - start) if alive else 0 for m, alive in zip(masks, live)]
        block = Block(
            start=start, end=end, tokens=state.canvas[:, start:end], generated=state.generated[:, start:end],
            unmask_step=state.unmask_step[:, start:end], logprobs=state.logprobs[:, start:end],
            steps_taken=state.steps_taken,
            active=~state.stopped & (state.gen_start < end) & (state.gen_end > start),
        )
        runner.run_block(block, row_steps, schedule.quotas(end - start), schedule.fractions)
        if stop_ids is not None:
            done = block.generated & block.tokens.ne(mask_id)
            hit = (block.tokens[..., None] == stop_ids).any(-1) & done
            state.stopped |= hit.any(-1) & block.active
    return state


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
    vocab = embedding_rows(model)
    used = input_ids[attention_mask]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= vocab):
        bad = used[(used < 0) | (used >= vocab)]
        raise ValueError(f"input_ids holds token ids outside [0, {vocab}) (the model's vocabulary), e.g. "
                         f"{bad[:5].tolist()}.")
    if not 0 <= settings.pad_token_id < vocab:
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab}), got {settings.pad_token_id}.")
    unreachable = [i for i in settings.stop_token_ids if not 0 <= i < vocab]
    if unreachable:  # the model can never produce them: no row would ever stop on them
        raise ValueError(f"stop token ids {unreachable} (stop_token_ids / eos_token_id, from the call or the "
                         f"generation_config) are not token ids of this model, [0, {vocab}): another model's ids?")
    if isinstance(generator, (list, tuple)) and len(generator) != input_ids.shape[0]:
        raise ValueError(f"generator is a list of {len(generator)} generators for {input_ids.shape[0]} returned rows "
                         "(prompts x num_return_sequences); give one per returned row (or a single generator).")
    return attention_mask


def _to_output(input_ids, layout, canvas, unmask_step, logprobs, steps_taken, calls,
               pad_id) -> DiffusionGenerationOutput:
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
    for name, value in (("steps", total_steps), ("max_new_tokens", max_new_tokens), ("block_length", block_length)):
        if value <= 0:  # 0 is not "unset": the caller's steps=0 used to become the config's (Dream's 512)
            raise ValueError(f"{name} must be positive, got {value}.")
    blocks = math.ceil(max_new_tokens / block_length)
    if total_steps % blocks:
        raise ValueError(f"steps ({total_steps}) must be divisible by the number of blocks ({blocks}).")
    return total_steps // blocks
