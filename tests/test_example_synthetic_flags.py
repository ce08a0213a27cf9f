"""``examples/math.py`` without ``--dataset_name`` trains on the synthetic arithmetic task, which writes its own
prompts and has its own reward: a ``--prompt_template`` or ``--reward_funcs`` given there was silently unused. Both
now stop the run before anything loads, with one line (``<prog>: error: ...``, exit 2); with a dataset they parse."""

from __future__ import annotations

import pytest
from test_cli import load_example
from test_newcomer_audit import error_line

from trl_diffusion.scripts.utils import parse_script_args


@pytest.mark.parametrize(("argv", "message"), [
    (["--prompt_template", "Q: {question}"], "prompt_template applies to a math dataset (--dataset_name)"),
    (["--reward_funcs", "official_math_reward"], "['official_math_reward'] apply to a math dataset (--dataset_name)"),
])
def test_dataset_flags_on_the_synthetic_task_are_refused(capsys, argv, message):
    parser = load_example("math").make_parser()
    assert message in error_line(capsys, parser, argv)


def test_the_same_flags_parse_with_a_dataset(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    parser = load_example("math").make_parser()
    script_args, _, _ = parse_script_args(parser, ["--dataset_name", str(data), "--prompt_template", "Q: {question}",
                                                   "--reward_funcs", "official_math_reward", "--use_cpu", "true"])
    assert script_args.reward_funcs == ["official_math_reward"]
    assert script_args.prompt_template == "Q: {question}"
    script_args, _, _ = parse_script_args(parser, ["--reward_funcs", "math_accuracy_reward", "--use_cpu", "true"])
    assert script_args.dataset_name is None  # the default reward, named: nothing is ignored that was asked for


@pytest.mark.parametrize("script", ["sft", "tracerl_math", "tracerl_code"])
def test_dataset_selection_flags_without_a_dataset_are_refused(script, capsys):
    """They were ignored: the synthetic task trained as if they were not given (exit status 0, not a word)."""
    import importlib

    parser = importlib.import_module(f"trl_diffusion.scripts.{script}").make_parser()
    common = ["--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--dataset_config", "main", "--dataset_test_split", "dev", *common])
    assert exit_info.value.code == 2
    assert "--dataset_config main, --dataset_test_split dev: these select within a dataset (--dataset_name)" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_script_args(parser, ["--dataset_train_split", "train[:10]", *common])
    parse_script_args(parser, ["--dataset_train_split", "train", *common])  # the default, said aloud: fine
