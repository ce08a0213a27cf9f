"""``DiffusionSFTTrainer``: TRL's ``SFTTrainer`` with a diffusion loss.

TRL keeps everything it already does (dataset formats and tokenization, completion-only and assistant-only
labels, truncation, PEFT, gradient accumulation, mixed precision, callbacks, logging, model cards, Hub push).
This subclass only

* adds a ``sample_index`` column during dataset preparation (the seed of each sample's noise, so a sample gets
  the same masks however the batch is split) and aligns a recorded ``unmask_step`` column for ``trajectory``;
  with ``packing`` the index travels with every token into the packed rows (TRL's ``pack_dataset``), so a packed
  document gets the noise it would get unpacked;
* wraps the collator (EOS padding, the extra columns, a mask-token check; for padding-free rows, which document
  each token belongs to);
* replaces ``compute_loss`` with the objectives of ``diffusion_losses``, normalised exactly as TRL does: the
  summed token loss divided by ``num_items_in_batch`` (all loss tokens of the accumulated batch); for a
  mixture-of-experts model SFTTrainer's load-balancing term is added and logged as ``aux_loss`` as TRL does
  (``router_aux_loss_coef``, default the config's; the forward's loss over the real tokens of its rows);
* with ``scoring_token_budget``, runs a micro-batch's rows in several forwards inside ``training_step``,
  back-propagating each before the next (the same gradient as one forward).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from datasets import Dataset, IterableDataset, LargeList, List, Value
from transformers import TrainerCallback
from transformers.modeling_outputs import MaskedLMOutput
from transformers.utils import logging
from trl import SFTConfig, SFTTrainer, pack_dataset
from trl.data_utils import is_conversational, is_conversational_from_value

from ..best_metric import check_best_metric_names_a_set, usable_best_metric
from ..data.loading import column_names, dataset_label, empty_dataset_error
from ..data.prepared import PreparedDatasets, tokenizer_fingerprint
from ..full_save import save_model_whole
from ..mask_token import first_few, mask_token_name
from ..model_card import card_dataset_name, finish_adapter_card, finish_model_card, policy_quick_start
from ..models import check_router_aux_loss_coef, check_tokenizer, check_trains_parameters, model_argument
from ..models.kernels import apply_fused_kernels
from ..models.remote_code import carry_tokenizer_code, push_from_checkpoint_with_code
from ..recomputed_forwards import check_recomputed_forwards, recomputed_forwards
from ..states import check_block_size_applies, max_positions, resolve_model_attention_backend
from ..synced_forwards import agreed_forward_count, needs_synced_forwards, zero_forward_term
from ..vocabulary import embedding_rows
from .checkpoint_files import (
    read_checkpoint_json,
    refuse_save_only_model,
    start_checkpoint_folder,
    warn_stream_resumed_after_first_pass,
)
from .diffusion_losses import (
    IGNORE_INDEX,
    ScoringBatch,
    TokenScores,
    build_objective,
    count_loss_tokens,
    diffusion_loss,
    joined_scores,
    never_committed_tail,
    per_row_weights,
    rows_averaged,
    sample_generators,
    split_rows,
)
from .eval_padding import EvaluatedLoader, padded_eval_batch, prefixed_eval_metrics, real_eval_rows
from .sft_config import DiffusionSFTConfig

FULL_ATTENTION_ONLY = ("random_masking", "semi_ar")
TOKEN_COUNT_NAME = "token_count.json"
"""A checkpoint's token counter, logging window in progress and ``save_only_model`` setting."""
logger = logging.get_logger(__name__)


@dataclass
class DiffusionModelSpec:
    """What the loss needs to know about the model, read once from the unwrapped model (no name checks)."""

    mask_token_id: int
    block_size: int | None
    logits_shift: bool


def _unwrap(model):
    """The model under a PEFT wrapper (attribute access falls through anyway; this keeps errors readable)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def read_model_spec(model) -> DiffusionModelSpec:
    """Read ``mask_token_id`` / ``block_size`` / ``logits_shift`` from a diffusion model, with a clear error
    for a model that does not implement the interface."""
    base = _unwrap(model)
    missing = [name for name in ("mask_token_id", "block_size", "logits_shift") if not hasattr(type(base), name)]
    if missing:
        raise TypeError(
            f"{type(base).__name__} is not a diffusion language model: it lacks {missing}. DiffusionSFTTrainer "
            "trains trl_diffusion models (SDAR / LLaDA / Dream) or any model with the same interface."
        )
    return DiffusionModelSpec(int(base.mask_token_id), base.block_size, bool(base.logits_shift))


def resolve_objective(objective: str | None, spec: DiffusionModelSpec) -> str:
    """The configured objective, or the model's default; raises when it does not fit the model's attention."""
    if objective is None:
        return "block" if spec.block_size else "random_masking"
    if objective == "block" and not spec.block_size:
        raise ValueError(
            "diffusion_objective='block' needs a block-causal model (model.block_size), but this model has full "
            "attention. Use 'random_masking', 'semi_ar', 'complementary' or 'trajectory'."
        )
    if objective in FULL_ATTENTION_ONLY and spec.block_size:
        raise ValueError(
            f"diffusion_objective={objective!r} is for full-attention models; this model is block-causal "
            f"(block_size={spec.block_size}). Use 'block' (or 'complementary' / 'trajectory')."
        )
    return objective


class DiffusionDataCollator:
    """Wraps the SFT collator: pads with trained-on EOS to a fixed length or the batch's longest (optional), carries
    ``sample_index`` and ``unmask_step`` (right-padded with -1), and rejects data containing the mask token. A
    trajectory row's never-committed canvas tail (completion tokens with step -1 after its last committed one,
    ``diffusion_losses.never_committed_tail``) leaves the labels, so that no count of loss tokens includes it, and
    the row's whole canvas goes to the objective as ``generated``.
    ``max_length`` (optional) refuses longer rows: prepared rows never are, rows of ``skip_prepare_dataset`` can be.

    Packed rows (examples with ``seq_lengths``; also an ``eval_packing`` eval set when training is not packed) stay
    one row each, right-padded; ``padding_free`` batches of unpacked examples become one row, as TRL's padding-free
    collator makes them. Both get ``position_ids`` restarting at 0 per document, ``document_ids`` ``[B, W]`` (-1 on
    padding) and one ``sample_index`` / ``sample_offset`` per document (its noise seed); the one-row batch also
    ``example_lengths``. TRL's collator would flatten packed rows too, which costs nothing with varlen kernels but
    makes dense attention quadratic in the whole batch. ``restore_document_starts`` keeps the label of each
    document's first token, which TRL's padding-free collator drops (an autoregressive model cannot predict it; a
    diffusion model without shifted logits scores it as any other masked token). ``one_labelled_span`` (``semi_ar``)
    refuses unpacked rows with several labelled spans, as construction refuses them in an in-memory dataset: a
    stream's (or a dataset passed to ``evaluate`` / ``predict``) are first seen here."""

    def __init__(self, base, mask_token_id: int, eos_token_id: int | None, pad_to_length: int | str | None,
                 max_length: int | None = None, padding_free: bool = False,
                 restore_document_starts: bool = True, reads_unmask_step: bool = True,
                 max_positions: int | None = None, one_labelled_span: bool = False, mask_token: str | None = None,
                 assistant_only_loss: bool = False, vocab_rows: int | None = None) -> None:
        self.base = base
        self.vocab_rows = vocab_rows  # the model's embedding rows: ids at or above them fail inside the embedding
        self.mask_token = mask_token  # the mask id's string and the setting the remedy depends on, for the refusal
        self.assistant_only_loss = assistant_only_loss
        self.one_labelled_span = one_labelled_span
        self.max_positions = max_positions
        self.mask_token_id = mask_token_id
        self.eos_token_id = eos_token_id
        self.pad_to_length = pad_to_length
        self.max_length = max_length
        self.padding_free = padding_free
        self.restore_document_starts = restore_document_starts
        self.reads_unmask_step = reads_unmask_step

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        examples = [dict(example) for example in examples]
        indices = [example.pop("sample_index", None) for example in examples]
        offsets = [example.pop("sample_offset", None) for example in examples]
        steps = [example.pop("unmask_step", None) for example in examples]
        if not self.reads_unmask_step:  # an objective other than "trajectory": a rollout's record goes unread
            steps = [None] * len(examples)
        for row, (example, index, step) in enumerate(zip(examples, indices, steps)):
            length = len(example["input_ids"])
            outside = _first_id_outside(example["input_ids"], self.vocab_rows) if self.vocab_rows and length else None
            if outside is not None:  # named by the token's own sample (a packed row's index is one per token)
                sample = index[outside] if isinstance(index, list) else index
                name = f"row {row}" if sample is None else f"sample_index {int(sample)}"
                raise _ids_outside_vocabulary_error(f"{name} of a batch", self.vocab_rows)
            if self.max_length is not None and length > self.max_length:
                raise ValueError(
                    f"a row of {length} tokens is longer than max_length={self.max_length} (with overlong_policy="
                    "'error' or pad_to_length_with_eos=True). Rows of skip_prepare_dataset are not truncated or "
                    "checked during preparation: shorten them yourself, or raise max_length."
                )
            document = max(example.get("seq_lengths") or [length])  # a packed row's positions restart per document
            if self.max_positions is not None and document > self.max_positions:
                raise ValueError(
                    f"a {'packed document' if 'seq_lengths' in example else 'row'} of {document} tokens needs "
                    f"{document} positions; the model has {self.max_positions}: it would train at positions the "
                    f"model has none for (and generate() refuses). Set max_length <= {self.max_positions} (rows are "
                    "truncated to it), or shorten the data."
                )
            labels = example.get("labels")
            if labels is not None and _labels_other_than_ids(example["input_ids"], labels):
                raise ValueError(
                    f"row {row} of a batch has labels other than its input_ids (or -100): the diffusion objectives "
                    "read labels as a mask only (-100: not trained) and predict the input ids themselves, so other "
                    "label values (shifted labels, other targets) would be trained as if they were the input ids. "
                    "Give labels equal to input_ids where trained and -100 elsewhere, or a completion_mask."
                )
            if step is not None and len(step) != length:
                raise ValueError(
                    f"a row of {length} tokens has {len(step)} 'unmask_step' entries. Prepared rows get one per "
                    "position; with skip_prepare_dataset, give one per position of input_ids (-1 on the prompt)."
                )
        if self.one_labelled_span:  # before EOS padding, whose labels may start a span of their own
            _refuse_several_spans_in_batch(examples, indices)
        if any("seq_lengths" in example for example in examples):
            return self._packed_rows(examples, indices, offsets)
        if self.padding_free:
            return self._documents_in_one_row(examples, indices, offsets)
        given = indices  # a wrapped row's per token, for the mask-token refusal
        if any(isinstance(index, list) for index in indices):  # packed without padding_free ("wrapped"): one row each
            offsets = [offset[0] if isinstance(index, list) else 0 for index, offset in zip(indices, offsets)]
            indices = [index[0] if isinstance(index, list) else index for index in indices]
        if self.pad_to_length is not None:
            target = self.pad_to_length
            if target == "longest":  # LLaDA's SFT: EOS up to the longest sequence of the mini-batch
                target = max(len(example["input_ids"]) for example in examples)
            for example in examples:
                labels = list(example.get("labels", example["input_ids"]))
                extra = max(target - len(example["input_ids"]), 0)
                example["input_ids"] = list(example["input_ids"]) + [self.eos_token_id] * extra
                example["labels"] = labels + [self.eos_token_id] * extra
        batch = self.base(examples)
        input_ids = batch["input_ids"]
        valid = batch["attention_mask"].bool() if "attention_mask" in batch else torch.ones_like(input_ids).bool()
        if bool((input_ids.eq(self.mask_token_id) & valid).any()):
            raise self._mask_token_error(examples, given)
        if any(index is None for index in indices):
            # Without prepared data (skip_prepare_dataset), seed each sample from its content, padding left out so
            # the seed does not depend on the rows it is batched with.
            indices = [hash(tuple(ids[row_valid].tolist())) % (2**31) if index is None else index
                       for index, ids, row_valid in zip(indices, input_ids, valid)]
        batch["sample_index"] = torch.tensor(indices, dtype=torch.long)
        if any(offset for offset in offsets):
            batch["sample_offset"] = torch.tensor(offsets, dtype=torch.long)
        if any(step is not None for step in steps):
            width = input_ids.shape[1]
            padded = torch.full_like(input_ids, -1)
            for row, step in enumerate(steps):
                padded[row, : len(step)] = torch.tensor(step[:width], dtype=torch.long)
            batch["unmask_step"] = padded
            batch.update(_never_committed_out_of_labels(batch["labels"], padded))
        return batch

    def _documents_in_one_row(self, examples: list[dict[str, Any]], indices: list, offsets: list) -> dict[str, Any]:
        """The padding-free batch: the examples' documents in one row (collated by the wrapped collator as one
        example, so its padding and extra keys apply), each token's position in its document, its document, and
        each document's seed."""
        lengths = [len(example["input_ids"]) for example in examples]
        documents = [list(example.get("seq_lengths") or [length]) for example, length in zip(examples, lengths)]
        for length, parts in zip(lengths, documents):
            if sum(parts) != length:
                raise ValueError(f"a packed row of {length} tokens has seq_lengths {parts} (sum {sum(parts)}).")
        labels = [list(example.get("labels", example["input_ids"])) for example in examples]
        row = {"input_ids": [token for example in examples for token in example["input_ids"]],
               "labels": [label for example_labels in labels for label in example_labels],
               "seq_lengths": [n for parts in documents for n in parts]}
        batch = self.base([row])
        batch.pop("attention_mask", None)  # `document_ids` says which columns are real
        input_ids = batch["input_ids"]
        document_lengths = torch.tensor(row["seq_lengths"])
        total = int(document_lengths.sum())
        document_ids = torch.full_like(input_ids, -1)
        document_ids[0, :total] = torch.repeat_interleave(torch.arange(len(document_lengths)), document_lengths)
        starts = torch.cumsum(document_lengths, 0) - document_lengths
        position_ids = torch.zeros_like(input_ids)
        position_ids[0, :total] = torch.arange(total) - torch.repeat_interleave(starts, document_lengths)
        batch["position_ids"] = position_ids
        batch["labels"][0, :total] = torch.tensor(row["labels"])
        if not self.restore_document_starts:  # shifted logits: nothing predicts a document's first token
            batch["labels"][0, starts] = IGNORE_INDEX
        if bool((input_ids.eq(self.mask_token_id) & (document_ids >= 0)).any()):
            raise self._mask_token_error(examples, indices)
        seeds = [document_noise_key(example["input_ids"], index, offset, start, length)
                 for example, index, offset, parts in zip(examples, indices, offsets, documents)
                 for start, length in zip(_starts(parts), parts)]
        batch["sample_index"] = torch.tensor([seed[0] for seed in seeds], dtype=torch.long)
        batch["sample_offset"] = torch.tensor([seed[1] for seed in seeds], dtype=torch.long)
        batch["document_ids"] = document_ids
        batch["example_lengths"] = torch.tensor(lengths, dtype=torch.long)
        return batch

    def _mask_token_error(self, examples: list[dict[str, Any]], indices: list) -> ValueError:
        """``_mask_token_in_batch`` with this collator's mask token and remedy."""
        return _mask_token_in_batch(examples, indices, self.mask_token_id, self.mask_token, self.assistant_only_loss)

    def _packed_rows(self, examples: list[dict[str, Any]], indices: list, offsets: list) -> dict[str, Any]:
        """Packed rows, one row each (``_documents_in_one_row`` per row), right-padded to the longest and stacked,
        with document ids numbered across the batch."""
        rows = [self._documents_in_one_row([example], [index], [offset])
                for example, index, offset in zip(examples, indices, offsets)]
        width = max(row["input_ids"].shape[1] for row in rows)
        pad_id = getattr(self.base, "pad_token_id", None)
        fill = {"input_ids": 0 if pad_id is None else pad_id, "labels": IGNORE_INDEX, "position_ids": 0,
                "document_ids": -1}
        batch = {key: torch.cat([torch.nn.functional.pad(row[key], (0, width - row[key].shape[1]), value=value)
                                 for row in rows]) for key, value in fill.items()}
        first = torch.tensor([0] + [len(row["sample_index"]) for row in rows[:-1]]).cumsum(0)
        batch["document_ids"] = torch.where(batch["document_ids"] >= 0, batch["document_ids"] + first[:, None], -1)
        for key in ("sample_index", "sample_offset"):
            batch[key] = torch.cat([row[key] for row in rows])
        return batch


