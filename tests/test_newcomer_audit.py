"""The example scripts' arguments a newcomer gets wrong or passes in another documented form: each either works or
stops the run before anything is loaded, with one line naming the problem (``<prog>: error: ...``, exit 2)."""

from __future__ import annotations

import json

import numpy
import pytest
from test_cli import load_example

from trl_diffusion.data import load_training_dataset
from trl_diffusion.rewards import official_math_reward
from trl_diffusion.scripts.utils import find_reward, parse_script_args


def error_line(capsys, parser, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, argv)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if ": error: " in line]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("reward", "message"), [
    ("official_math_rewrd", "no reward function 'official_math_rewrd' in trl_diffusion.rewards (did you mean "
                            "official_math_reward?)"),
    ("no_such_module_here.reward", "cannot import 'no_such_module_here'"),
])
def test_a_mistyped_reward_name_is_one_line_before_loading(capsys, tmp_path, reward, message):
    """Before the fix a mistyped ``--reward_funcs`` name was an ``AttributeError`` / ``ModuleNotFoundError``
    traceback after the model and the dataset had loaded (minutes for a recipe's 4B model)."""
    data = tmp_path / "math.jsonl"  # reward_funcs apply to a dataset (on the synthetic task they are refused)
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    parser = load_example("math").make_parser()
    assert message in error_line(capsys, parser, ["--dataset_name", str(data), "--reward_funcs", reward])
    assert find_reward("official_math_reward") is official_math_reward
    assert find_reward("trl_diffusion.rewards.official_math_reward") is official_math_reward


@pytest.mark.parametrize("name", ["math", "sft"])
def test_num_eval_zero_is_one_line_before_loading(capsys, name):
    """Before the fix ``--num_eval 0`` loaded the model, built the trainer and failed in the callback with a
    traceback ("no problems to evaluate")."""
    parser = load_example(name).make_parser()
    assert "num_eval must be >= 1" in error_line(capsys, parser, ["--num_eval", "0"])


def test_prompt_template_without_the_question_is_refused(capsys):
    """A template without ``{question}`` made every prompt the same text (nothing to learn), silently."""
    parser = load_example("math").make_parser()
    assert "prompt_template must contain {question}" in error_line(capsys, parser, ["--prompt_template", "Solve."])


@pytest.mark.parametrize("flag", ["--dataset_streaming", "--ignore_bias_buffers"])
def test_script_argument_flags_the_examples_ignore_are_refused(capsys, flag):
    """TRL's ``ScriptArguments`` flags that no example applies: before, ``--dataset_streaming true`` parsed and
    loaded the whole dataset anyway."""
    parser = load_example("sft").make_parser()
    assert f"{flag}: not used by the example scripts" in error_line(capsys, parser, [flag, "true"])


def test_math_dataset_takes_a_conversational_prompt_column(tmp_path):
    """A local file in TRL's conversational format (``prompt`` = chat messages): before, ``TypeError: can only
    concatenate list (not "str") to list``. Its messages are kept, the instruction appended to the last user turn."""
    path = tmp_path / "conv.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 1+1?"}],
             "answer": 2}]
    path.write_text("\n".join(json.dumps(row) for row in rows))
    math = load_example("math")
    dataset = math.math_dataset(str(path), None, "train")
    assert str(dataset[0]["answer"]) == "2"
    assert dataset[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "What is 1+1?" + math.INSTRUCTION}]
    with pytest.raises(ValueError, match="prompt_template needs the question as text"):
        math.math_dataset(str(path), None, "train", prompt_template="Q: {question}")


