"""TraceRLTrainer: TRL's GRPOTrainer with diffusion rollouts and trajectory-aware likelihoods.

What changes relative to GRPO (everything else — rewards, advantages, loss types, clipping, KL, buffering,
logging, callbacks — is TRL's):

* rollouts come from the model's diffusion ``generate()``; the whole sampler canvas, its trajectory
  (``unmask_step``), the sampler's log-probs and per-row mask seeds travel with the batch as tensors;
* ``_get_per_token_logps_and_entropies`` scores completions with the configured likelihood estimator
  (TraceRL's ``trajectory`` by default) instead of causal next-token log-probs; for a mixture-of-experts model
  GRPO's load-balancing ``aux_loss`` (``router_aux_loss_coef``, default the config's) is the mean over those scoring
  forwards of each one's loss over the real tokens of its packed rows (rollouts never ask for router logits);
* the loss mask carries TraceRL's per-token weights (1/|tau(t)| or 1/L_max) and, for masking estimators, which
  tokens were scored; ``loss_type="tracerl"`` divides by the number of training rows (response x merged step, or
  dLLM-RL's rows of the masking baselines); with ``masks_per_response = m`` every per-token tensor of the loss is
  ``[B, m * C]`` (mask k in columns k * C ...); ``kl_weighting="row_sum"`` adds the KL with its own weights;
* the KL is taken against the rollout policy (``kl_reference="old_policy"``, dLLM-RL) or a frozen copy of the
  initial policy (``"reference_model"``); advantages use the population std (``reward_std``);
* group filtering (dLLM-RL's accuracy band, or all-equal groups) takes dropped groups out of every normaliser;
* optional ``value_model``: token-wise GAE advantages over merged denoising steps replace GRPO's scalar ones, and
  the value model trains with its own optimizer on each (k-th) generation batch.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import math
import os
import random
import types
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import asdict, dataclass, fields

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from accelerate.utils import AutocastKwargs, send_to_device
from datasets import Dataset, IterableDataset
from transformers import GenerationConfig
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.callbacks import SyncRefModelCallback
from trl.trainer.utils import disable_dropout_in_model, is_async_callable, pad

from ..best_metric import check_best_metric_names_a_set, usable_best_metric
from ..data.loading import dataset_label, empty_dataset_error
from ..estimators import MULTI_MASK_ESTIMATORS, EstimatorSettings, draw_masks, estimate_logprobs, row_sizes
from ..full_save import save_model_whole
from ..generation.sampling import stable_seed
from ..mask_token import SANITIZE_CONTROL_TOKENS, first_few, mask_token_name
from ..model_card import card_dataset_name, finish_adapter_card, finish_model_card, policy_quick_start
from ..models import check_router_aux_loss_coef, check_tokenizer, check_trains_parameters, model_argument
from ..models.common import without_autocast_wrapper
from ..models.kernels import apply_fused_kernels
from ..models.remote_code import carry_tokenizer_code, push_from_checkpoint_with_code
from ..recomputed_forwards import check_recomputed_forwards, recomputed_forwards
from ..states import (
    CanvasLayout,
    blocks_from_prompt_end,
    check_block_size_applies,
    completion_blocks,
    max_positions,
    resolve_model_attention_backend,
    through_first_stop,
    trajectory_groups,
)
from ..synced_forwards import agreed_forward_count, needs_synced_forwards
from ..value import (
    DiffusionValueModel,
    clipped_value_loss,
    outcome_token_rewards,
    step_gae,
    summarize_value_statistics,
    token_values,
    value_statistics,
)
from ..value.value_model import check_value_model, warn_if_half_precision
from ..vocabulary import embedding_rows
from ..zero3 import gathered, whole_state_dict
from .checkpoint_files import refuse_save_only_model, start_checkpoint_folder
from .eval_padding import EvaluatedLoader, padded_eval_batch, prefixed_eval_metrics
from .tracerl_config import TraceRLConfig
from .tracerl_objective import kept_groups, leave_one_out_scale, population_advantages, step_weights, training_rows

REFERENCE_STATE_NAME = "ref_model_state.pt"
"""A checkpoint's copy of the reference model's parameters, written when ``sync_ref_model`` changes them."""
CHECKPOINT_FILES = ("rollout_buffer_*.pt", "value_model", "value_state.pt", "ref_model_state*.pt")
"""What ``_save_checkpoint`` adds to a checkpoint (glob patterns; the reference is one file per process under FSDP)."""

_CLIP_RATIOS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
"""TRL's clip-ratio means: over the trained tokens, or over the rows with ``importance_sampling_level="sequence"``."""
_CLIP_EXTREMES = ("clip_ratio/low_min", "clip_ratio/high_max")
"""TRL's least and greatest per-row clip ratios (per row: 0 or 1 with ``importance_sampling_level="sequence"``)."""

# TRL loss types that average over the rows of a micro-batch: filtered rows must leave that count too
_ROW_MEAN_LOSSES = ("grpo", "sapo", "dr_grpo", "luspo")

logger = logging.get_logger(__name__)


def mask_seed(seed: int, rollout_step: int | str, sample_index: int) -> int:
    """A stable 63-bit seed for one row's random masks: the same for old, new and reference log-probs and for a
    resumed run, different across rows and rollouts (``rollout_step``: ``TraceRLTrainer._rollout_key``)."""
    return stable_seed(seed, rollout_step, sample_index)


