"""TraceRLConfig: GRPOConfig plus what diffusion rollouts and trajectory-aware likelihoods need."""

from __future__ import annotations

import warnings
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
      `confidence_threshold`, `rollout_cache`; `temperature`, `top_k`, `top_p` are GRPO's own fields),
    * how completions are scored (`likelihood_estimator`, `shrinkage`, `training_block_size`,
      `step_normalization`, `scoring_token_budget`, `attention_backend` and the estimators' masking ratios),
    * `dynamic_group_filtering`,
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
    # annotated `str` so that the command line passes 'prefix' / 'dual' through (a bool annotation would reject
    # them); __post_init__ turns every form into True / False / 'prefix' / 'dual'
    rollout_cache: str = field(
        default=True,
        metadata={"help": "Rollout KV cache: True = exact cache on block models (none on full-attention ones); "
                  "False = none; 'prefix' / 'dual' = approximate caches for LLaDA/Dream. (Was `use_cache`, which "
                  "is transformers' model.config.use_cache during training.)"},
    )
    use_cache: str = field(
        default=False,
        metadata={"help": "transformers' model.config.use_cache during training (False). Deprecated here as the "
                  "old name of `rollout_cache`: any other value is moved to `rollout_cache` with a warning."},
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
                  "boolean mask) or 'auto' (flex on CUDA, sdpa elsewhere).", "choices": list(ATTENTION_BACKENDS)},
    )
    dynamic_group_filtering: bool = field(
        default=False,
        metadata={"help": "Drop groups whose rewards are all equal (all-or-nothing accuracy) from the loss, as the "
                  "anchors do; the fraction dropped is logged as `filtered_groups`."},
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
        self.rollout_cache = _cache_value("rollout_cache", self.rollout_cache)
        old = _cache_value("use_cache", self.use_cache)
        if old is not False:  # the old name of rollout_cache; keep saved model configs' use_cache a bool
            warnings.warn(f"TraceRLConfig(use_cache={self.use_cache!r}) sets the rollout KV cache under its old "
                          f"name; use rollout_cache={old!r}. use_cache stays transformers' model.config.use_cache "
                          "(False).", FutureWarning, stacklevel=3)
            self.rollout_cache, self.use_cache = old, False
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


_CACHE_VALUES = {"true": True, "false": False, "prefix": "prefix", "dual": "dual"}


def _cache_value(name: str, value) -> bool | str:
    """True / False / 'prefix' / 'dual' from a Python value or its command-line / YAML string form."""
    key = str(value).strip().lower()
    if key not in _CACHE_VALUES:
        raise ValueError(f"{name} must be one of True, False, 'prefix', 'dual' (or their strings), got {value!r}.")
    return _CACHE_VALUES[key]
