"""Loading a training set by Hub name or from a local file, as the examples accept either."""

from __future__ import annotations

import json
import os

from datasets import Dataset, IterableDataset, load_dataset, load_dataset_builder
from datasets.exceptions import DatasetNotFoundError

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")
"""File names read as a local dataset file rather than a Hub name (compared in lower case)."""


def is_local_file_name(name: str) -> bool:
    """Whether ``name`` ends like a local dataset file (``.json`` / ``.jsonl`` / ``.parquet``, in any case)."""
    return name.lower().endswith(LOCAL_SUFFIXES)


def check_local_file_type(name: str) -> None:
    """Refuse an existing file that is not a dataset file we read: ``load_dataset`` took ``data.csv`` or
    ``train.txt`` for a Hub id and failed on the network (``Couldn't reach ... on the Hub``)."""
    path = os.path.expanduser(name)
    if os.path.isfile(path) and not is_local_file_name(name):
        raise ValueError(f"dataset file {name!r} is not one of {LOCAL_SUFFIXES}: convert it (e.g. "
                         "datasets.load_dataset('csv', data_files=...)['train'].to_json('data.jsonl')).")


ROW_COLUMNS = frozenset({
    "text", "prompt", "completion", "messages", "conversations", "chosen", "rejected",  # TRL's formats
    "input_ids", "prompt_ids", "completion_ids", "unmask_step", "reward",  # tokenized rows, value trajectories
    "question", "problem", "answer", "ground_truth_answer",  # eval's formats
    "test", "test_list", "test_method", "entry_point",
})
"""Columns that make a JSON object a row of its own (compared in lower case), never a wrapper of rows:
``{"prompt": ..., "tools": [{...}]}`` is one row, ``{"version": 1, "data": [{...}, ...]}`` wraps two."""


def wrapped_rows_key(data: object) -> str | None:
    """The key of ``{"<key>": [{...}, ...]}``: a JSON object whose one non-empty list of objects holds the rows, or,
    with none, whose one empty list does (``{"rows": []}``: a file of no rows, not a row of one column); None for
    anything else. :func:`rows_wrapper_key` decides whether such an object wraps a file's rows."""
    if not isinstance(data, dict):
        return None
    lists = [k for k, v in data.items() if isinstance(v, list) and all(isinstance(r, dict) for r in v)]
    keys = [k for k in lists if data[k]] or lists
    return keys[0] if len(keys) == 1 else None


WRAPPER_KEYS = frozenset({"data", "rows", "records", "instances", "items", "problems"})
"""Keys that wrap a file's rows beside metadata (``{"version": 1, "data": [...]}``); an object of one key wraps its
rows whatever the key (``{"rows": [...]}``)."""


def rows_wrapper_key(data: object) -> str | None:
    """The key of the rows when the JSON object ``data`` (a whole ``.json`` file, or the one line of a ``.jsonl``
    file) wraps a file's rows: ``{"<key>": [{...}, ...]}`` alone, or beside metadata under a :data:`WRAPPER_KEYS`
    name (``{"version": 1, "data": [...]}``). None for an object that is itself a row: one with no single list of
    objects (:func:`wrapped_rows_key`), one whose list is a row column (:data:`ROW_COLUMNS`: ``messages``,
    ``conversations``) or holds chat messages (``role`` with ``content`` or ``tool_calls``, ShareGPT's ``from`` with
    ``value``), one with another key that is a row column (``{"question": ..., "data": [...]}``), or one with other
    keys and its list under another name (``{"query": ..., "tools": [...]}``). ``trl-diffusion eval`` and training
    read a file with this one rule."""
    key = wrapped_rows_key(data)
    if key is None or str(key).lower() in ROW_COLUMNS or (data[key] and all(map(_is_chat_message, data[key]))):
        return None
    if len(data) == 1:
        return key
    if any(str(other).lower() in ROW_COLUMNS for other in data if other != key):
        return None
    return key if str(key).lower() in WRAPPER_KEYS else None


def _is_chat_message(row: dict) -> bool:
    return ("role" in row and ("content" in row or "tool_calls" in row)) or {"from", "value"} <= set(row)


def _rows_field(path: str) -> str | None:
    """For a ``.json`` / ``.jsonl`` file that is one object wrapping its rows (:func:`rows_wrapper_key`), the key
    (``load_dataset``'s ``field``): without it the file loaded as one row whose columns were that list and the
    metadata beside it. Only a file that opens with an object which is not complete on its first line, or a file of
    one line, is parsed whole to find out; a list or JSON lines of several rows are left to ``datasets`` (and its
    cache) unread."""
    with open(path, encoding="utf-8-sig", errors="replace") as handle:  # -sig: a byte-order mark is not text
        lines = (line for line in handle if line.strip())
        first, second = next(lines, ""), next(lines, None)
    if not first.lstrip().startswith("{"):
        return None
    try:
        data = json.loads(first)
        if second is not None:
            return None  # whole objects line by line: JSON lines
    except json.JSONDecodeError:  # an object over several lines
        try:
            with open(path, encoding="utf-8-sig") as handle:
                data = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # not one JSON document: datasets' error
    key = rows_wrapper_key(data)
    if key is None:
        return None
    if not data[key]:  # datasets: 'Instruction "train" corresponds to no data!'
        raise ValueError(f"{path} holds no rows (its {key!r} list is empty): give it at least one example.")
    with open(path, "rb") as handle:
        if handle.read(3) == b"\xef\xbb\xbf":  # datasets' reader of a wrapped file fails on a byte-order mark
            raise ValueError(f"{path} wraps its rows in {{{key!r}: [...]}} and starts with a UTF-8 byte-order mark, "
                             "which datasets' JSON reader does not take there: save it without the mark (or as a "
                             "list of rows, or JSON lines).")
    return key


