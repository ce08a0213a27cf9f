"""Keep what we save loadable by the released remote code (``trust_remote_code=True``, without trl_diffusion).

The released SDAR/TraDo, LLaDA and Dream/DiffuCoder checkpoints ship their configuration, modeling and tokenizer code
as ``.py`` files named by the ``auto_map`` of ``config.json`` and ``tokenizer_config.json``. Our classes load those
checkpoints without running that code, and save the ``auto_map`` as it was loaded, so a saved folder would name files
it does not have, and the official stack (dLLM-RL's scripts, the model cards' snippets) could not load what was
trained here. After a save, :func:`carry_remote_code` brings the code along, as transformers does when it saves a
remote-code model it loaded itself:

* the source is a local folder with the files: they are copied, with the files they import relatively;
* the source is a Hub repository whose cached snapshot holds the code (downloaded with ``snapshot_download`` or an
  earlier ``trust_remote_code=True`` load): the files are copied from there, so the folder loads offline;
* the source is a Hub repository (its file is in the Hub cache: a relative path that no longer exists reads like a
  repository name too) without the code in the cache: each reference becomes ``"<repo>--<module>.<Class>"``, which
  transformers resolves from that repository (the released repos hold the code);
* otherwise: a warning names the files the folder lacks and how to copy them in (once per source and file).

The source is where the saved object was loaded from (``config._name_or_path``, ``tokenizer.name_or_path``).
Mid-training Hub pushes upload ``output_dir`` rather than the checkpoint: :func:`push_from_checkpoint_with_code`
puts the code there first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from transformers.dynamic_module_utils import get_relative_imports
from transformers.trainer_utils import HubStrategy
from transformers.utils import CHAT_TEMPLATE_FILE, logging

logger = logging.get_logger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_AUTO_MAP_FILES = ("config.json", "tokenizer_config.json")
_warned: set[tuple[str, str, tuple[str, ...]]] = set()  # (source, file name, missing files) already warned about


def _references(auto_map: dict) -> list[str]:
    """Every class reference in an ``auto_map`` (tokenizers map to ``[slow, fast]`` pairs, either may be None)."""
    values = [v for value in auto_map.values() for v in (value if isinstance(value, list) else [value])]
    return [v for v in values if isinstance(v, str)]


def _modules(saved: dict) -> set[str]:
    """The ``.py`` files an ``auto_map`` names in its own folder (``"repo--module.Class"`` references excluded)."""
    return {f"{r.split('.')[0]}.py" for r in _references(saved.get("auto_map") or {}) if "--" not in r}


def _with_relative_imports(folder: Path, module_files: list[str]) -> list[str]:
    """``module_files`` and every file of ``folder`` they import relatively (``from .x import y``), recursively."""
    found, todo = [], list(module_files)
    while todo:
        name = todo.pop()
        if name in found or not (folder / name).is_file():
            continue
        found.append(name)
        todo += [f"{module}.py" for module in get_relative_imports(folder / name)]
    return found


def _hub_snapshot(source: str, file_name: str) -> Path | None:
    """The Hub cache's snapshot folder (``main``) of the repository ``source`` names, when this machine downloaded
    its ``file_name`` there; None for anything else (a local path, a repository never downloaded)."""
    if not _REPO_ID.match(source) or "--" in source or ".." in source:
        return None
    try:
        cached = try_to_load_from_cache(source, file_name)
    except HFValidationError:
        return None
    return Path(cached).parent if isinstance(cached, str) else None


def _holds_code(folder: Path, module_files: list[str]) -> bool:
    """Whether ``folder`` has every one of ``module_files`` and every file they import relatively."""
    needed = _with_relative_imports(folder, module_files)
    return set(module_files) <= set(needed) and all(
        (folder / f"{module}.py").is_file() for name in needed for module in get_relative_imports(folder / name))


def carry_remote_code(directory: str | os.PathLike, source: str | os.PathLike | None,
                      file_name: str = "config.json") -> None:
    """Make the ``auto_map`` of ``directory/file_name`` loadable from ``directory`` (see the module docstring).

    References that already name a repository (``"repo--module.Class"``) and modules the folder already has are
    left as they are; a folder without ``file_name``, or a file without an ``auto_map``, is left alone."""
    path = Path(directory) / file_name
    if not path.is_file():
        return
    saved = json.loads(path.read_text(encoding="utf-8"))
    if file_name == "tokenizer_config.json" and _references(saved.get("auto_map") or {}):
        _write_bpe_vocabulary(Path(directory))
    missing = sorted(_modules(saved) - {p.name for p in Path(directory).glob("*.py")})
    if not missing:
        return
    source = os.fspath(source) if source else ""
    local = Path(source) if source and os.path.isdir(source) else None
    snapshot = None if local is not None or not source else _hub_snapshot(source, file_name)
    folder = local if local is not None else snapshot if snapshot and _holds_code(snapshot, missing) else None
    if folder is not None:  # copy the code: a local source, or a Hub cache snapshot that holds all of it
        for name in _with_relative_imports(folder, missing):
            if not (Path(directory) / name).exists():
                shutil.copyfile(folder / name, Path(directory) / name)
        missing = [name for name in missing if not (folder / name).is_file()]
    elif snapshot is not None:  # a Hub source without the code in the cache: point at the repository
        def point(reference):
            return f"{source}--{reference}" if isinstance(reference, str) and "--" not in reference else reference

        saved["auto_map"] = {key: [point(r) for r in value] if isinstance(value, list) else point(value)
                             for key, value in saved["auto_map"].items()}
        path.write_text(json.dumps(saved, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
        missing = []
    if missing and (source, file_name, tuple(missing)) not in _warned:
        _warned.add((source, file_name, tuple(missing)))
        logger.warning(
            f"{path} has an auto_map naming {', '.join(missing)}, which {directory} does not have and its source "
            f"({source or 'unknown'}) could not provide: without trl_diffusion, trust_remote_code=True cannot load "
            "this folder. Copy the files in from a folder holding the release's .py files with "
            f"trl_diffusion.models.carry_remote_code({os.fspath(directory)!r}, '<release folder>', {file_name!r}). "
            "Said once: later folders saved from this source lack them too."
        )


def _write_bpe_vocabulary(directory: Path) -> None:
    """``vocab.json`` + ``merges.txt`` from the folder's ``tokenizer.json`` when it has a BPE model and lacks them.

    The released tokenizer code (SDAR's ``tokenization_qwen2.Qwen2Tokenizer``, Dream's ``DreamTokenizer``) is a slow
    byte-level BPE tokenizer whose constructor opens those two files; transformers 5 saves only ``tokenizer.json``,
    so without them ``trust_remote_code=True`` fails on the saved folder. The added tokens stay where transformers
    put them (``tokenizer.json``), as in the releases' ``vocab.json``, which holds the base vocabulary only."""
    vocab, merges, source = directory / "vocab.json", directory / "merges.txt", directory / "tokenizer.json"
    if (vocab.exists() and merges.exists()) or not source.is_file():
        return
    model = json.loads(source.read_text(encoding="utf-8")).get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return
    lines = [pair if isinstance(pair, str) else " ".join(pair) for pair in model.get("merges") or []]
    if not vocab.exists():
        vocab.write_text(json.dumps(model["vocab"], ensure_ascii=False) + "\n", encoding="utf-8")
    if not merges.exists():
        merges.write_text("#version: 0.2\n" + "".join(f"{line}\n" for line in lines), encoding="utf-8")


