"""The examples default their sizes for the embedded tiny model (16-token completions, learning rate 1e-4, ...). A run
on another model that keeps them says so on stderr before anything loads; the embedded model, explicit values and the
recipes do not."""

import shutil
from pathlib import Path

import pytest
from example_scripts import load_example

from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.command_line import check_config_values, command_line_options
from trl_diffusion.scripts.utils import embedded_defaults_in_use, example_defaults, run_script
from trl_diffusion.testing import tiny_model

ROOT = Path(__file__).parent.parent
RECIPES = sorted((ROOT / "trl_diffusion" / "recipes").glob("*.yaml"))
CPU = ["--use_cpu", "true", "--bf16", "false", "--tf32", "false"]
NO_CHECKPOINTS = ["--save_strategy", "no", "--gradient_checkpointing", "false"]  # chosen: not named


def example_parser(name: str):
    return load_example(name).make_parser()


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """A model directory that is neither the embedded model nor trained from it: a tiny SDAR of another shape (the
    check reads its config.json, not the weights)."""
    folder = tmp_path_factory.mktemp("other") / "model"
    tiny_model("sdar").config.save_pretrained(folder)
    return str(folder)


def kept(name: str, argv: list[str]) -> list[str]:
    """What ``run_script`` names: the example's defaults still in use, less the options the command line or the config
    file sets."""
    parser = check_config_values(example_parser(name))
    defaults = example_defaults(parser)
    parsed = parser.parse_args_and_config(args=[*argv, *CPU])
    return embedded_defaults_in_use(defaults, parsed,
                                    command_line_options(parser, [*argv, *CPU]) | parser.config_file_keys)


@pytest.mark.parametrize("name,expected", [
    ("math", ["max_completion_length=16", "learning_rate=0.0001", "per_device_train_batch_size=64", "beta=0.0",
              "max_steps=60"]),
    ("code", ["max_completion_length=16", "learning_rate=0.0001", "per_device_train_batch_size=64", "beta=0.0",
              "max_steps=40"]),
    ("sft", ["max_length=64", "learning_rate=0.0005", "per_device_train_batch_size=32", "max_steps=200"]),
])
def test_another_model_with_the_tiny_sizes_is_named(other_model, name, expected):
    """Sizes, and TraceRL's KL off, a toy run's length, no checkpoints, no activation checkpointing and no bf16
    (``--bf16 false`` is given here: not named)."""
    expected = [*expected, "save_strategy=no", "gradient_checkpointing=False"]
    assert sorted(kept(name, ["--model_name_or_path", other_model])) == sorted(expected)
    parser = example_parser(name)
    parsed = parser.parse_args_and_config(args=["--model_name_or_path", other_model, "--use_cpu", "true"])
    assert "bf16=False" in embedded_defaults_in_use(example_defaults(parser), parsed)  # the example's default
    assert kept(name, []) == []  # the embedded model: these are its sizes
    assert kept(name, ["--model_name_or_path", str(EMBEDDED_MODEL)]) == []


def test_a_model_trained_from_the_embedded_one_keeps_its_sizes_quietly(tmp_path):
    """What an example saves from the embedded model (``outputs/math``: its config, other weights) is trained on with
    the same sizes: no warning (before, it counted as another model)."""
    trained = tmp_path / "outputs" / "math"
    shutil.copytree(EMBEDDED_MODEL, trained, ignore=shutil.ignore_patterns("*.safetensors"))
    for name in ("math", "code", "sft"):
        assert kept(name, ["--model_name_or_path", str(trained)]) == []


def test_explicit_values_are_not_named(other_model):
    """Also an explicit value equal to the example's default: the user chose it (it was named before)."""
    assert kept("math", ["--model_name_or_path", other_model, "--max_completion_length", "512",
                         "--learning_rate", "1e-6", "--per_device_train_batch_size", "8", "--beta", "0.04",
                         "--max_steps", "100", *NO_CHECKPOINTS]) == []
    assert kept("math", ["--model_name_or_path", other_model, "--learning_rate", "1e-6", "--beta", "0.0",
                         "--max_steps", "60", *NO_CHECKPOINTS]) == [
        "max_completion_length=16", "per_device_train_batch_size=64"]


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_the_recipes_set_their_own_sizes(recipe):
    name = "sft" if "sft" in recipe.stem else "code" if "code" in recipe.stem else "math"
    assert kept(name, ["--config", str(recipe)]) == []