def test_a_local_dataset_path_may_start_with_a_tilde(tmp_path, monkeypatch):
    """``check_script_args`` accepted ``~/data.jsonl`` (it expands ``~`` to check the file exists) but the loader
    passed it to ``datasets`` as written: ``FileNotFoundError: Unable to find '<cwd>/~/data.jsonl'``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "What is 1+1?\n", "completion": "2"}) + "\n")
    assert load_training_dataset("~/data.jsonl")[0] == {"prompt": "What is 1+1?\n", "completion": "2"}


@pytest.mark.parametrize(("reward", "message"), [
    ("MathAccuracyReward", "no reward function 'MathAccuracyReward' in trl_diffusion.rewards (a class or factory"),
    ("make_code_reward", "no reward function 'make_code_reward' in trl_diffusion.rewards (a class or factory"),
    ("math_reward", "give one of math_accuracy_reward, official_math_reward"),
    ("trl_diffusion.rewards.make_code_reward", "no reward function 'make_code_reward' in trl_diffusion.rewards"),
    ("collections.OrderedDict", "collections.OrderedDict is a class, not a reward function"),
])
def test_a_reward_class_or_factory_is_refused_before_loading(capsys, tmp_path, reward, message):
    """``--reward_funcs MathAccuracyReward`` (or a ``make_*`` factory) passed the check, loaded the model, then failed
    at the first rollout with a TypeError traceback; ``math_reward`` (a submodule) got "did you mean math_reward?"."""
    data = tmp_path / "math.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n')
    parser = load_example("math").make_parser()
    line = error_line(capsys, parser, ["--dataset_name", str(data), "--reward_funcs", reward])
    assert message in line and "did you mean math_reward?" not in line


def test_math_dataset_float_answers_are_scored_as_the_numbers_they_are(tmp_path):
    """A float answer column (parquet / JSON numbers): str() wrote 1e-05, which math-verify reads with e = Euler's
    number, so the right answer 0.00001 scored 0 (and 'e - 5' scored 1)."""
    from fractions import Fraction

    from trl_diffusion.rewards import gold_text, math_accuracy_reward

    path = tmp_path / "floats.jsonl"
    path.write_text("\n".join(json.dumps({"question": q, "answer": a})
                              for q, a in [("tiny?", 1e-05), ("huge?", 1e16), ("plain?", 18.0)]))
    golds = list(load_example("math").math_dataset(str(path), None, "train")["answer"])  # datasets keeps floats
    right = [r"\boxed{0.00001}", r"\boxed{10000000000000000}", r"\boxed{18}"]
    assert math_accuracy_reward(right, answer=golds) == [1.0, 1.0, 1.0]
    assert math_accuracy_reward([r"\boxed{e - 5}"], answer=[1e-05]) == [0.0]
    # a float32 parquet column's 1e-05 and 0.3 come back as 9.999999747378752e-06 and 0.30000001192092896
    single = [float(numpy.float32(1e-05)), float(numpy.float32(0.3))]
    assert math_accuracy_reward([r"\boxed{0.00001}", r"\boxed{0.3}"], answer=single) == [1.0, 1.0]
    # whole numbers keep every digit (an int column with a missing value is float64), fractions their form
    assert math_accuracy_reward([r"\boxed{17592186044416}", r"\boxed{17592186000000}"],
                                answer=[17592186044416.0] * 2) == [1.0, 0.0]
    assert gold_text(Fraction(1, 2**24)) == "1/16777216" and gold_text(2.0**53) == "9007199254740992.0"


def test_math_dataset_appends_the_instruction_to_content_parts(tmp_path):
    """A user message whose content is a list of parts ({"type": "text", ...}): `content += INSTRUCTION` failed, and
    the parts given to the chat template as a list rendered as an empty prompt on the Qwen templates: joined."""
    path = tmp_path / "parts.jsonl"
    path.write_text(json.dumps({"prompt": [{"role": "user", "content": [{"type": "text", "text": "What is 1+1?"}]}],
                                "answer": "2"}))
    math = load_example("math")
    content = math.math_dataset(str(path), None, "train")[0]["prompt"][0]["content"]
    assert content == "What is 1+1?" + math.INSTRUCTION
