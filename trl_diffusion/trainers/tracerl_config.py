"""TraceRLConfig: GRPOConfig plus what diffusion rollouts and trajectory-aware likelihoods need."""

from __future__ import annotations

import math
import numbers
import os
import warnings
from dataclasses import dataclass, field

from trl import GRPOConfig

from ..estimators import ESTIMATORS, MASK_SAMPLING, MULTI_MASK_ESTIMATORS, check_mask_options
from ..generation.sampler import check_cuda_graphs
from ..generation.sampling import MIN_TEMPERATURE, REMASKING_STRATEGIES, check_sampling_filters
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
from .tracerl_objective import STEP_NORMALIZATIONS

ROLLOUT_STRATEGIES = tuple(name for name in REMASKING_STRATEGIES if name != "origin")
"""Strategies of a per-block rollout schedule (``denoising_steps``); Dream's ``origin`` needs its linspace one."""
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
"""TRL 1.16 ``GRPOConfig.loss_type`` values (its trainer raises on any other only when the loss is computed)."""
LOSS_TYPES = ("tracerl", *GRPO_LOSS_TYPES)


@dataclass
class TraceRLConfig(GRPOConfig):
    r"""Configuration for [`TraceRLTrainer`]: every [`~trl.GRPOConfig`] field keeps its meaning (rewards,
    advantages, `loss_type`, clipping, `beta`, `num_iterations`, logging, ...). Added:

    * the diffusion sampler used for rollouts (`block_length`, `denoising_steps`, `remasking_strategy`,
      `confidence_threshold`, `rollout_cache`; `temperature`, `top_k`, `top_p` are GRPO's own fields), and
      `save_rollout_generation_config` (saved models carry that sampler in `generation_config.json`),
    * how completions are scored (`likelihood_estimator`, `shrinkage`, `training_block_size`,
      `step_normalization`, `scoring_temperature`, `exclude_mask_token_from_softmax`, `scoring_token_budget`,
      `recompute_scoring_forwards`, `attention_backend`, and the masking estimators' ratios, `random_mask_sampling`
      and `masks_per_response`),
    * `fused_kernels` (the layers' elementwise chains compiled into fused kernels, for scoring and rollouts),
    * `dynamic_group_filtering`,
    * `resume_without_rollout_state` (resuming from a checkpoint that lacks TraceRL's rollout state),
    * `reset_optimizer_per_rollout` (dLLM-RL's fresh optimizer state at every rollout),
    * TraceRL's objective as published (`loss_type="tracerl"`, `step_normalization`, `kl_reference`,
      `kl_weighting`, `log_ratio_clip`, `reward_std`, `dynamic_group_filtering` and its accuracy band),
    * the value model's GAE and training (`gamma`, `lam`, `cliprange_value`, `value_learning_rate`,
      `value_batch_size`, `value_train_every`), used only when the trainer is given a `value_model`.

    Defaults follow the published method (the paper's objective, and dLLM-RL's code where the paper is silent and
    the code does the same for every model family); [`TraceRLConfig.from_official`] gives dLLM-RL's per-family
    settings exactly (e.g. TraDo's 1/L_max normalisation, Dream's KL summed per row, raw-logit scoring). Changed
    GRPO defaults: `loss_type="tracerl"`, `beta=0.01` (k3 against the rollout policy, `kl_reference="old_policy"`),
    `use_bias_correction_kl=False`.
    """

    block_length: int = field(default=4, metadata={"help": "Rollout block length (tokens per block)."})
    denoising_steps: int = field(default=4, metadata={"help": "Rollout denoising steps per block."})
    remasking_strategy: str = field(
        default="low_confidence_dynamic",
        metadata={"help": f"Rollout remasking strategy, one of {ROLLOUT_STRATEGIES}."},
    )
    confidence_threshold: float = field(
        default=0.9, metadata={"help": "Confidence threshold of the `low_confidence_dynamic` strategy (the other "
                               "strategies do not read it: another value with them is a warning)."}
    )
    # annotated `str` so that the command line passes 'prefix' / 'dual' through (a bool annotation would reject
    # them); __post_init__ turns every form into 'auto' / True / False / 'prefix' / 'dual'
    rollout_cache: str = field(
        default="auto",
        metadata={"help": "Rollout KV cache: 'auto' = the exact cache on block models (SDAR / TraDo), none on "
                  "full-attention ones (LLaDA / Dream); True = the exact cache, which only block models have (an "
                  "error on LLaDA / Dream); False = none; 'prefix' / 'dual' = approximate caches for LLaDA / Dream. "
                  "(Was `use_cache`, which is transformers' model.config.use_cache during training.)"},
    )
    rollout_cuda_graphs: str = field(
        default="auto",
        metadata={"help": "generate()'s `cuda_graphs` for rollouts: 'auto' replays the cached denoising steps as CUDA "
                  "graphs on CUDA (SDAR's exact cache, LLaDA/Dream's prefix and dual caches; 6.8x the eager "
                  "batch-1 speed on an H200) where they apply, and decodes eagerly elsewhere (the CPU, no cache, "
                  "DeepSpeed ZeRO-3 and FSDP, whose parameter gathering cannot be captured); 'off' always decodes "
                  "eagerly.", "choices": ["auto", "off"]},
    )
    save_rollout_generation_config: bool = field(
        default=True,
        metadata={"help": "Write the rollout sampler (max_new_tokens, block_length, denoising_steps, "
                  "remasking_strategy, confidence_threshold, temperature, top_k, top_p, the KV cache, the stop ids) "
                  "into the generation_config.json of every saved model and checkpoint, so that generate() with no "
                  "arguments samples as the rollouts did. The model's generation_config in memory is not changed. "
                  "False: save the generation_config as loaded (plus TRL's pad_token_id)."},
    )
    use_cache: str = field(
        default=False,
        metadata={"help": "transformers' model.config.use_cache during training (always False). Deprecated here as "
                  "the old name of `rollout_cache`: any other value is moved to `rollout_cache` with a warning (an "
                  "error when `rollout_cache` is set to another value)."},
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
        metadata={"help": "Block size (>= 1) used to score block models (default: `block_length`). May differ from "
                  "the rollout's, e.g. 4 -> 8 for block-size adaptation. An error on full-attention (LLaDA / Dream) "
                  "models, which are scored without blocks."},
    )
    step_normalization: str = field(
        default="step",
        metadata={"help": "Per-token loss weight. 'step' (the paper; dLLM-RL's Dream/LLaDA code): 1/|tau(t)|, "
                  "|tau(t)| = the trained tokens of the token's merged step, so each step contributes the mean of its "
                  "tokens. 'max_length' (dLLM-RL's SDAR/TraDo code): 1/L_max, L_max = the longest trained completion "
                  "of the rollout batch. 'sequence': 1 (TRL's own).", "choices": list(STEP_NORMALIZATIONS)},
    )
    loss_type: str = field(
        default="tracerl",
        metadata={"help": "GRPO's loss aggregation, plus 'tracerl' (default; dLLM-RL): the weighted token losses "
                  "summed and divided by the number of training rows, one row per response and merged step (with "
                  "step_normalization='max_length' on block models: the r-th merged step of every block, as "
                  "dLLM-RL's SDAR/TraDo code stacks them), counted over the generation batch and spread evenly over "
                  "its optimizer steps. Masking estimators count dLLM-RL's rows: one per mask ('random_masking'), "
                  "two per pair ('coupled_pairs'), one per response ('coupled', 'mean_field'). Any TRL loss type "
                  "('dapo', 'grpo', 'dr_grpo', 'bnpo', ...) aggregates as in GRPOTrainer, over the token weights "
                  "of step_normalization (the trajectory estimator; the masking estimators weigh each mask's tokens "
                  "1/masks_per_response whatever step_normalization says): exactly GRPOTrainer's loss needs "
                  "step_normalization='sequence'.",
                  "choices": list(LOSS_TYPES)},
    )
    beta: float = field(
        default=0.01,
        metadata={"help": "KL coefficient (TraceRL: 0.01). The KL is the k3 estimator against `kl_reference`."},
    )
    kl_weighting: str = field(
        default="as_policy",
        metadata={"help": "Per-token weight of the KL term: 'as_policy' = the policy term's weight (1/|tau(t)| or "
                  "1/L_max; dLLM-RL's SDAR/TraDo code); 'row_sum' = 1, each row's KL summed over its tokens before "
                  "the division by the number of rows (dLLM-RL's Dream/LLaDA code). 'row_sum' needs "
                  "loss_type='tracerl'.", "choices": ["as_policy", "row_sum"]},
    )
    kl_reference: str = field(
        default="old_policy",
        metadata={"help": "What the KL term pulls towards: 'old_policy' (dLLM-RL) = the policy that sampled the "
                  "rollout (its log-probs pi_old, no extra model); 'reference_model' (TRL's GRPO) = a frozen copy of "
                  "the initial policy.", "choices": ["old_policy", "reference_model"]},
    )
    reset_optimizer_per_rollout: bool = field(
        default=False,
        metadata={"help": "Clear AdamW's moments and step counts (policy and value model) before every rollout's "
                  "first optimizer step, as dLLM-RL's fresh process per RL step re-creates its optimizers. The "
                  "learning-rate schedule keeps running (dLLM-RL's is constant). Not with DeepSpeed."},
    )
    use_bias_correction_kl: bool = field(
        default=False,
        metadata={"help": "Multiply the per-token KL by the importance ratio (TRL's correction). Off by default, as "
                  "in dLLM-RL."},
    )
    log_ratio_clip: float | None = field(
        default=None,
        metadata={"help": "Clamp log(pi/pi_old) to [-c, c] before the ratio is formed (dLLM-RL's SDAR/TraDo code: "
                  "10; no gradient flows through a clamped token). None: no clamp (dLLM-RL's Dream/LLaDA code)."},
    )
    reward_std: str = field(
        default="population",
        metadata={"help": "How rewards are scaled into advantages (with scale_rewards 'group' or 'batch'): "
                  "'population' (dLLM-RL) = (r - mean) / population std, 0 when the std is 0; 'sample' = TRL's "
                  "(r - mean) / (unbiased std + 1e-4).", "choices": ["population", "sample"]},
    )
    advantage_baseline: str = field(
        default="group_mean",
        metadata={"help": "What is subtracted from a reward: 'group_mean' (TRL, dLLM-RL) or 'leave_one_out' "
                  "(DiffuCoder's coupled-GRPO: the mean of the group's k - 1 other rewards, i.e. the group-mean "
                  "advantage times k / (k - 1)), then scaled as scale_rewards and reward_std say. Without a value "
                  "model only.", "choices": ["group_mean", "leave_one_out"]},
    )
    scoring_token_budget: int | None = field(
        default=16384,
        metadata={"help": "Maximum padded tokens per scoring forward (packed rows are chunked to stay under it)."},
    )
    recompute_scoring_forwards: bool = field(
        default=False,
        metadata={"help": "Checkpoint each scoring forward as a whole: the backward pass runs it again, so it holds "
                  "one forward's activations (at most `scoring_token_budget` tokens) instead of the whole "
                  "micro-batch's. Gradients are unchanged; costs one more forward per scoring forward. Also for the "
                  "value model. Not with FSDP."},
    )
    scoring_temperature: float | None = field(
        default=None,
        metadata={"help": "Temperature of the distribution the trainer scores (new, old and reference log-probs). "
                  "None: the rollout's `temperature`, so that re-scoring a fresh trajectory reproduces the sampler's "
                  "log-probs. dLLM-RL's trainers score raw logits (1.0), also for rollouts sampled at 0.8."},
    )
    exclude_mask_token_from_softmax: bool = field(
        default=True,
        metadata={"help": "Scoring: leave the mask token out of the softmax (a committed token is never a mask, and "
                  "the rollout sampler never samples it). False: dLLM-RL's trainers, whose softmax includes it; the "
                  "trainer's log-probs then differ slightly from the sampler's. Rollouts always exclude it."},
    )
    random_mask_low: float = field(
        default=0.1, metadata={"help": "`random_masking` / `coupled_pairs`: lowest mask probability (dLLM-RL's "
                               "lower_p)."}
    )
    random_mask_high: float = field(
        default=0.9, metadata={"help": "`random_masking` / `coupled_pairs`: highest mask probability (dLLM-RL's "
                               "upper_p)."}
    )
    random_mask_sampling: str = field(
        default="per_token",
        metadata={"help": "`random_masking` / `coupled_pairs`: 'per_token' = each token masked with its own "
                  "probability u ~ U(random_mask_low, random_mask_high) (dLLM-RL's SDAR/TraDo code); 'per_row' = one "
                  "ratio t ~ U(low, high) per mask, every token masked with probability t (dLLM-RL's Dream/LLaDA "
                  "code). Ignored by the other estimators.", "choices": list(MASK_SAMPLING)},
    )
    masks_per_response: int = field(
        default=1,
        metadata={"help": "`random_masking` / `coupled_pairs`: masks (pairs) drawn per response, each one dLLM-RL "
                  "training row (a pair: two). dLLM-RL's mask_times_per_sample: 35 for Dream/LLaDA, 1 for "
                  "SDAR/TraDo. Ignored by the other estimators."},
    )
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
    fused_kernels: bool = field(default=False, metadata={"help": FUSED_KERNELS_HELP})
    dynamic_group_filtering: str = field(
        default="accuracy_band",
        metadata={"help": "Which prompt groups leave the loss (and the value model's training) before training: "
                  "'accuracy_band' (dLLM-RL) = groups whose mean reward (the accuracy of a 0/1 reward) lies outside "
                  "[group_accuracy_low, group_accuracy_high]; needs rewards in [0, 1]. 'all_equal' = groups whose "
                  "rewards are all equal. 'none' = keep all (from Python also False; True = 'all_equal'). Dropped "
                  "groups leave every loss normaliser too; the fraction dropped is logged as `filtered_groups`.",
                  "choices": ["accuracy_band", "all_equal", "none"]},
    )
    group_accuracy_low: float = field(
        default=0.2, metadata={"help": "`accuracy_band`: lowest group accuracy kept (dLLM-RL: 0.2)."}
    )
    group_accuracy_high: float = field(
        default=0.8, metadata={"help": "`accuracy_band`: highest group accuracy kept (dLLM-RL: 0.8)."}
    )
    resume_without_rollout_state: bool = field(
        default=False,
        metadata={"help": "Resume from a checkpoint that lacks TraceRL's rollout state (`rollout_buffer_<rank>.pt`; "
                  "with a value model `value_model/` and `value_state.pt`) or whose buffers were saved by another "
                  "number of processes or per-device batch. The cycle in progress is then generated again and a "
                  "missing value model keeps its initial weights, so the run differs from an uninterrupted one. By "
                  "default such a resume is refused. A checkpoint saved with `save_only_model=True` is refused "
                  "either way (it has no optimizer states)."},
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
        default=5e-6, metadata={"help": "Value model: learning rate of its own AdamW optimizer, finite and > 0, "
                                "constant (lr_scheduler_type and warm-up apply to the policy only)."}
    )
    value_batch_size: int | None = field(
        default=256,
        metadata={"help": "Value model: training rows per value optimizer step (>= 1), over all processes. It takes "
                  "ceil(rows / value_batch_size) steps per generation batch: one epoch over the rows of the groups "
                  "that survive the filter (dLLM-RL: 8 GPUs x 32 accumulation x 1 row = 256). None: as many steps "
                  "as the policy takes per generation batch (steps_per_generation // gradient_accumulation_steps, "
                  "at least 1)."},
    )
    value_train_every: int = field(
        default=1,
        metadata={"help": "Value model: train it on every k-th (k >= 1) generation batch (1 = every one). Advantages "
                  "always come from the value model as it was before that batch's update."},
    )

    def __post_init__(self):
        given, passed = _cache_value("rollout_cache", self.rollout_cache), self.use_cache
        old = _cache_value("use_cache", passed)
        # transformers' Trainer copies use_cache into model.config.use_cache, which saved configs then hold: always
        # the bool False (a command-line "false" stayed the truthy string)
        self.rollout_cache, self.use_cache = given, False
        if old is not False:  # the old name of rollout_cache
            if given != "auto" and given != old:  # "auto" is the default: rollout_cache was set too, differently
                raise ValueError(f"rollout_cache={given!r} and use_cache={passed!r} (its deprecated old name) "
                                 "disagree; pass only rollout_cache.")
            warnings.warn(f"TraceRLConfig(use_cache={passed!r}) sets the rollout KV cache under its old "
                          f"name; use rollout_cache={old!r}. use_cache stays transformers' model.config.use_cache "
                          "(False).", FutureWarning, stacklevel=3)
            self.rollout_cache = old
        self._check_num_generations()
        check_optimization_numbers(self)  # before transformers', which fails on some without naming them
        take_checkpointing_old_name(self)
        super().__post_init__()
        self.check()
        if self.training_block_size is not None and self.training_block_size % self.block_length:
            warnings.warn(f"training_block_size={self.training_block_size} is not a multiple of block_length="
                          f"{self.block_length}: a block model then scores a token with the earlier training blocks "
                          "shown whole and clean, including tokens the sampler committed after it, so its log-prob is "
                          "not the one it was sampled with (the trajectory estimate is exact only for multiples, e.g. "
                          "4 -> 8).", stacklevel=3)
        default_threshold = type(self).__dataclass_fields__["confidence_threshold"].default
        if self.remasking_strategy != "low_confidence_dynamic" and self.confidence_threshold != default_threshold:
            warnings.warn(f"confidence_threshold={self.confidence_threshold} is read by remasking_strategy="
                          f"'low_confidence_dynamic' only; the rollouts' {self.remasking_strategy!r} ignores it.",
                          stacklevel=3)

    def check(self) -> None:
        """Check TraceRL's fields and the GRPO / transformers fields it refuses or bounds, raising a ValueError that
        names the field and the fix. ``__post_init__`` runs it, and so does ``TraceRLTrainer`` when it is built: a
        field set on the config after it was built (``args.top_p = None``, ``args.temperature = 0.0``) is refused
        as it would have been at construction, rather than reaching rollouts unchecked.

        Idempotent: the only values it writes are canonical forms of what it read (a command-line ``"true"`` /
        ``"false"``, a JSON string, a numpy number), which it leaves as they are on a second run. It re-derives
        nothing: the values ``GRPOConfig`` / ``TrainingArguments.__post_init__`` derive (``steps_per_generation``,
        ``generation_batch_size``, ...) and the move of the deprecated ``use_cache`` to ``rollout_cache`` happen at
        construction only."""
        self._check_num_generations()
        check_optimization_numbers(self)
        self.rollout_cache = _cache_value("rollout_cache", self.rollout_cache)
        check_field_types(self, GRPOConfig)
        self._check_checkpointing_kwargs()
        self.chat_template_kwargs = check_chat_template_kwargs(self.chat_template_kwargs)
        self._check_objective()
        check_cuda_graphs("rollout_cuda_graphs", self.rollout_cuda_graphs)
        if self.remasking_strategy not in ROLLOUT_STRATEGIES:
            raise ValueError(f"remasking_strategy {self.remasking_strategy!r} is not a rollout strategy; choose "
                             f"one of {ROLLOUT_STRATEGIES} (Dream's 'origin' runs over its own linspace schedule, "
                             "not denoising_steps per block).")
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
        self._check_sampling_and_scoring_fields()
        if not self.cliprange_value > 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}.")
        if not (0.0 <= self.gamma <= 1.0 and 0.0 <= self.lam <= 1.0):
            raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={self.gamma}, lam={self.lam}.")
        if not (math.isfinite(self.value_learning_rate) and self.value_learning_rate > 0):
            raise ValueError(f"value_learning_rate must be a finite number > 0, got {self.value_learning_rate}.")
        if self.value_train_every < 1:
            raise ValueError(f"value_train_every must be >= 1, got {self.value_train_every}.")
        if self.use_vllm or self.use_transformers_continuous_batching:
            raise ValueError("vLLM and continuous batching are autoregressive; diffusion rollouts use the model's "
                             "own generate(). Set use_vllm=False and use_transformers_continuous_batching=False.")
        if self.neftune_noise_alpha is not None:
            raise ValueError("neftune_noise_alpha adds fresh noise to the input embeddings at every training-mode "
                             "forward, so rollouts, pi_old and the scored log-probs would each come from another "
                             "noisy policy; leave it None (NEFTune is an SFT technique).")
        check_no_liger_kernel(self.use_liger_kernel)
        check_max_steps(self.max_steps)
        if self.label_smoothing_factor != 0.0:
            raise ValueError("label_smoothing_factor is not applied by the policy-gradient loss (there are no "
                             "labels); leave it at 0.0.")

    def _check_num_generations(self) -> None:
        """``num_generations`` is typed ``int | None`` by TRL, whose ``__post_init__`` then fails on ``% None``."""
        if self.num_generations is None:
            raise ValueError("num_generations must be an integer >= 2 (the responses per prompt that GRPO's "
                             "advantages compare), got None.")

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
        if self.recompute_scoring_forwards and self.scoring_token_budget is None:
            raise ValueError("recompute_scoring_forwards=True needs a scoring_token_budget: with one forward per "
                             "micro-batch there is only one forward to hold.")
        if self.max_completion_length is None or self.max_completion_length <= 0:
            raise ValueError("max_completion_length must be a positive int (diffusion rollouts decode on a canvas of "
                             f"that many tokens), got {self.max_completion_length}.")
        if self.temperature == 0:
            raise ValueError("TraceRL needs stochastic rollouts: temperature must be > 0.")
        if self.top_p is None:  # generate() would take the checkpoint's generation_config top_p for the rollouts
            raise ValueError("top_p must be a number in (0, 1] (1.0: no top-p filtering), got None.")
        check_sampling_filters(self.temperature, self.top_k, self.top_p, zero_means=None)
        if self.scoring_temperature is not None and not (math.isfinite(self.scoring_temperature)
                                                         and self.scoring_temperature >= MIN_TEMPERATURE):
            raise ValueError(f"scoring_temperature must be a finite number >= {MIN_TEMPERATURE:g} (or None: the "
                             f"rollout temperature), got {self.scoring_temperature}.")
        check_mask_options(self.random_mask_sampling, self.masks_per_response)
        ignored = {"min_p": self.min_p is not None, "repetition_penalty": self.repetition_penalty != 1.0,
                   "generation_kwargs": bool(self.generation_kwargs),
                   "cache_implementation": self.cache_implementation is not None}
        if any(ignored.values()):
            raise ValueError(f"{[name for name, set_ in ignored.items() if set_]} are not applied by diffusion "
                             "rollouts; leave them at their defaults (min_p=None, repetition_penalty=1.0, "
                             "generation_kwargs=None, cache_implementation=None). The rollout KV cache is "
                             "`rollout_cache`.")

    def _check_checkpointing_kwargs(self) -> None:
        """transformers' ``every_n_layers`` / ``offload`` checkpointing settings are arguments of the enabling method
        (``activation_checkpointing_enable``; ``gradient_checkpointing_enable`` before 5.23), not of
        ``torch.utils.checkpoint``; GRPO turns checkpointing off around each rollout and back on with the kwargs as
        they are (``disable_gradient_checkpointing``), after which every layer's forward got them (a TypeError at the
        first loss)."""
        kwargs = getattr(self, "activation_checkpointing_kwargs", None) or self.gradient_checkpointing_kwargs
        unsupported = sorted(set(kwargs) & {"every_n_layers", "offload"}) if isinstance(kwargs, dict) else []
        if unsupported and (getattr(self, "activation_checkpointing", None) or self.gradient_checkpointing):
            raise ValueError(f"activation_checkpointing_kwargs {unsupported} cannot be used with TraceRL: TRL's GRPO "
                             "turns checkpointing off around each rollout and back on passing these kwargs to "
                             "torch.utils.checkpoint, which does not take them. Leave them out (every layer is "
                             "checkpointed).")

    @classmethod
    def from_official(cls, name: str, num_processes: int | None = None, **overrides) -> TraceRLConfig:
        """A config with dLLM-RL's published RL settings for ``name`` (see ``OFFICIAL_SETTINGS``): ``"trado"``
        (configs/rl_trado.yaml and rl_trado_with_value.yaml), ``"dream"`` (rl_dream.yaml) or ``"llada"``
        (rl_llada.yaml). ``overrides`` (any field, e.g. ``output_dir``) win; ``likelihood_estimator=
        "random_masking"`` or ``"coupled_pairs"`` gives dLLM-RL's ``training.method`` ``random_masking`` or
        ``coupled`` with that family's masking settings (and ``shrinkage`` 1: those methods merge no steps).

        The optimizer batch holds as many responses as dLLM-RL's holds training rows (``OFFICIAL_ROWS``), one
        response per device per micro-step: gradient accumulation is that number over ``num_processes`` (default:
        ``WORLD_SIZE``, as set by ``accelerate launch``), rounded to the nearest layout that splits the rollout into
        whole optimizer steps when it does not divide exactly. A ``steps_per_generation`` override replaces the
        preset's ``generation_batch_size`` (TRL takes one of the two)."""
        if name not in OFFICIAL_SETTINGS:
            raise ValueError(f"unknown official setting {name!r}; choose one of {sorted(OFFICIAL_SETTINGS)}.")
        settings = {**OFFICIAL_SETTINGS[name], **overrides}
        if settings["likelihood_estimator"] != "trajectory" and "shrinkage" not in overrides:
            settings["shrinkage"] = 1  # dLLM-RL's `training.shrink` is TraceRL's: its masking methods do not read it
        if overrides.get("steps_per_generation") is not None and "generation_batch_size" not in overrides:
            del settings["generation_batch_size"]  # the caller's rollout layout replaces the preset's (TRL takes one)
        world = num_processes or int(os.environ.get("WORLD_SIZE", "1"))
        if "gradient_accumulation_steps" in overrides and "per_device_train_batch_size" not in overrides:
            # TRL's default per-device batch (8) would silently change the official rows per optimizer step
            raise ValueError(f"from_official({name!r}) got gradient_accumulation_steps without "
                             "per_device_train_batch_size: pass both, or only per_device_train_batch_size (the "
                             "accumulation is then derived to keep dLLM-RL's rows per optimizer step), or neither.")
        if "gradient_accumulation_steps" not in overrides:
            per_device = overrides.get("per_device_train_batch_size", 1)
            if isinstance(per_device, bool) or not isinstance(per_device, int) or per_device < 1:
                raise ValueError(f"per_device_train_batch_size must be an integer >= 1, got {per_device!r}.")
            settings.update(per_device_train_batch_size=per_device,
                            gradient_accumulation_steps=_official_accumulation(name, settings, world, per_device))
        return cls(**settings)

    def _check_loss_numbers(self) -> None:
        """GRPO's loss numbers, which TRL reads unchecked: a NaN or infinite ``beta`` (or entropy coefficient) made
        every weight NaN, a NaN clip range trained nothing, while the logged loss read 0.0. An infinite clip range
        or threshold is no limit and stays allowed."""
        for name in _FINITE_LOSS_NUMBERS:
            value = getattr(self, name)
            if not (_is_real(value) and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0 (0: no KL term), got {self.beta}.")
        for name in ("epsilon", "epsilon_high", "delta", "off_policy_mask_threshold"):
            value = getattr(self, name)
            if (value is not None or name == "epsilon") and not (_is_real(value) and value >= 0):  # NaN fails
                optional = "" if name == "epsilon" else " or None"
                raise ValueError(f"{name} must be a number >= 0 (inf: no limit){optional}, got {value!r}.")
        for name in ("top_entropy_quantile", "ref_model_mixup_alpha"):
            value = getattr(self, name)
            if not (_is_real(value) and 0 <= value <= 1):
                raise ValueError(f"{name} must lie in [0, 1], got {value!r}.")

    def _check_objective(self) -> None:
        """Validate (and canonicalise) the TraceRL objective's fields."""
        self._check_loss_numbers()
        if isinstance(self.dynamic_group_filtering, bool):  # the former boolean field: True = drop all-equal groups
            self.dynamic_group_filtering = "all_equal" if self.dynamic_group_filtering else "none"
        if self.dynamic_group_filtering not in ("accuracy_band", "all_equal", "none"):
            raise ValueError("dynamic_group_filtering must be 'accuracy_band', 'all_equal' or 'none', got "
                             f"{self.dynamic_group_filtering!r}.")
        if not 0.0 <= self.group_accuracy_low <= self.group_accuracy_high <= 1.0:
            raise ValueError("need 0 <= group_accuracy_low <= group_accuracy_high <= 1, got "
                             f"{self.group_accuracy_low} and {self.group_accuracy_high}.")
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}.")
        if self.step_normalization not in STEP_NORMALIZATIONS:
            raise ValueError(f"step_normalization must be one of {STEP_NORMALIZATIONS}, got "
                             f"{self.step_normalization!r}.")
        if self.loss_type == "tracerl":
            if self.step_normalization == "sequence":
                raise ValueError("loss_type='tracerl' averages over training rows (response x merged step) and needs "
                                 "step_normalization 'step' or 'max_length'; with 'sequence' use a TRL loss type "
                                 "such as 'dapo'.")
            if self.importance_sampling_level != "token":
                raise ValueError("loss_type='tracerl' sums per-token terms; it needs importance_sampling_level="
                                 "'token'.")
        if self.kl_weighting not in ("as_policy", "row_sum"):
            raise ValueError(f"kl_weighting must be 'as_policy' or 'row_sum', got {self.kl_weighting!r}.")
        if self.kl_weighting == "row_sum" and self.loss_type != "tracerl":
            raise ValueError("kl_weighting='row_sum' sums each training row's KL before dividing by the number of "
                             f"rows, which only loss_type='tracerl' counts; got loss_type={self.loss_type!r}.")
        if self.kl_reference not in ("old_policy", "reference_model"):
            raise ValueError(f"kl_reference must be 'old_policy' or 'reference_model', got {self.kl_reference!r}.")
        if self.kl_reference == "old_policy" and self.sync_ref_model:
            raise ValueError("sync_ref_model=True needs kl_reference='reference_model' (with 'old_policy' the KL is "
                             "taken against the rollout policy; there is no reference model to synchronise).")
        if self.log_ratio_clip is not None and not self.log_ratio_clip > 0:
            raise ValueError(f"log_ratio_clip must be > 0 or None, got {self.log_ratio_clip}.")
        if self.reward_std not in ("population", "sample"):
            raise ValueError(f"reward_std must be 'population' or 'sample', got {self.reward_std!r}.")
        if self.advantage_baseline not in ("group_mean", "leave_one_out"):
            raise ValueError(f"advantage_baseline must be 'group_mean' or 'leave_one_out', got "
                             f"{self.advantage_baseline!r}.")
        # TRL reads these only at the first rollout (an unknown scale_rewards raises there; num_iterations=0 gives an
        # empty dataloader and a run that trains nothing): say so now
        if isinstance(self.scale_rewards, str):  # the command line's true / false: TRL's True / False
            self.scale_rewards = {"true": "group", "false": "none"}.get(self.scale_rewards.lower(), self.scale_rewards)
        if self.scale_rewards not in ("group", "batch", "none"):
            raise ValueError("scale_rewards must be 'group', 'batch' or 'none' (or True / False), got "
                             f"{self.scale_rewards!r}.")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}.")
        if self.reward_std == "population" and self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError("reward_std='population' scales the summed reward (multi_objective_aggregation="
                             "'sum_then_normalize'); with 'normalize_then_sum' set reward_std='sample' (TRL's).")
        if self.value_batch_size is not None and self.value_batch_size < 1:
            raise ValueError(f"value_batch_size must be >= 1 or None, got {self.value_batch_size}.")


