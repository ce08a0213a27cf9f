"""A new user's path through the command line: recipes run with what they say (no toy default of the example
leaks into them), and the common mistakes (a config value of the wrong type, a dataset file that does not exist, a
single name where a list is expected) stop the run early with one line naming the problem."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_cli import load_example
from trl import TrlParser

from trl_diffusion.cli import main
from trl_diffusion.scripts.utils import parse_script_args

ROOT = Path(__file__).resolve().parent.parent
RECIPES = sorted((ROOT / "trl_diffusion" / "recipes").glob("*.yaml"))
RECIPE_EXAMPLE = {"sdar_4b_long_cot_sft": "sft", "diffucoder_7b_coupled_code": "code"}
CPU = ["--bf16", "false", "--tf32", "false", "--use_cpu", "true"]


def one_line_error(capsys, prog: str) -> str:
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "Warning" not in line
           and "warnings.warn" not in line]  # transformers' FutureWarning on gradient_checkpointing
    assert len(err) == 1 and err[0].startswith(f"{prog}: error: "), err
    return err[0]


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
        if getattr(with_toy, "gradient_checkpointing", False) and with_toy.ddp_find_unused_parameters is False:
            # unset, transformers derives False from checkpointing on (True for a PEFT model, whose trained LoRA
            # parameters all take part too): a setting of DDP's speed, not of what the recipe trains
            differ.discard("ddp_find_unused_parameters")
        assert not differ, f"{recipe.name}: the example's defaults change {sorted(differ)}"
    keys = yaml.safe_load(recipe.read_text())
    if "save_steps" in keys:
        assert keys.get("save_strategy") == "steps"


@pytest.mark.parametrize(("text", "message"), [
    ("max_steps: 2.5\n", "config file: max_steps: expected int, got 2.5."),
    ("num_generations: 8.0\n", "config file: num_generations: expected int, got 8.0."),  # an `int | None` field
    ("learning_rate: fast\n", "learning_rate"),
    ("bf16: 2\n", "config file: bf16: expected bool, got 2."),
])
def test_example_config_value_of_the_wrong_type_is_one_line(tmp_path, capsys, text, message):
    """A YAML value goes through the check its flag goes through (before the fix ``max_steps: 2.5`` and
    ``num_generations: 8.0`` passed and failed mid-run with a traceback; a single reward name was read as a list of
    one-letter names)."""
    (tmp_path / "run.yaml").write_text(text)
    parser = load_example("math").make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--config", str(tmp_path / "run.yaml")])
    assert exit_info.value.code == 2 and message in one_line_error(capsys, parser.prog)


def test_eval_config_value_of_the_wrong_type_is_one_line(tmp_path, capsys):
    (tmp_path / "eval.yaml").write_text("max_problems: 2.5\nstop_token_ids: [1, 2]\n")
    assert main(["eval", "--config", str(tmp_path / "eval.yaml")]) == 2
    assert one_line_error(capsys, "trl-diffusion eval").endswith("config file: max_problems: expected int, got 2.5.")
    (tmp_path / "eval.yaml").write_text("stop_token_ids: [1, 2.5]\n")
    assert main(["eval", "--config", str(tmp_path / "eval.yaml")]) == 2
    assert one_line_error(capsys, "trl-diffusion eval").endswith("stop_token_ids: expected int, got 2.5.")


def test_config_values_of_the_right_type_still_parse(tmp_path):
    data = tmp_path / "math.jsonl"  # reward_funcs apply to a dataset (on the synthetic task they are refused)
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    (tmp_path / "run.yaml").write_text("max_steps: 3\nlearning_rate: 1.0e-5\nbeta: 0\nbf16: false\n"
                                       "max_completion_length: 32\nreward_funcs: [official_math_reward]\n"
                                       f"dataset_name: {data}\n")
    script_args, args, _ = parse_script_args(load_example("math").make_parser(),
                                             ["--config", str(tmp_path / "run.yaml"), "--use_cpu", "true"])
    assert (args.max_steps, args.learning_rate, args.beta, args.max_completion_length) == (3, 1e-5, 0, 32)
    assert script_args.reward_funcs == ["official_math_reward"]
    # one name for a list option is a one-element list, as `--reward_funcs official_math_reward` gives (it was read
    # as a list of one-letter names, then refused)
    (tmp_path / "run.yaml").write_text(f"reward_funcs: official_math_reward\ndataset_name: {data}\n")
    script_args, _, _ = parse_script_args(load_example("math").make_parser(),
                                          ["--config", str(tmp_path / "run.yaml"), "--use_cpu", "true"])
    assert script_args.reward_funcs == ["official_math_reward"]


@pytest.mark.parametrize("name", ["math", "sft", "code"])
@pytest.mark.parametrize("dataset", ["no_such_file.jsonl", "missing/train.parquet", "~/no-such-dataset.json"])
def test_example_missing_dataset_file_is_one_line_before_loading(capsys, name, dataset):
    """Before the fix a mistyped local dataset file was a ``datasets`` traceback, after the model had loaded."""
    parser = load_example(name).make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--dataset_name", dataset])
    assert exit_info.value.code == 2
    assert one_line_error(capsys, parser.prog).endswith(f"dataset_name: no such dataset file: {dataset}")
