"""The trainers' own files in transformers' ``checkpoint-<step>`` folders, handled one way by all three: the folder is
cleared of an earlier run's files before it is written, a small JSON file of theirs is read back, a checkpoint
saved with ``save_only_model=True`` is refused on resume, and the resume of a stream past its first pass warns."""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any, NoReturn

from datasets import IterableDataset
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging

logger = logging.get_logger(__name__)


def start_checkpoint_folder(trainer, trial, ours: tuple[str, ...]) -> str:
    """This step's checkpoint folder, created and cleared of what an earlier run in the same ``output_dir`` left
    there: its ``trainer_state.json``, which marks a checkpoint complete (a save failing part-way would otherwise
    leave a folder that looks complete, mixing two runs), and ``ours``, glob patterns of the files and folders the
    trainer adds (a resume or ``load_best_model_at_end`` would read a stale one as this run's). Called by every
    process before any writes (a barrier), as transformers calls ``_save_checkpoint``."""
    folder = os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    if trainer.args.should_save:
        for pattern in (TRAINER_STATE_NAME, *ours):
            for path in glob.glob(os.path.join(glob.escape(folder), pattern)):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                else:
                    os.remove(path)
    trainer.accelerator.wait_for_everyone()  # no process writes its files before the old ones are gone
    os.makedirs(folder, exist_ok=True)
    return folder


def read_checkpoint_json(checkpoint: str | None, name: str) -> dict[str, Any] | None:
    """The trainer's JSON file ``name`` in ``checkpoint`` (None without a checkpoint or the file)."""
    path = os.path.join(checkpoint, name) if checkpoint is not None else None
    if path is None or not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def refuse_save_only_model(checkpoint: str, start_from: str, also_missing: str = "") -> NoReturn:
    """Refuse to resume a ``save_only_model=True`` checkpoint: transformers finds no optimizer, scheduler or RNG files
    and resumes silently with fresh ones (the learning-rate warmup starts again), so the run would differ from an
    uninterrupted one. ``start_from``: how to start a new run from its weights instead."""
    raise ValueError(f"checkpoint {checkpoint} was saved with save_only_model=True: it holds model weights only (no "
                     f"optimizer, scheduler or RNG state{also_missing}), and transformers documents such checkpoints "
                     f"as not resumable. Start a new run from its weights ({start_from}), or train with "
                     "save_only_model=False to be able to resume.")


def warn_stream_resumed_after_first_pass(trainer, checkpoint: str) -> None:
    """Warn when ``trainer`` resumes from ``checkpoint`` a training stream (``IterableDataset``) past its first pass:
    transformers skips the trained batches within the first pass only, so the resumed run starts a pass from its
    beginning and differs from an uninterrupted one. Nothing to say with ``ignore_data_skip`` (asked for)."""
    if (isinstance(trainer.train_dataset, IterableDataset) and (trainer.state.epoch or 0) >= 1
            and not trainer.args.ignore_data_skip):
        logger.warning(f"checkpoint {checkpoint} was saved after the training stream's first pass (epoch "
                       f"{trainer.state.epoch:.2f}): transformers skips the trained batches of an IterableDataset "
                       "within its first pass only, so the resumed run starts a pass from its beginning and "
                       "differs from an uninterrupted one (batches repeated, and for SFT noise from another pass). "
                       "A map-style Dataset resumes exactly.")
