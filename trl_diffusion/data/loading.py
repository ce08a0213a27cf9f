"""Loading a training set by Hub name or from a local file, as the examples accept either."""

from __future__ import annotations

import os

from datasets import Dataset, load_dataset

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
"""File names read as a local dataset file rather than a Hub name."""


def load_training_dataset(name: str, config: str | None = None, split: str = "train") -> Dataset:
    """``name`` is a local ``.json`` / ``.jsonl`` / ``.parquet`` file or a Hub dataset. A local file is one split,
    ``train``: ``split`` may slice it (``"train[:1000]"``), another split name is ``datasets``' error, and a
    ``config`` is refused (a local file has none). A local path may start with ``~``."""
    if name.endswith(LOCAL_SUFFIXES):
        if config is not None:
            raise ValueError(f"dataset_config={config!r} was given with the local file {name!r}, which has no "
                             "configs: leave dataset_config unset (or put that subset in a file of its own).")
        name = os.path.expanduser(name)
        kind = "parquet" if name.endswith(".parquet") else "json"
        return load_dataset(kind, data_files=name, split=split)
    return load_dataset(name, config, split=split)