def _starts(lengths: list[int]) -> list[int]:
    """Where each of consecutive parts of these ``lengths`` starts."""
    return [sum(lengths[:i]) for i in range(len(lengths))]


def document_noise_key(input_ids: list[int], index, offset, start: int, length: int) -> tuple[int, int]:
    """``(sample_index, offset)`` that seeds the noise of the document at ``start`` of a row
    (``diffusion_losses.document_seed``). Packed rows carry both per token (the original sample, and the token's
    position in it: a split-off fragment starts past 0); a row with one ``sample_index`` numbers its documents by
    where they start; rows without one (``skip_prepare_dataset``) are seeded from the document's tokens."""
    if isinstance(index, list):
        return int(index[start]), int(offset[start]) if offset is not None else start
    if index is not None:
        return int(index), start
    return hash(tuple(input_ids[start : start + length])) % (2**31), 0


class PassCounter(TrainerCallback):
    """Which pass over the training data the batches come from, the epoch that seeds their noise. ``state.epoch`` is
    updated after each optimizer step and, for an ``IterableDataset``, estimated from ``max_steps`` (its length is
    unknown), so at the first step of a new pass it still read the previous pass (whose masks that step repeated). The
    first ``on_epoch_begin`` of a ``train()`` takes ``int(state.epoch)`` (0, or the pass a resumed run is in); each
    later one is the next pass."""

    def __init__(self) -> None:
        self.current: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.current = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.current = int(state.epoch or 0) if self.current is None else self.current + 1

    def epoch(self, state) -> int:
        """The pass being trained on (``int(state.epoch)`` outside ``train()``)."""
        return int(state.epoch or 0) if self.current is None else self.current


