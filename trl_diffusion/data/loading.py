"""Loading a training set by Hub name or from a local file, as the examples accept either."""

from __future__ import annotations

import os

from datasets import Dataset, load_dataset

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
"""File names read as a local dataset file rather than a Hub name."""


def load_training_dataset(name: str, config: str | None = None, split: str = "train") -> Dataset:
    """``name`` is a local ``.json`` / ``.jsonl`` / ``.parquet`` file (its single split is used) or a Hub dataset
    (``config`` and ``split`` apply). A local path may start with ``~``."""
    if name.endswith(LOCAL_SUFFIXES):
        name = os.path.expanduser(name)
        kind = "parquet" if name.endswith(".parquet") else "json"
        return load_dataset(kind, data_files=name, split="train")
    return load_dataset(name, config, split=split)
