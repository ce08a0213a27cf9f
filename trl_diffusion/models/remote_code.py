"""Keep what we save loadable by the released remote code (``trust_remote_code=True``, without trl_diffusion).

The released SDAR/TraDo, LLaDA and Dream/DiffuCoder checkpoints ship their configuration, modeling and tokenizer code
as ``.py`` files named by the ``auto_map`` of ``config.json`` and ``tokenizer_config.json``. Our classes load those
checkpoints without running that code, and save the ``auto_map`` as it was loaded, so a saved folder would name files
it does not have, and the official stack (dLLM-RL's scripts, the model cards' snippets) could not load what was
trained here. After a save, :func:`carry_remote_code` brings the code along, as transformers does when it saves a
remote-code model it loaded itself:

* the source is a local folder with the files: they are copied, with the files they import relatively;
* the source is a Hub repository (its file is in the Hub cache: a relative path that no longer exists reads like a
  repository name too): each reference becomes ``"<repo>--<module>.<Class>"``, which transformers resolves from that
  repository (the released repos hold the code);
* otherwise: a warning names the files the folder lacks.

The source is where the saved object was loaded from (``config._name_or_path``, ``tokenizer.name_or_path``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from huggingface_hub import try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from transformers.dynamic_module_utils import get_relative_imports
from transformers.utils import logging

logger = logging.get_logger(__name__)

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _references(auto_map: dict) -> list[str]:
    """Every class reference in an ``auto_map`` (tokenizers map to ``[slow, fast]`` pairs, either may be None)."""
    values = [v for value in auto_map.values() for v in (value if isinstance(value, list) else [value])]
    return [v for v in values if isinstance(v, str)]


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


def _downloaded_from_hub(source: str, file_name: str) -> bool:
    """Whether ``source`` names a Hub repository whose ``file_name`` this machine downloaded."""
    if not _REPO_ID.match(source) or "--" in source or ".." in source:
        return False
    try:
        return isinstance(try_to_load_from_cache(source, file_name), str)
    except HFValidationError:
        return False


def carry_remote_code(directory: str | os.PathLike, source: str | os.PathLike | None,
                      file_name: str = "config.json") -> None:
    """Make the ``auto_map`` of ``directory/file_name`` loadable from ``directory`` (see the module docstring).

    References that already name a repository (``"repo--module.Class"``) and modules the folder already has are
    left as they are; a folder without ``file_name``, or a file without an ``auto_map``, is left alone."""
    path = Path(directory) / file_name
    if not path.is_file():
        return
    saved = json.loads(path.read_text(encoding="utf-8"))
    references = [r for r in _references(saved.get("auto_map") or {}) if "--" not in r]
    missing = sorted({f"{r.split('.')[0]}.py" for r in references} - {p.name for p in Path(directory).glob("*.py")})
    if not missing:
        return
    source = os.fspath(source) if source else ""
    if source and os.path.isdir(source):
        folder = Path(source)
        for name in _with_relative_imports(folder, missing):
            if not (Path(directory) / name).exists():
                shutil.copyfile(folder / name, Path(directory) / name)
        missing = [name for name in missing if not (folder / name).is_file()]
    elif _downloaded_from_hub(source, file_name):
        def point(reference):
            return f"{source}--{reference}" if isinstance(reference, str) and "--" not in reference else reference

        saved["auto_map"] = {key: [point(r) for r in value] if isinstance(value, list) else point(value)
                             for key, value in saved["auto_map"].items()}
        path.write_text(json.dumps(saved, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
        missing = []
    if missing:
        logger.warning(
            f"{path} has an auto_map naming {', '.join(missing)}, which {directory} does not have and its source "
            f"({source or 'unknown'}) could not provide: without trl_diffusion, trust_remote_code=True cannot load "
            "this folder until the release's .py files are copied into it."
        )


class CarryRemoteCodeConfig:
    """Config mixin: every ``config.json`` written (``save_pretrained``, model saves, trainer checkpoints,
    ``push_to_hub``) carries the released remote code. ``to_json_file`` is the hook because transformers writes the
    file there after it starts tracking the files to upload, so a push includes what is carried."""

    def to_json_file(self, json_file_path: str | os.PathLike, use_diff: bool = True) -> None:
        super().to_json_file(json_file_path, use_diff=use_diff)
        folder, name = os.path.split(os.fspath(json_file_path))
        carry_remote_code(folder or ".", getattr(self, "_name_or_path", None), name)


def carry_tokenizer_code(directory: str | os.PathLike, processing_class) -> None:
    """:func:`carry_remote_code` for a saved ``tokenizer_config.json`` (the trainers call it after each save; call it
    after saving a tokenizer yourself). ``processing_class`` is a tokenizer or a processor holding one."""
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    carry_remote_code(directory, getattr(tokenizer, "name_or_path", None), "tokenizer_config.json")