_DLLM_RL_COMMON = dict(
    likelihood_estimator="trajectory", loss_type="tracerl", epsilon=0.2, beta=0.01, kl_reference="old_policy",
    use_bias_correction_kl=False, num_iterations=1, dynamic_group_filtering="accuracy_band", group_accuracy_low=0.2,
    group_accuracy_high=0.8, scale_rewards="group", reward_std="population", learning_rate=1e-6,
    lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
    weight_decay=0.0, max_grad_norm=1.0,
    # the trainers score raw logits, mask token in the softmax (rl_trado.py 660, 727; rl_dream.py 455, 609; rl_llada.py
    # 439, 579)
    scoring_temperature=1.0, exclude_mask_token_from_softmax=False,
    # the random_masking / coupled baselines' lower_p / upper_p (used when likelihood_estimator selects them)
    random_mask_low=0.1, random_mask_high=0.9,
)

OFFICIAL_SETTINGS: dict[str, dict] = {
    # configs/rl_trado.yaml, rl_trado_with_value.yaml; train/rl_trado.py, train_trado_value.py
    "trado": dict(
        _DLLM_RL_COMMON, num_generations=16, generation_batch_size=64 * 16, max_completion_length=2000,
        block_length=4, denoising_steps=4, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.9,
        temperature=1.0, top_k=0, top_p=1.0, shrinkage=1, training_block_size=4, step_normalization="max_length",
        log_ratio_clip=10.0, kl_weighting="as_policy", random_mask_sampling="per_token", masks_per_response=1,
        gamma=1.0, lam=1.0, cliprange_value=0.2, value_learning_rate=5e-6, value_batch_size=256,
        value_train_every=1,
    ),
    # configs/rl_dream.yaml; train/rl_dream.py
    "dream": dict(
        _DLLM_RL_COMMON, num_generations=8, generation_batch_size=32 * 8, max_completion_length=1024,
        block_length=32, denoising_steps=32, remasking_strategy="low_confidence_static", temperature=0.8, top_k=50,
        top_p=0.9, shrinkage=8, step_normalization="step", log_ratio_clip=None, kl_weighting="row_sum",
        random_mask_sampling="per_row", masks_per_response=35,
    ),
    # configs/rl_llada.yaml; train/rl_llada.py
    "llada": dict(
        _DLLM_RL_COMMON, num_generations=8, generation_batch_size=32 * 8, max_completion_length=512,
        block_length=32, denoising_steps=32, remasking_strategy="low_confidence_static", temperature=0.8, top_k=0,
        top_p=1.0, shrinkage=8, step_normalization="step", log_ratio_clip=None, kl_weighting="row_sum",
        random_mask_sampling="per_row", masks_per_response=35,
    ),
}
"""dLLM-RL's published RL settings per model family, as ``TraceRLConfig`` fields. Its configs train TraceRL
(``training.method: TraceRL``); the masking fields are its settings for the ``random_masking`` / ``coupled``
baselines, used when ``likelihood_estimator`` selects them. Hardware settings (bf16, gradient checkpointing,
DeepSpeed) and the run length are the recipes' (``trl_diffusion.recipes``); the batch layout: ``OFFICIAL_ROWS``."""