class DiffusionSFTTrainer(EvaluatedLoader, SFTTrainer):
    """Supervised fine-tuning for diffusion language models (SDAR / TraDo, LLaDA, Dream / DiffuCoder).

    Takes the same arguments as [`trl.SFTTrainer`]; `args` is a [`DiffusionSFTConfig`] (an `SFTConfig` is
    converted). The objective is `args.diffusion_objective`, by default `"block"` for block-causal models and
    `"random_masking"` for full-attention ones.
    """

    _tag_names = ["trl", "diffusion", "trl-diffusion", "sft"]  # the same tags on every trainer's card
    _name = "Diffusion SFT"

    def create_model_card(self, model_name=None, dataset_name=None, tags=None):
        super().create_model_card(model_name=model_name, dataset_name=card_dataset_name(dataset_name), tags=tags)
        model_id = self.hub_model_id or self.args.output_dir
        finish_model_card(self, policy_quick_start(model_id, {"max_new_tokens": 128}, trainer=self))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """transformers' ``save_model``; under FSDP with a sharded state dict, where it writes nothing, the model is
        saved whole (``full_save.py``)."""
        save_model_whole(self, output_dir, _internal_call, super().save_model)

    def _save(self, output_dir: str | None = None, state_dict=None):
        """transformers' save (``save_model``, checkpoints, ``push_to_hub``), then the tokenizer's released remote
        code is carried along (``models/remote_code.py``; the model's comes with its ``config.json``)."""
        super()._save(output_dir, state_dict=state_dict)
        if self.args.should_save:  # transformers calls _save on every process under FSDP and DeepSpeed
            carry_tokenizer_code(output_dir or self.args.output_dir, self.processing_class)
            finish_adapter_card(self, output_dir or self.args.output_dir)  # PEFT's card: ours, no local path

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """transformers' mid-training Hub push, with the released remote code in what it uploads."""
        push_from_checkpoint_with_code(self, checkpoint_folder, super()._push_from_checkpoint)

    def _save_checkpoint(self, model, trial):
        """Also keep the running token count, so ``num_tokens`` continues after a resume instead of restarting, the
        metrics of the logging window in progress (every process holds the same: they are summed over processes), and
        whether the checkpoint holds the weights only (``save_only_model``: not resumable). Written before
        transformers' own files: its ``trainer_state.json`` (written last) marks a checkpoint complete, and a folder
        an earlier run left at this step loses its state file first (``checkpoint_files.py``)."""
        folder = start_checkpoint_folder(self, trial, (TOKEN_COUNT_NAME,))
        if self.args.should_save:
            with open(os.path.join(folder, TOKEN_COUNT_NAME), "w") as handle:
                json.dump({"total_train_tokens": self._total_train_tokens,
                           "save_only_model": self.args.save_only_model, "metrics": self._metrics["train"]}, handle)
        super()._save_checkpoint(model, trial)

    def _load_optimizer_and_scheduler(self, checkpoint):
        saved = read_checkpoint_json(checkpoint, TOKEN_COUNT_NAME)
        if saved is not None and saved.get("save_only_model", False):
            refuse_save_only_model(checkpoint, f"model_name_or_path={checkpoint}")
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        warn_stream_resumed_after_first_pass(self, checkpoint)
        if saved is None:  # a metric only: training itself resumes exactly
            logger.warning(f"{os.path.join(checkpoint, TOKEN_COUNT_NAME)} is missing (not saved by "
                           "DiffusionSFTTrainer?): the num_tokens metric restarts from 0.")
            return
        self._total_train_tokens = saved["total_train_tokens"]
        # the logging window in progress: a checkpoint between two logs would otherwise drop its first part
        self._metrics["train"] = defaultdict(list, saved.get("metrics", {}))

    def __init__(self, model, args: DiffusionSFTConfig | SFTConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_loss_func=None, **kwargs):
        model = model_argument(model, processing_class, type(self).__name__)
        args = self._to_diffusion_config(model, args)
        if compute_loss_func is not None:
            raise ValueError("compute_loss_func is not supported: the diffusion objective is the loss.")
        for name in ("compute_metrics", "preprocess_logits_for_metrics"):
            if kwargs.get(name) is not None:  # Trainer would skip them silently: the loss returns no logits
                raise ValueError(
                    f"{name} is not supported: the diffusion loss scores masked copies of each sequence, so there are "
                    "no logits of the clean sequence to pass on. Evaluation logs eval_loss, eval_entropy and "
                    "eval_mean_token_accuracy; compute other metrics in a TrainerCallback's on_evaluate."
                )
        if args.label_smoothing_factor:
            raise ValueError("label_smoothing_factor is not supported by the diffusion objectives.")
        check_best_metric_names_a_set(eval_dataset, args)
        # TRL reads the train set's first row before preparing it (a bare StopIteration when there is none); an eval
        # stream's emptiness shows when it is prepared
        named_evals = _named(eval_dataset)
        for label, dataset in [("train", train_dataset), *named_evals.items()]:
            if isinstance(dataset, Dataset) and len(dataset) == 0:
                raise empty_dataset_error(label)
        if isinstance(train_dataset, IterableDataset) and next(iter(train_dataset), None) is None:
            raise empty_dataset_error("train")
        if train_dataset is not None:
            self._check_columns(train_dataset, args, kwargs.get("formatting_func"), "train")
            datasets = {"train": train_dataset, **named_evals}
            _warn_completion_only_loss_unused(args, kwargs.get("formatting_func"), datasets)
            _warn_completion_mask_unused(args, datasets)
        if not isinstance(model, str):
            self._validate_model(model, args, processing_class)
            check_router_aux_loss_coef(model, args.router_aux_loss_coef)  # before TRL prepares the datasets
        super().__init__(model, args, data_collator, train_dataset, eval_dataset, processing_class, None, **kwargs)
        self.spec = self._validate_model(self.model, self.args, self._tokenizer)
        zero_stage = self.accelerator.state.deepspeed_plugin.zero_stage if self.is_deepspeed_enabled else None
        _check_token_budget(self.args, self.is_deepspeed_enabled)
        check_recomputed_forwards(self.args.recompute_scoring_forwards, self.is_fsdp_enabled, zero_stage,
                                  "recompute_scoring_forwards", self.model)
        self.objective = resolve_objective(self.args.diffusion_objective, self.spec)
        self.attention_backend = resolve_model_attention_backend(self.args.attention_backend, self.model,
                                                                 self.args.device, training=False)
        apply_fused_kernels(self.args.fused_kernels, self.model)
        self._noise_seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        self._inside_training_step = False  # see training_step
        self._passes = PassCounter()
        self.add_callback(self._passes)
        # Our loss is normalised by `num_items_in_batch`; make Trainer always count it, over every label (it would
        # drop position 0 of each row for a "...ForCausalLM" class name) or over labels[1:] for shifted logits.
        self.model_accepts_loss_kwargs = True
        self._loss_shifts_labels = self.spec.logits_shift
        pad_to = None
        if self.args.pad_to_length_with_eos:
            pad_to = self.args.max_length if self.args.eos_padding_length == "max_length" else "longest"
        if pad_to is not None and self._tokenizer.eos_token_id is None:  # TRL's collator would fail on a None id
            raise ValueError("pad_to_length_with_eos pads with the EOS token, but the tokenizer has none: set "
                             "eos_token in the config (a token of the tokenizer's vocabulary) or on the tokenizer.")
        limit = self.args.max_length if self.args.overlong_policy == "error" or pad_to else None
        positions = max_positions(self.model.config)
        prepared = {"train": self.train_dataset, **_named(self.eval_dataset)}
        _check_rows_fit(positions, pad_to, prepared)
        _check_no_mask_token(self.spec.mask_token_id, self._tokenizer.mask_token, prepared,
                             self.args.assistant_only_loss)
        rows = embedding_rows(self.model)
        _check_ids_in_vocabulary(rows, prepared)
        if self.objective == "semi_ar":
            _check_one_labelled_span(prepared)
        self.data_collator = DiffusionDataCollator(
            self.data_collator, self.spec.mask_token_id, self._tokenizer.eos_token_id, pad_to, limit,
            padding_free=self.padding_free, restore_document_starts=not self.spec.logits_shift,
            reads_unmask_step=self.args.diffusion_objective == "trajectory", max_positions=positions,
            one_labelled_span=self.objective == "semi_ar", mask_token=self._tokenizer.mask_token,
            assistant_only_loss=self.args.assistant_only_loss, vocab_rows=rows,
        )

    # ---------------------------------------------------------------------------------------------- validation

    @staticmethod
    def _to_diffusion_config(model, args) -> DiffusionSFTConfig:
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "") or "model"
            return DiffusionSFTConfig(f"{name.split('/')[-1]}-DiffusionSFT")
        if isinstance(args, DiffusionSFTConfig):
            return args
        values = args.to_dict()
        for key in values:
            if key.endswith("_token"):  # `to_dict` redacts these (hub_token, eos_token, pad_token)
                values[key] = getattr(args, key)
        return DiffusionSFTConfig(**{k: v for k, v in values.items() if k in DiffusionSFTConfig.__dataclass_fields__})

    @staticmethod
    def _check_columns(dataset, args: DiffusionSFTConfig, formatting_func, name: str) -> None:
        """A clear error when a dataset has none of the columns SFT reads (or lacks ``unmask_step``), and when TRL
        would ignore what it was given: a ``formatting_func`` beside prompt / messages columns, or put the EOS token
        on a text column beside a text completion (a conversational one gets its end of turn from the template)."""
        if isinstance(dataset, dict):
            for key, value in dataset.items():
                DiffusionSFTTrainer._check_columns(value, args, formatting_func, key)
            return
        if not isinstance(dataset, Dataset | IterableDataset):
            return
        columns = set(column_names(dataset))
        usable = (
            "input_ids" in columns
            or {"prompt", "completion"} <= columns
            or bool({"messages", "conversations"} & columns)
            or args.dataset_text_field in columns
            or formatting_func is not None
        )
        if not usable:
            raise ValueError(
                f"the {name} dataset has columns {sorted(columns)}, none of which SFT can train on. Provide "
                f"'prompt' + 'completion', 'messages', '{args.dataset_text_field}' (plain text) or tokenized "
                "'input_ids', or pass a formatting_func."
            )
        tokenized_by_trl = {"prompt", "messages", "conversations"} & columns  # before any text field, by TRL 1.16
        if formatting_func is not None and tokenized_by_trl and "input_ids" not in columns:
            raise ValueError(
                f"formatting_func writes the 'text' that TRL trains on for rows without prompt or messages, but the "
                f"{name} dataset has {sorted(tokenized_by_trl)}, which TRL tokenizes instead: the function's text "
                "would be ignored. Map those columns into a 'text' column yourself (and drop them), or leave "
                "formatting_func out."
            )
        completion = (getattr(dataset, "features", None) or {}).get("completion")
        text_completion = isinstance(completion, Value) and completion.dtype in ("string", "large_string")
        if args.dataset_text_field in columns and text_completion and "input_ids" not in columns:
            raise ValueError(
                f"the {name} dataset has both '{args.dataset_text_field}' (dataset_text_field) and 'completion': TRL "
                f"trains on the prompt and completion but appends the EOS token to '{args.dataset_text_field}', so "
                "the completions would be trained without their EOS (on which generate() stops). Remove the "
                f"'{args.dataset_text_field}' column, or set dataset_text_field to a name the dataset does not use."
            )
        if args.diffusion_objective == "trajectory" and "unmask_step" not in columns:
            raise ValueError(
                f"diffusion_objective='trajectory' needs an 'unmask_step' column (the sampler's step for each "
                f"completion token); the {name} dataset has {sorted(columns)}."
            )

    def _validate_model(self, model, args: DiffusionSFTConfig, processing_class) -> DiffusionModelSpec:
        base = _unwrap(model)
        if args.block_size is not None and getattr(base, "block_size", None) not in (None, args.block_size):
            base.config.block_size = args.block_size  # train (and later generate) at the configured block size
        try:
            spec = read_model_spec(model)
        except ValueError as error:  # the model's own "no mask token" message
            raise ValueError(str(error)) from None
        check_block_size_applies("block_size", args.block_size, spec.block_size)
        if spec.block_size and spec.logits_shift:
            raise ValueError("block-causal models with shifted logits are not supported.")
        resolve_objective(args.diffusion_objective, spec)
        if processing_class is not None:
            tokenizer = getattr(processing_class, "tokenizer", processing_class)
            check_tokenizer(tokenizer, base)  # LLaDA's released tokenizer has no mask token: the config's id is used
            if tokenizer.pad_token_id is not None and tokenizer.pad_token_id == spec.mask_token_id:
                raise ValueError("the pad token is the mask token; use a different pad token (e.g. EOS).")
        return spec

    # ------------------------------------------------------------------------------------------ dataset prep

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        reads_steps = self.args.diffusion_objective == "trajectory"  # the other objectives ignore a rollout's record
        for column in ("sample_index", "sample_offset", "unmask_step") if reads_steps else ("sample_index",
                                                                                           "sample_offset"):
            if column not in self._signature_columns:
                self._signature_columns.append(column)

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        """TRL's preparation, then the noise seed of every sample. Packing comes last, done here rather than by TRL
        so that the seed column goes into the packed rows with the tokens (TRL keeps only input_ids and labels);
        the rows are the ones TRL's packing makes (same order of shuffles, same ``pack_dataset``)."""
        settings = self._preparation_settings(processing_class, args, packing)
        if _PREPARED.holds(dataset, settings, dataset_name):
            # Already prepared by a DiffusionSFTTrainer (e.g. `trainer.evaluate(trainer.eval_dataset)`): with the same
            # settings, preparing again would make the same rows, or worse: re-spread `unmask_step` (an error), pack
            # packed rows again as single documents (documents attending to each other, new noise seeds). With other
            # settings (another trainer's) the rows are not these settings' (not truncated to this max_length, not
            # packed, ...) and cannot be made so from the prepared rows: refused. Known by identity: a user's own
            # `sample_index` column is no sign of it.
            return dataset
        if isinstance(dataset, Dataset) and len(dataset) == 0:  # TRL fails reading its first row (StopIteration)
            raise empty_dataset_error(_label(dataset_name))
        self._check_columns(dataset, args, formatting_func, dataset_name)
        if isinstance(dataset, Dataset | IterableDataset) and _packed_by_a_trainer(dataset):
            # a copy (`select`, `shuffle`, ...) of packed rows a DiffusionSFTTrainer made: packing them again would
            # join each row's documents into one and replace their noise seeds
            return _packed_rows_as_they_are(dataset, args.max_length, args.packing_strategy, packing, dataset_name)
        packed_given = False  # tokenized rows with `seq_lengths`: packed already, not packed again
        if isinstance(dataset, Dataset | IterableDataset):
            columns = column_names(dataset)
            packed_given = {"seq_lengths", "input_ids"} <= set(columns)
            if "seq_lengths" in columns and "input_ids" not in columns:
                # `seq_lengths` marks packed rows (TRL's packing writes it; the collator keeps each document apart):
                # on rows not tokenized yet it is a column of the user's, not lengths of these rows' documents. TRL's
                # collator reads it only with padding_free (and packing drops it); here it would make every row a
                # packed one, so it is dropped, as a column SFT does not read.
                dataset = dataset.remove_columns("seq_lengths")
        if formatting_func is None and not args.assistant_only_loss:  # (it trains the generation blocks only)
            first = dataset[0] if isinstance(dataset, Dataset) else (
                next(iter(dataset), None) if isinstance(dataset, IterableDataset) else None)  # TRL reads it too
            if first is not None and (is_conversational(first) or is_conversational_from_value(first)):
                _warn_trailing_assistant_header(processing_class)
        rows_given = len(dataset) if isinstance(dataset, Dataset) else None
        max_length = args.max_length
        steps = args.diffusion_objective == "trajectory"
        if args.overlong_policy == "error" or packing or steps:
            # tokenize without truncating: refuse what is too long, leave it to packing, or truncate the recorded
            # steps with the tokens (below: whether a row was cut is then known)
            args.max_length = None
        try:
            dataset = super()._prepare_dataset(dataset, processing_class, args, False, formatting_func, dataset_name)
        except StopIteration:  # TRL's read of a stream's first row: an empty stream
            raise empty_dataset_error(_label(dataset_name)) from None
        finally:
            args.max_length = max_length
        if args.overlong_policy == "error" and max_length is not None:
            dataset = dataset.map(_refuse_overlong, fn_kwargs={"max_length": max_length})
        if steps:
            dataset = dataset.map(_align_unmask_step)
            if max_length is not None and args.overlong_policy != "error" and not packing:
                dataset = _truncate_with_steps(dataset, max_length, args.truncation_mode)
        # the noise seed: a user's `sample_index` is overwritten, and a `sample_offset` (the seed's second part, which
        # only packing writes, below) dropped: the collator would read it as this sample's offset
        dataset = _without_column(dataset, "sample_offset")
        stream = isinstance(dataset, IterableDataset)
        dataset = dataset.map(_add_stream_sample_index if stream else _add_sample_index, with_indices=True)
        if rows_given is not None and len(dataset) == 0:
            # Trainer would fail at train() with "num_samples=0", and evaluate() log no eval_loss
            raise _emptied_dataset_error(_label(dataset_name), rows_given, args)
        if packing and packed_given:  # the user's packed rows: each document kept apart, as without packing
            dataset = _packed_rows_fit(dataset, max_length, dataset_name)
        elif packing:
            dataset = _pack(dataset, args, dataset_name)
        _PREPARED.add(dataset, settings)
        return dataset

    @staticmethod
    def _preparation_settings(processing_class, args: DiffusionSFTConfig, packing: bool) -> dict[str, Any]:
        """The settings that decide what ``_prepare_dataset`` makes of a dataset (TRL's steps and ours), recorded
        with each prepared dataset: one passed again is used as it is only when they are the same. They are the
        configuration's: ``completion_only_loss`` as set (None: TRL's choice by the data's format, which it reads from
        the first row, and a prepared row no longer shows), not TRL's inference. Not ``formatting_func``: TRL applies
        it to rows without ``input_ids`` only, so it cannot change what a second preparation makes of prepared rows
        (and functions compare by identity: one re-created per trainer would differ)."""
        steps = args.diffusion_objective == "trajectory"
        return {
            "tokenizer": tokenizer_fingerprint(processing_class),
            "dataset_text_field": args.dataset_text_field,
            "completion_only_loss": args.completion_only_loss,
            "assistant_only_loss": args.assistant_only_loss,
            "max_length": args.max_length,
            "truncation_mode": args.truncation_mode,
            "overlong_policy": args.overlong_policy,
            "packing": packing,
            "packing_strategy": args.packing_strategy if packing else None,
            "shuffle_dataset": args.shuffle_dataset,
            "seed": args.seed if args.shuffle_dataset else None,
            "diffusion_objective": "trajectory" if steps else "not trajectory",  # only `trajectory` reads the steps
        }

    # ---------------------------------------------------------------------------------------------------- loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mode = "train" if self.model.training else "eval"
        args = self.args
        documents = inputs.get("document_ids")  # padding-free rows (packing): which document each token is in
        samples = len(inputs["example_lengths"]) if "example_lengths" in inputs else inputs["input_ids"].shape[0]
        real = real_eval_rows(self.accelerator, self._evaluated_loader, samples) if mode == "eval" else None
        if real:  # score only the real samples of a padded last eval batch
            inputs = _first_samples(inputs, real)
            documents = inputs.get("document_ids")
        if mode == "eval" and padded_eval_batch(self.accelerator, self._evaluated_loader):
            # `num_items_in_batch` counted the whole padded batch (the duplicated samples too, on every process):
            # normalise by the tokens of the samples kept here instead.
            num_items_in_batch = None
        epoch = self._passes.epoch(self.state) if mode == "train" else 0
        offsets = inputs.get("sample_offset")
        generators = sample_generators(inputs["sample_index"].tolist(), self._noise_seed, epoch,
                                       None if offsets is None else offsets.tolist())
        labels = inputs["labels"]
        low, high = args.mask_ratio_range or (args.mask_eps, None)
        if "attention_mask" in inputs:
            valid = inputs["attention_mask"].bool()
        else:
            valid = documents >= 0 if documents is not None else torch.ones_like(labels).bool()
        batch = build_objective(
            self.objective, inputs["input_ids"], labels, valid, generators,
            mask_token_id=self.spec.mask_token_id, block_size=self.spec.block_size, eps=low, high=high,
            per_token=args.mask_ratio_sampling == "per_token",
            weighting=args.loss_weighting, semi_ar_block_length=args.semi_ar_block_length,
            unmask_step=inputs.get("unmask_step"), shrinkage=args.trajectory_shrinkage,
            generated=inputs.get("generated"),
            position_ids=inputs.get("position_ids") if documents is not None else None, documents=documents,
        )
        if args.loss_normalization == "tokens":
            normaliser = num_items_in_batch
            if normaliser is None:
                normaliser = count_loss_tokens(labels, self.spec.logits_shift)
        else:  # dLLM-RL's: the mean over rows of each row's normalised loss, then over accumulation steps
            labels_counted = labels[..., 1:] if self.spec.logits_shift else labels
            batch.weights = per_row_weights(batch, args.loss_normalization, labels_counted.ne(IGNORE_INDEX).sum(-1),
                                            logits_shift=self.spec.logits_shift,
                                            length=args.loss_normalization_length)
            steps = getattr(self, "current_gradient_accumulation_steps", 1) if mode == "train" else 1
            # Trainer leaves the division by accumulation steps to us
            normaliser = rows_averaged(batch, args.loss_normalization, self.spec.logits_shift) * steps
        # As SFTTrainer: `num_items_in_batch` counts every rank's tokens and DDP averages the gradients.
        by_tokens = args.loss_normalization == "tokens"
        scale = 1
        if args.average_tokens_across_devices and num_items_in_batch is not None and by_tokens:
            scale = self.accelerator.num_processes // self.get_tp_size()
        loss, scores = self._loss_in_forwards(model, batch, normaliser, scale, mode, num_items_in_batch)
        self._log_metrics(mode, inputs, scores, counted=real != 0)
        if return_outputs:
            return loss, MaskedLMOutput(loss=loss)
        return loss

    def train(self, *args, **kwargs):
        """Trainer's ``train``, refusing first a model with no trainable parameter (``check_trains_parameters``):
        evaluating a frozen model is fine, training it would change nothing."""
        check_trains_parameters(self.model, f"{type(self).__name__}'s model")
        return super().train(*args, **kwargs)

    def training_step(self, *args, **kwargs):
        """Trainer's step; inside it (and only there) ``compute_loss`` may back-propagate the forwards of a
        micro-batch cut by ``scoring_token_budget`` before the last (``_loss_in_forwards``)."""
        self._inside_training_step = True
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self._inside_training_step = False

    def _determine_best_metric(self, metrics: dict[str, float], trial) -> bool:
        """transformers' choice of the best checkpoint, with a warning when ``metric_for_best_model`` is NaN
        (``usable_best_metric``)."""
        why = "the evaluated losses or metrics are NaN (a diverged model?)"
        metrics = usable_best_metric(metrics, self.args.metric_for_best_model, self.state.global_step, why)
        return super()._determine_best_metric(metrics, trial)

    def predict(self, test_dataset, ignore_keys=None, metric_key_prefix: str = "test"):
        """Trainer's ``predict``, with ``test_dataset`` prepared as SFTTrainer's ``evaluate`` prepares a dataset
        passed to it (TRL's ``predict`` took prepared rows only: raw ones failed with "No columns ... match"), and
        with ``skip_prepare_dataset`` refused as ``evaluate`` refuses it when it has mask columns but no labels."""
        if not self._skip_prepare_dataset:
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
            test_dataset = self._prepare_dataset(test_dataset, self.processing_class, self.args, packing,
                                                 self._formatting_func, "test")
        self._reject_skip_prepare_without_labels({"test": test_dataset}, self.data_collator)
        return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def _reject_skip_prepare_without_labels(self, datasets: dict, data_collator) -> None:
        """TRL's refusal of a ``skip_prepare_dataset`` dataset with mask columns but no ``labels`` (every token would
        be scored, the prompt too), applied to the collator ``DiffusionDataCollator`` wraps: TRL checks only its own
        collator class, so after construction (``evaluate``, ``predict``) the wrapper hid it and the check passed."""
        if isinstance(data_collator, DiffusionDataCollator):
            data_collator = data_collator.base
        super()._reject_skip_prepare_without_labels(datasets, data_collator)

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """Trainer's loop; TRL's metrics of the evaluated rows join its metrics under ``metric_key_prefix``
        (``prefixed_eval_metrics``), and none are left for the next evaluation or for ``log``."""
        self._metrics["eval"].clear()
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        output.metrics.update(prefixed_eval_metrics(self._metrics["eval"], metric_key_prefix))
        self._metrics["eval"].clear()
        return output

    def _loss_in_forwards(self, model, batch: ScoringBatch, normaliser, scale: int, mode: str,
                          num_items_in_batch) -> tuple[torch.Tensor, TokenScores]:
        """``diffusion_loss`` of ``batch`` (times ``scale``, plus the weighted router loss), in forwards of at most
        ``scoring_token_budget`` tokens (``split_rows``). The loss is a sum over rows, so in a training step each
        forward but the last is back-propagated here, as Trainer back-propagates what this returns: the value of
        them all with the graph of the last, and the same gradient as one forward. (Called outside Trainer's
        ``training_step``, the returned loss carries every forward's graph.)

        Processes may run different numbers of forwards. Under DDP the early ones therefore run inside ``no_sync``
        (DDP decides at the forward whether its backward all-reduces; its ``no_sync`` nests): the micro-batch's
        last backward, or the accumulation window's last, all-reduces what they accumulated. Under FSDP / ZeRO-3
        every forward is a collective: every process runs as many as the busiest (the missing ones are zero-loss
        forwards), and each backward reduces its gradients as FSDP decides.

        With ``recompute_scoring_forwards`` nothing is back-propagated here: each forward is checkpointed as a whole
        (``recomputed_forwards``) and Trainer's one backward runs them again, one at a time."""
        args = self.args
        chunks = split_rows(batch, args.scoring_token_budget)
        synced = args.scoring_token_budget is not None and needs_synced_forwards(model)
        count = agreed_forward_count(len(chunks), batch.input_ids.device, synced)
        plan = chunks[:-1] + [None] * (count - len(chunks)) + chunks[-1:]
        excluded = self.spec.mask_token_id if args.exclude_mask_token_from_softmax else None
        recompute = args.recompute_scoring_forwards
        backward_here = self._inside_training_step and torch.is_grad_enabled() and not recompute
        total, parts = 0.0, []
        with recomputed_forwards(self.accelerator.unwrap_model(model), recompute):
            for i, chunk in enumerate(plan):
                early = backward_here and i < len(plan) - 1
                with self.accelerator.no_sync(model) if early and not synced else contextlib.nullcontext():
                    loss, scores = self._forward_loss(model, batch, chunk, normaliser, scale, excluded,
                                                      len(chunks), mode, num_items_in_batch)
                    if early:
                        self._backward_early(loss, num_items_in_batch)
                        loss = loss.detach()
                if scores is not None:
                    parts.append(scores)
                total = total + loss
        return total, joined_scores(parts)

    def _forward_loss(self, model, batch: ScoringBatch, chunk: ScoringBatch | None, normaliser, scale: int,
                      excluded: int | None, forwards: int, mode: str, num_items_in_batch):
        """One forward of ``_loss_in_forwards``: ``chunk``'s loss times ``scale`` plus its share (1 / ``forwards``)
        of the weighted router loss, and its scores; for None, a forward that adds exactly zero (scores None)."""
        if chunk is None:
            return zero_forward_term(model, batch.input_ids[:1]), None
        loss, scores = diffusion_loss(model, chunk, normaliser, self.spec.logits_shift, excluded, self.args.loss_type,
                                      self.attention_backend, router_loss=self.aux_loss_enabled)
        loss = loss * scale
        if scores.aux_loss is not None:  # GRPO's rule for several forwards: their mean
            loss = loss + self._weighted_aux_loss(scores.aux_loss, mode, num_items_in_batch is not None) / forwards
        return loss, scores

    def _backward_early(self, loss: torch.Tensor, num_items_in_batch) -> None:
        """Back-propagate one forward's share of the micro-batch loss as ``Trainer.training_step`` back-propagates
        the rest: divided by the accumulation steps when it would divide."""
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # transformers >= 5.24 may set it
        if scaled is None:
            scaled = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        if not scaled:
            loss = loss / self.current_gradient_accumulation_steps
        self.accelerator.backward(loss)

    def _weighted_aux_loss(self, aux_loss: torch.Tensor, mode: str, accumulated: bool) -> torch.Tensor:
        """SFTTrainer's mixture-of-experts term: ``router_aux_loss_coef`` times the forward's load-balancing loss (a
        mean over the micro-batch's real tokens, which DDP averages across processes), divided by the accumulation
        steps when ``Trainer`` leaves the accumulation to the loss (``accumulated``: it passed ``num_items_in_batch``,
        as in training)."""
        steps = self.current_gradient_accumulation_steps if accumulated and mode == "train" else 1
        return self.router_aux_loss_coef * aux_loss / steps

    def _log_metrics(self, mode: str, inputs, scores, counted: bool = True) -> None:
        """Token metrics summed over every process (``counted=False``: this process adds nothing, its batch being
        only padding). Not ``gather_for_metrics``: it would cut the per-process sums to the padded batch's sample
        count."""
        gather = self.accelerator.gather
        keep = 1 if counted else 0
        num_scored = gather(scores.scored.sum() * keep).sum()
        entropy = gather(scores.entropy.detach().sum() * keep).sum()
        correct = gather(scores.is_top1.sum() * keep).sum()
        metrics = self._metrics[mode]
        if num_scored > 0:  # a mask draw can mask nothing: no mean to log (a 0 would be averaged in by `log`)
            metrics["entropy"].append((entropy / num_scored).item())
            metrics["mean_token_accuracy"].append((correct / num_scored).item())
        metrics["scored_tokens"].append(num_scored.item())
        if scores.aux_loss is not None:  # SFTTrainer's `aux_loss`: the mean of the processes' load-balancing losses
            pooled = gather(torch.stack([scores.aux_loss.detach().float(), torch.ones_like(scores.aux_loss)]) * keep)
            pooled = pooled.view(-1, 2).sum(0)
            if pooled[1] > 0:
                metrics["aux_loss"].append((pooled[0] / pooled[1]).item())
        if mode == "train":
            if "attention_mask" in inputs:
                tokens = inputs["attention_mask"].sum()
            elif "document_ids" in inputs:
                tokens = inputs["document_ids"].ge(0).sum()
            else:
                tokens = inputs["input_ids"].numel()
            # every process's tokens, the repeated samples of a padded last batch too (they are trained on):
            # gather_for_metrics cut the per-process counts to the batch's sample count
            self._total_train_tokens += int(self.accelerator.gather(
                torch.as_tensor(tokens, device=self.accelerator.device)).sum())
        metrics["num_tokens"] = [self._total_train_tokens]


