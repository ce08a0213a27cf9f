"""Files shipped with the package: the embedded tiny SDAR checkpoint that examples default to.

``EMBEDDED_MODEL`` is a directory loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer``:
a ~0.8M-parameter SDAR (block size 4) trained from scratch with ``DiffusionSFTTrainer`` to a middling accuracy
(37.6% greedy exact match on held-out problems) on 3-digit addition and subtraction (``EMBEDDED_TASK``), a harder
variant of the 2-digit task the from-scratch proof masters, so RL has room to improve.
``scripts/make_embedded_model.py`` reproduces it from its seed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig

EMBEDDED_MODEL = Path(__file__).parent / "tiny-sdar-arithmetic"
EMBEDDED_TASK = {"num_train": 12000, "num_test": 500, "digits": 3, "seed": 0}
"""``make_problems`` arguments of the task the embedded model was trained on (train split) and is scored on
(held-out split)."""
EMBEDDED_FORMAT = "prompt_completion"
"""The dataset format it was trained in: plain ``"What is a+b?\\n"`` prompts (no chat template)."""
EMBEDDED_CHAT_TEMPLATE = EMBEDDED_FORMAT == "conversational"

__all__ = [
    "EMBEDDED_ARCHITECTURE", "EMBEDDED_CHAT_TEMPLATE", "EMBEDDED_FORMAT", "EMBEDDED_MODEL", "EMBEDDED_TASK",
    "check_hub_model_cached", "check_model_folder", "is_embedded_model", "resolve_model_path",
]


def resolve_model_path(name: str | os.PathLike | None) -> str:
    """The model to load: ``name``, or the embedded model when ``name`` is empty.

    Raises ``ValueError("no such local directory: ...")`` early for a name that is written as a path (it starts
    with ``.``, ``/`` or ``~``, or has more than one ``/``) but names no directory, instead of letting the Hub
    client report it as a malformed repo id. A Hub id (``owner/name``) is returned unchanged.
    """
    if name is None or str(name) == "":
        if not Path(EMBEDDED_MODEL, "config.json").exists():
            raise ValueError(f"no model given and the embedded model is not installed at {EMBEDDED_MODEL}; "
                             "pass --model_name_or_path.")
        return str(EMBEDDED_MODEL)
    text = str(name)
    path = Path(os.path.expanduser(text))  # "~nouser/x" stays as written (Path.expanduser raises on it)
    path_like = text.startswith((".", "/", "~", "\\")) or text.count("/") > 1 or "\\" in text or path.exists()
    if path_like and not path.is_dir():
        raise ValueError(f"{'not a directory' if path.exists() else 'no such local directory'}: {text}")
    return str(path) if path_like else text


def check_hub_model_cached(name: str, revision: str | None = None, file_name: str = "config.json") -> None:
    """With the Hub offline (``HF_HUB_OFFLINE=1``), raise ``ValueError`` naming ``name`` when it is a Hub id whose
    ``file_name`` (``tokenizer_config.json`` for a tokenizer) is not in the local Hugging Face cache, before anything
    is loaded (transformers' own error names neither the model nor the fix). A local directory, or any name while the
    Hub is online, passes."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.HF_HUB_OFFLINE or Path(os.path.expanduser(name)).is_dir():
        return
    try:
        cached = try_to_load_from_cache(name, file_name, revision=revision)
    except ValueError:  # not a valid repo id: left to the loader's own message
        return
    if not isinstance(cached, str):
        at, flag = (f" at revision {revision!r}", f" --revision {revision}") if revision else ("", "")
        raise ValueError(f"model {name!r}{at} is not in the local Hugging Face cache and the Hub is offline "
                         f"(HF_HUB_OFFLINE=1): download it first (`hf download {name}{flag}`) or pass a local "
                         "directory.")


def check_model_folder(path: str) -> None:
    """Raise ``ValueError`` for a local directory that holds neither a model (``config.json``) nor a PEFT adapter
    (``adapter_config.json``), naming its subfolders that hold one (``--model_name_or_path outputs`` for
    ``outputs/math``, a run's ``checkpoint-*``): loading it failed on the tokenizer, with a traceback per process. A
    Hub id (no such directory) passes."""
    folder = Path(os.path.expanduser(path))
    if not folder.is_dir() or _holds_model(folder):
        return
    inside = sorted(str(sub.relative_to(folder)) for sub in folder.iterdir() if sub.is_dir() and _holds_model(sub))
    hint = f"; these subfolders do: {', '.join(inside)}" if inside else ""
    raise ValueError(f"{path} holds no model: no config.json, and no adapter_config.json of a PEFT adapter{hint}.")


def _holds_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() or (folder / "adapter_config.json").is_file()


EMBEDDED_ARCHITECTURE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                         "num_attention_heads", "num_key_value_heads", "head_dim", "block_size", "mask_token_id")
"""The ``config.json`` fields that identify the embedded model's architecture. A model with all of them equal was
trained from it (what ``examples/*.py`` save in ``outputs/<name>``, their checkpoints, a copy): no other checkpoint
has this 0.8M-parameter shape over a 128-token vocabulary."""


def is_embedded_model(name_or_config: str | os.PathLike | PretrainedConfig | None) -> bool:
    """Whether ``name_or_config`` is the embedded model or a model trained from it, which want the same plain prompts
    (:data:`EMBEDDED_FORMAT`): the embedded directory, or a local directory (a path, or a loaded model's
    ``name_or_path``) or a model config with the embedded model's architecture (:data:`EMBEDDED_ARCHITECTURE`). A
    PEFT adapter directory (``--use_peft``) is judged by its ``base_model_name_or_path``. A Hub id is not read
    (False)."""
    if name_or_config is None or str(name_or_config) == "":
        return False
    if not isinstance(name_or_config, (str, os.PathLike)):  # a model config
        return _embedded_architecture(name_or_config.to_dict())
    try:
        path = Path(os.path.expanduser(str(name_or_config))).resolve()
        adapter = path / "adapter_config.json"
        if not (path / "config.json").is_file() and adapter.is_file():
            base = json.loads(adapter.read_text()).get("base_model_name_or_path")
            if not base:
                return False
            path = Path(os.path.expanduser(base)).resolve()
        if path == EMBEDDED_MODEL.resolve():
            return True
        config = path / "config.json"
        return config.is_file() and _embedded_architecture(json.loads(config.read_text()))
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, or not a JSON object
        return False


def _embedded_architecture(config: dict) -> bool:
    embedded = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    return all(config.get(field) == embedded[field] for field in EMBEDDED_ARCHITECTURE)