def _is_blank_or_empty_list(path: str) -> bool:
    """Whether a ``.json`` / ``.jsonl`` file holds nothing but white space, or ``[]``: read up to its second
    character that is not white space."""
    seen = ""
    with open(path, encoding="utf-8-sig", errors="replace") as handle:
        while len(seen) < 2 and (chunk := handle.read(1 << 16)):
            seen += "".join(chunk.split())[:2 - len(seen)]
    return seen in ("", "[]")


def load_training_dataset(name: str, config: str | None = None, split: str = "train") -> Dataset:
    """``name`` is a local ``.json`` / ``.jsonl`` / ``.parquet`` file or a Hub dataset. A local file is one split,
    ``train``: ``split`` may slice it (``"train[:1000]"``), another split name is ``datasets``' error, and a
    ``config`` is refused (a local file has none). A local path may start with ``~``; a ``.json`` file may hold a
    list of rows, JSON lines, or one object wrapping the rows (``{"rows": [...]}``, also beside metadata:
    ``{"version": 1, "data": [...]}``; a ``.jsonl`` file of that one object too), read as ``trl-diffusion eval``
    reads them (:func:`rows_wrapper_key`). Another existing file is refused (``check_local_file_type``)."""
    if is_local_file_name(name):
        if config is not None:
            raise ValueError(f"dataset_config={config!r} was given with the local file {name!r}, which has no "
                             "configs: leave dataset_config unset (or put that subset in a file of its own).")
        path = os.path.expanduser(name)
        if name.lower().endswith(".parquet"):
            return load_dataset("parquet", data_files=path, split=split)
        field = None
        if os.path.isfile(path):
            if _is_blank_or_empty_list(path):  # datasets: a bare StopIteration, or 'corresponds to no data!'
                raise ValueError(f"{name} holds no rows: give it at least one example.")
            field = _rows_field(path)
        return load_dataset("json", data_files=path, split=split, **({"field": field} if field else {}))
    check_local_file_type(name)
    try:
        return load_dataset(name, config, split=split)
    except (DatasetNotFoundError, ConnectionError) as exc:
        raise hub_dataset_error(name, exc) from exc


def hub_dataset_error(name: str, exc: OSError) -> ValueError:
    """A Hub dataset ``datasets`` cannot find or reach (no such dataset, a private one without a token, the Hub
    offline without it in the cache, no network) as one ``ValueError`` naming ``dataset_name``."""
    return ValueError(f"dataset_name {name!r}: {' '.join(str(exc).split())}; pass a Hub dataset id (with the Hub "
                      "offline, one in the local cache) or a local .json / .jsonl / .parquet file.")


def check_hub_dataset(name: str, config: str | None = None) -> None:
    """Raise ``ValueError`` naming ``name`` when it is no dataset ``datasets`` can load (:func:`hub_dataset_error`),
    or ``config`` is none of its configs, before anything is loaded: ``datasets.load_dataset_builder`` reads the
    dataset's metadata (offline: the local cache), no data. A local file name passes (checked on its own)."""
    if is_local_file_name(name):
        return
    try:
        load_dataset_builder(name, config)
    except (DatasetNotFoundError, ConnectionError) as exc:
        raise hub_dataset_error(name, exc) from None


def column_names(dataset: Dataset | IterableDataset) -> list[str]:
    """A dataset's columns; a stream that does not declare them (``IterableDataset.from_generator``) shows its first
    example's keys (none when it is empty)."""
    if dataset.column_names is not None:
        return list(dataset.column_names)
    return list(next(iter(dataset), None) or ())


def dataset_label(split: str, name: str | None = None) -> str:
    """How the trainers' messages name a dataset: ``train``, ``eval``, ``test`` (``predict``), or ``eval 'b'`` for the
    member ``name`` of a dict of eval datasets."""
    return split if name is None else f"{split} {name!r}"


def empty_dataset_error(label: str) -> ValueError:
    """The trainers' refusal of a dataset with no rows (``label``: :func:`dataset_label`): Trainer failed at
    ``train()`` with torch's "num_samples=0" (TRL's SFT with a bare StopIteration), and ``evaluate()`` logged no
    ``eval_loss`` (``metric_for_best_model`` then failed after the first training steps)."""
    return ValueError(f"the {label} dataset has no rows: give it at least one example.")