def test_run_script_warns_on_stderr_before_main(other_model, capsys):
    parser = example_parser("math")
    seen = []
    run_script(lambda *parsed: seen.append(capsys.readouterr().err), parser,
               ["--model_name_or_path", other_model, "--max_completion_length", "256", "--beta", "0.01",
                "--max_steps", "10", *NO_CHECKPOINTS, *CPU])
    assert ": warning: learning_rate=0.0001, per_device_train_batch_size=64 are this example's defaults" \
        in seen[0]
    run_script(lambda *parsed: seen.append(capsys.readouterr().err), parser,
               ["--model_name_or_path", other_model, "--max_completion_length", "256", "--beta", "0.01",
                "--max_steps", "10", "--learning_rate", "1e-6", *NO_CHECKPOINTS, *CPU])
    assert ": warning: per_device_train_batch_size=64 is this example's default for" in seen[1]
    run_script(lambda *parsed: seen.append(capsys.readouterr().err), parser, CPU)
    assert "warning" not in seen[2]


@pytest.mark.parametrize("name", ["math", "code", "sft"])
def test_another_model_on_the_synthetic_task_is_named(other_model, name, capsys):
    """``--config sdar_4b_long_cot_sft`` without the ``--dataset_name`` its header asks for trained
    SDAR-4B-Chat on the synthetic 3-digit arithmetic, silently (the recipe sets every size, so nothing warned)."""
    seen = []
    record = lambda *parsed: seen.append(capsys.readouterr().err)  # noqa: E731
    sizes = {"sft": ["--max_length", "256", "--learning_rate", "1e-5", "--per_device_train_batch_size", "2",
                     "--max_steps", "10"]}.get(
        name, ["--max_completion_length", "64", "--learning_rate", "1e-6", "--per_device_train_batch_size", "8",
               "--beta", "0.01", "--max_steps", "10"]) + NO_CHECKPOINTS
    run_script(record, example_parser(name), ["--model_name_or_path", other_model, *sizes, *CPU])
    assert f": warning: no --dataset_name: {other_model} trains on the synthetic arithmetic task" in seen[0]
    data = Path(other_model).parent / "data.jsonl"
    data.write_text('{"prompt": "1+1=", "completion": "2", "answer": "2"}\n')
    run_script(record, example_parser(name), ["--model_name_or_path", other_model, "--dataset_name", str(data),
                                             *sizes, *CPU])
    run_script(record, example_parser(name), CPU)  # the embedded model: its own task
    assert "warning" not in seen[1] and "warning" not in seen[2]


def test_a_config_file_and_a_launch_precision_are_the_users_choice(other_model, tmp_path, monkeypatch):
    """Values a user's own ``--config`` file sets, equal to the example's defaults or not, are not named; nor is
    ``bf16`` when the launch sets the mixed precision (``accelerate launch --mixed_precision bf16``), which
    transformers then follows."""
    config = tmp_path / "mine.yaml"
    config.write_text(f"model_name_or_path: {other_model}\nbeta: 0.0\nmax_completion_length: 16\nsave_strategy: 'no'\n"
                      "gradient_checkpointing: false\n")
    assert sorted(kept("math", ["--config", str(config)])) == [
        "learning_rate=0.0001", "max_steps=60", "per_device_train_batch_size=64"]
    parser = example_parser("math")
    parsed = parser.parse_args_and_config(args=["--model_name_or_path", other_model, "--use_cpu", "true"])
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert "bf16=False" not in embedded_defaults_in_use(example_defaults(parser), parsed)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert "bf16=False" in embedded_defaults_in_use(example_defaults(parser), parsed)
