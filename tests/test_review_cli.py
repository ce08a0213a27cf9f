"""A new user's path through the command line: recipes run with what they say (no toy default of the example
leaks into them), and the common mistakes (a config value of the wrong type, a dataset file that does not exist, a
single name where a list is expected) stop the run early with one line naming the problem."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import yaml
from trl import TrlParser

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
RECIPE_EXAMPLE = {"sdar_4b_long_cot_sft": "sft", "diffucoder_7b_coupled_code": "code"}
CPU = ["--bf16", "false", "--tf32", "false", "--use_cpu", "true"]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"review_cli_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_recipe_is_not_changed_by_the_examples_toy_defaults(recipe):
    """The examples set toy defaults (``save_strategy="no"``, ``max_steps=200``) for the embedded model; a recipe is
    a published run and must mean the same with or without them. Before the fix every recipe saved no checkpoint
    (its ``save_steps`` ignored) and the SFT / DiffuCoder recipes stopped after 200 / 40 steps instead of 1 epoch."""
    example = load_example(RECIPE_EXAMPLE.get(recipe.stem, "math"))
    toy = example.make_parser()
    plain = TrlParser(toy.dataclass_types)  # the same dataclasses, TRL's own defaults
    argv = ["--config", str(recipe), *CPU]
    for with_toy, without in zip(toy.parse_args_and_config(argv), plain.parse_args_and_config(argv)):
        differ = {k for k in vars(without) if repr(getattr(with_toy, k)) != repr(getattr(without, k))}
        assert not differ, f"{recipe.name}: the example's defaults change {sorted(differ)}"
    keys = yaml.safe_load(recipe.read_text())
    if "save_steps" in keys:
        assert keys.get("save_strategy") == "steps"
