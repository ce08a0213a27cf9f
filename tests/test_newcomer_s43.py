"""What a docs-vs-code audit found the commands doing otherwise than the docs say: a folder that holds no model (a
traceback per process after the launch), and a recipe given to another ``examples/<name>.py`` (only ``trl-diffusion
<command>`` refused it: ``examples/math.py --config diffucoder_7b_coupled_code`` went on to load a 7B model)."""

from __future__ import annotations

import json
import shutil

import pytest
from example_scripts import load_example
from test_cli import one_line_error
from test_cli_launch import launches, not_launched  # noqa: F401 (fixtures)

from trl_diffusion.assets import EMBEDDED_MODEL, check_model_folder
from trl_diffusion.cli import main
from trl_diffusion.scripts.utils import run_script


def run(argv: list[str]) -> int:
    """``trl-diffusion <argv>``'s exit status: what ``main`` returns, or the status a script's parsing exits with."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_a_folder_without_a_model_is_one_line_naming_the_subfolders_that_hold_one(tmp_path, capsys,
                                                                                 launches):  # noqa: F811
    outputs = tmp_path / "outputs"
    shutil.copytree(EMBEDDED_MODEL, outputs / "math")
    (outputs / "sft" / "checkpoint-2").mkdir(parents=True)
    (outputs / "sft" / "checkpoint-2" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (outputs / "runs").mkdir()  # no model in it
    for command in ("math", "sft", "code"):
        assert run([command, "--model_name_or_path", str(outputs), "--max_steps", "1"]) == 2
        assert one_line_error(capsys, f"trl-diffusion {command}").endswith(
            f"{outputs} holds no model: no config.json, and no adapter_config.json of a PEFT adapter; these "
            "subfolders do: math.")
    assert run(["math", "--value_model", str(outputs / "runs"), "--max_steps", "1"]) == 2
    assert one_line_error(capsys, "trl-diffusion math").endswith(
        "runs holds no model: no config.json, and no adapter_config.json of a PEFT adapter.")
    assert run(["eval", "--model_name_or_path", str(outputs / "sft"), "--max_problems", "1", "--output_dir", ""]) == 2
    assert "sft holds no model: no config.json, and no adapter_config.json of a PEFT adapter; these subfolders do: " \
        "checkpoint-2." in one_line_error(capsys, "trl-diffusion eval")
    assert launches == []
    check_model_folder(str(outputs / "math"))  # a model
    check_model_folder(str(outputs / "sft" / "checkpoint-2"))  # an adapter
    check_model_folder("JetLM/TraDo-4B-Instruct")  # a Hub id: the cache check decides
    assert run(["math", "--model_name_or_path", str(outputs / "math"), "--max_steps", "1"]) == 0
    assert len(launches) == 1


@pytest.mark.parametrize(("command", "recipe", "its_command"), [("sft", "trado_4b_tracerl_math", "math"),
                                                               ("math", "diffucoder_7b_coupled_code", "code")])
def test_an_example_refuses_a_recipe_of_another_command(capsys, command, recipe, its_command):
    module = load_example(command)
    with pytest.raises(SystemExit) as exit_:
        run_script(module.main, module.make_parser(f"{command}.py"), ["--config", recipe])
    assert exit_.value.code == 2
    assert one_line_error(capsys, f"{command}.py").endswith(
        f"--config {recipe} is a recipe of trl-diffusion {its_command} (examples/{its_command}.py), not of "
        f"trl-diffusion {command}: run trl-diffusion {its_command} --config {recipe}.")