class CarryRemoteCodeConfig:
    """Config mixin: every ``config.json`` written (``save_pretrained``, model saves, trainer checkpoints,
    ``push_to_hub``) carries the released remote code. ``to_json_file`` is the hook because transformers writes the
    file there after it starts tracking the files to upload, so a push includes what is carried."""

    def to_json_file(self, json_file_path: str | os.PathLike, use_diff: bool = True) -> None:
        super().to_json_file(json_file_path, use_diff=use_diff)
        _write_torch_dtype(Path(json_file_path))
        folder, name = os.path.split(os.fspath(json_file_path))
        carry_remote_code(folder or ".", getattr(self, "_name_or_path", None), name)


def _write_torch_dtype(path: Path) -> None:
    """Add ``torch_dtype`` beside the ``dtype`` transformers 5 writes: the releases' key, the one transformers 4 (which
    the released code needs) reads; transformers 5 reads ``dtype`` first and takes ``torch_dtype`` silently."""
    config = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(config.get("dtype"), str) and config["dtype"] != "auto" and "torch_dtype" not in config:
        # a dtype name only: transformers 4 resolves torch_dtype as getattr(torch, name) ("auto" failed to load)
        config["torch_dtype"] = config["dtype"]
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def carry_tokenizer_code(directory: str | os.PathLike, processing_class) -> None:
    """:func:`carry_remote_code` for a saved ``tokenizer_config.json``, which is also rewritten in the releases' format
    (:func:`_write_released_tokenizer_config`). The trainers call it after each save; call it after saving a tokenizer
    yourself. ``processing_class`` is a tokenizer or a processor holding one."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    carry_remote_code(directory, getattr(tokenizer, "name_or_path", None), "tokenizer_config.json")
    _write_released_tokenizer_config(directory)


def _write_released_tokenizer_config(directory: str | os.PathLike) -> None:
    """Rewrite the ``tokenizer_config.json`` transformers 5 saved in ``directory`` as the releases write it, so that
    transformers 4 (which the released code needs) loads the tokenizer as transformers 5 does:

    * a list of ``extra_special_tokens`` becomes ``additional_special_tokens`` (transformers 4 takes
      ``extra_special_tokens`` for a dict of named tokens and fails on a list);
    * ``tokenizer_class`` ``TokenizersBackend`` (transformers 5's name) becomes ``PreTrainedTokenizerFast``;
    * ``chat_template.jinja`` is also written inline as ``chat_template`` (older transformers 4, 4.46 among them,
      reads only that).

    The added tokens' ids stay in ``tokenizer.json``, where transformers 4 reads them for slow tokenizers too."""
    directory = Path(directory)
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(config.get("extra_special_tokens"), list):
        config.setdefault("additional_special_tokens", config.pop("extra_special_tokens"))
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        config["chat_template"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def copy_carried_code(folder: str | os.PathLike, directory: str | os.PathLike) -> list[str]:
    """Copy into ``directory`` the ``.py`` files of ``folder`` that the ``auto_map`` of its ``config.json`` and
    ``tokenizer_config.json`` name, with the files they import relatively; returns their names."""
    folder = Path(folder)
    modules = set().union(*(_modules(json.loads((folder / name).read_text(encoding="utf-8")))
                            for name in _AUTO_MAP_FILES if (folder / name).is_file()))
    copied = _with_relative_imports(folder, sorted(modules))
    for name in copied:
        shutil.copyfile(folder / name, Path(directory) / name)
    return copied


def _pushes(trainer) -> bool:
    """Whether transformers' ``Trainer._push_from_checkpoint`` uploads on this call (its own early returns)."""
    args, in_progress = trainer.args, getattr(trainer, "push_in_progress", None)
    busy = in_progress is not None and not in_progress.is_done()
    return trainer.is_world_process_zero() and args.hub_strategy != HubStrategy.END and (
        args.hub_always_push or not busy)


def push_from_checkpoint_with_code(trainer, checkpoint_folder: str, push: Callable[[str], None]) -> None:
    """transformers' ``Trainer._push_from_checkpoint`` (``push``), with the released remote code in what it uploads.

    ``push`` copies a fixed list of files (weights, ``config.json``, ...) from the checkpoint into ``output_dir``,
    saves the processing class there and starts uploading ``output_dir`` in the background at once, so the code must
    be in place before it runs: the checkpoint's carried ``.py`` files are copied first, and the processing class is
    saved and its code carried here, held back from ``push`` (its save would write the ``tokenizer_config.json``
    ``auto_map`` as loaded, without a Hub source's ``"repo--"`` references, after the carry)."""
    processing_class = trainer.processing_class
    if _pushes(trainer):
        output_dir = trainer.args.output_dir
        copy_carried_code(checkpoint_folder, output_dir)
        if processing_class is not None:
            processing_class.save_pretrained(output_dir)
            carry_tokenizer_code(output_dir, processing_class)
    trainer.processing_class = None
    try:
        push(checkpoint_folder)
    finally:
        trainer.processing_class = processing_class
