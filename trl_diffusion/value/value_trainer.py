"""``DiffusionValueTrainer``: fit a value model on stored trajectories with rewards, to warm-start it before RL.

A row is one rollout: ``prompt`` (text or conversational, tokenized as ``GRPOTrainer`` does, with the config's
``chat_template_kwargs``) or ``prompt_ids`` (unpadded, or left-padded with a ``prompt_mask`` column whose 0s are
dropped), ``completion_ids`` (the sampler canvas), ``unmask_step`` (per completion token, -1 = never committed) and
a scalar ``reward`` (use the reward your RL run will see, e.g. group-normalised). Targets are the step-level returns of
TraceRL's GAE (the reward itself with ``gamma = 1``); the loss is ``0.5 (V - R)^2`` averaged over trained tokens.
"""

from __future__ import annotations

import json
import math
import os
from functools import partial
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, IterableDataset
from transformers import AutoTokenizer
from transformers.utils import logging
from trl.data_utils import is_conversational
from trl.trainer.base_trainer import _BaseTrainer
from trl.trainer.utils import pad

from ..best_metric import check_best_metric_names_a_set, usable_best_metric
from ..data.loading import empty_dataset_error
from ..data.prepared import PreparedDatasets, tokenizer_fingerprint
from ..full_save import save_model_whole
from ..mask_token import SANITIZE_CONTROL_TOKENS, mask_token_name
from ..model_card import card_dataset_name, finish_model_card, value_quick_start
from ..models import check_tokenizer, check_trains_parameters, model_argument
from ..models.kernels import apply_fused_kernels
from ..models.remote_code import carry_tokenizer_code, push_from_checkpoint_with_code
from ..recomputed_forwards import check_recomputed_forwards, recomputed_forwards
from ..states import check_block_size_applies, max_positions, resolve_model_attention_backend, through_first_stop
from ..trainers.checkpoint_files import (
    read_checkpoint_json,
    refuse_save_only_model,
    start_checkpoint_folder,
    warn_stream_resumed_after_first_pass,
)
from ..trainers.eval_padding import EvaluatedLoader, real_eval_rows
from ..vocabulary import embedding_rows
from .advantages import outcome_token_rewards, step_gae, summarize_value_statistics, value_statistics
from .value_config import DiffusionValueConfig
from .value_model import DiffusionValueModel, check_value_model, token_values, warn_if_half_precision

TRAJECTORY_COLUMNS = ("prompt_ids", "completion_ids", "unmask_step", "reward")
VALUE_STATS_NAME = "value_stats.json"
"""A checkpoint's value statistics of the logging window in progress and ``save_only_model`` setting."""
logger = logging.get_logger(__name__)


class TrajectoryCollator:
    """Pads rollouts: prompts left (``prompt_mask``), canvases right (``completion_mask`` = 0 and ``unmask_step`` =
    -1 there, so a shorter canvas is scored as it was sampled, whatever rows share its batch), and marks the trained
    tokens (committed, and up to the first stop token when ``stop_token_ids`` is given)."""

    def __init__(self, pad_token_id: int, stop_token_ids: list[int] | None = None) -> None:
        self.pad_token_id, self.stop_token_ids = pad_token_id, stop_token_ids

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        prompts = [torch.tensor(e["prompt_ids"], dtype=torch.long) for e in examples]
        completions = [torch.tensor(e["completion_ids"], dtype=torch.long) for e in examples]
        steps = [torch.tensor(e["unmask_step"], dtype=torch.long) for e in examples]
        completion_ids = pad(completions, padding_value=self.pad_token_id, padding_side="right")
        unmask_step = pad(steps, padding_value=-1, padding_side="right")
        trained = unmask_step >= 0
        if self.stop_token_ids:
            trained = through_first_stop(completion_ids, trained, torch.tensor(self.stop_token_ids))
        return {
            "prompt_ids": pad(prompts, padding_value=self.pad_token_id, padding_side="left"),
            "prompt_mask": pad([torch.ones_like(p) for p in prompts], padding_value=0, padding_side="left"),
            "completion_ids": completion_ids,
            "completion_mask": pad([torch.ones_like(c) for c in completions], padding_value=0, padding_side="right"),
            "unmask_step": unmask_step,
            "trained_mask": trained,
            "reward": torch.tensor([float(e["reward"]) for e in examples]),
        }


