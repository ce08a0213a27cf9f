"""``DiffusionSFTConfig``: ``trl.SFTConfig`` plus the diffusion objective and its noise settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import SFTConfig

from ..models.kernels import FUSED_KERNELS_HELP
from ..states import (
    ATTENTION_BACKENDS,
    check_attention_backend,
    check_field_types,
    check_max_steps,
    check_no_liger_kernel,
    check_optimization_numbers,
    take_checkpointing_old_name,
)
from .diffusion_losses import (
    LOSS_NORMALIZATIONS,
    LOSS_WEIGHTINGS,
    MASK_RATIO_SAMPLING,
    OBJECTIVES,
    PACKED_OBJECTIVES,
    PER_TOKEN_OBJECTIVES,
)

OVERLONG_POLICIES = ("truncate", "error")
NONE_STRINGS = ("None", "none")
"""``diffusion_objective`` strings that mean None (the command line passes ``--diffusion_objective None`` as text)."""


EOS_PADDING_LENGTHS = ("max_length", "longest")
"""How far ``pad_to_length_with_eos`` pads: to ``max_length``, or to the micro-batch's longest sequence."""
MASK_EPS_DEFAULT = 1e-3
"""``mask_eps``'s default (another value with ``mask_ratio_range`` or ``trajectory`` would be ignored)."""