def _named(eval_dataset) -> dict:
    """``eval_dataset`` as ``{label: dataset}`` (``dataset_label``: ``eval``, or ``eval 'b'`` for a dict's member)."""
    if eval_dataset is None:
        return {}
    if isinstance(eval_dataset, dict):
        return {dataset_label("eval", name): data for name, data in eval_dataset.items()}
    return {"eval": eval_dataset}


def _check_rows_fit(positions: int | None, pad_to: int | str | None, datasets: dict) -> None:
    """Refuse at construction what the collator would refuse at the first batch holding it: rows padded to a fixed
    length beyond the model's positions, or an in-memory prepared dataset with a row (a packed row's document) longer
    than them; SFT trained at positions the model has none for, which ``generate()`` then refuses. Read from the
    Arrow column's list lengths (no pass over the rows in Python); streams are checked by the collator alone."""
    if positions is None:
        return
    if isinstance(pad_to, int) and pad_to > positions:
        raise ValueError(f"pad_to_length_with_eos pads every row to max_length={pad_to}, beyond the model's "
                         f"{positions} positions; set max_length <= {positions}.")
    for name, dataset in datasets.items():
        packed = isinstance(dataset, Dataset) and "seq_lengths" in dataset.column_names
        column = "seq_lengths" if packed else "input_ids"
        longest = _column_max(dataset, column, lengths=not packed)
        if longest is not None and longest > positions:
            unit = "packed document" if column == "seq_lengths" else "row"
            raise ValueError(f"the {name} dataset has a {unit} of {longest} tokens, beyond the model's {positions} "
                             "positions: it would train at positions the model has none for (and generate() refuses). "
                             f"Set max_length <= {positions} (rows are truncated to it), or shorten the data.")