OFFICIAL_ROWS: dict[str, dict[str, int]] = {
    # GPUs x gradient accumulation x rows per micro-batch; a TraDo response has ~4 rows (the most merged steps in a
    # block, block 4), a Dream one 1024 / 8 merged steps, a LLaDA one 512 / 8
    "trado": dict(rows_per_optimizer_step=8 * 32 * 1, trajectory_rows_per_response=4),
    "dream": dict(rows_per_optimizer_step=8 * 128 * 2, trajectory_rows_per_response=128),
    "llada": dict(rows_per_optimizer_step=1 * 128 * 2, trajectory_rows_per_response=64),
}
"""dLLM-RL's training rows per optimizer step, and the TraceRL rows of a typical response, per family."""


def _official_accumulation(name: str, settings: dict, world: int, per_device: int = 1) -> int:
    """Gradient accumulation (``per_device`` responses per device per micro-step) that gives about as many training
    rows per optimizer step as dLLM-RL's: a divisor of the micro-steps per rollout, so that each rollout is whole
    steps."""
    estimator = settings["likelihood_estimator"]
    rows = OFFICIAL_ROWS[name]
    if estimator == "trajectory":
        per_response = rows["trajectory_rows_per_response"]
    elif estimator in MULTI_MASK_ESTIMATORS:  # a mask is one row, a coupled pair two
        per_response = settings["masks_per_response"] * (2 if estimator == "coupled_pairs" else 1)
    else:
        raise ValueError(f"dLLM-RL has no likelihood_estimator={estimator!r} ('coupled' is DiffuCoder's; dLLM-RL's "
                         "coupled method is 'coupled_pairs'): choose 'trajectory', 'random_masking' or "
                         "'coupled_pairs', or pass per_device_train_batch_size and gradient_accumulation_steps.")
    batch = settings.get("generation_batch_size")
    if batch is None and settings.get("steps_per_generation") is not None:
        batch = settings["steps_per_generation"] * world * per_device  # TRL's rollout: per_device per micro-step
    if batch is None or batch % (world * per_device):
        raise ValueError(f"{name}: a rollout of {batch} responses does not split over {world} processes x "
                         f"{per_device} per device; pass per_device_train_batch_size and gradient_accumulation_steps.")
    micro_steps = batch // (world * per_device)
    wanted = rows["rows_per_optimizer_step"] / per_response / world / per_device
    divisors = [d for d in range(1, micro_steps + 1) if micro_steps % d == 0]
    return min(divisors, key=lambda d: (abs(d - wanted), -d))


_FINITE_LOSS_NUMBERS = ("beta", "entropy_coef", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta",
                        "entropy_target", "sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos",
                        "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
"""GRPO fields that reach the loss as factors: NaN or an infinity there makes it NaN."""


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


_CACHE_VALUES = {"auto": "auto", "true": True, "false": False, "prefix": "prefix", "dual": "dual"}


def _cache_value(name: str, value) -> bool | str:
    """'auto' / True / False / 'prefix' / 'dual' from a Python value or its command-line / YAML string form."""
    key = str(value).strip().lower()
    if key not in _CACHE_VALUES:
        raise ValueError(f"{name} must be one of 'auto', True, False, 'prefix', 'dual' (or their strings), got "
                         f"{value!r}.")
    return _CACHE_VALUES[key]
