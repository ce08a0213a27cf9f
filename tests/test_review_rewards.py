"""Regression tests from an adversarial review of the rewards and the evaluation loaders: each one failed before the
fix it guards."""

import json
import pickle
import threading

import pytest

from trl_diffusion.cli import main
from trl_diffusion.eval import load_eval_problems
from trl_diffusion.rewards import MathAccuracyReward


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ------------------------------------------------------------------------------------------------ eval datasets


def test_a_later_row_without_the_formats_column_is_a_clear_error(tmp_path, capsys):
    """The format is detected from the first row; a later row without its column was a bare KeyError (a traceback
    from ``trl-diffusion eval``)."""
    path = _write_jsonl(tmp_path / "gap.jsonl", [{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?"}])
    with pytest.raises(ValueError, match=r"row 1 has no 'answer' column.*'problem_answer'"):
        load_eval_problems(path)
    assert main(["eval", "--dataset", path, "--progress", "false", "--output_dir", ""]) == 2
    assert "row 1 has no 'answer' column" in capsys.readouterr().err


def test_a_one_problem_file_whose_row_holds_a_list_of_objects(tmp_path):
    """A single JSON object is one problem when it is in a known format, even if one of its fields is a list of
    objects; it used to be taken for a ``{"rows": [...]}`` wrapper and that field read as the problems."""
    row = {"problem": "1+1?", "answer": "2", "hints": [{"level": 1, "text": "add"}]}
    for path in (_write_jsonl(tmp_path / "one.jsonl", [row]), str(tmp_path / "one.json")):
        (tmp_path / "one.json").write_text(json.dumps(row))
        _, problems = load_eval_problems(path)
        assert [(p.task, p.answer) for p in problems] == [("math", "2")]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"rows": [row, dict(row, answer="4")]}))
    assert [p.answer for p in load_eval_problems(str(wrapped))[1]] == ["2", "4"]


def test_a_split_or_config_for_a_local_file_is_an_error(tmp_path):
    """``dataset_test_split`` / ``dataset_config`` select within a Hub dataset; for a local file (or the built-in
    task) they were silently ignored and the whole file evaluated."""
    path = _write_jsonl(tmp_path / "math.jsonl", [{"problem": "1+1?", "answer": "2"}])
    with pytest.raises(ValueError, match=r"dataset_test_split='train'.*Hub datasets only.*local file"):
        load_eval_problems(path, split="train")
    with pytest.raises(ValueError, match=r"dataset_config='main'.*built-in task"):
        load_eval_problems("arithmetic", config="main")
    assert len(load_eval_problems(path)[1]) == 1


# ------------------------------------------------------------------------------------------------ math reward


def _in_thread(fn, limit=300.0):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), "the reward hung in a worker thread"
    return out["value"]


def test_math_reward_off_the_main_thread_cannot_be_hung_by_a_short_answer():
    """math-verify's timeouts only work in the main thread; a 13-character power tower used to hang the reward
    for good when called from any other thread (the length cap does not bound it)."""
    reward = MathAccuracyReward(parsing_timeout=1, verify_timeout=1)
    try:
        completions = [r"\boxed{9^{9^{9^{9}}}}", r"\boxed{\frac{1}{2}}", "The final answer is 18.", r"\boxed{19}"]
        golds = ["18", "0.5", "18", "18"]
        assert _in_thread(lambda: reward(completions, answer=golds)) == [0.0, 1.0, 1.0, 0.0]
        assert reward.worker is not None and reward.worker.pid is not None  # checked in the child, which is alive
        # The main thread keeps math-verify's own timeouts and gives the same scores without a child.
        assert reward(completions[1:], answer=golds[1:]) == [1.0, 1.0, 0.0]
        assert pickle.loads(pickle.dumps(reward))(completions[1:2], answer=golds[1:2]) == [1.0]
    finally:
        reward.close()