@dataclass
class DiffusionSFTConfig(SFTConfig):
    """Configuration for [`DiffusionSFTTrainer`]. Only the diffusion-specific fields are listed; every
    [`trl.SFTConfig`] field keeps its meaning.

    Args:
        diffusion_objective (`str` or `None`, *optional*):
            `"block"` (SDAR / BD3-LM: noisy and clean copies in one forward), `"random_masking"` (LLaDA / Dream
            masked-diffusion ELBO), `"semi_ar"` (full-attention semi-autoregressive blocks), `"complementary"`
            (a mask and its complement), or `"trajectory"` (the states a recorded rollout visited; needs an
            `unmask_step` column). `None` (also the strings `"None"` / `"none"`, as the command line passes it)
            picks `"block"` for block-causal models and `"random_masking"` otherwise.
        loss_weighting (`str`, *optional*, defaults to `"elbo"`):
            `"elbo"` weights each masked token by 1/t (t = its mask ratio); `"none"` weights all by 1.
        mask_eps (`float`, *optional*, defaults to `1e-3`):
            Smallest mask ratio: t = eps + (1 - eps) u with u ~ U(0, 1). Must lie in (0, 0.5); another value with
            `mask_ratio_range` or the `"trajectory"` objective (which do not read it) is an error.
        mask_ratio_range (`list[float]` or `None`, *optional*):
            `[low, high]` with 0 < low <= high <= 1 (`complementary`: high < 1): draw mask ratios from U(low, high)
            instead of U(mask_eps, 1) (`complementary`: U(mask_eps, 1 - mask_eps)). dLLM-RL's SFT uses `[0.1, 0.9]`.
        mask_ratio_sampling (`str`, *optional*, defaults to `"per_sample"`):
            `"per_sample"`: one ratio t per sample (per block for `semi_ar`); `"per_token"`: each completion token
            masked with its own probability (dLLM-RL's SFT of block models and its `semi_ar`); needs
            `loss_weighting="none"`.
        loss_normalization (`str`, *optional*, defaults to `"tokens"`):
            `"tokens"`: TRL's (summed loss / the accumulated batch's loss tokens); per-row means: each training
            row's summed loss divided by its masked tokens (`"row_masked"`, dLLM-RL's full-attention SFT), by its
            sample's loss tokens (`"row_tokens"`, LLaDA's SFT) or by `loss_normalization_length` (`"row_length"`,
            dLLM-RL's block SFT), averaged over rows (`"row_masked"` / `"row_length"`: those with a scored token) and
            accumulation steps.
        loss_normalization_length (`int` or `None`, *optional*):
            `"row_length"`'s divisor (>= 1): dLLM-RL's block SFT divides every row by its dataset's padded response
            length, the longest response capped at `max_gen_length` (2000 in its long-CoT config).
        exclude_mask_token_from_softmax (`bool`, *optional*, defaults to `True`):
            Leave the mask token out of the loss's softmax; `False` scores over the whole vocabulary, as the
            released SFT code does.
        block_size (`int` or `None`, *optional*):
            Block size (>= 1) for block-causal models; an error on full-attention models. `None` uses the model's;
            another value retrains the model at that block size and is written to `model.config.block_size`.
        semi_ar_block_length (`int`, *optional*, defaults to `32`):
            Length (>= 1) of the semi-autoregressive blocks of `"semi_ar"` (counted from the end of the prompt).
        trajectory_shrinkage (`int`, *optional*, defaults to `1`):
            `"trajectory"`: merge this many (>= 1) consecutive denoising steps into one training state (within each
            block for block-causal models, as TraceRL).
        scoring_token_budget (`int` or `None`, *optional*):
            Most padded tokens (>= 1) per training forward. The rows the objective builds from a micro-batch
            (`semi_ar` and `trajectory` build several per sample) are cut into forwards of at most this many tokens
            (a longer row alone); in training each is back-propagated before the next runs, so activation memory
            is that of one forward and the gradient is unchanged. `None`: one forward per micro-batch (TRL's).
        recompute_scoring_forwards (`bool`, *optional*, defaults to `False`):
            With `scoring_token_budget`: instead of a backward per forward, one backward per micro-batch (as TRL),
            each forward checkpointed as a whole and run again in it, one at a time: the same gradient and
            activation memory, one more forward each, and usable where a backward must run once per micro-batch
            (DeepSpeed ZeRO-1/2/3, LOMO, layer-wise optimizers). Not with FSDP.
        pad_to_length_with_eos (`bool`, *optional*, defaults to `False`):
            Pad every sequence with EOS up to `max_length` and train on the padding (LLaDA SFT), so the model
            learns to end answers on a fixed-length canvas.
        eos_padding_length (`str`, *optional*, defaults to `"max_length"`):
            With `pad_to_length_with_eos`: pad to `max_length`, or to the longest sequence of the micro-batch
            (`"longest"`, as LLaDA's SFT pads its mini-batch).
        overlong_policy (`str`, *optional*, defaults to `"truncate"`):
            What to do with a sequence longer than `max_length`: `"truncate"` (as `truncation_mode` says) or
            `"error"`.
        attention_backend (`str`, *optional*, defaults to `"auto"`):
            How training attention masks are built: `"flex"` (a flex-attention `BlockMask`, no dense mask),
            `"sdpa"` (a dense boolean mask), or `"auto"` (flex on CUDA for half precision and head_dim
            64/128/256, SDPA otherwise; `states.resolve_attention_backend`).
        fused_kernels (`bool`, *optional*, defaults to `False`):
            Compile the layers' elementwise chains (RMSNorm, residual add + norm, RoPE, SwiGLU) into fused kernels
            with `torch.compile` (`models.set_fused_kernels`), for training forwards and `generate()`. Half-precision
            values differ from eager in their last bits; the first calls compile (seconds).
    """

    diffusion_objective: str | None = field(
        default=None,
        metadata={
            "help": "Diffusion SFT objective: 'block', 'random_masking', 'semi_ar', 'complementary' or "
            "'trajectory'. None (also 'none') picks 'block' for block-causal models and 'random_masking' otherwise.",
            "choices": [*NONE_STRINGS, *OBJECTIVES],
        },
    )
    loss_weighting: str = field(
        default="elbo",
        metadata={"help": "'elbo' weights each masked token by 1/t (its mask ratio); 'none' by 1.",
                  "choices": list(LOSS_WEIGHTINGS)},
    )
    mask_eps: float = field(
        default=MASK_EPS_DEFAULT,
        metadata={"help": "Smallest mask ratio, in (0, 0.5): t = eps + (1 - eps) * u, u ~ U(0, 1)."},
    )
    exclude_mask_token_from_softmax: bool = field(
        default=True,
        metadata={"help": "Leave the mask token out of the softmax the loss is computed with (the sampler never "
                  "samples it). False: the released SFT code's loss (SDAR, LLaDA, Dream, dLLM-RL), a cross-entropy "
                  "over the whole vocabulary, mask token included."},
    )
    mask_ratio_range: list[float] | None = field(
        default=None,
        metadata={"help": "[low, high], 0 < low <= high <= 1: mask ratios from U(low, high) instead of U(mask_eps, 1) "
                  "(complementary: U(mask_eps, 1 - mask_eps)). dLLM-RL's SFT: 0.1 0.9."},
    )
    mask_ratio_sampling: str = field(
        default="per_sample",
        metadata={"help": "'per_sample': one mask ratio per sample (per block for semi_ar); 'per_token': each "
                  "completion token masked with its own probability (dLLM-RL's SFT; needs loss_weighting='none').",
                  "choices": list(MASK_RATIO_SAMPLING)},
    )
    loss_normalization: str = field(
        default="tokens",
        metadata={"help": "'tokens' (TRL: summed loss / the accumulated batch's loss tokens), or per-row means: "
                  "'row_masked' (each row's loss / its masked tokens; dLLM-RL's full-attention SFT), 'row_tokens' "
                  "(/ its sample's loss tokens; LLaDA's SFT) or 'row_length' (/ loss_normalization_length; "
                  "dLLM-RL's block SFT), averaged over rows ('row_masked' / 'row_length': those with a scored token) "
                  "and accumulation steps.",
                  "choices": list(LOSS_NORMALIZATIONS)},
    )
    loss_normalization_length: int | None = field(
        default=None,
        metadata={"help": "'row_length''s divisor (>= 1), for every row: dLLM-RL's block SFT divides by its dataset's "
                  "padded response length (the longest response, capped at max_gen_length: 2000 in its long-CoT "
                  "config). Only with loss_normalization='row_length'."},
    )
    block_size: int | None = field(
        default=None,
        metadata={"help": "Block size (>= 1) for block-causal models; an error on full-attention models. None uses "
                  "the model's; another value retrains the model at that block size and writes it to "
                  "model.config.block_size."},
    )
    semi_ar_block_length: int = field(
        default=32,
        metadata={"help": "Length (>= 1) of the 'semi_ar' blocks, counted from the end of the prompt."},
    )
    trajectory_shrinkage: int = field(
        default=1,
        metadata={"help": "'trajectory': merge this many (>= 1) consecutive denoising steps into one training state "
                  "(within each block for block-causal models, as TraceRL)."},
    )
    scoring_token_budget: int | None = field(
        default=None,
        metadata={"help": "Most padded tokens (>= 1) per training forward: the rows the objective builds (semi_ar "
                  "and trajectory build several per sample) are cut into forwards of at most this many tokens, each "
                  "back-propagated before the next (same gradient, one forward's activations). None: one forward "
                  "per micro-batch (TRL's)."},
    )
    recompute_scoring_forwards: bool = field(
        default=False,
        metadata={"help": "With scoring_token_budget: one backward per micro-batch (TRL's) instead of one per "
                  "forward, each forward checkpointed as a whole and run again in it (same gradient and memory, one "
                  "more forward each); usable with DeepSpeed ZeRO-1/2/3, LOMO and layer-wise optimizers. Not with "
                  "FSDP."},
    )
    pad_to_length_with_eos: bool = field(
        default=False,
        metadata={"help": "Pad every sequence with EOS up to max_length and train on the padding (LLaDA SFT)."},
    )
    eos_padding_length: str = field(
        default="max_length",
        metadata={"help": "With pad_to_length_with_eos: pad to max_length, or to the micro-batch's longest sequence "
                  "('longest', as LLaDA's SFT pads its mini-batch).", "choices": list(EOS_PADDING_LENGTHS)},
    )
    overlong_policy: str = field(
        default="truncate",
        metadata={"help": "Sequences longer than max_length: 'truncate' (per truncation_mode) or 'error'.",
                  "choices": list(OVERLONG_POLICIES)},
    )

    attention_backend: str = field(
        default="auto",
        metadata={"help": "Training attention masks: 'flex' (flex-attention BlockMask, no dense mask), 'sdpa' (dense "
                  "boolean mask) or 'auto' (flex on CUDA if verified, else sdpa).",
                  "choices": list(ATTENTION_BACKENDS)},
    )
    fused_kernels: bool = field(default=False, metadata={"help": FUSED_KERNELS_HELP})

    def __post_init__(self):
        if self.diffusion_objective in NONE_STRINGS:
            self.diffusion_objective = None
        check_optimization_numbers(self)  # before transformers', which fails on some without naming them
        take_checkpointing_old_name(self)
        super().__post_init__()
        check_field_types(self, SFTConfig)
        check_attention_backend(self.attention_backend)
        if self.diffusion_objective is not None and self.diffusion_objective not in OBJECTIVES:
            raise ValueError(f"diffusion_objective must be one of {OBJECTIVES} or None, got "
                             f"{self.diffusion_objective!r}.")
        if self.loss_weighting not in LOSS_WEIGHTINGS:
            raise ValueError(f"loss_weighting must be one of {LOSS_WEIGHTINGS}, got {self.loss_weighting!r}.")
        if not 0 < self.mask_eps < 0.5:
            raise ValueError(f"mask_eps must be in (0, 0.5), got {self.mask_eps}.")
        for name in ("max_length", "block_size", "semi_ar_block_length", "trajectory_shrinkage",
                     "scoring_token_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value}.")
        if self.recompute_scoring_forwards and self.scoring_token_budget is None:
            raise ValueError("recompute_scoring_forwards=True needs a scoring_token_budget: with one forward per "
                             "micro-batch there is only one forward to hold.")
        if self.overlong_policy not in OVERLONG_POLICIES:
            raise ValueError(f"overlong_policy must be one of {OVERLONG_POLICIES}, got {self.overlong_policy!r}.")
        if self.eos_padding_length not in EOS_PADDING_LENGTHS:
            raise ValueError(f"eos_padding_length must be one of {EOS_PADDING_LENGTHS}, got "
                             f"{self.eos_padding_length!r}.")
        if self.eos_padding_length != "max_length" and not self.pad_to_length_with_eos:
            raise ValueError(f"eos_padding_length={self.eos_padding_length!r} applies to pad_to_length_with_eos=True "
                             "only; it would be ignored.")
        if self.pad_to_length_with_eos and self.max_length is None and self.eos_padding_length == "max_length":
            raise ValueError("pad_to_length_with_eos=True pads to max_length; set max_length (or "
                             "eos_padding_length='longest').")
        if self.mask_eps != MASK_EPS_DEFAULT and (self.mask_ratio_range is not None
                                                  or self.diffusion_objective == "trajectory"):
            why = ("mask_ratio_range sets the mask ratios" if self.mask_ratio_range is not None
                   else "'trajectory' replays recorded states")
            raise ValueError(f"mask_eps={self.mask_eps} would be ignored: {why}. Leave it at {MASK_EPS_DEFAULT}.")
        for name, default, objective in (("semi_ar_block_length", 32, "semi_ar"),
                                         ("trajectory_shrinkage", 1, "trajectory")):
            if getattr(self, name) != default and self.diffusion_objective != objective:
                # None picks 'block' or 'random_masking', which read neither field
                raise ValueError(f"{name}={getattr(self, name)} applies to diffusion_objective={objective!r} only, "
                                 f"not to {self.diffusion_objective!r}; it would be ignored. Leave it at {default}.")
        if self.pad_to_length_with_eos and self.diffusion_objective == "trajectory":
            raise ValueError("pad_to_length_with_eos does not apply to 'trajectory': recorded rollouts fix the "
                             "completion tokens and their steps.")
        check_no_liger_kernel(self.use_liger_kernel)
        check_max_steps(self.max_steps)
        packed = [name for name in ("packing", "eval_packing", "padding_free") if getattr(self, name)]
        if packed and self.diffusion_objective not in (None, *PACKED_OBJECTIVES):
            raise ValueError(
                f"{' / '.join(packed)} does not apply to diffusion_objective={self.diffusion_objective!r}: packed "
                f"rows train with {PACKED_OBJECTIVES} (or None, the model's default). Set {packed[0]}=False."
            )
        self._check_noise_options(packed)
        if packed and self.pad_to_length_with_eos:
            raise ValueError(f"pad_to_length_with_eos pads every sequence to max_length, so there is nothing to pack; "
                             f"set {packed[0]}=False or pad_to_length_with_eos=False.")

    def _check_noise_options(self, packed: list[str]) -> None:
        """``mask_ratio_range``, ``mask_ratio_sampling`` and ``loss_normalization``, against the objective."""
        objective = self.diffusion_objective
        if self.mask_ratio_range is not None:
            values = list(self.mask_ratio_range)
            if len(values) != 2 or not 0 < values[0] <= values[1] <= 1:
                raise ValueError(f"mask_ratio_range must be [low, high] with 0 < low <= high <= 1, got {values}.")
            if objective == "trajectory":
                raise ValueError("mask_ratio_range does not apply to 'trajectory': its states are recorded.")
            if objective == "complementary" and values[1] >= 1:
                raise ValueError(f"mask_ratio_range {values} for 'complementary' needs high < 1: the complement of a "
                                 "mask of ratio t has ratio 1 - t, and its ELBO weight 1 / (2 (1 - t)) grows without "
                                 "bound as t nears 1 (default: [mask_eps, 1 - mask_eps]).")
        if self.mask_ratio_sampling not in MASK_RATIO_SAMPLING:
            raise ValueError(f"mask_ratio_sampling must be one of {MASK_RATIO_SAMPLING}, got "
                             f"{self.mask_ratio_sampling!r}.")
        if self.mask_ratio_sampling == "per_token":
            if objective not in (None, *PER_TOKEN_OBJECTIVES):
                raise ValueError(f"mask_ratio_sampling='per_token' applies to {PER_TOKEN_OBJECTIVES}, not to "
                                 f"{objective!r}.")
            if self.loss_weighting != "none":
                raise ValueError("mask_ratio_sampling='per_token' has no ELBO weight (each token has its own ratio); "
                                 "set loss_weighting='none', as dLLM-RL's SFT does.")
        if self.loss_normalization not in LOSS_NORMALIZATIONS:
            raise ValueError(f"loss_normalization must be one of {LOSS_NORMALIZATIONS}, got "
                             f"{self.loss_normalization!r}.")
        length = self.loss_normalization_length
        if self.loss_normalization == "row_length" and length is None:
            raise ValueError("loss_normalization='row_length' divides every row by loss_normalization_length: set it "
                             "(dLLM-RL's block SFT: its padded response length, e.g. 2000).")
        if self.loss_normalization != "row_length" and length is not None:
            raise ValueError(f"loss_normalization_length={length} applies to loss_normalization='row_length' only, "
                             f"not to {self.loss_normalization!r}; it would be ignored.")
        if length is not None and length < 1:
            raise ValueError(f"loss_normalization_length must be >= 1, got {length}.")
        if self.loss_normalization != "tokens":
            allowed = ("block", "random_masking") + (("semi_ar",) if self.loss_normalization == "row_masked" else ())
            if objective not in (None, *allowed):
                raise ValueError(f"loss_normalization={self.loss_normalization!r} applies to {allowed}, not to "
                                 f"{objective!r}.")
            if packed:
                raise ValueError(f"loss_normalization={self.loss_normalization!r} normalises each row, and a packed "
                                 f"row holds several samples; set {packed[0]}=False or loss_normalization='tokens'.")