class TraceRLTrainer(EvaluatedLoader, GRPOTrainer):
    """Trajectory-aware RL for diffusion language models (TraceRL, arXiv 2509.06949) on TRL's GRPOTrainer.

    Accepts everything ``GRPOTrainer`` accepts; ``args`` is a :class:`TraceRLConfig`. ``value_model`` (a
    :class:`~trl_diffusion.value.DiffusionValueModel` or a path for ``DiffusionValueModel.load``) switches on the
    value model: per-token advantages (``gamma``, ``lam``) and its own training (``cliprange_value``,
    ``value_learning_rate``, ``value_batch_size``, ``value_train_every``).
    """

    _tag_names = ["trl", "diffusion", "trl-diffusion", "tracerl"]  # the same tags on every trainer's card
    _name = "TraceRL"
    _paper = {
        "title": "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language Models",
        "id": "2509.06949",
        "citation": (
            "@article{wang2025tracerl,\n  title={Revolutionizing Reinforcement Learning Framework for Diffusion "
            "Large Language Models},\n  author={Wang, Yinjie and Yang, Ling and Li, Bowen and Tian, Ye and Shen, "
            "Ke and Wang, Mengdi},\n  journal={arXiv preprint arXiv:2509.06949},\n  year={2025}\n}"
        ),
    }

    def __init__(self, model, reward_funcs=None, args: TraceRLConfig | None = None, *pos, value_model=None, **kwargs):
        given = _grpo_arguments(pos, kwargs)
        model = model_argument(model, given.get("processing_class"), type(self).__name__)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = TraceRLConfig(f"{str(name).split('/')[-1]}-TraceRL")
        elif not isinstance(args, TraceRLConfig):
            raise TypeError(f"args must be a TraceRLConfig, got {type(args).__name__}.")
        args.check()  # a field set after the config was built is refused as at its construction
        if not isinstance(model, str):
            check_router_aux_loss_coef(model, args.router_aux_loss_coef)
        if args.cast_lm_head_to_fp32 and not isinstance(model, str) and model.get_output_embeddings() is None:
            raise ValueError("cast_lm_head_to_fp32=True needs a separate output layer; this model computes its logits "
                             "from the input embeddings (LLaDA with weight_tying=True).")
        multi_turn = [name for name in ("tools", "rollout_func", "environment_factory")
                      if given.get(name) is not None]
        if multi_turn:
            raise ValueError(f"{', '.join(multi_turn)} (TRL's tool calling / custom rollouts) cannot be used with "
                             "TraceRLTrainer: its rollouts are diffusion trajectories from model.generate(), and "
                             "the trainer scores exactly the states they record.")
        _check_datasets(given.get("train_dataset"), given.get("eval_dataset"), args)
        _check_reward_names(reward_funcs)
        kl_to_old = args.beta != 0.0 and args.kl_reference == "old_policy"
        own_reference = args.beta != 0.0 and args.kl_reference == "reference_model" and not isinstance(model, str) \
            and not _is_peft(model) and given.get("peft_config") is None
        beta = args.beta
        reference = None
        if own_reference:  # TRL would re-load the reference from config._name_or_path, which an in-memory model lacks
            # copy before TRL patches the policy's forward (a copy made later would call the policy's weights)
            reference = copy.deepcopy(model).eval()
        sync_reference = args.sync_ref_model
        if own_reference or kl_to_old:  # KL against pi_old needs no reference model at all
            args.beta, args.sync_ref_model = 0.0, False  # TRL refuses to sync a reference it did not build
        try:
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        finally:
            args.beta, args.sync_ref_model = beta, sync_reference
        unwrapped = self.accelerator.unwrap_model(self.model)
        base = unwrapped.get_base_model() if _is_peft(unwrapped) else unwrapped
        if not hasattr(base, "attention_kind"):
            raise TypeError(f"{type(base).__name__} is not a diffusion model of trl_diffusion (SDAR, LLaDA, Dream).")
        if args.cast_lm_head_to_fp32:  # TRL cast the weights (policy, and the reference it built) but not autocast
            run_output_layer_in_fp32(base.get_output_embeddings())
            if self.ref_model is not None:
                run_output_layer_in_fp32(self.accelerator.unwrap_model(self.ref_model).get_output_embeddings())
        self._mask_token_id = base.mask_token_id  # raises a clear error when the model has no mask token
        check_tokenizer(self._tokenizer, base)
        self._check_chat_template()
        self._check_prompts_without_mask_token()
        self._check_chat_template_kwargs_apply()
        self._check_reward_datasets()
        self.beta = beta
        if args.loss_type == "tracerl":
            # TRL's `dapo` branch divides by `num_items_in_batch`; TraceRL sets it to the number of training rows
            self.loss_type = "dapo"
        if self._entropy_bonus_enabled and args.dynamic_group_filtering != "none" and (
                args.gradient_accumulation_steps > 1 or self.accelerator.num_processes > 1):
            raise ValueError("the entropy bonus with group filtering is supported on one process without gradient "
                             "accumulation only: TRL's bonus is each micro-batch's mean entropy divided by "
                             "gradient_accumulation_steps (and averaged over processes), and a micro-batch whose "
                             "rows were all filtered adds 0 yet counts, so the bonus would shrink with the fraction "
                             "of micro-batches that kept a group (0.55 of entropy_coef at batch 1 x accumulation 8 "
                             "with half the groups filtered). Set dynamic_group_filtering='none' or entropy_coef=0 "
                             f"(got gradient_accumulation_steps={args.gradient_accumulation_steps} on "
                             f"{self.accelerator.num_processes} process(es)).")
        if self._entropy_bonus_enabled and args.dynamic_group_filtering != "none" \
                and args.loss_type in _ROW_MEAN_LOSSES:
            raise ValueError(f"the entropy bonus with loss_type={args.loss_type!r} and group filtering is not "
                             "supported (filtered rows are taken out of the row count by rescaling the loss); use "
                             "loss_type 'tracerl' or 'dapo', or dynamic_group_filtering='none'.")
        if args.loss_type == "bnpo" and args.dynamic_group_filtering != "none" and (
                args.gradient_accumulation_steps > 1 or self.accelerator.num_processes > 1):
            raise ValueError("loss_type='bnpo' with group filtering is supported on one process without gradient "
                             "accumulation only: bnpo divides each micro-batch's loss by that micro-batch's weight "
                             "sum, then by gradient_accumulation_steps (and averages over processes), so a "
                             "micro-batch whose groups were all filtered adds 0 yet counts, and the step shrinks "
                             "with the fraction of micro-batches that kept a group (half the gradient with half of "
                             "them filtered). Use loss_type 'dapo' (bnpo's weighted mean over the whole generation "
                             "batch) or 'tracerl', or dynamic_group_filtering='none' (got gradient_accumulation_steps="
                             f"{args.gradient_accumulation_steps} on {self.accelerator.num_processes} process(es)).")
        if self.aux_loss_enabled and args.dynamic_group_filtering != "none" and args.loss_type in _ROW_MEAN_LOSSES:
            raise ValueError(f"the mixture-of-experts load-balancing loss (router_aux_loss_coef="
                             f"{self.router_aux_loss_coef}) with loss_type={args.loss_type!r} and group filtering is "
                             "not supported (filtered rows are taken out of the row count by rescaling the loss, "
                             "which would rescale the router loss too); use loss_type 'tracerl' or 'dapo', "
                             "dynamic_group_filtering='none', or router_aux_loss_coef=0.")
        check_block_size_applies("training_block_size", args.training_block_size, base.block_size)
        _warn_other_block_size(base.block_size, args)
        self._rollout_cache = _rollout_cache(args.rollout_cache, base)
        _check_completion_fits(base, args)
        zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        self._rollout_graphs = _rollout_cuda_graphs(args, self.is_fsdp_enabled, zero_stage)
        _check_optimizer_reset(args, self.is_deepspeed_enabled)
        check_recomputed_forwards(args.recompute_scoring_forwards, self.is_fsdp_enabled, zero_stage,
                                  "recompute_scoring_forwards", self.model)
        if own_reference:
            reference.requires_grad_(False)
            if args.disable_dropout:
                disable_dropout_in_model(reference)
            if args.cast_lm_head_to_fp32:  # TRL casts the reference it builds; this one it never sees
                cast_output_layer_to_fp32(reference)
            if self.is_deepspeed_enabled:
                reference = prepare_deepspeed(reference, self.accelerator)
            elif self.is_fsdp_enabled:
                reference = prepare_fsdp(reference, self.accelerator)
            else:
                reference = self.accelerator.prepare_model(reference, evaluation_mode=True)
            self.ref_model = reference
            if sync_reference:
                self.add_callback(SyncRefModelCallback(ref_model=reference, accelerator=self.accelerator))
        # the sampler's and the scorer's settings, read once and together (as TRL does): whatever is later set on
        # self.args, rollouts sample the distribution the trainer scores
        self._rollout_settings = sampled = RolloutSettings.from_args(args)
        training_block = args.training_block_size or sampled.block_length
        multi_mask = args.likelihood_estimator in MULTI_MASK_ESTIMATORS
        self.estimator_settings = EstimatorSettings(
            name=args.likelihood_estimator, shrinkage=args.shrinkage, block_size=training_block,
            temperature=sampled.temperature if args.scoring_temperature is None else args.scoring_temperature,
            token_budget=args.scoring_token_budget, mask_low=args.random_mask_low, mask_high=args.random_mask_high,
            coupled_low=args.coupled_low, coupled_high=args.coupled_high, prompt_mask_prob=args.prompt_mask_prob,
            attention_backend=resolve_model_attention_backend(args.attention_backend, base, self.accelerator.device,
                                                              training=False),
            random_mask_sampling=args.random_mask_sampling if multi_mask else "per_token",
            masks_per_response=args.masks_per_response if multi_mask else 1,
            exclude_mask_token=args.exclude_mask_token_from_softmax, rollout_block_length=sampled.block_length,
        )
        if args.shrinkage != 1 and args.likelihood_estimator != "trajectory" and value_model is None:
            logger.warning(f"shrinkage={args.shrinkage} has no effect here: it merges the steps of the rollout's "
                           f"trajectory, which likelihood_estimator={args.likelihood_estimator!r} does not score (it "
                           "draws its own masks), and there is no value model, whose states it would also merge.")
        apply_fused_kernels(args.fused_kernels, self.model, self.ref_model)
        self.reward_funcs = [_name_errors(f, n) for f, n in zip(self.reward_funcs, self.reward_func_names)]
        self._scoring: dict | None = None  # the rows being scored: canvas, trajectory, seeds, sampler log-probs
        self._loss_inputs: dict | None = None  # the micro-batch inside _compute_loss (old log-probs, KL target)
        self._rollout_rewards: torch.Tensor | None = None
        self._rollout_stats: list[float] = []  # this process's sampler statistics of the last rollout
        self._eval_batches = 0  # eval generation batches of the running evaluation: see _rollout_key
        self._rollout_global_step: int | None = None  # the optimizer step during which the training rollout was made
        self._flat_reward_batches = 0  # training generation batches in a row without a group of differing rewards
        self.value_model = self.value_optimizer = None
        self._value_batches = 0  # training generation batches seen by the value model
        if value_model is None:
            _warn_value_fields_unread(args)
        else:
            if args.advantage_baseline != "group_mean":
                raise ValueError(f"advantage_baseline={args.advantage_baseline!r} sets the reward baseline of group "
                                 "advantages; with a value model the advantages are GAE's (the value is the "
                                 "baseline). Use advantage_baseline='group_mean' or no value model.")
            self._setup_value_model(value_model, base)

    def train(self, *args, **kwargs):
        """Trainer's ``train``, refusing first a model with no trainable parameter (``check_trains_parameters``):
        evaluating a frozen model is fine, training it would change nothing."""
        check_trains_parameters(self.model, f"{type(self).__name__}'s model")
        return super().train(*args, **kwargs)

    def _datasets(self) -> dict:
        """The train and eval datasets by name (``eval 'a'`` for a named eval set, as the SFT trainer names it)."""
        evals = self.eval_dataset if isinstance(self.eval_dataset, dict) else {None: self.eval_dataset}
        return {"train": self.train_dataset,
                **{"eval" if name is None else dataset_label("eval", name): data for name, data in evals.items()}}

    def _check_reward_datasets(self) -> None:
        """Let each reward function that can (``check_dataset``: the code rewards) refuse rows it cannot score, when
        the trainer is built: a refused row raised only when its batch came up, steps into training."""
        for func in self.reward_funcs:
            check = getattr(func, "check_dataset", None)
            if callable(check):
                for split, dataset in self._datasets().items():
                    if isinstance(dataset, Dataset):  # a stream is not read ahead
                        check(dataset, split)

    def _chat_prompts(self) -> dict[str, bool]:
        """For each train / eval dataset that declares a ``prompt`` column in its features, whether its prompts are
        chat messages (else text). Read from the features, so a stream is not read ahead."""
        kinds = {}
        for split, dataset in self._datasets().items():
            features = getattr(dataset, "features", None) or {}
            if "prompt" in features:
                kinds[split] = _is_list_type(features.arrow_schema.field("prompt").type)
        return kinds

    def _check_chat_template(self) -> None:
        """Refuse train and eval datasets of chat-message prompts when the tokenizer has no chat template (a base
        model's): TRL's rollout failed on them at the first batch, steps into training. A stream without features
        fails at its first batch with TRL's error."""
        if getattr(self._tokenizer, "chat_template", None) is not None:
            return
        for split, chat in self._chat_prompts().items():
            if chat:
                raise ValueError(f"the {split} dataset's prompts are chat messages, but the tokenizer has no chat "
                                 "template (a base model's): give the prompts as text, or use a tokenizer with a "
                                 "chat template.")

    def _check_chat_template_kwargs_apply(self) -> None:
        """Refuse ``chat_template_kwargs`` with a dataset of text prompts: TRL passes them to the chat template, which
        text prompts never go through, so they were ignored without a word (``trl-diffusion eval`` refuses the
        same)."""
        if not self.chat_template_kwargs:
            return
        for split, chat in self._chat_prompts().items():
            if not chat:
                raise ValueError(f"chat_template_kwargs {self.chat_template_kwargs} apply to conversational prompts, "
                                 f"which go through the chat template, but the {split} dataset's prompts are text "
                                 "(examples/math.py's --prompt_template builds such prompts): leave "
                                 "chat_template_kwargs unset, or give the prompts as chat messages.")

    def _check_prompts_without_mask_token(self) -> None:
        """Refuse, naming their rows, the prompts of map-style train and eval datasets that tokenize to the mask id
        (their text holds the mask token's string): ``generate()`` would refuse them only when their batch is rolled
        out, steps into training. Only the rows whose text holds the string are tokenized, as TRL tokenizes prompts
        (with ``chat_template_kwargs``: ``sanitize_control_tokens=True`` encodes it as text in conversations)."""
        added = self._tokenizer.added_tokens_decoder.get(self._mask_token_id)
        if added is None:  # an ordinary vocabulary piece (every released family's is an added token): any text may
            return  # tokenize to it, which only tokenizing every prompt would find; the rollout check names it
        splits = self._datasets()
        sanitized = bool(self.chat_template_kwargs.get("sanitize_control_tokens"))
        for split, dataset in splits.items():
            if not isinstance(dataset, Dataset):  # a stream is not read ahead: generate() refuses such a prompt
                continue
            held = (row for row, prompt in enumerate(dataset["prompt"])  # str(): every message's content too
                    if added.content in str(prompt) and self._mask_token_id in self._tokenize_prompts([prompt])[0][0])
            rows = list(itertools.islice(held, 6))
            if rows:
                fix = "" if sanitized else f", or for conversational prompts pass {SANITIZE_CONTROL_TOKENS}"
                raise ValueError(f"the prompts of the {split} dataset's row(s) {first_few(rows)} hold "
                                 f"{mask_token_name(self._mask_token_id, added.content)}, which the model would read "
                                 f"as a position to fill (generate() refuses such a prompt). Remove or escape it in "
                                 f"these prompts{fix}.")

    # ------------------------------------------------------------------------------------------------ rollouts
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None and any(images):
            raise ValueError("TraceRLTrainer does not support images.")
        held = next((ids for ids in prompt_ids if self._mask_token_id in ids), None)
        if held is not None:  # a streamed or evaluate() dataset's prompt: generate() would name no prompt
            raise ValueError(f"a prompt holds {mask_token_name(self._mask_token_id)}, which the model would read as a "
                             f"position to fill: {self._tokenizer.decode(held)!r}. Remove or escape it in the prompt "
                             f"(for conversational prompts, {SANITIZE_CONTROL_TOKENS}).")
        device = self.accelerator.device
        tensors = [torch.tensor(ids, dtype=torch.long) for ids in prompt_ids]  # an empty one too (not float32)
        prompt = pad(tensors, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left").to(device)
        rows = len(prompt_ids)
        first = self.accelerator.process_index * rows
        rollout_step = self._rollout_key()
        if self.model.training:
            self._rollout_global_step = self.state.global_step
        seeds = torch.tensor([mask_seed(self.args.seed, rollout_step, first + i) for i in range(rows)])
        # one sampling generator per row, keyed like the masks: a row's rollout does not depend on its batch or
        # process, so a 2-process run samples exactly what a 1-process run with twice the batch samples
        generator = [torch.Generator().manual_seed(mask_seed(self.args.seed + 1, rollout_step, first + i))
                     for i in range(rows)]
        with (
            # GRPOTrainer's call: the checkpointing it turns off for the rollout comes back with the run's kwargs
            unwrap_model_for_generation(
                self.model_wrapped, self.accelerator, gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs) as unwrapped,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),  # FSDP1's root weights, as TRL does
        ):
            peft_model = _is_peft(unwrapped)
            model = unwrapped.get_base_model() if peft_model else unwrapped
            # accelerate runs the prepared model's forward under its mixed-precision autocast; a PEFT model's base
            # model generates through its own forward, so it gets the same autocast here (without the weight-cast
            # cache, which a CUDA-graph capture must not fill) and samples the policy the trainer scores
            precision = (self.accelerator.autocast(AutocastKwargs(cache_enabled=False)) if peft_model
                         else contextlib.nullcontext())
            with precision:
                out = model.generate(prompt, prompt_mask, **self._rollout_sampler(),
                                     cuda_graphs=self._rollout_graphs, return_dict_in_generate=True,
                                     generator=generator)
        width = prompt.shape[1]
        canvas, steps, logps = out.sequences[:, width:], out.unmask_step[:, width:], out.token_logprobs[:, width:]
        self._scoring = {"canvas_ids": canvas, "unmask_step": steps, "mask_seeds": seeds.to(device),
                         "sampler_logps": logps}
        block_length = self._rollout_settings.block_length
        blocks = completion_blocks(prompt_mask, steps.shape[1], block_length if model.block_size else None)
        if blocks is None:  # full attention: blocks start at the end of the (left-padded) prompt
            blocks = blocks_from_prompt_end(torch.ones_like(steps, dtype=torch.bool), block_length)
        # logged in _log_rollout_stats, over every process (no collective here: TRL may call this method a
        # different number of times per process)
        self._rollout_stats = [out.tokens_per_step.float().sum().item(), out.denoising_steps.float().sum().item(),
                               float(rows), float(blocks_generated(steps, blocks).sum()),
                               float(out.num_forward_passes)]
        # each completion: through its last committed token (at most max_completion_length), cut after a stop token
        columns = torch.arange(steps.shape[1], device=device)
        last_committed = torch.where(steps >= 0, columns, -1).max(-1, keepdim=True).values
        kept = (columns <= last_committed) & (columns < self.max_completion_length)
        kept = through_first_stop(canvas, kept, torch.tensor(list(self.eos_token_ids), device=device))
        lengths = kept.sum(-1).tolist()
        completion_ids = [row[:length] for row, length in zip(canvas.tolist(), lengths)]
        completion_logps = [row[:length] for row, length in zip(logps.tolist(), lengths)]
        return completion_ids, completion_logps

    def _rollout_sampler(self) -> dict:
        """The ``generate()`` arguments of every rollout that decide its tokens (``cuda_graphs`` and the generators
        aside); also what a saved model's ``generation_config.json`` holds (``_rollout_generation_config``). The
        config's sampler fields come from the trainer's construction (``RolloutSettings``), as the scoring settings
        do, so a later change to ``self.args`` cannot make rollouts sample what the trainer does not score."""
        settings = asdict(self._rollout_settings)
        if settings["remasking_strategy"] != "low_confidence_dynamic":  # read by that strategy only (generate()
            del settings["confidence_threshold"]                           # warns about it otherwise)
        return {"max_new_tokens": self.max_completion_length, **settings,
                # every sampler argument is given (top_k 0 and top_p 1.0 = off, alg_temp and cfg_scale 0 = none): one
                # left unset would come from the checkpoint's generation_config.json (TraDo's: Qwen3's top_k 20 and
                # top_p 0.95), not from this config
                "alg_temp": 0.0, "cfg_scale": 0.0,
                "use_cache": self._rollout_cache, "num_return_sequences": 1,  # TRL repeats the prompts itself
                "stop_token_ids": list(self.eos_token_ids), "pad_token_id": self._tokenizer.pad_token_id}

    def _rollout_key(self) -> int | str:
        """What keys this generation batch's random streams (sampling and masks), unique per generation batch: the
        optimizer step, plus the micro-step within it when a step generates several batches (steps_per_generation *
        num_iterations < gradient_accumulation_steps), plus the batch index for evaluation (every eval batch runs at
        the same step). Without the extra parts those batches would reuse the same streams row for row. The batch
        index counts from 0 in every evaluation, so an evaluation at a given step samples the same whatever ran
        before it (another eval set, a failed or repeated evaluation)."""
        step = self.state.global_step
        if self.model.training:
            within = self._step % self.args.gradient_accumulation_steps
            return step if within == 0 else f"{step}.{within}"
        self._eval_batches += 1
        return f"eval:{step}.{self._eval_batches - 1}"

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        infinite = rewards.isinf().any(0)  # gathered, so every process raises together
        if infinite.any():
            names = [name for name, bad in zip(self.reward_func_names, infinite.tolist()) if bad]
            raise ValueError(f"reward functions {names} returned an infinite reward; rewards must be finite numbers "
                             "(None, or NaN, marks 'not applicable').")
        self._rollout_rewards = rewards  # gathered across processes; used by dynamic group filtering
        if self.model.training:
            self._watch_reward_signal(rewards)
        return rewards

    identical_rewards_patience = 10
    """Training generation batches in a row in which no group's rewards differ before the trainer warns."""

    def _watch_reward_signal(self, rewards: torch.Tensor) -> None:
        """Warn (once per run of flat batches) when, for ``identical_rewards_patience`` generation batches in a row,
        every group's completions got identical rewards: every advantage is then 0 and the policy does not move."""
        total = torch.nansum(rewards * self.reward_weights.to(rewards.device), dim=1)
        groups = total.view(-1, self.num_generations)
        flat = bool(((groups.max(1).values - groups.min(1).values) == 0).all())
        self._flat_reward_batches = self._flat_reward_batches + 1 if flat else 0
        if self._flat_reward_batches == self.identical_rewards_patience and self.accelerator.is_main_process:
            seen = sorted({round(v, 4) for v in total.tolist()})
            logger.warning(
                f"TraceRL: for {self._flat_reward_batches} generation batches in a row every group's completions got "
                f"identical rewards (values seen: {seen[:5]}), so every advantage is 0 and nothing is learned. Check "
                "that the prompts are in the format the model was trained on (the embedded model wants plain "
                "prompts: to_dataset(problems, EMBEDDED_FORMAT)), that the reward function reads the right dataset "
                "columns, that max_completion_length leaves room for an answer, and look at the completions "
                "(log_completions=True)."
            )

    def _reset_optimizer_state(self) -> None:
        """dLLM-RL's fresh optimizers at every rollout: AdamW's moments and step counts cleared, policy and value
        model (re-created optimizers with the same settings would start exactly so)."""
        for optimizer in (self.optimizer, self.value_optimizer):
            if optimizer is not None:
                optimizer.state.clear()

    def _generate_and_score_completions(self, inputs):
        if self.model.training and self.args.reset_optimizer_per_rollout:
            self._reset_optimizer_state()
        kl_to_old = self.beta != 0.0 and self.args.kl_reference == "old_policy"
        beta, self.beta = self.beta, (0.0 if kl_to_old else self.beta)  # no reference forward for a KL to pi_old
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self.beta = beta
        mode = "train" if self.model.training else "eval"
        self._log_rollout_stats(mode)
        scoring = self._scoring
        output.update(scoring)
        # TRL's off-policy sequence mask would compare the scored log-probs with these, the sampler's log-probs of
        # the trajectory; the masking estimators (and merged steps, another scoring temperature) score other
        # quantities, so it measures pi_theta against pi_old as the trainer scores them (TRL's non-vLLM rule)
        output.pop("sampling_per_token_logps", None)
        rows, width = output["completion_ids"].shape
        completion_mask = output["completion_mask"]
        kept_responses = self._kept_responses(rows, mode)
        keep = self._local(kept_responses, rows)
        if self.args.reward_std == "population":
            output["advantages"] = self._population_advantages(rows, mode, kept_responses)
        if self.args.advantage_baseline == "leave_one_out":  # r - mean of the k - 1 others = (r - mean) k / (k - 1)
            group = self.num_generations if mode == "train" else self.num_generations_eval
            scale = leave_one_out_scale(self._rewards(), group).to(output["advantages"].dtype)
            output["advantages"] = output["advantages"] * self._local(scale, rows)
        trainable = completion_mask.bool() & _fit_width(scoring["unmask_step"] >= 0, width) & keep[:, None]
        weights, training_rows_, trained = self._loss_weights(output["prompt_mask"], scoring, trainable)
        # with m masks per response every per-token tensor of the loss is [B, m * C], mask k in columns k * C ...
        masks = self.estimator_settings.masks_per_response
        output["completion_mask"] = completion_mask.float().repeat(1, masks) * weights
        if self.args.kl_weighting == "row_sum":
            output["kl_weights"] = trained  # every trained token's KL counts once: a row's KL is its sum
        # TRL's normaliser counts only what is trained: tracerl, the training rows; dapo / cispo / vespo, the token
        # weights (their loss is sum(w * l) / sum(w), as bnpo's over one micro-batch; a token count divided the
        # weighted sum by the tokens per step, or by L_max, instead)
        count = training_rows_.sum() if self.args.loss_type == "tracerl" else output["completion_mask"].sum()
        output["num_items_in_batch"] = self.accelerator.gather(count.float()).sum()
        output["kept_rows"] = keep.float()
        if self.args.loss_type in _ROW_MEAN_LOSSES:
            # these losses average over every row of a micro-batch (and over the accumulation steps): filtered rows
            # must leave that count, over the generation batch of every process (as the other losses' normaliser)
            kept, total = self.accelerator.reduce(torch.stack([keep.sum(), torch.tensor(rows, device=keep.device)])
                                                  .float(), reduction="sum")
            output["kept_row_scale"] = total / kept if kept > 0 else torch.ones_like(total)
        if self.value_model is not None:
            # the value model scores trajectory states, one value per completion token: its loss takes each token's
            # weights summed over the masks, and its advantages are tiled over them
            folded = weights.view(rows, masks, width).sum(1)
            advantages = self._value_advantages(output, trainable, folded, training_rows_, mode)
            output["advantages"] = advantages.repeat(1, masks)
            per_response = (advantages * trainable).sum(1) / trainable.sum(1).clamp(min=1)
            self._log_advantages(self.accelerator.gather(per_response))
        else:
            self._log_advantages(self.accelerator.gather(output["advantages"]) * kept_responses)
        return output

    def _log_advantages(self, advantages: torch.Tensor) -> None:
        """Make the completions table's ``advantage`` column (``log_completions``; TRL logs its own group advantages
        for the generation batch, every process's rows) what the loss uses: ``advantages`` ``[N]``, 0 for a response
        of a group ``dynamic_group_filtering`` dropped, the mean of its trained tokens' GAE advantages with a value
        model."""
        logged = self._logs["advantages"]  # a bounded deque TRL just extended
        values = advantages.tolist()[-len(logged):] if logged else []
        for i, value in enumerate(values):
            logged[len(logged) - len(values) + i] = value

    def _log_rollout_stats(self, mode: str) -> None:
        """The sampler's metrics over every process's rows, as one process sampling the whole generation batch
        would log them: per-row sums (steps, blocks each row generated) and row counts are added; the forward
        passes are the largest count of any process."""
        stats = torch.tensor(self._rollout_stats, device=self.accelerator.device)
        sums = self.accelerator.reduce(stats[:4].clone(), reduction="sum")
        largest = self.accelerator.gather(stats[None, 4:].clone()).amax(0)
        self._metrics[mode]["rollout/tokens_per_step"].append((sums[0] / sums[2]).item())
        self._metrics[mode]["rollout/forward_passes"].append(largest[0].item())
        self._metrics[mode]["rollout/denoising_steps_per_block"].append((sums[1] / sums[3].clamp(min=1)).item())

    def _rewards(self) -> torch.Tensor:
        """``[N]`` weighted, summed reward of every response of the generation batch (all processes), NaN where
        every reward function declined to score (TRL's unscorable rows)."""
        per_func = self._rollout_rewards
        rewards = torch.nansum(per_func * self.reward_weights.to(per_func.device), dim=1)
        return torch.where(torch.isnan(per_func).all(dim=1), torch.nan, rewards)

    def _local(self, values: torch.Tensor, local_rows: int) -> torch.Tensor:
        start = self.accelerator.process_index * local_rows
        return values[start : start + local_rows].to(self.accelerator.device)

    def _population_advantages(self, local_rows: int, mode: str, kept: torch.Tensor) -> torch.Tensor:
        """dLLM-RL's advantages (population std, 0 when it is 0) in place of TRL's (this process's rows). The groups
        ``dynamic_group_filtering`` drops are left out of the statistics, as if not sampled (``scale_rewards='batch'``
        took its std over them too: one all-correct group dropped from eight rows scaled the others' by 1.15)."""
        group = self.num_generations if mode == "train" else self.num_generations_eval
        rewards = self._rewards()
        rewards = torch.where(kept.to(rewards.device), rewards, torch.nan)  # NaN: out of the statistics, advantage 0
        advantages = population_advantages(rewards, group, self.args.scale_rewards)
        return self._local(advantages, local_rows)

    def _kept_responses(self, local_rows: int, mode: str) -> torch.Tensor:
        """``[N]`` (every process's responses) False for those of the groups ``dynamic_group_filtering`` drops."""
        args = self.args
        if args.dynamic_group_filtering == "none" or self._rollout_rewards is None:
            return torch.ones(self.accelerator.num_processes * local_rows, dtype=torch.bool,
                              device=self.accelerator.device)
        group = self.num_generations if mode == "train" else self.num_generations_eval
        keep = kept_groups(self._rewards(), group, args.dynamic_group_filtering, args.group_accuracy_low,
                           args.group_accuracy_high)
        self._metrics[mode]["filtered_groups"].append(1.0 - keep.float().mean().item())
        return keep.to(self.accelerator.device)

    def _loss_weights(self, prompt_mask: torch.Tensor, scoring: dict,
                      trainable: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-token loss weights ``[B, W]``, the number of training rows ``[B]`` and the trained tokens ``[B, W]``
        (1 where a token is in the loss, once per row that trains it); ``W = masks_per_response x C``.

        Trajectory: 1/|tau(t)| (``step``), 1/L_max (``max_length``) or 1 (``sequence``); a row per merged step (for
        ``max_length`` on block models, per r-th merged step of every block). Masking estimators, under
        ``loss_type='tracerl'``: the scored tokens weighted 1/(their row's size) (``step``) or 1/L_max
        (``max_length``); dLLM-RL's rows (``random_masking``: one per mask, ``coupled_pairs``: two per pair;
        ``coupled`` / ``mean_field``: one per response), empty rows not counted. Under TRL's loss types the scored
        tokens, 1/masks_per_response each (the masks' estimates averaged)."""
        args, settings = self.args, self.estimator_settings
        steps, width = scoring["unmask_step"], trainable.shape[1]
        trained = trainable.float()
        if args.step_normalization == "max_length":
            longest = self.accelerator.gather(trainable.sum(1).max()[None]).max()
            length_weight = 1.0 / longest.clamp(min=1).float()
        if settings.name != "trajectory":
            masks = settings.masks_per_response
            draws = draw_masks(settings, steps >= 0, scoring["mask_seeds"], prompt_mask.shape[1])
            kept = _per_mask(draws["scored"], masks, width).bool() & trainable.repeat(1, masks)
            if draws["row"] is None:  # coupled, mean_field: the response is one row
                row = torch.zeros_like(kept, dtype=torch.long)
            else:
                row = _per_mask(draws["row"], masks, width)
            tokens_per_row, rows = row_sizes(row, kept)
            kept = kept.float()
            if args.loss_type != "tracerl" or args.step_normalization == "sequence":
                return kept / masks, rows, kept
            if args.step_normalization == "step":
                return kept / tokens_per_row.clamp(min=1), rows, kept
            return kept * length_weight, rows, kept
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if _is_peft(model) else model
        block = settings.block_size if base.block_size is not None else None
        groups = _fit_width(trajectory_groups(steps, prompt_mask, settings.shrinkage, block), width)
        blocks = completion_blocks(prompt_mask, width, block)
        rows = training_rows(groups, trainable, blocks, stack_blocks=args.step_normalization == "max_length")
        if args.step_normalization == "step":
            return step_weights(groups, trainable), rows, trained
        if args.step_normalization == "max_length":
            return trained * length_weight, rows, trained
        return trained, rows, trained

    def _own_state_tokens(self, prompt_mask: torch.Tensor, unmask_step: torch.Tensor) -> torch.Tensor:
        """True for committed tokens the trajectory estimator scores given the state the sampler committed them
        from: those of the first denoising step of their merged group (every committed token at shrinkage 1)."""
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if _is_peft(model) else model
        settings = self.estimator_settings
        groups = trajectory_groups(unmask_step, prompt_mask, settings.shrinkage,
                                   settings.block_size if base.block_size is not None else None)
        committed = groups >= 0
        if not bool(committed.any()):
            return committed
        index = groups.clamp(min=0)
        late = int(unmask_step.max()) + 1
        first = torch.full((groups.shape[0], int(groups.max()) + 1), late, device=groups.device,
                           dtype=unmask_step.dtype)
        first = first.scatter_reduce(1, index, torch.where(committed, unmask_step, late), reduce="amin")
        return committed & (unmask_step == first.gather(1, index))

    # ------------------------------------------------------------------------------------------------ value model
    def _setup_value_model(self, value_model, policy) -> None:
        """Check the value model against the policy, place and prepare it like the policy, give it an optimizer."""
        args = self.args
        if isinstance(value_model, (str, os.PathLike)):
            # in float32 unless model_init_kwargs names a dtype, as TRL loads a policy path
            value_model = DiffusionValueModel.load(str(value_model), dtype=_path_dtype(args.model_init_kwargs))
        check_value_model(value_model, "value_model")
        check_trains_parameters(value_model, f"{type(self).__name__}'s value_model")
        without_autocast_wrapper(value_model)  # a warm-start trainer's bf16 autocast, if it ran in bf16
        value_model = value_model.whole()  # kept whole on every process, also one loaded partitioned under ZeRO-3
        if value_model.mask_token_id != policy.mask_token_id:
            raise ValueError(f"the value model's mask_token_id ({value_model.mask_token_id}) differs from the "
                             f"policy's ({policy.mask_token_id}): it must share the policy's tokenizer.")
        check_tokenizer(self._tokenizer, value_model)
        rows, policy_rows = embedding_rows(value_model), embedding_rows(policy)
        if rows < max(policy_rows, len(self._tokenizer)):  # it reads every token the policy samples
            raise ValueError(f"the value model's embedding has {rows} rows, fewer than the policy's ({policy_rows}) "
                             f"or the tokenizer's ({len(self._tokenizer)} tokens): it reads every token the policy "
                             "samples, any of the policy's rows. Build it from the policy (DiffusionValueModel."
                             "from_policy) or resize its embedding to the policy's.")
        if value_model.attention_kind != policy.attention_kind:
            raise ValueError(f"the value model's attention ({value_model.attention_kind}) differs from the policy's "
                             f"({policy.attention_kind}); use a backbone of the policy's family.")
        if getattr(self.accelerator, "is_fsdp2", False):
            raise NotImplementedError("a value model under FSDP2 is not supported yet; use DDP, FSDP1 or DeepSpeed.")
        warn_if_half_precision(value_model, args.value_learning_rate, "value_learning_rate")
        if getattr(args, "activation_checkpointing", args.gradient_checkpointing):
            _enable_checkpointing(value_model, args)
        if args.disable_dropout:
            disable_dropout_in_model(value_model)
        apply_fused_kernels(args.fused_kernels, value_model)
        self.value_model = self.accelerator.prepare_model(value_model)
        # the policy optimizer's parameter groups (transformers' Trainer): no weight decay on norms and biases
        decayed = set(self.get_decay_parameter_names(self.value_model))
        named = [(name, p) for name, p in self.value_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for name, p in named if name in decayed], "weight_decay": args.weight_decay},
                  {"params": [p for name, p in named if name not in decayed], "weight_decay": 0.0}]
        self.value_optimizer = torch.optim.AdamW([group for group in groups if group["params"]],
                                                 lr=args.value_learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                                 eps=args.adam_epsilon)

    def _token_values(self, prompt_ids, prompt_mask, canvas_ids, unmask_step) -> tuple[torch.Tensor, torch.Tensor]:
        settings, unwrapped = self.estimator_settings, self.accelerator.unwrap_model(self.value_model)
        with recomputed_forwards(unwrapped, self.args.recompute_scoring_forwards):
            return token_values(self.value_model, prompt_ids, prompt_mask, canvas_ids, unmask_step,
                                settings.shrinkage, settings.block_size, settings.token_budget, unwrapped,
                                settings.attention_backend)

    def _value_advantages(self, output: dict, trainable: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor,
                          mode: str) -> torch.Tensor:
        """``[B, C]`` GAE advantages from the value model as it is now (GRPO's normalised reward is the outcome
        reward on each response's last step); then, on every ``value_train_every``-th training batch, one epoch of
        value updates towards the returns over the rows that survived the group filter."""
        width = trainable.shape[1]
        inputs = (output["prompt_ids"], output["prompt_mask"], output["canvas_ids"], output["unmask_step"])
        self.value_model.eval()
        with torch.no_grad():
            old_values, groups = self._token_values(*inputs)
        old_values, groups = _fit_width(old_values, width), _fit_width(groups, width)
        rewards = outcome_token_rewards(output["advantages"], groups, trainable)
        advantages, returns = step_gae(rewards, old_values, groups, trainable, self.args.gamma, self.args.lam)
        stats = self.accelerator.gather(value_statistics(old_values, returns, trainable)[None]).sum(0)
        for name, number in summarize_value_statistics(stats).items():
            self._metrics[mode][f"value/{name}"].append(number)
        if mode == "train":
            if self._value_batches % self.args.value_train_every == 0:
                # tracerl: the policy's token weights over training rows (dLLM-RL); otherwise a mean over tokens
                tracerl = self.args.loss_type == "tracerl"
                mask, units = (weights, rows) if tracerl else (trainable.float(), trainable.sum(1))
                loss = self._train_value_model(inputs, old_values, returns, mask, units, rows)
                if loss is not None:
                    self._metrics[mode]["value/loss"].append(self.accelerator.gather(loss[None]).mean().item())
            self._value_batches += 1
        return advantages.detach()

    def _value_updates(self, rows: torch.Tensor, live: int) -> int:
        """Value optimizer steps for this generation batch: ceil(training rows / ``value_batch_size``) over all
        processes (one epoch), or the policy's steps per generation batch; at most one per ``live`` response (those
        with something to train on) of the process that has the most, so that no step is empty everywhere."""
        args = self.args
        if args.value_batch_size is None:
            wanted = args.steps_per_generation // args.gradient_accumulation_steps
        else:
            total = int(self.accelerator.reduce(rows.sum(), reduction="sum").item())
            wanted = -(-total // args.value_batch_size)
        most = int(self.accelerator.gather(torch.tensor([live], device=rows.device)).max().item())
        return max(1, min(wanted, most))

    def _train_value_model(self, inputs, old_values, returns, mask, units, rows) -> torch.Tensor | None:
        """Clipped value loss over the generation batch, ``sum(mask * loss) / sum(units)`` per optimizer step
        (``units``: training rows or tokens, over all processes), in ``_value_updates`` steps on micro-batches of
        ``per_device_train_batch_size``. Nothing to train on (every group filtered): no step, returns None.

        Under DDP (and for a replicated model accelerate did not wrap, as under DeepSpeed) gradients accumulate
        locally and are averaged across processes once per step, so a micro-batch may take several forwards."""
        args, model = self.args, self.value_model
        if self.accelerator.reduce(units.sum().float(), reduction="sum").item() == 0:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        unwrapped = self.accelerator.unwrap_model(model)
        manual_sync = self.accelerator.num_processes > 1 and (
            unwrapped is model or isinstance(model, torch.nn.parallel.DistributedDataParallel))
        # Only the responses with units (rows of surviving groups) are split into steps: TRL keeps a group's
        # responses together and the filter drops whole groups, so an even split of every response would leave steps
        # with nothing to train on, in which AdamW still moves the weights.
        live = units.gt(0).nonzero().squeeze(-1)
        updates = live.tensor_split(self._value_updates(rows, live.numel()))
        losses = []
        # an update an exception ended (OOM, Ctrl-C) left its gradients: the next train() would add them to its own
        model.zero_grad(set_to_none=True)
        model.train()
        try:
            for chunk in updates:
                # every rank's units: DDP averages gradients over ranks, so divide by the mean count per rank
                # (a per-rank count would make a 2-process run differ from a 1-process run with twice the batch)
                count = self.accelerator.reduce(units[chunk].sum().float(), reduction="sum")
                if count.item() == 0:  # empty on every process (all agree): no step
                    continue
                count = count / self.accelerator.num_processes
                # a process with nothing in this step still joins the gradient averaging, with a zero loss on one row;
                # under FSDP / ZeRO-3 every process runs as many pieces as the busiest (each forward is a collective)
                pieces = list(chunk.split(args.per_device_train_batch_size)) if len(chunk) else []
                pieces += [None] * (agreed_forward_count(max(len(pieces), 1), old_values.device,
                                                         needs_synced_forwards(model)) - len(pieces))
                step_loss = torch.zeros((), device=old_values.device)
                for i, piece in enumerate(pieces):
                    sync_now = i == len(pieces) - 1 and not manual_sync
                    real = piece is not None
                    piece = piece if real else live.new_zeros(1)
                    with contextlib.nullcontext() if sync_now else self.accelerator.no_sync(model):
                        values, _ = self._token_values(*(t[piece] for t in inputs))
                        values = _fit_width(values, mask.shape[1])
                        if real:
                            per_token = clipped_value_loss(values, old_values[piece], returns[piece],
                                                           args.cliprange_value)
                            loss = (per_token * mask[piece]).sum() / count
                        else:
                            loss = values.sum() * 0.0
                        loss.backward()
                    step_loss = step_loss + loss.detach()
                losses.append(step_loss)
                if manual_sync:
                    for p in params:
                        if p.grad is not None:
                            p.grad = self.accelerator.reduce(p.grad, reduction="mean")
                if args.max_grad_norm is not None and args.max_grad_norm > 0:  # transformers': <= 0 is no clipping
                    torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
                self.value_optimizer.step()
                self.value_optimizer.zero_grad(set_to_none=True)
        finally:
            model.eval()
        return torch.stack(losses).mean()

    # ------------------------------------------------------------------------------------------------ checkpoints
    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        """TRL's card; its quick start samples with the rollout settings the policy was trained with (named in a
        comment when the saved ``generation_config.json`` holds them, passed to the pipeline when it does not)."""
        super().create_model_card(model_name=model_name, dataset_name=card_dataset_name(dataset_name), tags=tags)
        sampler = {k: v for k, v in self._rollout_sampler().items() if k not in ("stop_token_ids", "pad_token_id",
                                                                                  "num_return_sequences")}
        if self.args.save_rollout_generation_config:  # named in a comment: leave out the settings that mean "none"
            sampler = {k: v for k, v in sampler.items() if k not in ("alg_temp", "cfg_scale")}
        quick_start = policy_quick_start(self.hub_model_id or self.args.output_dir, sampler,
                                         in_generation_config=self.args.save_rollout_generation_config, trainer=self)
        finish_model_card(self, quick_start)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """transformers' ``save_model``; under FSDP with a sharded state dict, where it writes nothing, the model is
        saved whole (``full_save.py``)."""
        save_model_whole(self, output_dir, _internal_call, super().save_model)

    def _save(self, output_dir: str | None = None, state_dict=None):
        """transformers' save (``save_model``, checkpoints, ``push_to_hub``), then, on the process that writes, the
        rollout sampler into ``generation_config.json`` (``save_rollout_generation_config``) and the tokenizer's
        released remote code (``models/remote_code.py``; the model's comes with its ``config.json``)."""
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            if self.args.save_rollout_generation_config:
                self._rollout_generation_config().save_pretrained(output_dir or self.args.output_dir)
            carry_tokenizer_code(output_dir or self.args.output_dir, self.processing_class)
            finish_adapter_card(self, output_dir or self.args.output_dir)  # PEFT's card: ours, no local path

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """transformers' mid-training Hub push, with the released remote code in what it uploads."""
        push_from_checkpoint_with_code(self, checkpoint_folder, super()._push_from_checkpoint)

    def _rollout_generation_config(self) -> GenerationConfig:
        """A copy of the policy's generation config with the rollout sampler written in, in the names ``generate()``
        reads, so that ``generate()`` without arguments samples as the rollouts did. The policy's own config is left
        as it is: training and evaluation keep reading it as before.

        The rollouts pass every sampler argument, so the config's other fields stay as they are; Dream's ``alg`` /
        ``steps`` go, as a call's block-wise arguments turn them off. ``do_sample=True`` (TraceRL's temperature is
        > 0) is what transformers' validation asks of a config with a temperature, top-k or top-p."""
        model = self.accelerator.unwrap_model(self.model)
        model = model.get_base_model() if _is_peft(model) else model
        config = copy.deepcopy(model.generation_config)
        for name in ("alg", "steps"):
            if name in vars(config):
                delattr(config, name)
        for name, value in {**self._rollout_sampler(), "do_sample": True}.items():
            setattr(config, name, value)
        config._from_model_config = False  # else GenerationConfig.from_pretrained would drop the diffusion fields
        return config

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint plus what exact resume needs: the buffered rollout of the current generation cycle,
        GRPO's micro-step counter and the metrics of the logging window in progress (per process), and the value model
        with its optimizer. With ``save_only_model``
        the value model's weights are saved without its optimizer, as transformers saves the policy's, and the
        buffer records the setting so that a resume is refused (see ``_load_optimizer_and_scheduler``).

        Ours are written first: transformers writes ``trainer_state.json`` (without which it will not resume from
        a folder) and only then deletes older checkpoints, so a save that fails part-way never leaves a resumable
        checkpoint without our files, nor deletes the last complete one. A folder an earlier run left at this step
        loses its state file and our files first (``checkpoint_files.py``)."""
        folder = start_checkpoint_folder(self, trial, CHECKPOINT_FILES)
        torch.save({"step": self._step, "buffer": self._buffered_inputs, "layout": self._rollout_layout(),
                    "save_only_model": self.args.save_only_model, "metrics": dict(self._metrics["train"])},
                   os.path.join(folder, f"rollout_buffer_{self.accelerator.process_index}.pt"))
        if self.value_model is not None and self.args.should_save:
            self.accelerator.unwrap_model(self.value_model).save_pretrained(os.path.join(folder, "value_model"))
            if not self.args.save_only_model:
                torch.save({"optimizer": self.value_optimizer.state_dict(), "value_batches": self._value_batches},
                           os.path.join(folder, "value_state.pt"))
        if self._synced_reference() is not None and not self.args.save_only_model:
            # sync_ref_model moves the reference away from the initial policy, which a resumed run rebuilds it from
            writes = self.args.should_save or self.is_fsdp_enabled  # FSDP: each process its own shards
            # every process joins ZeRO-3's gathering; only a writing one copies the model to the CPU (under DDP the
            # others would each hold a full copy of the reference in host memory for nothing)
            state = self._reference_parameters(copy=writes)
            if writes:
                torch.save(state, self._reference_state_path(folder))
        self.accelerator.wait_for_everyone()  # every process's files exist before the state file marks the folder
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, f"rollout_buffer_{self.accelerator.process_index}.pt")
        # to the CPU first: torch.load cannot map onto the device of a multi-process CPU run ("cpu:0")
        saved = torch.load(path, map_location="cpu", weights_only=True) if os.path.exists(path) else None
        problems = self._rollout_state_problems(checkpoint, saved)
        # decided together: a process that resumed while another one raised would wait for it forever
        only_model = saved is not None and saved.get("save_only_model", False)
        flags = torch.tensor([float(only_model), float(bool(problems))], device=self.accelerator.device)
        any_only_model, any_problem = (self.accelerator.reduce(flags, reduction="sum") > 0).tolist()
        if any_only_model:
            refuse_save_only_model(checkpoint, f"model_name_or_path={checkpoint}, with a value model value_model="
                                               f"{os.path.join(checkpoint, 'value_model')}",
                                   also_missing=", nor the value model's optimizer")
        if any_problem:
            found = f"checkpoint {checkpoint} cannot be resumed exactly: " + "; ".join(
                problems or ["another process's rollout state is incomplete (see its error)"])
            if not self.args.resume_without_rollout_state:
                raise ValueError(f"{found}. Resume from a checkpoint saved by TraceRLTrainer with the same number of "
                                 "processes and per-device batch, or set resume_without_rollout_state=True to resume "
                                 "anyway (the generation cycle in progress is generated again, so the run differs "
                                 "from an uninterrupted one).")
            logger.warning(f"{found}. Resuming anyway (resume_without_rollout_state=True): the generation cycle in "
                           "progress is generated again.")
            saved = None  # on every process: one that kept its buffer would skip the others' generation collectives
        if saved is not None:
            self._step, self._buffered_inputs = saved["step"], send_to_device(saved["buffer"], self.accelerator.device)
            # the logging window in progress: a checkpoint between two logs would otherwise drop its first part
            self._metrics["train"] = defaultdict(list, saved.get("metrics", {}))
        self._load_value_and_reference(checkpoint, resume=True)

    def _load_best_model(self) -> None:
        """transformers loads the best checkpoint's policy only: its value model and synced reference are loaded too,
        so that the trainer ends with the best step's models. Weights only, as transformers leaves the policy's
        optimizer as it is (the value optimizer stays the last step's)."""
        super()._load_best_model()
        self._load_value_and_reference(self.state.best_model_checkpoint, resume=False)

    def _load_value_and_reference(self, checkpoint: str, resume: bool) -> None:
        """The value model and the synced reference as ``checkpoint`` saved them. ``resume``: with the value
        optimizer and update count, from a complete value state only (``_rollout_state_problems`` refused or warned
        about the rest); otherwise (``load_best_model_at_end``) the weights, with a warning for what the checkpoint
        lacks (``save_only_model`` saves no reference)."""
        value_dir, value_state = os.path.join(checkpoint, "value_model"), os.path.join(checkpoint, "value_state.pt")
        if self.value_model is not None and os.path.isdir(value_dir) and (os.path.exists(value_state) or not resume):
            state = whole_state_dict(DiffusionValueModel.from_pretrained(value_dir))  # also under ZeRO-3
            self.accelerator.unwrap_model(self.value_model).load_state_dict(state)
            if resume:
                extra = torch.load(value_state, map_location="cpu", weights_only=True)
                saved_groups = len(extra["optimizer"]["param_groups"])
                if saved_groups != len(self.value_optimizer.param_groups):
                    raise ValueError(f"{value_state} holds a value optimizer with {saved_groups} parameter group(s), "
                                     f"this trainer's has {len(self.value_optimizer.param_groups)} (weight decay and "
                                     "none, as the policy's: checkpoints saved before that change had one); resume "
                                     "from a newer checkpoint, or start from its value_model folder as a new value "
                                     "model.")
                self.value_optimizer.load_state_dict(extra["optimizer"])
                self._value_batches = extra["value_batches"]
        elif self.value_model is not None and not resume:
            logger.warning(f"{checkpoint} holds no value_model/: the value model stays the last step's.")
        reference_state = self._reference_state_path(checkpoint)
        if self._synced_reference() is not None and os.path.exists(reference_state):
            self._load_reference_parameters(torch.load(reference_state, map_location="cpu", weights_only=True))
        elif self._synced_reference() is not None and not resume:
            logger.warning(f"{checkpoint} holds no {os.path.basename(reference_state)} (save_only_model=True "
                           "writes none): the reference model stays as sync_ref_model left it at the last step.")

    def _synced_reference(self):
        """The reference model that ``sync_ref_model`` mixes with the policy during training (None without one)."""
        return self.ref_model if self.args.sync_ref_model and self.beta != 0.0 else None

    def _reference_state_path(self, checkpoint: str) -> str:
        """Where ``checkpoint`` keeps the synced reference: one file, or one per process under FSDP (sharded)."""
        name = REFERENCE_STATE_NAME
        if self.is_fsdp_enabled:
            name = name.replace(".pt", f"_{self.accelerator.process_index}.pt")
        return os.path.join(checkpoint, name)

    def _reference_parameters(self, copy: bool = True) -> dict[str, torch.Tensor] | None:
        """The synced reference's parameters (what ``SyncRefModelCallback`` changes), on the CPU; gathered under
        DeepSpeed ZeRO-3 as the callback gathers them (a collective: every process calls this). ``copy=False``: only
        join the gathering, return None."""
        reference = self._synced_reference()
        with gathered(list(reference.parameters()), modifier_rank=None):
            if not copy:
                return None
            return {name: p.detach().to("cpu", copy=True) for name, p in reference.named_parameters()}

    def _load_reference_parameters(self, state: dict[str, torch.Tensor]) -> None:
        reference = self._synced_reference()
        with gathered(list(reference.parameters()), modifier_rank=0), torch.no_grad():
            for name, parameter in reference.named_parameters():
                if name not in state or state[name].shape != parameter.shape:
                    raise ValueError(f"the checkpoint's {REFERENCE_STATE_NAME} does not match this run's reference "
                                     f"model (parameter {name!r}).")
                parameter.copy_(state[name])

    def _rollout_layout(self) -> dict:
        """What a process's rollout buffer depends on: how the generation batch is split over processes."""
        return {"num_processes": self.accelerator.num_processes,
                "per_device_train_batch_size": self.args.per_device_train_batch_size}

    def _rollout_state_problems(self, checkpoint: str, saved: dict | None) -> list[str]:
        """What keeps ``checkpoint`` from resuming this run exactly (nothing: an empty list)."""
        problems = []
        if saved is None:
            problems.append(f"rollout_buffer_{self.accelerator.process_index}.pt is missing")
        elif saved.get("layout") != self._rollout_layout():
            problems.append(f"its rollout buffer was saved with {saved.get('layout')}, this run has "
                            f"{self._rollout_layout()}")
        elif self.args.loss_type in _ROW_MEAN_LOSSES and any("kept_row_scale" not in batch
                                                             for batch in saved["buffer"] or []):
            problems.append(f"its rollout buffer lacks the kept_row_scale that loss_type={self.args.loss_type!r} "
                            "needs (saved by an older trl_diffusion)")
        has_value = [os.path.exists(os.path.join(checkpoint, name)) for name in ("value_model", "value_state.pt")]
        if self.value_model is not None:
            problems += [f"{name} is missing" for name, exists in zip(("value_model/", "value_state.pt"), has_value)
                         if not exists]
        elif any(has_value):
            problems.append("it holds a value model (value_model/) but this trainer has none; pass value_model= "
                            "(--value_model of examples/math.py and trl-diffusion math)")
        reference_state = self._reference_state_path(checkpoint)
        if self._synced_reference() is not None and not os.path.exists(reference_state):
            problems.append(f"{os.path.basename(reference_state)} (the reference model as sync_ref_model left it) is "
                            "missing")
        return problems

    # ------------------------------------------------------------------------------------------------ scoring
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """GRPO's evaluation step. The eval sampler repeats every prompt ``num_generations_eval`` times, but
        accelerate counts the last batch's remainder over the prompts, so ``gather_for_metrics`` kept the wrong number
        of that batch's losses (process 0's only with two processes; half of them in one process whenever the prompt
        count is not a multiple of the global eval batch): it is counted over the rows the sampler yields."""
        loader = self._evaluated_loader  # None outside evaluation_loop: the active dataloader may be another's
        if loader is not None and loader.remainder >= 0 and hasattr(loader.dataset, "__len__"):
            loader.remainder = len(loader.dataset) * self.num_generations_eval % loader.total_batch_size
            if self.accelerator.num_processes > 1 and self.accelerator.is_main_process and \
                    padded_eval_batch(self.accelerator, loader):
                logger.warning_once(
                    f"evaluation: the last eval batch holds {loader.total_batch_size - loader.remainder} rows of "
                    "padding (accelerate fills every process's batch with the first prompts' rows again); GRPO "
                    "generates, scores and counts them in the eval metrics like real rows. An eval set whose prompts "
                    f"x num_generations_eval ({self.num_generations_eval}) fill whole global eval batches "
                    f"({loader.total_batch_size} rows) has none.")
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def evaluate(self, eval_dataset=None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Trainer's evaluation, refusing by name an empty eval ``Dataset`` (passed here, named here, or the
        trainer's: it would log no ``eval_loss`` / ``eval_reward``, and ``metric_for_best_model`` then fail) and a
        global eval batch that ``num_generations_eval`` does not divide; the global random states are restored
        after it (``_global_random_state_kept``)."""
        if isinstance(eval_dataset, str) and isinstance(self.eval_dataset, dict) and eval_dataset in self.eval_dataset:
            _refuse_empty(self.eval_dataset[eval_dataset], dataset_label("eval", eval_dataset))
        else:
            _refuse_empty(self.eval_dataset if eval_dataset is None else eval_dataset, "eval")
        processes, per_device = self.accelerator.num_processes, self.args.per_device_eval_batch_size
        if per_device * processes % self.num_generations_eval:  # GRPOConfig checks it only with an eval_strategy
            raise ValueError(f"the global eval batch size ({per_device} x {processes} process(es)) must be divisible "
                             f"by num_generations_eval ({self.num_generations_eval}): every batch holds whole "
                             "groups of one prompt's completions (it failed after the rollouts, in a reshape).")
        with _global_random_state_kept(self.accelerator.device):
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _determine_best_metric(self, metrics: dict[str, float], trial) -> bool:
        """transformers' choice of the best checkpoint; a ``metric_for_best_model`` of NaN (an evaluation where no
        reward function scored a completion) is warned about and never the best (``usable_best_metric``)."""
        why = "no reward function scored any evaluated completion (every reward None), or the rewards were NaN"
        metrics = usable_best_metric(metrics, self.args.metric_for_best_model, self.state.global_step, why)
        return super()._determine_best_metric(metrics, trial)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Trainer's loop; TRL's metrics of the evaluated rows join its metrics under ``metric_key_prefix``
        (``prefixed_eval_metrics``), and none are left for the next evaluation or for ``log``."""
        self._metrics["eval"].clear()
        self._eval_batches = 0  # its rollouts' seeds: see _rollout_key
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics.update(prefixed_eval_metrics(self._metrics["eval"], metric_key_prefix))
        self._metrics["eval"].clear()
        return output

    def _compute_loss(self, model, inputs):
        self._scoring = {k: inputs[k] for k in ("canvas_ids", "unmask_step", "mask_seeds", "sampler_logps")}
        inputs = dict(inputs)  # filled in while scoring; the buffered batch stays as it was
        if self.beta != 0.0 and self.args.kl_reference == "old_policy":
            # k3 against pi_old; without stored old log-probs pi_old is the current policy (filled in when scored)
            inputs["ref_per_token_logps"] = inputs.get("old_per_token_logps")
        self._loss_inputs = inputs
        beta = self.beta
        summed_kl = beta != 0.0 and self.args.kl_weighting == "row_sum"
        if summed_kl:
            self.beta = 0.0  # TRL's KL would carry the policy weights: added below with its own
        mode = "train" if self.model.training else "eval"
        token_metrics = self._token_metric_names()
        row_metrics = [*_CLIP_RATIOS, *_CLIP_EXTREMES] if self._clip_ratios_per_row() else []
        logged_before = {name: len(self._metrics[mode].get(name, ()))
                         for name in token_metrics + row_metrics}  # creates none
        rows = torch.tensor(float(inputs["kept_rows"].numel()), device=inputs["kept_rows"].device)
        totals = self.accelerator.reduce(torch.stack([inputs["completion_mask"].sum().detach().float(),
                                                      inputs["kept_rows"].sum(), rows]), reduction="sum")
        weight_total, kept_rows, all_rows = totals.tolist()
        try:
            loss = super()._compute_loss(model, inputs)
            if summed_kl:
                loss = loss + beta * self._summed_kl(inputs)
        finally:
            self._loss_inputs, self.beta = None, beta
        if weight_total < 1:
            # TRL's token metrics are sum(w x) / max(sum(w), 1): with weights that sum below 1 (1/L_max over fewer
            # than L_max tokens) that is not a mean, and its scale followed the micro-batch's token count; with no
            # trained token at all (every row filtered) it is a 0 that TRL's log would average in (the logged entropy
            # fell with the fraction of filtered micro-batches): NaN, which the log leaves out
            for name in token_metrics:
                values = self._metrics[mode].get(name, [])
                values[logged_before[name]:] = [value / weight_total if weight_total > 0 else math.nan
                                                for value in values[logged_before[name]:]]
        if row_metrics and kept_rows < all_rows:
            # per sequence (importance_sampling_level="sequence"), TRL's clip ratios are means over every row; a
            # filtered row has ratio 1 and is never clipped, so it only added to the count: the mean over the kept
            # rows, NaN (left out of the log) when none is kept
            # each row's indicator is 0 or 1, so the mean times the rows is the count of clipped rows (rounded: TRL
            # sums in float32)
            for name in _CLIP_RATIOS:
                values = self._metrics[mode].get(name, [])
                values[logged_before[name]:] = [round(value * all_rows) / kept_rows if kept_rows > 0 else math.nan
                                                for value in values[logged_before[name]:]]
            # the least low / greatest high clip indicator over the rows: a filtered row's 0 made the minimum 0;
            # over the kept rows it is 1 when every kept row (low) / any kept row (high) is clipped
            for extreme, mean, hit in (("clip_ratio/low_min", "clip_ratio/low_mean", lambda m: m == 1.0),
                                       ("clip_ratio/high_max", "clip_ratio/high_mean", lambda m: m > 0.0)):
                means = self._metrics[mode].get(mean, [])[logged_before[mean]:]
                values = self._metrics[mode].get(extreme, [])
                if len(means) == len(values) - logged_before[extreme]:
                    values[logged_before[extreme]:] = [m if math.isnan(m) else float(hit(m)) for m in means]
        if "router_loss" in inputs:
            # GRPO logs it with gather_for_metrics, which at a training epoch's last batch keeps only the first
            # ``remainder`` values (counted in prompts): process 0's alone on two processes. Every process's counts.
            logged = self.accelerator.gather(inputs["router_loss"][None]).mean().item()
            self._metrics[mode]["aux_loss"][-1] = logged
        if self.args.loss_type in _ROW_MEAN_LOSSES:
            # TRL averages over every row; filtered rows (zero loss) must not count (see kept_row_scale)
            loss = loss * inputs["kept_row_scale"]
        return loss

    def _token_metric_names(self) -> list[str]:
        """The metrics TRL's ``_compute_loss`` logs as a mean over the loss's token weights (``global_masked_mean``
        of per-token values; the clip ratios are per sequence with ``importance_sampling_level="sequence"``)."""
        names = ["kl", "entropy"]
        if not self._clip_ratios_per_row():
            names += [*_CLIP_RATIOS, "cispo_clip_ratio"]
        return names

    def _clip_ratios_per_row(self) -> bool:
        """Whether TRL's clip ratios are per row (0 or 1 each): with ``importance_sampling_level="sequence"`` and
        advantages per row; a value model's per-token advantages make them token means again."""
        return self.importance_sampling_level == "sequence" and self.value_model is None

    def get_high_entropy_mask(self, entropies: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
        """TRL's ``top_entropy_quantile`` mask over the trained tokens. The completion mask TRL passes carries the
        loss weights (1/|tau(t)|, 1/L_max), and TRL compares ``entropy * mask`` with the quantile: the mask's 0/1
        form keeps the intended fraction of tokens."""
        return super().get_high_entropy_mask(entropies, (mask > 0).to(entropies.dtype), threshold)

    def _summed_kl(self, inputs: dict) -> torch.Tensor:
        """``kl_weighting='row_sum'``: the k3 KL of every trained token with weight 1 (``kl_weights``), over TRL's
        ``tracerl`` / ``dapo`` normaliser (the training rows of one accumulation window), so a row adds its summed
        KL (dLLM-RL's Dream/LLaDA code). Logged as ``kl`` like TRL's (mean over the loss mask)."""
        logps, reference = inputs["scored_logps"], inputs["ref_per_token_logps"]
        kl = torch.exp(reference - logps) - (reference - logps) - 1
        if self.args.use_bias_correction_kl:
            old = inputs.get("old_per_token_logps")
            kl = kl * torch.exp(logps - (logps.detach() if old is None else old))
        mode = "train" if self.model.training else "eval"
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normalizer = normalizer * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        mask = inputs["completion_mask"]
        totals = self.accelerator.reduce(torch.stack([(kl * mask).sum(), mask.sum()]).detach(), reduction="sum")
        # as TRL's, divided by max(weights, 1): _compute_loss makes it the weighted mean where they sum below 1
        self._metrics[mode]["kl"].append((totals[0] / totals[1].clamp(min=1.0)).item())
        return (kl * inputs["kl_weights"]).sum() / normalizer

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **unused):
        scoring = self._scoring
        if scoring is None or scoring["canvas_ids"].shape[0] != input_ids.shape[0]:
            raise RuntimeError("TraceRLTrainer scores completions from their recorded trajectories; none are attached "
                               "to this batch.")
        prompt_width = input_ids.shape[1] - logits_to_keep
        prompt_ids, prompt_mask = input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        unwrapped = self.accelerator.unwrap_model(model)
        rows = batch_size or input_ids.shape[0]
        logps, entropies = [], []
        router_losses = [] if compute_aux_loss else None  # one per scoring forward, averaged below as GRPO does
        with recomputed_forwards(unwrapped, self.args.recompute_scoring_forwards):  # only where gradients flow
            for start in range(0, input_ids.shape[0], rows):
                part = slice(start, start + rows)
                lp, ent, _ = estimate_logprobs(
                    _ForwardThrough(model, unwrapped), prompt_ids[part], prompt_mask[part],
                    scoring["canvas_ids"][part], scoring["unmask_step"][part], self.estimator_settings,
                    scoring["mask_seeds"][part], compute_entropy, router_losses,
                )
                logps.append(lp)
                entropies.append(ent)
        masks = self.estimator_settings.masks_per_response
        logps = _per_mask(torch.cat(logps), masks, logits_to_keep)
        entropies = _per_mask(torch.cat(entropies), masks, logits_to_keep) if compute_entropy else None
        if torch.is_grad_enabled() and self.estimator_settings.name == "trajectory" and self._rollout_weights():
            sampler = _fit_width(scoring["sampler_logps"], logits_to_keep)
            # the completion part of ``attention_mask`` carries the loss weights (1/|tau|, ...): any weight > 0 counts
            committed = _fit_width((scoring["unmask_step"] >= 0).float(), logits_to_keep) * (
                attention_mask[:, prompt_width:] > 0).float()
            difference = (logps.detach() - sampler).abs() * committed
            # tokens scored from the very state the sampler committed them from: 0 gap when the two agree, whatever
            # the shrinkage (the full gap also measures how much merging steps changes the scored states)
            own = committed * _fit_width(self._own_state_tokens(prompt_mask, scoring["unmask_step"]).float(),
                                         logits_to_keep)
            # pooled over every process's tokens (not a mean of per-process means: processes hold different counts)
            totals = self.accelerator.reduce(torch.stack([difference.sum(), committed.sum(), (difference * own).sum(),
                                                          own.sum()]), reduction="sum")
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["rollout/sampler_logp_gap"].append((totals[0] / totals[1].clamp(min=1)).item())
            self._metrics[mode]["rollout/sampler_logp_gap_exact"].append((totals[2] / totals[3].clamp(min=1)).item())
        aux = _mean_router_loss(router_losses, input_ids.device) if compute_aux_loss else None
        if aux is not None and self._loss_inputs is not None:
            self._loss_inputs["router_loss"] = aux.detach()
        return self._against_old_policy(logps), entropies, aux

    def _rollout_weights(self) -> bool:
        """Whether the policy being scored is the one that sampled the rollout: in evaluation, or in the micro-batches
        of the optimizer step during which the rollout was made (the weights move only at optimizer steps). Read
        from ``global_step`` itself, not from a count of micro-batches: TRL generates every ``steps_per_generation x
        num_iterations`` micro-batches, not always at an optimizer step's first one, and transformers ends an epoch
        with a shorter accumulation window. The sampler gap is measured there only: later steps score with moved
        weights, which the gap would mistake for a disagreement. (A rollout restored from a checkpoint was made
        before the step the run resumes at: None.)"""
        if not self.model.training:
            return True
        return self._rollout_global_step == self.state.global_step

    def _against_old_policy(self, logps: torch.Tensor) -> torch.Tensor:
        """Inside the loss: fill in pi_old as the KL target when the batch has no stored old log-probs (pi_old is
        then the current policy), and clamp log(pi / pi_old) to ``log_ratio_clip`` (no gradient where clamped)."""
        inputs = self._loss_inputs
        if inputs is None:
            return logps
        if "ref_per_token_logps" in inputs and inputs["ref_per_token_logps"] is None:
            inputs["ref_per_token_logps"] = logps.detach()
        old, clip = inputs.get("old_per_token_logps"), self.args.log_ratio_clip
        if clip is not None and old is not None:
            logps = old + (logps - old).clamp(-clip, clip)
        inputs["scored_logps"] = logps
        return logps


def _mean_router_loss(router_losses: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The mean of the scoring forwards' load-balancing losses (GRPO's ``aux_loss``: the mean over its forwards);
    0 when this process ran none (nothing to score)."""
    if not router_losses:
        return torch.zeros((), device=device)
    return torch.stack([loss.to(device) for loss in router_losses]).mean()


def _path_dtype(model_init_kwargs: dict | None):
    """The dtype TRL loads a model path in: ``model_init_kwargs["dtype"]``, float32 when unset."""
    dtype = (model_init_kwargs or {}).get("dtype", "float32")
    return getattr(torch, dtype) if dtype in ("bfloat16", "float16", "float32") else dtype


class _ForwardThrough:
    """Calls the (possibly DDP/PEFT-wrapped) ``model`` but answers the diffusion interface from ``unwrapped``."""

    def __init__(self, model, unwrapped):
        self._model = model
        self._base = unwrapped.get_base_model() if _is_peft(unwrapped) else unwrapped

    def __call__(self, **kwargs):
        return self._model(**kwargs)

    def __getattr__(self, name):
        return getattr(self._base, name)


class _RewardErrorNamer:
    """Wraps a synchronous reward function so that an exception inside it, or an output that is not one number
    (or None) per completion, names the function."""

    def __init__(self, func, name: str):
        self.func, self.__name__ = func, name

    def __call__(self, *args, **kwargs):
        try:
            output = self.func(*args, **kwargs)
        except Exception as error:
            raise RuntimeError(f"reward function {self.__name__!r} raised {type(error).__name__}: {error}") from error
        return _check_reward_output(output, len(kwargs["completions"]), self.__name__)


class _AsyncRewardErrorNamer(_RewardErrorNamer):
    """The same for an async reward function (TRL awaits these separately, so the wrapper stays async)."""

    async def __call__(self, *args, **kwargs):
        try:
            output = await self.func(*args, **kwargs)
        except Exception as error:
            raise RuntimeError(f"reward function {self.__name__!r} raised {type(error).__name__}: {error}") from error
        return _check_reward_output(output, len(kwargs["completions"]), self.__name__)


def _name_errors(func, name):
    if isinstance(func, torch.nn.Module):
        return func
    return _AsyncRewardErrorNamer(func, name) if is_async_callable(func) else _RewardErrorNamer(func, name)


def _check_reward_output(output, expected: int, name: str):
    """``output`` if it is a list (or tuple, or 1-D tensor / array) of ``expected`` rewards, each a number or None
    (TRL's "not applicable", like NaN); otherwise a ValueError naming the function. Infinite rewards are refused
    after gathering, in ``TraceRLTrainer._calculate_rewards``. Another ordered iterable (a generator, ``map``,
    ``dict.values()``) is read into a list first, as TRL takes any iterable; a set (no order) is refused."""
    if isinstance(output, Iterable) and getattr(output, "ndim", None) is None and not isinstance(
            output, (str, bytes, Sequence, Mapping, AbstractSet)):
        output = list(output)
    one_dimensional = getattr(output, "ndim", None) == 1
    if isinstance(output, (str, bytes, Mapping)) or not (isinstance(output, Sequence) or one_dimensional):
        raise ValueError(f"reward function {name!r} returned {type(output).__name__} {output!r:.80}; it must return a "
                         "list with one reward (a number, or None for 'not applicable') per completion.")
    if len(output) != expected:
        raise ValueError(f"reward function {name!r} returned {len(output)} rewards for {expected} completions; it "
                         "must return one per completion.")
    for index, reward in enumerate(output):
        if reward is not None and not _is_number(reward):
            raise ValueError(f"reward function {name!r} returned {reward!r:.80} ({type(reward).__name__}) for "
                             f"completion {index}; a reward is a number, or None for 'not applicable'.")
    return output


def _is_number(value) -> bool:
    if isinstance(value, (str, bytes)):  # float("1.0") would accept a string
        return False
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def _check_reward_names(reward_funcs: object) -> None:
    """Refuse a string naming one of :data:`trl_diffusion.rewards.REWARD_FUNCTIONS` (the command line's names):
    TRL reads a string as a reward model's Hub id or folder, so it went to the Hub (a long wait and an ``OSError``
    offline) instead of calling the function."""
    from ..rewards import REWARD_FUNCTIONS

    names = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]  # one, or a list (TRL's)
    for name in names:
        if isinstance(name, str) and name in REWARD_FUNCTIONS and not os.path.exists(name):
            raise ValueError(f"reward_funcs: {name!r} names a trl_diffusion reward function; pass the function "
                             f"(from trl_diffusion.rewards import {name}). TRL reads a string as a reward model's Hub "
                             "id or folder.")


def _grpo_arguments(pos: tuple, kwargs: dict) -> dict:
    """GRPOTrainer's arguments after ``args`` by name, whether given by position or by keyword (the checks must see
    a ``tools`` or ``peft_config`` passed either way)."""
    names = list(inspect.signature(GRPOTrainer.__init__).parameters)[4:]  # after self, model, reward_funcs, args
    if len(pos) > len(names):
        raise TypeError(f"TraceRLTrainer takes at most {len(names) + 3} positional arguments, got {len(pos) + 3}.")
    return {**dict(zip(names, pos)), **kwargs}


@contextlib.contextmanager
def _global_random_state_kept(device: torch.device):
    """Restore Python's, NumPy's and torch's global random states (CPU, and ``device`` if it is a CUDA device: no
    CUDA context is made for a run on the CPU) after the block. An evaluation draws from them (the eval loader seeds
    its iterator from torch's generator), and TRL's shuffle of each generation batch reads torch's: an evaluation
    changed the rows of the training steps after it (weights 9e-3 apart after 4 steps with
    ``steps_per_generation=2``)."""
    python, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        try:
            yield
        finally:
            random.setstate(python)
            np.random.set_state(numpy_state)


def _check_datasets(train, evals, args: TraceRLConfig) -> None:
    """The train and eval datasets' checks at construction: rows, columns, prompts, and enough prompts for one
    generation batch (each would otherwise show only in ``train()`` / ``evaluate()``, or not at all)."""
    _refuse_empty(train, "train")
    _refuse_empty(evals, "eval")
    _check_prompt_column(train, "train")
    _check_prompt_column(evals, "eval")
    _check_generation_batch_fits(train, args)
    check_best_metric_names_a_set(evals, args)


def _refuse_empty(dataset, label: str) -> None:
    """Refuse a ``Dataset`` with no rows, or a dict of eval datasets holding one, by name (``dataset_label``): TRL's
    sampler yields nothing from it, so ``train()`` takes no step yet returns, and ``evaluate()`` logs no
    ``eval_loss`` / ``eval_reward`` (``metric_for_best_model`` then fails with a KeyError). Streams are not read
    ahead."""
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            _refuse_empty(part, dataset_label(label, name))
    elif isinstance(dataset, Dataset) and len(dataset) == 0:
        raise empty_dataset_error(label)


def _check_generation_batch_fits(dataset, args: TraceRLConfig) -> None:
    """Refuse a train ``Dataset`` with fewer prompts than one generation batch takes: TRL's ``RepeatSampler`` keeps
    only full batches of ``generation_batch_size // num_generations`` prompts (``generation_batch_size`` is global:
    per device x processes x ``steps_per_generation``), so it yields nothing, and ``train()`` returns at step 0
    with ``max_steps`` or fails with a message about ``max_steps`` with ``num_train_epochs``."""
    if not isinstance(dataset, Dataset):  # a stream is not read ahead
        return
    batch, generations = args.generation_batch_size, args.num_generations
    prompts = batch // generations
    if len(dataset) < prompts:
        raise ValueError(
            f"the train dataset has {len(dataset)} prompt(s), but one generation batch takes {prompts} "
            f"(generation_batch_size {batch} / num_generations {generations}; TRL's sampler keeps only full "
            "batches, so training would never take a step). Give more prompts or lower per_device_train_batch_size "
            f"({args.per_device_train_batch_size}) / steps_per_generation ({args.steps_per_generation}; "
            "gradient_accumulation_steps when not set) / generation_batch_size: generation_batch_size is "
            f"per_device_train_batch_size x {args.world_size} process(es) x steps_per_generation.")


def _check_prompt_column(dataset, split: str) -> None:
    """GRPO reads prompts from a ``prompt`` column: say so at construction, not at the first batch."""
    if isinstance(dataset, dict):
        for name, part in dataset.items():
            _check_prompt_column(part, dataset_label(split, name))
        return
    if not isinstance(dataset, Dataset | IterableDataset):
        return
    columns = dataset.column_names or list(next(iter(dataset), {}))
    if not columns and isinstance(dataset, IterableDataset):
        raise ValueError(f"the {split} dataset is a stream that declares no columns, and its first row has none: an "
                         "empty stream, or one built without features whose rows hold no keys. TraceRLTrainer "
                         "samples completions for the prompts in a 'prompt' column: check that the stream yields "
                         "rows, and declare its columns when building it, e.g. IterableDataset.from_generator(gen, "
                         "features=Features({'prompt': Value('string')})).")
    images = [name for name in ("image", "images") if name in columns]
    if images:  # TRL would render them into the prompts first (a chat template may fail on them first)
        raise ValueError(f"the {split} dataset has an {images[0]!r} column: TraceRLTrainer does not support images "
                         "(its rollouts are text diffusion trajectories). Remove the column.")
    if "prompt" not in columns:
        raise ValueError(f"the {split} dataset has columns {sorted(columns)} but no 'prompt' column; TraceRLTrainer "
                         "samples completions for the prompts in 'prompt' (text or chat messages). Rename your prompt "
                         "column, e.g. dataset.rename_column('question', 'prompt').")
    if isinstance(dataset, Dataset):  # a stream is not read ahead: its rows fail when rolled out
        _check_prompt_values(dataset, split)


def _is_list_type(arrow_type: pa.DataType) -> bool:
    """Whether a ``prompt`` column of this Arrow type holds lists (chat messages), not text."""
    return any(check(arrow_type) for check in (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list,
                                               pa.types.is_list_view, pa.types.is_large_list_view))


def _check_prompt_values(dataset: Dataset, split: str) -> None:
    """Refuse, naming its first rows, a map-style dataset whose prompts are missing (None: a JSON row without the
    key) or empty, or a ``prompt`` column that holds neither text nor conversations: each failed only when its batch
    was rolled out, steps into training, with an error naming no row (a tokenizer TypeError, "a prompt is empty").
    Read from the Arrow column, in the dataset's order."""
    column = dataset.with_format("arrow")["prompt"]
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        empty = pc.equal(pc.utf8_length(column), 0)
    elif _is_list_type(column.type) and (pa.types.is_struct(column.type.value_type)
                                         or pa.types.is_null(column.type.value_type)):
        empty = pc.equal(pc.list_value_length(column), 0)
    elif pa.types.is_null(column.type):  # every row None
        empty = pc.is_null(column)
    else:
        raise ValueError(f"the {split} dataset's 'prompt' column holds {column.type} values; TraceRLTrainer needs "
                         "text or chat messages (a list of {'role': ..., 'content': ...}) in it.")
    rows = pc.indices_nonzero(pc.fill_null(empty, True)).to_pylist()
    if rows:
        raise ValueError(f"the prompts of the {split} dataset's row(s) {first_few(rows[:6])} are missing (None) or "
                         f"empty ({len(rows)} row(s)); every prompt is rolled out, so each needs text or messages. "
                         "Fill them in or drop the rows, e.g. dataset.filter(lambda row: bool(row['prompt'])).")


@dataclass(frozen=True)
class RolloutSettings:
    """The ``TraceRLConfig`` fields the rollout sampler reads, as ``generate()`` arguments (``top_k`` 0: off). The
    trainer takes them once, when it is built, together with its scoring settings (``EstimatorSettings``), as TRL's
    ``GRPOTrainer`` copies ``temperature`` / ``top_k`` / ``top_p`` once for both its sampling and its scoring: a
    later change to ``trainer.args`` (a callback's temperature schedule) would otherwise reach the rollouts but not
    the scoring, whose log-probs would then not be those the tokens were sampled with."""

    block_length: int
    denoising_steps: int
    remasking_strategy: str
    confidence_threshold: float
    temperature: float
    top_k: int
    top_p: float

    @classmethod
    def from_args(cls, args: TraceRLConfig) -> RolloutSettings:
        """The settings ``args`` holds now (checked by ``TraceRLConfig.check``)."""
        return cls(block_length=args.block_length, denoising_steps=args.denoising_steps,
                   remasking_strategy=args.remasking_strategy, confidence_threshold=args.confidence_threshold,
                   temperature=args.temperature, top_k=args.top_k or 0, top_p=args.top_p)


VALUE_FIELDS = ("gamma", "lam", "cliprange_value", "value_learning_rate", "value_batch_size", "value_train_every")
"""The ``TraceRLConfig`` fields only a value model reads."""


def _warn_value_fields_unread(args: TraceRLConfig) -> None:
    """Warn about the value-model fields ``args`` sets to other than their defaults when the trainer has no value
    model, which alone reads them (as ``shrinkage`` without a reader warns)."""
    defaults = {f.name: f.default for f in fields(TraceRLConfig)}
    changed = [f"{name}={getattr(args, name)!r}" for name in VALUE_FIELDS if getattr(args, name) != defaults[name]]
    if changed:
        logger.warning(f"{', '.join(changed)} set{'s' if len(changed) == 1 else ''} the value model's training, but "
                       "this trainer has none (pass value_model=, --value_model in examples/math.py and "
                       "trl-diffusion math): ignored.")


def _warn_other_block_size(model_block_size: int | None, args: TraceRLConfig) -> None:
    """Warn when a block model (SDAR / TraDo) is rolled out at another block length than its config's block size:
    allowed, but rarely meant, since TraceRLConfig's default (4, TraDo's) does not follow the model, while
    ``generate()`` does; the rollout settings are also written into the saved ``generation_config``. (An explicit
    ``training_block_size`` is the user's choice, e.g. dLLM-RL's training at 8 on a block-4 model.)"""
    if model_block_size is None or args.block_length == model_block_size:
        return
    trains = "" if args.training_block_size is not None else " and trains"
    logger.warning(
        f"the model's config has block_size={model_block_size}, but TraceRL rolls out{trains} at block_length="
        f"{args.block_length} (TraceRLConfig's default is TraDo's 4; generate() on this model defaults to "
        f"{model_block_size}). Pass block_length={model_block_size} (and denoising_steps) to keep the block size "
        "the model was trained at."
    )


def _check_completion_fits(model, args: TraceRLConfig) -> None:
    """Raise now, not at the first rollout, when ``max_completion_length`` leaves no room for a one-token prompt in the
    model's positions (a block model's rollout rounded up to whole blocks, as ``generate()`` counts it)."""
    positions = max_positions(model.config)
    layout = CanvasLayout([1], args.max_completion_length, args.block_length, model.block_size is not None)
    if positions is not None and layout.row_positions()[0] > positions:
        rounded = " (rounded up to whole blocks of block_length)" if model.block_size is not None else ""
        field = "max_position_embeddings" if getattr(model.config, "max_position_embeddings", None) else \
            "max_sequence_length"
        raise ValueError(f"max_completion_length ({args.max_completion_length}) leaves no room for a prompt{rounded} "
                         f"in the model's {positions} positions ({field}); lower max_completion_length.")


def _enable_checkpointing(model, args: TraceRLConfig) -> None:
    """Checkpoint ``model`` (the value model) as transformers' Trainer checkpoints the policy: through
    ``activation_checkpointing_enable`` where it exists (transformers 5.23 deprecates ``gradient_checkpointing_enable``
    with a FutureWarning), with ``every_n_layers`` / ``offload`` taken out of the kwargs as its arguments; before 5.23,
    ``gradient_checkpointing_enable`` with ``gradient_checkpointing_kwargs`` as they are."""
    if not hasattr(model, "activation_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        return
    kwargs = dict(getattr(args, "activation_checkpointing_kwargs", None) or {})
    every_n_layers, offload = kwargs.pop("every_n_layers", 1), kwargs.pop("offload", False)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs or None,
                                          every_n_layers=every_n_layers, offload=offload)


def _rollout_cache(value: bool | str, base) -> bool | str:
    """The ``use_cache`` the rollouts pass to ``generate()`` for ``rollout_cache=value`` on the model ``base``:
    ``'auto'`` is the exact cache on a block model and none on a full-attention one. A cache the model's family does
    not have is refused now (``generate()`` reads ``True`` on LLaDA / Dream as no cache, so that a generation config's
    ``use_cache: true`` does not change their output; asked for here, it would silently be none)."""
    block_model = base.block_size is not None
    family = f"{type(base).__name__} (model_type {getattr(base.config, 'model_type', None)!r})"
    if value == "auto":
        return block_model
    if value is True and not block_model:
        raise ValueError(f"rollout_cache=True is the exact KV cache of block models (SDAR / TraDo); {family} has full "
                         "attention and no exact cache, so its rollouts would run uncached. Set rollout_cache="
                         "'prefix' or 'dual' (the approximate Fast-dLLM-style caches of LLaDA / Dream), False for "
                         "none, or leave it at 'auto' (none on full-attention models).")
    if value in ("prefix", "dual") and block_model:  # said now rather than by generate() at the first rollout
        raise ValueError(f"rollout_cache={value!r} is an approximate cache for full-attention models (LLaDA, Dream); "
                         f"{family} is a block model, whose cache is exact: set rollout_cache=True or 'auto' (or "
                         "False for none).")
    return value


def _rollout_cuda_graphs(args: TraceRLConfig, fsdp: bool, zero_stage: int | None) -> str:
    """The rollouts' ``cuda_graphs``: the config's, except that FSDP and DeepSpeed ZeRO-3 decode eagerly. They
    gather parameters inside the forward (hooks, communication, memory freed after it), which a capture cannot
    hold, also with one process."""
    if args.rollout_cuda_graphs == "auto" and (fsdp or zero_stage == 3):
        setup = "FSDP" if fsdp else "DeepSpeed ZeRO-3"
        logger.info(f"rollout_cuda_graphs='auto': rollouts decode eagerly under {setup} (its parameter gathering "
                    "inside the forward cannot be captured in a CUDA graph).")
        return "off"
    return args.rollout_cuda_graphs


def _check_optimizer_reset(args: TraceRLConfig, deepspeed: bool) -> None:
    """``reset_optimizer_per_rollout`` clears a torch optimizer's state; DeepSpeed keeps its optimizer's state in its
    own partitions (and offloaded optimizers), which this has not been checked against."""
    if args.reset_optimizer_per_rollout and deepspeed:
        raise ValueError("reset_optimizer_per_rollout is not supported with DeepSpeed (its optimizer keeps its state "
                         "in its own partitions); use DDP or FSDP, or set it to False.")


def blocks_generated(unmask_step: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``[B]`` how many blocks each row generated: the distinct ``blocks`` (``[B, C]`` block index of every canvas
    column) among its committed columns (``unmask_step >= 0``). A row that stops early generated fewer blocks, and
    a prompt that ends inside a block makes the first generated block a partial one."""
    hits = torch.zeros(blocks.shape[0], int(blocks.max()) + 1, device=blocks.device)
    hits.scatter_add_(1, blocks, unmask_step.ge(0).float())
    return hits.gt(0).sum(1)


def _fit_width(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or right-pad (with zeros) the last dimension to ``width``."""
    if tensor.shape[-1] >= width:
        return tensor[..., :width]
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))


