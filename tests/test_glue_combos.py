"""The example scripts' and ``trl-diffusion``'s ``--config`` handling combined with command-line flags: a config
file value is checked as the same value given as a flag is, and every way of naming the file either works or is one
line ``<prog>: error: ...`` with exit status 2 (never a traceback)."""

from __future__ import annotations

import pytest
from test_cli import load_example
from test_newcomer_audit import error_line

from trl_diffusion.cli import main
from trl_diffusion.scripts.utils import parse_script_args


def config_file(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(("name", "key"), [("sft", "num_eval"), ("math", "max_steps")])
def test_config_null_for_an_option_that_cannot_be_none_is_one_line(capsys, tmp_path, name, key):
    """``num_eval: null`` was a ``TypeError`` traceback; ``max_steps: null`` parsed and reached the Trainer as None
    (a ``TypeError`` mid-run, after the model had loaded). On the command line neither can be None."""
    parser = load_example(name).make_parser()
    line = error_line(capsys, parser, ["--config", config_file(tmp_path, f"{key}: null\n")])
    assert f"config file: {key}: null is not a value of this option" in line


def test_config_null_for_an_optional_option_is_kept(tmp_path):
    parser = load_example("sft").make_parser()
    script_args, _, _ = parse_script_args(parser, ["--config", config_file(tmp_path, "max_train_samples: null\n")])
    assert script_args.max_train_samples is None


def test_config_value_outside_the_choices_is_one_line(capsys, tmp_path):
    """``dtype: bfloat15`` parsed (argparse checks choices on the command line only) and failed when the model
    loaded; ``--dtype bfloat15`` was refused at once."""
    parser = load_example("math").make_parser()
    line = error_line(capsys, parser, ["--config", config_file(tmp_path, "dtype: bfloat15\n")])
    assert "config file: dtype: 'bfloat15' is not one of" in line
    _, _, model_args = load_example("math").make_parser().parse_args_and_config(
        ["--config", config_file(tmp_path, "dtype: bfloat16\n")])
    assert model_args.dtype == "bfloat16"


def test_config_flag_with_equals_sign_reads_the_file(tmp_path):
    """``--config=file.yaml`` (the form every other flag accepts) was an unknown argument "(did you mean
    --fsdp_config?)"; it now reads the file, and a flag given on the command line still wins over it."""
    path = config_file(tmp_path, "max_steps: 7\nlearning_rate: 0.5\n")
    _, args, _ = parse_script_args(load_example("sft").make_parser(), [f"--config={path}", "--max_steps", "3"])
    assert (args.max_steps, args.learning_rate) == (3, 0.5)


@pytest.mark.parametrize("argv", [["--config", "/no/such/config.yaml"], ["--config"]])
def test_unreadable_or_missing_config_file_is_one_line(capsys, argv):
    """A missing file was a ``FileNotFoundError`` traceback, ``--config`` without a file an ``IndexError`` one."""
    line = error_line(capsys, load_example("sft").make_parser(), argv)
    assert "/no/such/config.yaml" in line or "--config needs a file" in line


def test_eval_config_flag_with_equals_sign(capsys, tmp_path):
    path = config_file(tmp_path, "max_problemz: 1\n")
    assert main(["eval", f"--config={path}"]) == 2
    err = capsys.readouterr().err
    assert "config file: unknown key(s): max_problemz (did you mean max_problems?)" in err, err


def test_every_trainer_tags_its_cards_alike():
    """The SFT card was tagged trl-diffusion, TraceRL's and the value model's trl_diffusion: one Hub tag for all."""
    from trl_diffusion.trainers import DiffusionSFTTrainer, TraceRLTrainer
    from trl_diffusion.value import DiffusionValueTrainer

    for trainer in (DiffusionSFTTrainer, TraceRLTrainer, DiffusionValueTrainer):
        assert {"trl", "diffusion", "trl-diffusion"} <= set(trainer._tag_names), trainer.__name__
