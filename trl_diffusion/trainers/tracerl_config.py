"""TraceRLConfig: GRPOConfig plus what diffusion rollouts and trajectory-aware likelihoods need."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..estimators import ESTIMATORS
from ..generation.sampling import REMASKING_STRATEGIES
from ..states import ATTENTION_BACKENDS, check_attention_backend


@dataclass
class TraceRLConfig(GRPOConfig):
    r"""Configuration for [`TraceRLTrainer`]: every [`~trl.GRPOConfig`] field keeps its meaning (rewards,
    advantages, `loss_type`, clipping, `beta`, `num_iterations`, logging, ...). Added:

    * the diffusion sampler used for rollouts (`block_length`, `denoising_steps`, `remasking_strategy`,
      `confidence_threshold`, `use_cache`; `temperature`, `top_k`, `top_p` are GRPO's own fields),
    * how completions are scored (`likelihood_estimator`, `shrinkage`, `training_block_size`,
      `step_normalization`, `scoring_token_budget`, `attention_backend` and the estimators' masking ratios),
    * `dynamic_group_filtering`,
    * `resume_without_rollout_state` (resuming from a checkpoint that lacks TraceRL's rollout state),
    * the value model's GAE and training (`gamma`, `lam`, `cliprange_value`, `value_learning_rate`,
      `value_train_every`), used only when the trainer is given a `value_model`.
    """

    block_length: int = field(default=4, metadata={"help": "Rollout block length (tokens per block)."})
    denoising_steps: int = field(default=4, metadata={"help": "Rollout denoising steps per block."})
    remasking_strategy: str = field(
        default="low_confidence_dynamic",
        metadata={"help": f"Rollout remasking strategy, one of {REMASKING_STRATEGIES}."},
    )
    confidence_threshold: float = field(
        default=0.9, metadata={"help": "Confidence threshold of the `low_confidence_dynamic` strategy."}
    )
    use_cache: bool | str = field(
        default=True,
        metadata={"help": "Rollout KV cache: True = exact cache on block models (none on full-attention ones); "
                  "'prefix' / 'dual' = approximate caches for LLaDA/Dream."},
    )
    likelihood_estimator: str = field(
        default="trajectory",
        metadata={"help": f"How log pi(completion) is estimated, one of {ESTIMATORS}. `trajectory` is TraceRL."},
    )
    shrinkage: int = field(
        default=1,
        metadata={"help": "TraceRL shrinkage s: merge s consecutive denoising steps into one scored state (within "
                  "each block for block models, over the response for full-attention models)."},
    )
    training_block_size: int | None = field(
        default=None,
        metadata={"help": "Block size used to score block models (default: `block_length`). May differ from the "
                  "rollout's, e.g. 4 -> 8 for block-size adaptation."},
    )
    step_normalization: str = field(
        default="step",
        metadata={"help": "'step': each token's loss is weighted 1/|tau(t)| (tokens committed in its merged step), so "
                  "with loss_type='grpo' a sequence's loss is the mean over its steps of per-step means (TraceRL). "
                  "'sequence': plain per-token weighting (TRL's own)."},
    )
    scoring_token_budget: int | None = field(
        default=16384,
        metadata={"help": "Maximum padded tokens per scoring forward (packed rows are chunked to stay under it)."},
    )
    random_mask_low: float = field(default=0.1, metadata={"help": "`random_masking`: lowest per-token mask prob."})
    random_mask_high: float = field(default=0.9, metadata={"help": "`random_masking`: highest per-token mask prob."})
    coupled_low: float = field(default=0.2, metadata={"help": "`coupled`: lowest mask ratio t."})
    coupled_high: float = field(default=0.8, metadata={"help": "`coupled`: highest mask ratio t."})
    prompt_mask_prob: float = field(
        default=0.15, metadata={"help": "`mean_field`: probability of masking each prompt token (d1)."}
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "Scoring attention masks: 'flex' (flex-attention BlockMask, no dense mask), 'sdpa' (dense "
                  "boolean mask) or 'auto' (flex on CUDA if verified, else sdpa).",
                  "choices": list(ATTENTION_BACKENDS)},
    )
    dynamic_group_filtering: bool = field(
        default=False,
        metadata={"help": "Drop groups whose rewards are all equal (all-or-nothing accuracy) from the loss, as the "
                  "anchors do; the fraction dropped is logged as `filtered_groups`."},
    )
    resume_without_rollout_state: bool = field(
        default=False,
        metadata={"help": "Resume from a checkpoint that lacks TraceRL's rollout state (`rollout_buffer_<rank>.pt`; "
                  "with a value model `value_model/` and `value_state.pt`) or whose buffers were saved by another "
                  "number of processes or per-device batch. The cycle in progress is then generated again and a "
                  "missing value model keeps its initial weights, so the run differs from an uninterrupted one. By "
                  "default such a resume is refused."},
    )

    gamma: float = field(
        default=1.0,
        metadata={"help": "Value model: discount factor over merged denoising steps (TRL PPO's `gamma`)."},
    )
    lam: float = field(
        default=1.0,
        metadata={"help": "Value model: GAE lambda over merged denoising steps (TRL PPO's `lam`). With gamma = lam "
                  "= 1 a token's advantage is R - V_j."},
    )
    cliprange_value: float = field(
        default=0.2,
        metadata={"help": "Value model: clip range of the value loss 0.5 * max((V - R)^2, (V_clip - R)^2), "
                  "V_clip = V_old + clip(V - V_old, -cliprange_value, cliprange_value)."},
    )
    value_learning_rate: float = field(
        default=5e-6, metadata={"help": "Value model: learning rate of its own AdamW optimizer."}
    )
    value_train_every: int = field(
        default=1,
        metadata={"help": "Value model: train it on every k-th generation batch (1 = every one). Advantages always "
                  "come from the value model as it was before that batch's update."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.remasking_strategy not in REMASKING_STRATEGIES:
            raise ValueError(f"unknown remasking_strategy {self.remasking_strategy!r}; choose one of "
                             f"{REMASKING_STRATEGIES}.")
        if self.likelihood_estimator not in ESTIMATORS:
            raise ValueError(f"unknown likelihood_estimator {self.likelihood_estimator!r}; choose one of "
                             f"{ESTIMATORS}.")
        if self.block_length <= 0 or self.denoising_steps <= 0 or self.denoising_steps > self.block_length:
            raise ValueError("need 0 < denoising_steps <= block_length, got "
                             f"block_length={self.block_length}, denoising_steps={self.denoising_steps}.")
        if self.shrinkage < 1:
            raise ValueError(f"shrinkage must be >= 1, got {self.shrinkage}.")
        check_attention_backend(self.attention_backend)
        if self.training_block_size is not None and self.training_block_size <= 0:
            raise ValueError(f"training_block_size must be positive, got {self.training_block_size}.")
        if self.step_normalization not in ("step", "sequence"):
            raise ValueError(f"step_normalization must be 'step' or 'sequence', got {self.step_normalization!r}.")
        self._check_sampling_and_scoring_fields()
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}.")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={self.gamma}, lam={self.lam}.")
        if not self.value_learning_rate > 0 or self.value_train_every < 1:
            raise ValueError("need value_learning_rate > 0 and value_train_every >= 1, got "
                             f"{self.value_learning_rate} and {self.value_train_every}.")
        if not self.temperature > 0:
            raise ValueError("TraceRL needs stochastic rollouts: temperature must be > 0.")
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise ValueError("vLLM and continuous batching are autoregressive; diffusion rollouts use the model's "
                             "own generate(). Set use_vllm=False and use_transformers_continuous_batching=False.")

    def _check_sampling_and_scoring_fields(self) -> None:
        """Ranges of the rollout and scoring fields, checked here rather than at the first rollout or scoring step
        (NaN fails every comparison below)."""
        for name in ("confidence_threshold", "prompt_mask_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}.")
        for low, high in (("random_mask_low", "random_mask_high"), ("coupled_low", "coupled_high")):
            if not 0.0 < getattr(self, low) <= getattr(self, high) < 1.0:
                raise ValueError(f"need 0 < {low} <= {high} < 1, got {low}={getattr(self, low)}, "
                                 f"{high}={getattr(self, high)}.")
        if self.scoring_token_budget is not None and self.scoring_token_budget <= 0:
            raise ValueError(f"scoring_token_budget must be positive (or None), got {self.scoring_token_budget}.")
        if self.max_completion_length is not None and self.max_completion_length <= 0:
            raise ValueError(f"max_completion_length must be positive, got {self.max_completion_length}.")
        if not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be finite, got {self.temperature}.")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = no top-k filtering), got {self.top_k}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}.")
        ignored = {"min_p": self.min_p is not None, "repetition_penalty": self.repetition_penalty != 1.0,
                   "generation_kwargs": bool(self.generation_kwargs)}
        if any(ignored.values()):
            raise ValueError(f"{[name for name, set_ in ignored.items() if set_]} are not applied by diffusion "
                             "rollouts; leave them at their defaults (min_p=None, repetition_penalty=1.0, "
                             "generation_kwargs=None).")
