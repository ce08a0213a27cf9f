"""The published training configurations (dLLM-RL's TraceRL and SFT configs, DiffuCoder's coupled GRPO) as
``--config`` files of the training scripts. They ship with the package: ``--config <name>`` (the file's name without
``.yaml``) reads one from anywhere, and ``trl-diffusion recipes`` lists them. Each file's header says what it mirrors,
how to launch it and where it deviates; ``docs/recipes.md`` explains them."""

from __future__ import annotations

import re
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parent


def recipe_names() -> list[str]:
    """The shipped recipes' names, sorted."""
    return sorted(path.stem for path in RECIPES_DIR.glob("*.yaml"))


def recipe_path(name: str) -> Path:
    """The file of the shipped recipe ``name``; ``ValueError`` naming the recipes there are when there is none."""
    path = RECIPES_DIR / f"{name}.yaml"
    if name not in recipe_names():
        raise ValueError(f"no recipe named {name!r}; the shipped recipes are {', '.join(recipe_names())} "
                         "(or give a config file's path).")
    return path


def recipe_summary(name: str) -> str:
    """A line for a recipe from its header comment: what it trains (the header's first words, up to the first
    ``(``, ``:`` or ``,``) and the official config it mirrors."""
    header = " ".join(line.lstrip("#").strip() for line in recipe_path(name).read_text().splitlines()
                      if line.startswith("#"))
    what = re.split(r"[(:,]", header, maxsplit=1)[0].strip()
    mirrored = re.search(r"mirroring (\S+ \S+)", header)
    return f"{what} (mirrors {mirrored.group(1)})" if mirrored else what


def recipe_command(name: str) -> str:
    """The training command a recipe is for (``sft``, ``math`` or ``code``), from the ``trl-diffusion <command>``
    launch line of its header."""
    found = re.search(r"trl-diffusion (\w+) ", recipe_path(name).read_text())
    if found is None:
        raise ValueError(f"recipe {name!r}: its header shows no `trl-diffusion <command>` launch line.")
    return found.group(1)
