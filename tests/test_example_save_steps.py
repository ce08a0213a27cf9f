"""The examples default to ``save_strategy="no"`` (no checkpoints of the tiny model) where transformers defaults to
``"steps"``: ``--save_steps 1`` alone saved nothing, silently, and a later ``--resume_from_checkpoint true`` found no
checkpoint. It is now one error line naming ``--save_strategy steps``."""

from __future__ import annotations

import pytest
from example_scripts import load_example
from test_cli import one_line_error

from trl_diffusion.scripts.utils import parse_script_args


@pytest.mark.parametrize("name", ["math", "sft", "code"])
def test_save_steps_without_a_save_strategy_is_one_error_line(capsys, name):
    parser = load_example(name).make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--save_steps", "10"])
    assert exit_info.value.code == 2
    assert one_line_error(capsys, parser.prog).endswith(
        "save_steps=10 saves nothing: save_strategy is 'no' (the examples' default; transformers' is 'steps'). Pass "
        "--save_strategy steps to save a checkpoint every 10 steps.")


def test_save_steps_with_the_steps_strategy_or_the_defaults_parse():
    parser = load_example("math").make_parser()
    args = parse_script_args(parser, ["--save_steps", "10", "--save_strategy", "steps"])[1]
    assert args.save_steps == 10 and args.save_strategy == "steps"
    args = parse_script_args(parser, [])[1]
    assert args.save_strategy == "no"
    args = parse_script_args(parser, ["--save_strategy", "epoch"])[1]
    assert args.save_strategy == "epoch"


def test_the_command_line_save_strategy_overrides_a_config_files_save_steps(tmp_path, capsys):
    """``--config trado_4b_tracerl_math --save_strategy no`` (a recipe's checkpoints turned off for a
    trial run) was refused with the error above, which blamed the examples' default for the recipe's save_steps."""
    config = tmp_path / "run.yaml"
    config.write_text("save_strategy: steps\nsave_steps: 160\n")
    parser = load_example("math").make_parser()
    args = parse_script_args(parser, ["--config", str(config), "--save_strategy", "no"])[1]
    assert args.save_strategy == "no" and args.save_steps == 160
    config.write_text("save_steps: 160\n")  # the file's save_steps alone still saves nothing: refused
    with pytest.raises(SystemExit):
        parse_script_args(load_example("math").make_parser(), ["--config", str(config)])
    assert "save_steps=160 saves nothing" in one_line_error(capsys, parser.prog)
