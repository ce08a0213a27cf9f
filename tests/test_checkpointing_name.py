"""``gradient_checkpointing`` / ``activation_checkpointing``: transformers 5.23 renamed the field and warns with a
FutureWarning whenever the old name is set while the new one is not. TRL 1.16 sets the old name's default (True), so
every TraceRL / SFT / value config built from Python warned, and so did every shipped recipe (whose old-name key
transformers before 5.23 needs). Our configs move the old name to the new one first: no warning, and the value
transformers itself resolves."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
from test_recipes import RECIPES, parse
from transformers import TrainingArguments

from trl_diffusion import DiffusionSFTConfig, DiffusionValueConfig, TraceRLConfig

CONFIGS = [TraceRLConfig, DiffusionSFTConfig, DiffusionValueConfig]
SETTINGS = [{}, {"gradient_checkpointing": True}, {"gradient_checkpointing": False},
            {"activation_checkpointing": False}, {"gradient_checkpointing": True, "activation_checkpointing": False}]
RENAMED = "activation_checkpointing" in {item.name for item in dataclasses.fields(TrainingArguments)}


def names(args) -> tuple:
    return args.gradient_checkpointing, getattr(args, "activation_checkpointing", args.gradient_checkpointing)


@pytest.mark.parametrize("config_class", CONFIGS)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "none")
def test_no_future_warning_and_transformers_own_resolution(tmp_path, config_class, settings):
    if not RENAMED and "activation_checkpointing" in settings:
        pytest.skip("this transformers has only gradient_checkpointing")
    common = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        ours = config_class(**common, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        # transformers' own reading of the same values, TRL's default for the old name included
        theirs = TrainingArguments(**common, **{"gradient_checkpointing": True, **settings})
    assert names(ours) == names(theirs)
    assert names(ours)[0] == names(ours)[1]  # the old name mirrors the new one, as transformers leaves it


@pytest.mark.parametrize("recipe", RECIPES, ids=[recipe.stem for recipe in RECIPES])
def test_the_shipped_recipes_build_without_the_warning(recipe):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _, args, _ = parse(recipe)
    assert names(args) == (True, True)  # the recipe's gradient_checkpointing: true