class DiffusionValueTrainer(EvaluatedLoader, _BaseTrainer):
    """Fits a [`DiffusionValueModel`] (or a path for `DiffusionValueModel.load`) on stored trajectories."""

    _tag_names = ["trl", "diffusion", "trl-diffusion", "value-model"]  # the same tags on every trainer's card
    _name = "DiffusionValue"
    # the loss is divided by the trained tokens of the whole accumulated batch (`get_batch_samples`): Trainer must
    # not divide it by the accumulation steps again (batch 1 x accumulation 2 trains as batch 2)
    loss_is_scaled_for_ga = True

    def __init__(self, model, args: DiffusionValueConfig | None = None,
                 train_dataset: Dataset | IterableDataset | None = None,
                 eval_dataset: Dataset | IterableDataset | dict[str, Dataset | IterableDataset] | None = None,
                 processing_class=None, callbacks=None, optimizers=(None, None)):
        model = model_argument(model, processing_class, type(self).__name__)
        if isinstance(model, str):
            model = DiffusionValueModel.load(model, dtype=torch.float32)  # as TRL loads a model path
        check_value_model(model, "model")
        if args is None:
            args = DiffusionValueConfig(f"{str(model.config._name_or_path or 'model').split('/')[-1]}-Value")
        elif not isinstance(args, DiffusionValueConfig):
            raise TypeError(f"args must be a DiffusionValueConfig, got {type(args).__name__}.")
        warn_if_half_precision(model, args.learning_rate, "learning_rate")
        check_block_size_applies("training_block_size", args.training_block_size, model.block_size)
        if processing_class is None:
            processing_class = AutoTokenizer.from_pretrained(model.config._name_or_path)
        check_tokenizer(processing_class, model)
        check_best_metric_names_a_set(eval_dataset, args)
        prepare = partial(_prepare_dataset, tokenizer=processing_class, chat_template_kwargs=args.chat_template_kwargs,
                          vocab_size=embedding_rows(model),
                          max_positions=max_positions(model.config), mask_token_id=model.mask_token_id)
        train_dataset = prepare(train_dataset, name="train_dataset") if train_dataset is not None else None
        if isinstance(eval_dataset, dict):  # named eval sets (a DatasetDict too), as in transformers
            eval_dataset = {k: prepare(v, name=f"eval_dataset[{k!r}]") for k, v in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = prepare(eval_dataset, name="eval_dataset")
        self._prepare_trajectories = prepare
        stop = _stop_token_ids(processing_class, model) if args.truncate_at_eos else None
        collator = TrajectoryCollator(processing_class.pad_token_id or 0, stop)
        super().__init__(model=model, args=args, data_collator=collator, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, callbacks=callbacks,
                         optimizers=optimizers)
        # value_statistics sums over the trained tokens since the last log (all processes): the logged mean value and
        # explained variance are those of every token of the window, not an average of per-micro-batch ratios (a
        # micro-batch of one rollout has constant returns with gamma = 1, so its own explained variance is NaN)
        self._value_stats: dict[str, torch.Tensor | None] = {"train": None, "eval": None}
        self.attention_backend = resolve_model_attention_backend(args.attention_backend, self.model, args.device,
                                                                 training=False)
        apply_fused_kernels(args.fused_kernels, self.model)
        zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        check_recomputed_forwards(args.recompute_scoring_forwards, self.is_fsdp_enabled, zero_stage,
                                  "recompute_scoring_forwards", self.model)

    def train(self, *args, **kwargs):
        """Trainer's ``train``, refusing first a model with no trainable parameter (``check_trains_parameters``):
        evaluating a frozen model is fine, training it would change nothing."""
        check_trains_parameters(self.model, f"{type(self).__name__}'s model")
        return super().train(*args, **kwargs)

    def _inner_training_loop(self, *args, **kwargs):
        """Trainer's loop, from empty training statistics: a failed ``train()`` (or the try that
        ``auto_find_batch_size`` retries with a smaller batch after running out of memory, which re-enters here)
        left those of its unlogged micro-batches, which the first log would mix in."""
        self._value_stats["train"] = None
        return super()._inner_training_loop(*args, **kwargs)

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """transformers' micro-batches of one optimizer step, with ``num_items_in_batch`` the trained tokens of all
        of them (over every process with ``average_tokens_across_devices``), as transformers counts label tokens."""
        batch_samples, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        if not batch_samples:
            return batch_samples, None
        count = sum(batch["trained_mask"].sum() for batch in batch_samples).to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return batch_samples, count

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=card_dataset_name(dataset_name), tags=tags)
        finish_model_card(self, value_quick_start(self.hub_model_id or self.args.output_dir))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """transformers' ``save_model``; under FSDP with a sharded state dict, where it writes nothing, the model is
        saved whole (``full_save.py``)."""
        save_model_whole(self, output_dir, _internal_call, super().save_model)

    def _save(self, output_dir: str | None = None, state_dict=None):
        """transformers' save, then the tokenizer's released remote code is carried along (``models/remote_code.py``;
        the model's comes with its ``config.json``)."""
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:
            carry_tokenizer_code(output_dir or self.args.output_dir, self.processing_class)

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """transformers' mid-training Hub push, with the released remote code in what it uploads."""
        push_from_checkpoint_with_code(self, checkpoint_folder, super()._push_from_checkpoint)

    def _save_checkpoint(self, model, trial):
        """transformers' checkpoint, after the model card in ``output_dir`` (as TRL's trainers write it) and the
        value statistics of the logging window in progress with the ``save_only_model`` setting (not resumable).
        Ours are written first: transformers' ``trainer_state.json`` (written last) marks a checkpoint complete, and
        a folder an earlier run left at this step loses its state file first (``checkpoint_files.py``)."""
        hub_model_id = self.args.hub_model_id
        self.create_model_card(model_name=hub_model_id.split("/")[-1] if hub_model_id else
                               Path(self.args.output_dir).name)
        folder = start_checkpoint_folder(self, trial, (VALUE_STATS_NAME,))
        if self.args.should_save:  # the statistics are summed over processes: every process holds the same
            stats = self._value_stats["train"]
            with open(os.path.join(folder, VALUE_STATS_NAME), "w") as handle:
                json.dump({"save_only_model": self.args.save_only_model,
                           "value_stats": stats.tolist() if stats is not None else None}, handle)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        """transformers' resume, refused for a ``save_only_model`` checkpoint (as SFT and TraceRL refuse it), with
        the value statistics of the logging window in progress: a checkpoint between two logs would otherwise drop
        its first part from the next log."""
        saved = read_checkpoint_json(checkpoint, VALUE_STATS_NAME)
        if saved is not None and saved["save_only_model"]:
            refuse_save_only_model(checkpoint, f"model={checkpoint}")
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        warn_stream_resumed_after_first_pass(self, checkpoint)
        if saved is None:  # a metric only: training itself resumes exactly
            logger.warning(f"{os.path.join(checkpoint, VALUE_STATS_NAME)} is missing (not saved by "
                           "DiffusionValueTrainer?): the first log's value/ statistics cover the steps since the "
                           "resume only.")
        elif saved["value_stats"] is not None:
            self._value_stats["train"] = torch.tensor(saved["value_stats"], dtype=torch.float64,
                                                      device=self.accelerator.device)

    def _set_signature_columns_if_needed(self):
        if self._signature_columns is None:
            self._signature_columns = list(TRAJECTORY_COLUMNS)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """Trainer's ``evaluate``; a dict of datasets passed to it is prepared first, each under its name (Trainer
        evaluates them one by one, as unnamed sets), so an error names the set and comes before any is evaluated."""
        if isinstance(eval_dataset, dict):
            eval_dataset = {key: self._prepared(data, f"eval_dataset[{key!r}]") for key, data in eval_dataset.items()}
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _determine_best_metric(self, metrics: dict[str, float], trial) -> bool:
        """transformers' choice of the best checkpoint, with a warning when ``metric_for_best_model`` is NaN
        (``usable_best_metric``)."""
        metric = self.args.metric_for_best_model
        why = (NAN_EXPLAINED_VARIANCE if metric and metric.endswith("value/explained_variance") else
               "the evaluated values or losses are NaN (a diverged model?)")
        return super()._determine_best_metric(usable_best_metric(metrics, metric, self.state.global_step, why), trial)

    def get_eval_dataloader(self, eval_dataset=None):
        if eval_dataset is not None and not isinstance(eval_dataset, str):
            eval_dataset = self._prepared(eval_dataset, "eval_dataset")
        return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        return super().get_test_dataloader(self._prepared(test_dataset, "test_dataset"))

    def _prepared(self, dataset, name: str):
        """A dataset passed to ``evaluate()`` or ``predict()``, streamed or not: tokenized and checked as the
        trainer's own are (a ``prompt_ids`` column is an input column, no sign that the rows were checked), unless
        this trainer's settings prepared it (``trainer.eval_dataset``); another type is refused."""
        return self._prepare_trajectories(dataset, name=name)  # returns one it prepared with these settings as it is

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        args = self.args
        mode = "train" if model.training else "eval"
        real = real_eval_rows(self.accelerator, self._evaluated_loader, inputs["reward"].shape[0]) \
            if mode == "eval" else None
        if real:  # the last eval batch, padded by accelerate with repeated rows: score only its real rows
            inputs = {key: value[:real] for key, value in inputs.items()}
        unwrapped = self.accelerator.unwrap_model(model)
        with recomputed_forwards(unwrapped, args.recompute_scoring_forwards):
            values, groups = token_values(model, inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_ids"],
                                          inputs["unmask_step"], args.shrinkage, args.training_block_size,
                                          args.scoring_token_budget, unwrapped, self.attention_backend,
                                          inputs["completion_mask"])
        mask = inputs["trained_mask"]
        rewards = outcome_token_rewards(inputs["reward"], groups, mask)
        _, returns = step_gae(rewards, values.detach(), groups, mask, args.gamma, 1.0)
        squared = (0.5 * (values - returns) ** 2 * mask).sum()
        if num_items_in_batch is None:  # evaluation: this batch's token mean
            loss = squared / mask.sum().clamp(min=1)
        else:  # the accumulated batch's token mean; DDP averages gradients over processes, hence the factor
            loss = squared / num_items_in_batch.clamp(min=1)
            if self.args.average_tokens_across_devices:
                loss = loss * self.accelerator.num_processes
        # a process whose padded batch holds no real row adds nothing (its loss is dropped by gather_for_metrics)
        keep = 0.0 if real == 0 else 1.0
        stats = self.accelerator.gather(value_statistics(values.detach(), returns, mask)[None] * keep).sum(0).double()
        previous = self._value_stats[mode]
        self._value_stats[mode] = stats if previous is None else previous + stats
        return (loss, values) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Trainer's loop; the value statistics of the evaluated rows join its metrics under ``metric_key_prefix``
        (``eval_value/explained_variance``; ``eval_<name>_value/...`` for a named eval set), so ``evaluate()`` returns
        them and ``metric_for_best_model`` can name them."""
        self._value_stats["eval"] = None
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        stats, self._value_stats["eval"] = self._value_stats["eval"], None
        if stats is not None:
            output.metrics.update({f"{metric_key_prefix}_value/{name}": number
                                   for name, number in summarize_value_statistics(stats).items()})
        return output

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        metrics = {}
        if self.model.training and self._value_stats["train"] is not None:  # evaluation_loop reports eval's
            metrics = {f"value/{name}": number
                       for name, number in summarize_value_statistics(self._value_stats["train"]).items()}
            self._value_stats["train"] = None
        super().log({**logs, **metrics}, start_time)

    def _track_num_input_tokens(self, inputs) -> None:
        """``include_num_input_tokens_seen``: a batch's tokens are its prompts' and canvases' (Trainer looks for
        ``input_ids``, which a trajectory batch does not have, and counted 0); ``non_padding`` leaves out the
        padding of both."""
        setting = self.args.include_num_input_tokens_seen
        if setting == "no":
            return
        if setting == "non_padding":
            tokens = inputs["prompt_mask"].sum() + inputs["completion_mask"].sum()
        else:
            tokens = torch.tensor(inputs["prompt_ids"].numel() + inputs["completion_ids"].numel())
        tokens = torch.as_tensor(tokens, device=self.args.device, dtype=torch.int64)
        self.state.num_input_tokens_seen += self.accelerator.gather(tokens).sum().item()


NAN_EXPLAINED_VARIANCE = ("explained variance is NaN when the returns of the evaluated tokens do not vary (too few "
                          "eval rows, e.g. one, or all rewards equal with gamma = 1)")
"""Why ``value/explained_variance`` is NaN (by design: ``summarize_value_statistics``)."""


def _stop_token_ids(tokenizer, model) -> list[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    eos = getattr(model.config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return sorted(ids)


def _check_integers(index: int, name: str, values: list, low: int, high: int | None = None) -> None:
    """Each of ``values`` an integer in ``[low, high)`` (``high`` None: no upper bound), else a ValueError naming the
    row and column: float ids (pandas, NaN padding) were truncated silently, out-of-vocabulary ids failed at the
    first step with a bare IndexError."""
    for column, value in enumerate(values):
        integer = isinstance(value, int) and not isinstance(value, bool)
        if not (integer and value >= low and (high is None or value < high)):
            bound = f"[{low}, {high})" if high is not None else f">= {low}"
            raise ValueError(f"row {index}: {name!r}[{column}] must be an integer {bound}, got {value!r}.")


def _unpadded_prompt(index: int, ids: list, mask: Any) -> list:
    """``ids`` without the left padding ``mask`` marks 0: a ``prompt_ids`` row sliced from a batch at the prompt
    width (``out.sequences[r, :P]``) with its ``prompt_mask`` (TRL's and TraceRL's layout, ``generate()``'s input).
    Kept, the pads were prompt tokens to the value model (with pad == EOS they are valid ids, so nothing failed), and
    every value was that of a state no sampler saw. A ValueError names the row for a mask that is not one 0 or 1 per
    prompt id, is all 0, or has a 0 after a 1 (right padding or a hole: ``generate()`` pads prompts on the left)."""
    if not isinstance(mask, list) or len(mask) != len(ids):
        got = f"{len(mask)} entries" if isinstance(mask, list) else (
            "None (a missing value)" if mask is None else f"a {type(mask).__name__}")
        raise ValueError(f"row {index}: 'prompt_mask' must hold one 0 or 1 per 'prompt_ids' token ({len(ids)}), got "
                         f"{got}; pass the attention mask the prompts were generated with (all 1s for an unpadded "
                         "prompt).")
    for column, value in enumerate(mask):
        if not (isinstance(value, int) and value in (0, 1)):
            raise ValueError(f"row {index}: 'prompt_mask'[{column}] must be 0 (padding) or 1 (prompt token), got "
                             f"{value!r}.")
    if 1 not in mask:
        raise ValueError(f"row {index}: 'prompt_mask' is all 0, so the prompt has no token: a rollout needs a "
                         "prompt; fix the mask or drop the row.")
    start = mask.index(1)
    if 0 in mask[start:]:
        hole = start + mask[start:].index(0)
        raise ValueError(f"row {index}: 'prompt_mask'[{hole}] is 0 after the 1 at column {start}: only left "
                         "padding (0s before the prompt, as generate() takes prompts) can be dropped; pad the prompts "
                         "on the left (tokenizer.padding_side = 'left') or pass 'prompt_ids' without padding.")
    return ids[start:]


def _left_padding_warning(name: str, index: int, tokenizer) -> str:
    """The warning for the first ``prompt_ids`` row of ``name`` that starts with the pad token, without a
    ``prompt_mask`` column: most likely the left padding of a batch kept by slicing it at the prompt width. A
    warning, not an error: a prompt may start with that id (the tokenized prompts of SDAR/TraDo, LLaDA and Dream do
    not: the first have no BOS, and LLaDA's and Dream's BOS is not their pad token)."""
    string = f" {tokenizer.pad_token!r}" if getattr(tokenizer, "pad_token", None) else ""
    return (f"{name} row {index}: 'prompt_ids' starts with the pad token{string} (id {tokenizer.pad_token_id}), "
            "most likely the left padding of a batch kept by slicing it at the prompt width (out.sequences[r, :P]): "
            "the value model reads pads as prompt tokens, and scores states the sampler never saw. Pass the "
            "prompts' attention mask as a 'prompt_mask' column (its 0s are dropped) or strip the padding; ignore "
            "this if the prompt really starts with that token. (Only the first such row is named.)")


def _check_no_mask_token(index: int, mask_id: int, tokenizer, in_prompt: bool, in_completion: bool) -> None:
    """Refuse a row whose prompt or committed completion tokens hold the mask id: a token equal to it cannot be told
    from a masked position in any state (SFT's collator and ``generate()`` refuse it too)."""
    if not (in_prompt or in_completion):
        return
    where = " and ".join(part for part, found in (("prompt", in_prompt), ("completion_ids", in_completion)) if found)
    fixes = []
    if in_prompt:
        fixes.append("text containing the mask token's string tokenizes to it: remove or escape it in the prompt, or "
                     f"for conversational prompts pass {SANITIZE_CONTROL_TOKENS}")
    if in_completion:
        fixes.append("a sampler never commits it (only positions with unmask_step -1 may hold it)")
    name = mask_token_name(mask_id, getattr(tokenizer, "mask_token", None))
    raise ValueError(f"row {index}: the {where} hold(s) {name}, which the value model could not tell from a masked "
                     f"position; {'; '.join(fixes)}.")


def _check_prompt(index: int, prompt: Any) -> None:
    """Refuse, naming the row, a ``prompt`` that is neither non-empty text nor a non-empty conversation (a list of
    ``{"role", "content"}`` messages), before it is tokenized: ``None`` (a missing value in a table) failed in
    transformers with "You need to specify either `text` or `text_target`", ``[]`` with TRL's bare IndexError, and a
    list of strings was tokenized as a batch. An empty prompt is refused as the empty tokenization of one is: no
    rollout has one."""
    if isinstance(prompt, str | list) and not prompt:
        raise ValueError(f"row {index}: the prompt is empty ({prompt!r}): a rollout needs a prompt; fill it in or "
                         "drop the row.")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and all(isinstance(message, dict) and "role" in message for message in prompt):
        return
    got = "None (a missing value)" if prompt is None else f"a {type(prompt).__name__} ({prompt!r:.80})"
    raise ValueError(f"row {index}: 'prompt' must be text or a conversation (a list of {{'role': ..., 'content': "
                     f"...}} messages), got {got}; fill it in or drop the row.")


def _columns_of_non_empty(dataset: Dataset | IterableDataset, name: str) -> set[str]:
    """The columns of ``dataset`` (``name``: the argument, e.g. ``eval_dataset['b']``), refused when it has no rows.
    A stream is not read ahead (a shuffle buffer would fill; a stream read once would lose its first row), except one
    that does not declare its columns (``IterableDataset.from_generator``): its first row shows them."""
    if isinstance(dataset, IterableDataset) and dataset.column_names is not None:
        return set(dataset.column_names)
    if isinstance(dataset, IterableDataset):
        first = next(iter(dataset), None)
        if first is None:
            raise empty_dataset_error(_label(name))
        return set(first)
    if len(dataset) == 0:
        raise empty_dataset_error(_label(name))
    return set(dataset.column_names)


def _label(name: str) -> str:
    """How messages name the dataset of an argument (``dataset_label``'s form): ``train_dataset`` -> ``train``,
    ``eval_dataset['b']`` (a member of a dict, its key's repr) -> ``eval 'b'``."""
    return name.removesuffix("_dataset").replace("_dataset[", " ").removesuffix("]")


def _prepare_dataset(dataset: Dataset | IterableDataset, tokenizer, chat_template_kwargs: dict | None = None,
                     vocab_size: int | None = None, max_positions: int | None = None,
                     name: str = "train_dataset", mask_token_id: int | None = None) -> Dataset | IterableDataset:
    """Check the type and columns, tokenize ``prompt`` into ``prompt_ids`` when needed (conversational prompts as
    ``GRPOTrainer`` renders them, with ``chat_template_kwargs``), drop the left padding a ``prompt_mask`` column marks
    0 (the column then goes: the collator pads prompts itself; without one, a first ``prompt_ids`` row that starts
    with the pad token is warned about), check the trajectory lengths and that ids are
    integers in ``[0, vocab_size)`` and steps integers >= -1; a prompt must be non-empty, hold no
    ``mask_token_id`` (nor may a committed completion token) and prompt + completion fit in ``max_positions``, as
    for a rollout (a value model fit on trajectories no rollout can produce). A stream
    (``IterableDataset``) is checked row by row as it is read. ``name`` is the argument, for the type error.
    A dataset with no rows is refused (``_columns_of_non_empty``)."""
    settings = {"tokenizer": tokenizer_fingerprint(tokenizer), "chat_template_kwargs": chat_template_kwargs,
                "vocab_size": vocab_size, "max_positions": max_positions, "mask_token_id": mask_token_id}
    # e.g. evaluate(trainer.eval_dataset): checked already
    if _PREPARED.holds(dataset, settings, name.replace("_dataset", "")):
        return dataset
    if not isinstance(dataset, Dataset | IterableDataset):  # TRL's error (a DatasetDict: pick a split)
        hint = ("pick one split, e.g. dataset['train']" if isinstance(dataset, dict) else
                "convert rows with datasets.Dataset.from_list(rows) or a DataFrame with Dataset.from_pandas(frame)")
        raise TypeError(f"`{name}` must be a `Dataset` or `IterableDataset`, got `{type(dataset).__name__}`: {hint}.")
    columns = _columns_of_non_empty(dataset, name)
    missing = [c for c in ("completion_ids", "unmask_step", "reward") if c not in columns]
    if missing or not columns & {"prompt", "prompt_ids"}:
        raise ValueError(f"a value dataset needs 'prompt' or 'prompt_ids', 'completion_ids', 'unmask_step' and "
                         f"'reward' columns; missing {missing or ['prompt / prompt_ids']} (has {sorted(columns)}).")
    masked = "prompt_mask" in columns
    if masked and "prompt_ids" not in columns:
        raise ValueError(f"{name} has a 'prompt_mask' column but no 'prompt_ids': the mask marks the padding of "
                         "token ids, and text prompts are tokenized without padding; drop 'prompt_mask', or pass the "
                         "left-padded 'prompt_ids' it belongs to.")
    pad_id = getattr(tokenizer, "pad_token_id", None)
    warned: list[int] = []  # the row named by the left-padding warning: one warning per dataset, a stream's too

    def tokenized(index: int, prompt: Any) -> list[int]:
        """``prompt`` tokenized as ``GRPOTrainer`` tokenizes it (conversations with the chat template)."""
        _check_prompt(index, prompt)
        if is_conversational({"prompt": prompt}):
            rendered = tokenizer.apply_chat_template(conversation=[prompt], add_generation_prompt=True, tokenize=True,
                                                     return_dict=True, **(chat_template_kwargs or {}))
            return list(rendered["input_ids"][0])
        return list(tokenizer(text=prompt)["input_ids"])

    def process(example: dict, index: int) -> dict:
        reward = example["reward"]
        if not isinstance(reward, (int, float)) or not math.isfinite(reward):
            # a NaN reward would make the loss NaN and every weight NaN after the step (the logged loss stays 0)
            raise ValueError(f"row {index}: 'reward' must be a finite number, got {reward!r}.")
        if len(example["completion_ids"]) != len(example["unmask_step"]):
            raise ValueError(f"completion_ids ({len(example['completion_ids'])}) and unmask_step "
                             f"({len(example['unmask_step'])}) must have the same length.")
        if not any(step >= 0 for step in example["unmask_step"]):
            # nothing to train on; a micro-batch of such rows has a loss without a graph, and backward fails
            raise ValueError(f"row {index}: no completion token was committed (every 'unmask_step' is -1, or the "
                             "canvas is empty): there is nothing to fit; drop the row.")
        steps = example["unmask_step"]
        _check_integers(index, "completion_ids", example["completion_ids"], 0, vocab_size)
        _check_integers(index, "unmask_step", steps, -1)
        if "prompt_ids" in example:
            _check_integers(index, "prompt_ids", example["prompt_ids"], 0, vocab_size)
        last = max(i for i, step in enumerate(steps) if step >= 0)
        if any(step < 0 for step in steps[:last]):
            # the samplers commit every column up to the last committed one; the packed scoring layout relies on it
            gap = next(i for i, step in enumerate(steps[:last]) if step < 0)
            raise ValueError(f"row {index}: 'unmask_step' is -1 at column {gap}, before committed column {last}: a "
                             "trajectory commits every column before its last committed one (-1 only after a stop).")
        if masked:
            ids = _unpadded_prompt(index, example["prompt_ids"], example["prompt_mask"])
        elif "prompt_ids" in example:
            ids = example["prompt_ids"]
            if pad_id is not None and ids and ids[0] == pad_id and not warned:
                warned.append(index)
                logger.warning(_left_padding_warning(name, index, tokenizer))
        else:
            ids = tokenized(index, example["prompt"])
        if "prompt_ids" in example and example.get("prompt") not in (None, "", []) and list(ids) != tokenized(
                index, example["prompt"]):
            raise ValueError(f"row {index}: 'prompt_ids' are not 'prompt' tokenized with this trainer's tokenizer "
                             "(and chat_template_kwargs): rows another trainer prepared with another tokenizer, or "
                             "ids of another pipeline. The value model reads 'prompt_ids'; drop one of the two "
                             "columns (the text is tokenized here when 'prompt_ids' is absent).")
        if not ids:
            raise ValueError(f"row {index}: the prompt is empty (no token): a rollout needs a prompt.")
        if mask_token_id is not None:
            committed = [token for token, step in zip(example["completion_ids"], steps) if step >= 0]
            _check_no_mask_token(index, mask_token_id, tokenizer, mask_token_id in ids, mask_token_id in committed)
        total = len(ids) + len(example["completion_ids"])
        if max_positions is not None and total > max_positions:
            raise ValueError(f"row {index}: prompt ({len(ids)}) + completion ({len(example['completion_ids'])}) = "
                             f"{total} tokens exceed the model's {max_positions} positions.")
        return {} if "prompt_ids" in example and not masked else {"prompt_ids": list(ids)}

    prepared = dataset.map(process, with_indices=True, remove_columns=["prompt_mask"] if masked else None)
    _PREPARED.add(prepared, settings)
    return prepared


_PREPARED = PreparedDatasets("DiffusionValueTrainer")
"""The datasets ``_prepare_dataset`` returned (checked), with the settings they were checked for."""
