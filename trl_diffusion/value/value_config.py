"""``DiffusionValueConfig``: TRL's base training arguments plus how trajectories are turned into value targets."""

from __future__ import annotations

from dataclasses import dataclass, field

from trl.trainer.base_config import _BaseConfig

from ..models.kernels import FUSED_KERNELS_HELP
from ..states import (
    ATTENTION_BACKENDS,
    check_attention_backend,
    check_chat_template_kwargs,
    check_field_types,
    check_max_steps,
    check_no_liger_kernel,
    check_optimization_numbers,
    take_checkpointing_old_name,
)


@dataclass
class DiffusionValueConfig(_BaseConfig):
    r"""Configuration for [`DiffusionValueTrainer`], which fits a [`DiffusionValueModel`] on stored trajectories.
    Every [`~transformers.TrainingArguments`] field keeps its meaning (TRL's defaults for logging and precision).

    Args:
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount over merged denoising steps, in [0, 1]; the target of token j is `R_j = r_j + gamma * R*_{t(j)+1}`
            (the reward itself when `gamma = 1`).
        shrinkage (`int`, *optional*, defaults to `1`):
            Merge this many (>= 1) consecutive denoising steps into one state, as `TraceRLConfig.shrinkage`.
        training_block_size (`int` or `None`, *optional*):
            Block size (>= 1) used to build the states of a block-causal value model (default: the model's); an
            error for a full-attention (LLaDA / Dream) value model, whose states have no blocks.
        scoring_token_budget (`int` or `None`, *optional*, defaults to `16384`):
            Maximum padded tokens per forward (>= 1; packed rows are chunked to stay under it).
        recompute_scoring_forwards (`bool`, *optional*, defaults to `False`):
            Checkpoint each forward as a whole, as `TraceRLConfig.recompute_scoring_forwards`: the backward pass
            holds one forward's activations, not the micro-batch's; gradients unchanged, one more forward each. Not
            with FSDP.
        truncate_at_eos (`bool`, *optional*, defaults to `True`):
            Train only on tokens up to and including the first end-of-sequence token of each completion, as
            TraceRL's completion mask does.
        chat_template_kwargs (`dict` or `None`, *optional*):
            Keyword arguments of `apply_chat_template` for conversational prompts, as `GRPOConfig.chat_template_kwargs`
            (a JSON object on the command line); give the TraceRL run's so the value model sees the policy's prompts.
        attention_backend (`str`, *optional*, defaults to `"auto"`):
            `"flex"` (flex-attention `BlockMask`), `"sdpa"` (dense boolean mask) or `"auto"` (flex on CUDA where
            verified, SDPA otherwise; `states.resolve_attention_backend`).
        fused_kernels (`bool`, *optional*, defaults to `False`):
            Compile the layers' elementwise chains (RMSNorm, residual add + norm, RoPE, SwiGLU) into fused kernels
            with `torch.compile` (`models.set_fused_kernels`), for the value model's forwards. Half-precision values
            differ from eager in their last bits; the first calls compile (seconds).
    """

    learning_rate: float = field(
        default=5e-6, metadata={"help": "Initial learning rate (the TraceRL reference's value learning rate)."}
    )
    remove_unused_columns: bool = field(
        default=False, metadata={"help": "Keep the trajectory columns (the collator reads them)."}
    )
    gamma: float = field(
        default=1.0, metadata={"help": "Discount over merged denoising steps, in [0, 1] (TRL PPO's `gamma`)."}
    )
    shrinkage: int = field(
        default=1, metadata={"help": "Merge this many (>= 1) consecutive denoising steps into one state (as TraceRL)."}
    )
    training_block_size: int | None = field(
        default=None, metadata={"help": "Block size (>= 1) for block-causal value models (default: the model's); an "
                                "error for full-attention (LLaDA / Dream) value models."}
    )
    scoring_token_budget: int | None = field(
        default=16384, metadata={"help": "Maximum padded tokens per forward, >= 1 or None (rows are chunked to stay "
                                 "under it)."}
    )
    recompute_scoring_forwards: bool = field(
        default=False, metadata={"help": "Checkpoint each forward as a whole (run again in the backward pass): "
                                 "activation memory of one forward instead of the micro-batch's, same gradients, "
                                 "one more forward each. Not with FSDP."}
    )
    truncate_at_eos: bool = field(
        default=True,
        metadata={"help": "Train only on tokens up to and including the first end-of-sequence token."},
    )
    chat_template_kwargs: dict | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments of the chat template for conversational prompts, as GRPOConfig's (a JSON "
                  "object on the command line), e.g. {\"enable_thinking\": false}: the TraceRL run's, so the value "
                  "model sees the prompts the policy saw."},
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "Attention masks: 'flex' (flex-attention BlockMask, no dense mask), 'sdpa' (dense boolean "
                  "mask) or 'auto' (flex on CUDA if verified, else sdpa).",
                  "choices": list(ATTENTION_BACKENDS)},
    )
    fused_kernels: bool = field(default=False, metadata={"help": FUSED_KERNELS_HELP})

    def __post_init__(self):
        check_optimization_numbers(self)  # before transformers', which fails on some without naming them
        take_checkpointing_old_name(self)
        super().__post_init__()
        check_field_types(self, _BaseConfig)
        self.chat_template_kwargs = check_chat_template_kwargs(self.chat_template_kwargs)
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma must lie in [0, 1], got {self.gamma}.")
        if self.shrinkage < 1:
            raise ValueError(f"shrinkage must be >= 1, got {self.shrinkage}.")
        check_attention_backend(self.attention_backend)
        if self.training_block_size is not None and self.training_block_size <= 0:
            raise ValueError(f"training_block_size must be positive, got {self.training_block_size}.")
        if self.scoring_token_budget is not None and self.scoring_token_budget <= 0:
            raise ValueError(f"scoring_token_budget must be positive (or None), got {self.scoring_token_budget}.")
        if self.recompute_scoring_forwards and self.scoring_token_budget is None:
            raise ValueError("recompute_scoring_forwards=True needs a scoring_token_budget: with one forward per "
                             "micro-batch there is only one forward to hold.")
        check_no_liger_kernel(self.use_liger_kernel)
        check_max_steps(self.max_steps)
        if self.label_smoothing_factor:
            raise ValueError("label_smoothing_factor does not apply to the value model: its loss is a squared error "
                             "to the returns, not a cross-entropy over labels.")