def _per_mask(tensor: torch.Tensor, masks: int, width: int) -> torch.Tensor:
    """An estimator's ``[B, masks x canvas]`` output as ``[B, masks x width]``: each mask's columns cut or
    zero-padded to the completion width (``_fit_width`` per mask)."""
    batch = tensor.shape[0]
    return _fit_width(tensor.view(batch, masks, -1), width).reshape(batch, masks * width)


def cast_output_layer_to_fp32(model: torch.nn.Module) -> None:
    """``cast_lm_head_to_fp32`` for a model TRL does not build (the trainer's own reference copy of an in-memory
    policy): the output layer's weights in float32, run as ``run_output_layer_in_fp32``. With tied embeddings the
    input embedding (the same weights) still returns the model's dtype to the layers."""
    head = model.get_output_embeddings()
    dtype = head.weight.dtype
    head.float()
    run_output_layer_in_fp32(head)
    if getattr(model.config, "tie_word_embeddings", False):
        model.get_input_embeddings().register_forward_hook(lambda module, inputs, output: output.to(dtype))


def _float32_linear(head: torch.nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):
        bias = None if head.bias is None else head.bias.float()
        return torch.nn.functional.linear(hidden.float(), head.weight.float(), bias)


def run_output_layer_in_fp32(head: torch.nn.Linear) -> None:
    """Make the output layer compute in float32 outside autocast, which TRL documents ``cast_lm_head_to_fp32`` to do
    ("the LM head projection in float32, outside autocast") and its fused scoring head does. The forward TRL installs
    on the layer only casts dtypes, which accelerate's mixed-precision autocast (``bf16=True``) undoes: the logits of
    rollouts, training and reference forwards were bf16 products. Bound as a method, so a copy of the model (deepcopy)
    computes with its own weights."""
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(f"cast_lm_head_to_fp32=True needs a plain linear output layer; this model's is a "
                         f"{type(head).__name__} (e.g. a PEFT modules_to_save copy). Leave the output layer out of "
                         "the adapter, or set cast_lm_head_to_fp32=False.")
    head.forward = types.MethodType(_float32_linear, head)


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)