ARROW_SLICE_ROWS = 1 << 12
"""Rows per piece of the construction checks' pass over an Arrow column (``_arrow_slices``)."""


def _arrow_slices(dataset, column: str):
    """The list ``column`` of an in-memory dataset's rows, in the dataset's order (a ``select`` / ``shuffle`` mapping
    applied: packing shuffles), as ``(dataset index of its first row, Arrow list array)`` pieces of at most
    ``ARROW_SLICE_ROWS`` rows, read by ``datasets`` one batch at a time (stored rows as zero-copy slices of the often
    memory-mapped table, mapped rows gathered per batch): a check reading them holds one piece's positions at a time,
    whatever the dataset's size. Nothing for a stream, an empty dataset or a missing column."""
    if not isinstance(dataset, Dataset) or len(dataset) == 0 or column not in dataset.column_names:
        return
    start = 0
    for table in dataset.with_format("arrow", columns=[column]).iter(batch_size=ARROW_SLICE_ROWS):
        for chunk in table.column(column).chunks:
            yield start, chunk
            start += len(chunk)


def _list_parts(lists) -> tuple[np.ndarray, Any]:
    """An Arrow list array's row bounds (``rows + 1`` offsets, from 0) and the values they bound (a zero-copy slice:
    the array may itself be a slice of a longer one). A fixed-size list (a ``List(..., length=n)`` feature, a
    parquet file's fixed-size lists) is read as an ordinary list first: it has no offsets."""
    if pa.types.is_fixed_size_list(lists.type) or pa.types.is_list_view(lists.type) or pa.types.is_large_list_view(
            lists.type):
        lists = lists.cast(pa.large_list(lists.type.value_type))  # one piece: a bounded copy
    offsets = lists.offsets.to_numpy()
    return offsets - offsets[0], lists.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))


