"""Which datasets a trainer prepared, and with what settings.

``trainer.evaluate(trainer.eval_dataset)`` hands a trainer the dataset it prepared itself: preparing it again would
redo work or, for SFT, break it (re-spread steps, pack packed rows). A dataset prepared by another trainer with other
settings (tokenizer, ``max_length``, packing, ...) is not this trainer's data and cannot be re-made from its prepared
rows, so it is refused. Datasets are known by identity; the settings are compared by value.
"""

from __future__ import annotations

import weakref
from typing import Any

from datasets import Dataset, IterableDataset


class PreparedDatasets:
    """The datasets one kind of trainer prepared, each with the settings it was prepared with (weakly held)."""

    def __init__(self, trainer: str) -> None:
        self.trainer = trainer
        self._settings: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def add(self, dataset: Dataset | IterableDataset, settings: dict[str, Any]) -> None:
        self._settings[dataset] = settings

    def holds(self, dataset: Any, settings: dict[str, Any], dataset_name: str) -> bool:
        """Whether ``dataset`` was prepared with ``settings`` (use it as it is); raise when it was prepared with
        others; False for a dataset never prepared (a list or DataFrame is not weak-referenceable: never)."""
        if not isinstance(dataset, Dataset | IterableDataset) or dataset not in self._settings:
            return False
        before = self._settings[dataset]
        changed = [key for key in settings if before.get(key) != settings[key]]
        if changed:
            shown = "; ".join(_setting_change(key, before.get(key), settings[key]) for key in changed)
            raise ValueError(
                f"the {dataset_name} dataset was prepared by a {self.trainer} with other settings: {shown}. Its rows "
                "are those settings' rows (tokenized, checked, truncated or packed for them) and cannot be prepared "
                "again for these. Pass the dataset given to that trainer (its rows before preparation) instead, or "
                "use the same settings."
            )
        return True


def tokenizer_fingerprint(processing_class: Any) -> dict[str, Any]:
    """What of a tokenizer decides the tokens of prepared rows: its class, vocabulary, special tokens, BOS / EOS
    flags and chat template. Not the object: a sweep that loads the same tokenizer for each trainer (as TRL does
    when ``processing_class`` is None) can reuse the rows another trainer prepared."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer is None:
        return {}
    return {
        "class": type(tokenizer).__name__,
        "vocabulary": hash(frozenset(tokenizer.get_vocab().items())),
        "special_tokens": (tokenizer.special_tokens_map, sorted(tokenizer.all_special_tokens)),
        "add_bos_token": getattr(tokenizer, "add_bos_token", None),
        "add_eos_token": getattr(tokenizer, "add_eos_token", None),
        "chat_template": tokenizer.chat_template,
    }


def _setting_change(key: str, before: Any, now: Any) -> str:
    """One difference, in the words of the config."""
    if key == "tokenizer":
        return "another tokenizer (vocabulary, special tokens or chat template)"
    return f"{key}={before!r} when prepared, {now!r} now"
