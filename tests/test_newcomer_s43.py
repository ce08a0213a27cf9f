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


# ------------------------------------------------------------------------------------------ a released-format run


def test_tracerl_refuses_chat_prompts_for_a_tokenizer_without_a_chat_template(tmp_path):
    """A base model's tokenizer has no chat template: TRL's rollout failed on chat-message prompts at the first batch
    (a traceback steps into training); the trainer refuses them when it is built, naming the dataset."""
    from datasets import Dataset

    from trl_diffusion.testing import build_tokenizer, tiny_model
    from trl_diffusion.trainers.tracerl_config import TraceRLConfig
    from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, report_to="none", use_cpu=True, bf16=False, max_steps=1)
    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1+2?"}]] * 4})
    text = Dataset.from_dict({"prompt": ["What is 1+2?"] * 4})
    with pytest.raises(ValueError, match="the eval dataset's prompts are chat messages, but the tokenizer has no chat "
                                         "template"):
        TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=text, eval_dataset=chat, processing_class=tokenizer)
    TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                   train_dataset=text, processing_class=tokenizer)  # text prompts need no template


def test_the_math_example_on_a_base_model_asks_for_a_prompt_template(tmp_path, capsys):
    folder = tmp_path / "base"
    shutil.copytree(EMBEDDED_MODEL, folder)
    (folder / "chat_template.jinja").unlink()  # a base model: no chat template
    data = tmp_path / "math.jsonl"
    data.write_text('{"question": "What is 1+1?", "answer": "2"}\n' * 8)
    module = load_example("math")
    with pytest.raises(SystemExit) as exit_:
        run_script(module.main, module.make_parser("math.py"),
                   ["--model_name_or_path", str(folder), "--dataset_name", str(data), "--use_cpu", "true",
                    "--output_dir", str(tmp_path / "out")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == "math.py: error: " + (  # after the loading bars
        "the tokenizer has no chat template (a base model's), and without --prompt_template the questions become chat "
        "messages: pass --prompt_template with {question} in it, e.g. $'Question: {question}\\nAnswer:'.")


def test_a_prompt_preset_of_another_family_is_named(caplog):
    from trl_diffusion.eval.datasets import PRESET_MODEL_TYPES, PROMPT_PRESETS
    from trl_diffusion.eval.evaluate import _warn_other_family_preset

    assert PRESET_MODEL_TYPES.keys() == PROMPT_PRESETS.keys()  # every preset says which family it is for
    with caplog.at_level("WARNING", logger="trl_diffusion.eval.evaluate"):
        _warn_other_family_preset("dllm_rl_sdar", "llada")
        _warn_other_family_preset("dllm_rl_sdar_think", "sdar_moe")  # its own family: no warning
        _warn_other_family_preset("dllm_rl_dream", "Dream")
        _warn_other_family_preset("Question: {question}", "llada")  # not a preset
    assert [r.getMessage() for r in caplog.records] == [
        "prompt_template 'dllm_rl_sdar' is dLLM-RL's prompt for sdar / sdar_moe models, with their chat markup, but "
        "the model is a llada model: its preset is dllm_rl_llada."]