def _rows_of(positions: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The row of each of these flattened ``positions`` of a list array with row bounds ``offsets``."""
    return np.searchsorted(offsets, positions, side="right") - 1


def _column_max(dataset, column: str, lengths: bool) -> int | None:
    """The longest list (``lengths``) or the largest value of an in-memory dataset's list ``column``, read piece by
    piece (``_arrow_slices``); None for a stream, an empty dataset or a missing column."""
    largest = None
    for _, lists in _arrow_slices(dataset, column):
        value = pc.max(pc.list_value_length(lists) if lengths else _list_parts(lists)[1]).as_py()
        if value is not None and (largest is None or value > largest):
            largest = value
    return largest


def _check_ids_in_vocabulary(rows: int, datasets: dict) -> None:
    """Refuse at construction an in-memory prepared dataset with token ids outside ``[0, rows)``, the rows of the
    model's input embedding, naming its first rows: a tokenizer with more tokens than the model (tokens added
    without ``resize_token_embeddings``) failed at the first step with a bare IndexError inside the embedding (a
    device-side assert on CUDA). Read from the Arrow column; streams are checked by the collator."""
    for name, dataset in datasets.items():
        bad = []
        for start, ids in _arrow_slices(dataset, "input_ids"):
            offsets, values = _list_parts(ids)
            outside = pc.or_(pc.less(values, 0), pc.greater_equal(values, rows))
            bad += (start + np.unique(_rows_of(pc.indices_nonzero(outside).to_numpy(), offsets))).tolist()
        if bad:
            raise _ids_outside_vocabulary_error(
                f"{len(bad)} row(s) of the prepared {name} dataset ({first_few(bad[:6])})", rows)


def _ids_outside_vocabulary_error(where: str, rows: int) -> ValueError:
    return ValueError(f"{where}: token ids outside [0, {rows}), the rows of the model's input embedding. The "
                      "tokenizer has tokens the model has no embedding for: after adding tokens, call "
                      "model.resize_token_embeddings(len(tokenizer)).")


def _first_id_outside(ids, rows: int) -> int | None:
    """The position of the first token id of a row outside ``[0, rows)``, or None; one vectorised pass (a row of a
    ``with_format("torch")`` dataset is a tensor, which Python's ``min`` / ``max`` walk element by element)."""
    ids = torch.as_tensor(ids)
    outside = (ids < 0) | (ids >= rows)
    return int(outside.nonzero()[0, 0]) if bool(outside.any()) else None


def _labels_other_than_ids(ids, labels) -> bool:
    """Whether a row's ``labels`` are not its ids where trained (-100 elsewhere), or have another length; one
    vectorised pass, as ``_first_id_outside`` (the collator runs it on every row of every batch)."""
    ids, labels = torch.as_tensor(ids), torch.as_tensor(labels)
    return ids.shape != labels.shape or bool(((labels != IGNORE_INDEX) & (labels != ids)).any())


def _check_no_mask_token(mask_id: int, mask_token: str | None, datasets: dict,
                         assistant_only_loss: bool = False) -> None:
    """Refuse at construction an in-memory prepared dataset holding the mask id (text with the mask token's string
    tokenizes to it), naming its first rows and the part (prompt: no label; completion: trained on), rather than at
    the first batch holding it, from the collator. Read from the Arrow column; streams are checked by the collator.
    The remedy offered depends on ``assistant_only_loss`` (``_mask_token_remedy``)."""
    for name, dataset in datasets.items():
        rows = []
        for start, ids in _arrow_slices(dataset, "input_ids"):
            offsets, values = _list_parts(ids)
            hits = pc.indices_nonzero(pc.equal(values, mask_id)).to_numpy()
            rows += (start + np.unique(_rows_of(hits, offsets))).tolist()
        if not rows:
            continue
        shown = first_few([f"{row} ({_mask_part(dataset[row], mask_id)})" for row in rows[:6]])
        raise ValueError(
            f"the {name} dataset holds {mask_token_name(mask_id, mask_token)} in {len(rows)} row(s): {shown} "
            "(indices of the prepared dataset; prompt: tokens without a label). Diffusion training could not tell it "
            "from a masked position. Text containing the mask token's string tokenizes to it: "
            + _mask_token_remedy(assistant_only_loss)
        )


def _mask_token_remedy(assistant_only_loss: bool) -> str:
    """What to do about mask-token text in the data. ``sanitize_control_tokens`` (a ``chat_template_kwargs`` column)
    encodes control tokens written in messages as text, but transformers refuses it together with
    ``return_assistant_tokens_mask``, which TRL asks for under ``assistant_only_loss``: not offered then."""
    if assistant_only_loss:
        return ("remove or escape it in the data (the chat_template_kwargs option sanitize_control_tokens cannot help "
                "here: transformers refuses it together with the assistant mask that assistant_only_loss=True needs).")
    return ("remove or escape it in the data, or for conversational rows add a chat_template_kwargs column holding "
            "{'sanitize_control_tokens': True} (transformers then encodes the control tokens written in messages as "
            "text).")


def _mask_part(row: dict, mask_id: int) -> str:
    """Where a row holds the mask id: its prompt (no label), its completion (labelled: trained on), or both."""
    parts = {"prompt" if label == IGNORE_INDEX else "completion"
             for token, label in zip(row["input_ids"], _row_labels(row)) if token == mask_id}
    return " and ".join(sorted(parts, reverse=True))


def _row_labels(row: dict) -> list:
    """A row's labels; for a row of ``skip_prepare_dataset`` with a ``completion_mask`` instead, -100 where it is 0;
    without either, its tokens (every token is trained on)."""
    labels = row.get("labels")
    if labels is None and row.get("completion_mask") is not None:
        labels = [IGNORE_INDEX if keep == 0 else 0 for keep in row["completion_mask"]]
    return row["input_ids"] if labels is None else labels


def _mask_token_in_batch(examples: list[dict[str, Any]], indices: list, mask_id: int, mask_token: str | None,
                        assistant_only_loss: bool) -> ValueError:
    """The collator's refusal of a batch holding the mask id (a stream's rows, and a dataset passed to ``evaluate`` /
    ``predict``, are first seen there), worded as ``_check_no_mask_token``'s: the token, the samples holding it with
    the part (prompt: no label), and the remedy. A sample is named by its ``sample_index`` (``indices``: one per
    example, or for a packed row one per token, so each token's own sample), else by its row in the batch."""
    parts: dict[str, set[str]] = {}
    for row, (example, index) in enumerate(zip(examples, indices)):
        labels = _row_labels(example)
        for position, token in enumerate(example["input_ids"]):
            if int(token) != mask_id:
                continue
            sample = index[position] if isinstance(index, list) else index
            name = f"batch row {row}" if sample is None else f"sample_index {int(sample)}"
            parts.setdefault(name, set()).add("prompt" if labels[position] == IGNORE_INDEX else "completion")
    shown = [f"{name} ({' and '.join(sorted(found, reverse=True))})" for name, found in parts.items()]
    return ValueError(
        f"a batch holds {mask_token_name(mask_id, mask_token)} in {len(shown)} sample(s): {first_few(shown)} "
        "(sample_index: the sample's row in the prepared dataset, before packing, or its place in a stream; prompt: "
        "tokens without a label). Diffusion training could not tell it from a masked position. Text containing the "
        "mask token's string tokenizes to it: " + _mask_token_remedy(assistant_only_loss)
    )


def _several_spans_error(where: str, count: int, shown: list[str]) -> ValueError:
    """The ``semi_ar`` refusal of ``count`` rows with several labelled spans (``shown``: how to find the first few),
    with the remedies."""
    return ValueError(
        f"diffusion_objective='semi_ar' needs one labelled span per row (a completion, one assistant turn), but "
        f"{where} has {count} row(s) with several: {first_few(shown)}. semi_ar lays its blocks over a row's labels "
        "from the first to the last as one span, so an earlier turn would be trained seeing the later turns clean, "
        "and a later turn's blocks would not start where the sampler starts them (at the end of its prompt). Give one "
        "row per assistant turn (e.g. a prompt/completion dataset: the conversation before the turn as 'prompt', the "
        "turn as 'completion'), or use another objective such as diffusion_objective='random_masking'."
    )


def _check_one_labelled_span(datasets: dict) -> None:
    """Refuse at construction (``semi_ar``) an in-memory prepared dataset with rows of several labelled spans
    (assistant-only multi-turn conversations), naming its first rows. Read from the Arrow ``labels`` column (no pass
    over the rows in Python); streams are checked by the collator. Rows without labels are trained on whole (one
    span); packed rows (``seq_lengths``, given with ``skip_prepare_dataset``) are refused by ``semi_ar`` itself."""
    for name, dataset in datasets.items():
        if not isinstance(dataset, Dataset) or "seq_lengths" in dataset.column_names:
            continue
        count, shown = 0, []
        for start, labels in _arrow_slices(dataset, "labels"):  # piece by piece: memory bounded by a piece
            offsets, values = _list_parts(labels)
            counts = _span_counts(pc.not_equal(values, IGNORE_INDEX).to_numpy(zero_copy_only=False), offsets)
            rows = np.flatnonzero(counts > 1)
            count += len(rows)
            shown += [f"{start + row} ({counts[row]} spans)" for row in rows[: 6 - len(shown)]]
        if count:
            raise _several_spans_error(f"the {name} dataset", count, shown)


def _span_counts(labelled: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """How many labelled spans (runs of consecutive labelled positions) each row holds, from the rows' flattened
    positions' ``labelled`` flags (bool) and their ``rows + 1`` bounds ``offsets`` (from 0): an Arrow list array's,
    or a batch's. ``semi_ar`` lays its blocks over one span (a completion, one assistant turn); assistant-only
    multi-turn rows hold one per turn. Only the spans' first positions get an index (a byte per position
    otherwise)."""
    starts = labelled.copy()
    starts[1:] &= ~labelled[:-1]
    firsts = offsets[:-1][offsets[:-1] < offsets[1:]]  # a row's first position starts a span when labelled
    starts[firsts] = labelled[firsts]
    return np.bincount(_rows_of(np.flatnonzero(starts), offsets), minlength=len(offsets) - 1)


def _refuse_several_spans_in_batch(examples: list[dict[str, Any]], indices: list) -> None:
    """The collator's ``semi_ar`` check of ``_check_one_labelled_span``, over a batch's unpacked labelled examples;
    names them by ``sample_index`` (their index in the prepared dataset or stream, ``stream_sample_index``), else by
    batch row."""
    checked = [(row, example["labels"]) for row, example in enumerate(examples)
               if example.get("labels") is not None and "seq_lengths" not in example]
    if not checked:
        return
    labelled = np.concatenate([np.asarray(list(labels)) != IGNORE_INDEX for _, labels in checked])
    offsets = np.concatenate([[0], np.cumsum([len(labels) for _, labels in checked])])
    counts = _span_counts(labelled, offsets)
    several = [(checked[i][0], int(counts[i])) for i in np.flatnonzero(counts > 1)]
    if several:
        named = [f"sample_index {indices[row]}" if isinstance(indices[row], int) else f"batch row {row}"
                 for row, _ in several]
        raise _several_spans_error("a batch", len(several),
                                   [f"{name} ({spans} spans)" for name, (_, spans) in zip(named, several)])


def _label(dataset_name: str) -> str:
    """How messages name a dataset ``_prepare_dataset`` gets from TRL: ``train``, ``eval``, ``test`` (``predict``),
    else the key of a dict of eval datasets (``eval 'b'``; a key ``"train"`` reads as the train set here, but an
    empty member was refused by name at construction)."""
    return dataset_name if dataset_name in ("train", "eval", "test") else dataset_label("eval", dataset_name)


def _emptied_dataset_error(label: str, rows_given: int, args: DiffusionSFTConfig) -> ValueError:
    """The refusal of a dataset that preparation left with no rows: truncation to ``max_length`` drops every row left
    without a labelled token (TRL's ``_prepare_dataset`` does, and ``_truncate_with_steps`` as it). Trainer would
    fail at ``train()`` with "num_samples=0"; ``evaluate()`` would log no ``eval_loss`` (and
    ``metric_for_best_model`` fail later)."""
    return ValueError(
        f"the {label} dataset is empty after preparation: all {rows_given} of its rows were dropped because "
        f"truncating them to max_length={args.max_length} (truncation_mode={args.truncation_mode!r}) left none of "
        "their tokens with a label (rows without one are dropped, as TRL does): the prompts (or the turns "
        "before the first trained-on one) fill max_length. Raise max_length above the longest prompt, or shorten the "
        "prompts."
    )


ANSWER_PROBES = ("The answer is 4.", "The answer is 6.")
"""The assistant answers :func:`trailing_assistant_header` renders (text no chat template adds)."""


def trailing_assistant_header(processing_class) -> str | None:
    """What the chat template writes after a conversation's last assistant answer, when that opens another assistant
    turn: LLaDA-8B-Instruct's template appends its assistant header after every conversation, whatever
    ``add_generation_prompt``. Found by comparing what follows the answer at the end of a conversation with what
    follows it before a next turn: that much is the end of the turn; more is a header when an assistant turn opens
    with it (the text before an answer, or the generation prompt, ends with it), an eos token after it aside. The
    probes are rendered as they are, and with a system turn first where the template refuses them (one that requires
    a system message); None when it still does, or for a template that closes the turn only."""
    first, second = ANSWER_PROBES
    turns = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": first},
             {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": second}]
    for system in ([], [{"role": "system", "content": "You are a helpful assistant."}]):
        try:
            ending = processing_class.apply_chat_template(system + turns[:2], tokenize=False)
            continuing = processing_class.apply_chat_template(system + turns, tokenize=False)
            opening = processing_class.apply_chat_template(system + turns[:1], tokenize=False,
                                                           add_generation_prompt=True)
            break
        except Exception:  # a template may refuse a probe (its own raise_exception): try it with a system turn
            continue
    else:
        return None
    if not all(isinstance(text, str) for text in (ending, continuing, opening)):
        return None
    if first not in ending or second not in continuing:
        return None
    before, _, after = ending.rpartition(first)
    between = continuing.partition(first)[2].rpartition(second)[0]  # end of turn, next user turn, assistant header
    closing = after.rstrip()
    eos = getattr(processing_class, "eos_token", None)
    if eos and closing.endswith(eos):  # an eos after the conversation (Phi-3's) is no header
        closing = closing[:-len(eos)]
    extra = closing[len(os.path.commonprefix([closing, between])):].strip()
    return after if extra and any(text.rstrip().endswith(extra) for text in (before, between, opening)) else None


def _warn_trailing_assistant_header(processing_class) -> None:
    header = trailing_assistant_header(processing_class)
    if header is not None:
        logger.warning_once(
            f"the chat template writes {header!r} after a conversation's last assistant answer (it opens another "
            "assistant turn, as LLaDA-8B-Instruct's template does), so SFT on these conversational rows trains every "
            "answer to end with it. Give chat_template_path a template that appends the assistant header only {% if "
            "add_generation_prompt %}.")


def _completion_only_loss_applies(columns: set[str]) -> bool:
    """Whether TRL's ``completion_only_loss`` changes the labels of a dataset with these columns: it masks the prompt
    of prompt/completion rows (or, for tokenized rows, where ``completion_mask`` is 0) and nothing else."""
    return {"prompt", "completion"} <= columns or "completion_mask" in columns


def _datasets_without_labels(datasets: dict, selected: Callable[[set[str]], bool]) -> str | None:
    """``"the train dataset"`` / ``"the train and eval datasets"``: the datasets without a ``labels`` column (rows
    that say themselves which tokens are trained on) whose columns ``selected`` picks; None for none."""
    names = [name for name, dataset in datasets.items() if isinstance(dataset, Dataset | IterableDataset)
             and "labels" not in (columns := set(column_names(dataset))) and selected(columns)]
    return f"the {' and '.join(names)} dataset" + ("s" if len(names) > 1 else "") if names else None


def _warn_completion_only_loss_unused(args: DiffusionSFTConfig, formatting_func, datasets: dict) -> None:
    """One warning when ``completion_only_loss=True`` was set explicitly (None: TRL's choice by format) for datasets
    it does nothing to (language modeling: ``messages`` or text), which then train on every token, the user turns
    too. Not with a ``formatting_func``, which TRL refuses with it, nor for rows with ``labels`` (prepared rows, packed
    ones too), which say themselves which tokens are trained on."""
    if args.completion_only_loss is not True or formatting_func is not None:
        return
    datasets_named = _datasets_without_labels(datasets, lambda columns: not _completion_only_loss_applies(columns))
    if datasets_named:
        logger.warning(
            f"completion_only_loss=True does nothing to {datasets_named}: it applies to prompt/completion data (or "
            "tokenized rows with a completion_mask), and these rows are language modeling ones ('messages' or text), "
            "so every token is trained on, user turns included. For conversations, set "
            "assistant_only_loss=True to train on the assistant turns only; or give 'prompt' / 'completion' columns."
        )


def _warn_completion_mask_unused(args: DiffusionSFTConfig, datasets: dict) -> None:
    """One warning when completions that TRL will not single out are given: with ``completion_only_loss`` unset it
    decides once, from the train dataset's format (completion-only when it holds prompt/completion rows, for every
    dataset then), so with another train format the prompt of an eval set's prompt/completion rows, and of tokenized
    rows with a ``completion_mask`` (the train set's too), is trained on or scored. Not for rows with ``labels``,
    which say themselves which tokens are trained on, nor when ``completion_only_loss`` is set either way."""
    if args.completion_only_loss is not None or {"prompt", "completion"} <= set(column_names(datasets["train"])):
        return
    datasets_named = _datasets_without_labels(
        datasets, lambda columns: "completion_mask" in columns or {"prompt", "completion"} <= columns)
    if datasets_named:
        logger.warning(
            f"the completions of {datasets_named} are not singled out: with completion_only_loss unset, TRL trains "
            "on the completion only (a prompt/completion pair's, or a completion_mask's) when the train dataset "
            "holds prompt/completion rows, deciding once from it, so every token of these rows is trained on (or "
            "scored), the prompt too. Set completion_only_loss=True to train on the completions only (False trains "
            "on every token without this warning).")


def _check_token_budget(args: DiffusionSFTConfig, deepspeed: bool) -> None:
    """``scoring_token_budget`` back-propagates several forwards per micro-batch (unless
    ``recompute_scoring_forwards``: one backward). Refused where a backward does more than accumulate gradients:
    DeepSpeed's (accelerate steps its engine with it), and the LOMO and layer-wise (GaLore, APOLLO) optimizers'
    (they update the weights inside the backward)."""
    if args.scoring_token_budget is None or args.recompute_scoring_forwards:
        return
    if deepspeed:
        raise ValueError("scoring_token_budget is not supported with DeepSpeed (accelerate's backward also steps the "
                         "DeepSpeed engine, once per forward here); add recompute_scoring_forwards=True (one "
                         "backward; ZeRO-1/2/3), use DDP or FSDP, or unset scoring_token_budget (lowering "
                         "per_device_train_batch_size if memory needs it).")
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in ("lomo", "adalomo") or "layerwise" in optim:
        raise ValueError(f"scoring_token_budget is not supported with optim={optim!r} (it updates the weights inside "
                         "each backward); add recompute_scoring_forwards=True (one backward), choose another "
                         "optimizer, or unset scoring_token_budget (lowering per_device_train_batch_size if memory "
                         "needs it).")


def _first_samples(inputs: dict[str, Any], count: int) -> dict[str, Any]:
    """The batch cut to its first ``count`` samples: rows (and for packed rows, their documents' seeds), or for a
    padding-free batch (one row of documents) the columns and documents of its first ``count`` examples."""
    if "document_ids" not in inputs:
        return {k: v[:count] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    if "example_lengths" not in inputs:
        documents = int(inputs["document_ids"][:count].max()) + 1
        per_document = ("sample_index", "sample_offset")
        return {k: v[:documents] if k in per_document else v[:count] for k, v in inputs.items()}
    width = int(inputs["example_lengths"][:count].sum())
    documents = int(inputs["document_ids"][0, width - 1]) + 1
    kept = {key: inputs[key][:, :width] for key in ("input_ids", "labels", "position_ids", "document_ids")}
    kept.update({key: inputs[key][:documents] for key in ("sample_index", "sample_offset")})
    kept["example_lengths"] = inputs["example_lengths"][:count]
    return kept


def _refuse_overlong(example: dict, max_length: int) -> dict:
    length = len(example["input_ids"])
    if length > max_length:
        raise ValueError(
            f"a sequence has {length} tokens, more than max_length={max_length}, and overlong_policy='error'. Raise "
            "max_length, shorten the data, or set overlong_policy='truncate'."
        )
    return {}


def _align_unmask_step(example: dict) -> dict:
    """Spread the ``unmask_step`` column (one entry per completion token, in order) over the full, untruncated
    sequence (-1 on the prompt). The steps follow ``never_committed_tail``'s rule (a -1 only in the trailing run a
    rollout that stopped early leaves), checked here so that a row breaking it is refused when the trainer is
    built."""
    labels = example.get("labels") or example["input_ids"]
    positions = [i for i, label in enumerate(labels) if label != IGNORE_INDEX]
    steps = list(example["unmask_step"])
    if len(steps) != len(positions):
        raise ValueError(
            f"'unmask_step' has {len(example['unmask_step'])} entries but the row has {len(positions)} completion "
            "tokens; give one step per completion token (tokenize the data yourself, with 'input_ids', "
            "'completion_mask' and completion_only_loss=True, if the completion text does not re-tokenize to the "
            "generated tokens)."
        )
    never_committed_tail(torch.ones(1, len(steps), dtype=torch.bool), torch.tensor([steps], dtype=torch.long))
    full = [-1] * len(example["input_ids"])
    for position, step in zip(positions, steps):
        full[position] = int(step)
    return {"unmask_step": full}


def _truncate_with_steps(dataset, max_length: int, truncation_mode: str):
    """TRL's truncation (``SFTTrainer._prepare_dataset``: ``input_ids`` and ``labels`` cut to ``max_length`` at the
    end or the start, then rows left with nothing to train on dropped), cutting the spread ``unmask_step`` with
    them. A never-committed canvas tail (step -1) is cut as any token, what is kept of it stays masked; a row left
    with no committed completion token (``keep_end`` cutting into the tail) is dropped as a row without labels."""
    if truncation_mode not in ("keep_start", "keep_end"):
        raise ValueError(f"Unsupported truncation mode: {truncation_mode}, expected 'keep_start' or 'keep_end'")
    cut = slice(None, max_length) if truncation_mode == "keep_start" else slice(-max_length, None)

    def truncate(example: dict) -> dict:
        return {key: example[key][cut] for key in ("input_ids", "labels", "unmask_step")}

    dataset = dataset.map(truncate)
    return dataset.filter(_has_committed_label)


def _has_committed_label(example: dict) -> bool:
    """Whether a prepared trajectory row still has a token to score: a label on a committed position."""
    return any(label != IGNORE_INDEX and step >= 0 for label, step in zip(example["labels"], example["unmask_step"]))


def _never_committed_out_of_labels(labels: torch.Tensor, unmask_step: torch.Tensor) -> dict[str, torch.Tensor]:
    """A collated trajectory batch's never-committed canvas tail (``never_committed_tail`` of its labelled
    positions; a -1 elsewhere is refused) taken out of ``labels``, which Trainer and ``count_loss_tokens`` count as
    loss tokens, with the whole canvas as ``generated`` (in every batch, tail or not: accelerate's
    ``dispatch_batches`` joins the processes' batches by the first batch's keys)."""
    completion = labels != IGNORE_INDEX
    tail = never_committed_tail(completion, unmask_step)
    return {"labels": labels.masked_fill(tail, IGNORE_INDEX), "generated": completion}


_PREPARED = PreparedDatasets("DiffusionSFTTrainer")
"""The datasets a ``DiffusionSFTTrainer`` prepared, with their ``_preparation_settings``."""


def _without_column(dataset, column: str):
    """``dataset`` without ``column`` (as it is when it has none)."""
    return dataset.remove_columns(column) if column in column_names(dataset) else dataset


def _add_sample_index(example: dict, index: int) -> dict:
    """The noise seed of a ``Dataset``'s row: its index."""
    return {"sample_index": index}


def _add_stream_sample_index(example: dict, index: int) -> dict:
    """The noise seed of a stream's row. ``index`` counts the rows of one dataloader worker (each reads its own
    shards, counting from 0): ``stream_sample_index`` makes it unique across the workers."""
    worker = torch.utils.data.get_worker_info()
    if worker is None:  # read in this process (dataloader_num_workers=0)
        return {"sample_index": index}
    return {"sample_index": stream_sample_index(index, worker.id, worker.num_workers)}


def stream_sample_index(index: int, worker_id: int, num_workers: int) -> int:
    """The ``sample_index`` of row ``index`` of dataloader worker ``worker_id`` of ``num_workers``: the workers' rows
    interleaved (``index * num_workers + worker_id``), so that no two rows of a pass share a seed. ``datasets`` gives
    each worker every ``num_workers``-th shard and does not say which shard a row is from, so the numbering (and
    with it a stream's masks) depends on the number of workers; one worker (or none) numbers the stream's rows in
    order, as a ``Dataset``'s."""
    return index * num_workers + worker_id


def _index_every_token(example: dict) -> dict:
    """``sample_index`` and ``sample_offset`` (the token's position in its sample) for every token, so that packing
    carries them along with the tokens."""
    length = len(example["input_ids"])
    return {"sample_index": [example["sample_index"]] * length, "sample_offset": list(range(length))}


def _pack(dataset, args: DiffusionSFTConfig, dataset_name: str):
    """TRL's packing step (``SFTTrainer._prepare_dataset``: select the columns, ``pack_dataset``, shuffle; its
    shuffle before packing already ran, at the end of the unpacked preparation) with the per-token noise seed
    columns packed along. ``input_ids`` stays the first column: packing measures lengths with it."""
    if args.max_length is None:
        raise ValueError("When packing is enabled, `max_length` can't be `None`.")
    map_kwargs = {"num_proc": args.dataset_num_proc} if isinstance(dataset, Dataset) else {}
    dataset = dataset.map(_index_every_token, **map_kwargs)
    if isinstance(dataset, Dataset):  # stored: int32, half the size of the default int64 lists
        for column in ("sample_index", "sample_offset"):
            dataset = dataset.cast_column(column, List(Value("int32")))
    dataset = dataset.select_columns(["input_ids", "labels", "sample_index", "sample_offset"])
    if isinstance(dataset, Dataset):
        map_kwargs["desc"] = f"Packing {dataset_name} dataset"
    dataset = pack_dataset(dataset, args.max_length, args.packing_strategy, map_kwargs)
    return dataset.shuffle(seed=args.seed) if args.shuffle_dataset else dataset


def _packed_by_a_trainer(dataset: Dataset | IterableDataset) -> bool:
    """Whether ``dataset`` holds packed rows a ``DiffusionSFTTrainer`` made (``_pack``) or a copy of them
    (``select``, ``shuffle``, ``filter``, a stream made of them): tokenized rows whose noise seed columns
    ``sample_index`` and ``sample_offset`` hold one entry per token, as only packing writes them. (The prepared
    dataset itself is known by identity, ``_PREPARED``; a copy is another object.)"""
    if not {"input_ids", "sample_index", "sample_offset"} <= set(column_names(dataset)):
        return False
    features = dataset.features
    if features is not None and "sample_index" in features and not isinstance(features["sample_index"],
                                                                              List | LargeList):
        return False
    first = next(iter(dataset), None)  # its first row: one seed entry per token, as packing writes them
    return first is not None and all(_length(first[column]) == _length(first["input_ids"])
                                     for column in ("sample_index", "sample_offset"))


def _length(value: Any) -> int | None:
    """The number of entries of a list or 1-d array (``None`` for a scalar)."""
    if isinstance(value, list):
        return len(value)
    return len(value) if getattr(value, "ndim", 0) == 1 else None


def _packed_rows_as_they_are(dataset, max_length: int | None, strategy: str, packing: bool, dataset_name: str):
    """A trainer's packed rows given again (``_packed_by_a_trainer``), used as they are (their documents and noise
    seeds kept) where the dataset is packed (``packing``; ``eval_packing`` for an eval set) with the strategy they
    were packed with (rows of ``'wrapped'`` have no ``seq_lengths``) and they fit ``max_length``. Refused otherwise:
    packed rows cannot be unpacked, cut, or packed again without joining their documents into one."""
    remedy = "Pass the rows before preparation (the dataset given to the trainer that packed them)"
    if not packing:
        raise ValueError(
            f"the {dataset_name} dataset holds packed rows a DiffusionSFTTrainer made (one sample_index and "
            "sample_offset per token: a select, shuffle or other copy of a packed prepared dataset), and it is used "
            f"without packing (packing, or eval_packing for an eval set): packed rows cannot be unpacked. {remedy}, "
            "or turn packing on."
        )
    wrapped = "seq_lengths" not in column_names(dataset)
    if wrapped != (strategy == "wrapped"):
        made = "'wrapped'" if wrapped else "'bfd' or 'bfd_split'"
        raise ValueError(
            f"the {dataset_name} dataset holds packed rows a DiffusionSFTTrainer made with packing_strategy={made} "
            f"(a copy of a packed prepared dataset; {'no' if wrapped else 'a'} seq_lengths column), and "
            f"packing_strategy={strategy!r} now: they cannot be packed again. {remedy}, or use the strategy they "
            "were packed with."
        )
    return _packed_rows_fit(dataset, max_length, dataset_name)


def _packed_rows_fit(dataset, max_length: int | None, dataset_name: str):
    """Rows given packed to a dataset packed with ``max_length``, which packing would not have made longer: checked
    from the Arrow column (an in-memory dataset) or as each row is read (a stream)."""
    if max_length is None:
        raise ValueError("When packing is enabled, `max_length` can't be `None`.")
    if isinstance(dataset, IterableDataset):
        return dataset.map(_refuse_long_packed_row, fn_kwargs={"max_length": max_length, "dataset_name": dataset_name})
    _check_packed_row_length(_column_max(dataset, "input_ids", lengths=True) or 0, max_length, dataset_name)
    return dataset


def _refuse_long_packed_row(example: dict, max_length: int, dataset_name: str) -> dict:
    """``_check_packed_row_length`` of a stream's row."""
    _check_packed_row_length(len(example["input_ids"]), max_length, dataset_name)
    return {}


def _check_packed_row_length(length: int, max_length: int, dataset_name: str) -> None:
    """Refuse a packed row (given packed) of ``length`` tokens, longer than the ``max_length`` it is packed to."""
    if length > max_length:
        raise ValueError(
            f"the {dataset_name} dataset holds packed rows (given packed: they are not packed again) of up to "
            f"{length} tokens, longer than max_length={max_length}: packed rows cannot be cut. Pass the rows before "
            "preparation (or unpacked), or raise max_length."
        )
