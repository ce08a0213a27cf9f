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
