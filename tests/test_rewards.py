"""Tests for the reward functions (math, format, code) on small fixtures copied from the real datasets."""

import decimal
import json
import pickle
import threading
from pathlib import Path

import numpy
import pytest

from trl_diffusion.rewards import (
    boxed_format_reward,
    build_tests,
    code_execution_reward,
    completion_to_text,
    extract_code,
    extract_gold_answer,
    gold_text,
    last_boxed_content,
    make_code_reward,
    math_accuracy_reward,
    think_format_reward,
)
from trl_diffusion.rewards.format_reward import ThinkFormatReward
from trl_diffusion.rewards.math_reward import MathAccuracyReward

FIXTURES = Path(__file__).parent / "fixtures" / "rewards"
TRL_KWARGS = {
    "prompts": ["p"],
    "completion_ids": [[1, 2]],
    "trainer_state": None,
    "log_extra": lambda name, values: None,
    "log_metric": lambda name, value: None,
}


def load(name):
    with open(FIXTURES / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def as_chat(texts):
    return [[{"role": "assistant", "content": t}] for t in texts]


# ---------------------------------------------------------------------------------------------------- shared helpers


def test_completion_to_text_shapes():
    assert completion_to_text("plain") == "plain"
    assert completion_to_text([{"role": "assistant", "content": "chat"}]) == "chat"
    parts = [{"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert completion_to_text(parts) == "ab"
    assert completion_to_text([{"role": "user", "content": "q"}, {"role": "assistant", "content": "x"}]) == "x"
    assert completion_to_text(None) == ""


def test_last_boxed_content():
    assert last_boxed_content(r"\boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed_content(r"\boxed{\{1, 2\}}") == r"\{1, 2\}"
    assert last_boxed_content(r"so \fbox{204}") == "204"
    assert last_boxed_content(r"\boxed{3} and finally \boxed{4") is None  # the last box is unclosed
    assert last_boxed_content("no box") is None


def test_last_boxed_content_skips_an_unbalanced_escaped_brace():
    """An escaped brace is a literal, not a delimiter, also when it has no partner: ``\\}`` inside the box and
    ``\\left\\{ ... \\right.`` (a piecewise function) must neither close the box early nor keep it open."""
    assert last_boxed_content(r"x \boxed{a\}}") == r"a\}"
    assert last_boxed_content(r"\boxed{\left\{ x \right.}") == r"\left\{ x \right."


# -------------------------------------------------------------------------------------------------------------- math


def test_math500_solutions_match_answers():
    rows = load("math500_sample.jsonl")
    answers = [r["answer"] for r in rows]
    assert math_accuracy_reward([r["solution"] for r in rows], answer=answers) == [1.0] * len(rows)
    assert math_accuracy_reward(as_chat([r["solution"] for r in rows]), answer=answers, **{}) == [1.0] * len(rows)
    # Gold taken from the solution column's last box when there is no answer column.
    preds = [f"The answer is $\\boxed{{{a}}}$." for a in answers]
    assert math_accuracy_reward(preds, solution=[r["solution"] for r in rows]) == [1.0] * len(rows)
    # Shifted answers are wrong.
    assert math_accuracy_reward(preds[1:] + preds[:1], answer=answers) == [0.0] * len(rows)


def test_gsm8k_hash_gold():
    rows = load("gsm8k_sample.jsonl")
    golds = [r["answer"] for r in rows]
    numbers = [g.rsplit("####", 1)[1].strip() for g in golds]
    completions = [f"Step by step... so the total is \\boxed{{{n}}}." for n in numbers]
    assert math_accuracy_reward(completions, answer=golds) == [1.0] * len(rows)
    assert math_accuracy_reward(completions[1:] + completions[:1], answer=golds) == [0.0] * len(rows)
    assert extract_gold_answer("a\n#### 1,234") == "1234"


def test_aime_answers_and_unboxed_predictions():
    rows = load("aime24_sample.jsonl")
    answers = [r["answer"] for r in rows]
    assert math_accuracy_reward([f"Thus \\boxed{{{a}}}" for a in answers], answer=answers) == [1.0] * len(rows)
    # Without a box, math-verify extracts LaTeX / plain numbers from the text.
    texts = ["The final answer is 18.", r"So $x = \frac12$.", "I don't know."]
    assert math_accuracy_reward(texts, answer=["18", r"\frac{1}{2}", "3"]) == [1.0, 1.0, 0.0]


def test_math_last_box_wins_and_missing_gold_is_none():
    rewards = math_accuracy_reward(
        [r"\boxed{3} no wait \boxed{4}", r"\boxed{4}", r"\boxed{4}"], answer=["4", "", None]
    )
    assert rewards == [1.0, None, None]
    assert math_accuracy_reward([r"\boxed{3} no wait \boxed{4"], answer=["3"]) == [0.0]  # truncated last box


def test_math_a_full_stop_inside_the_box_is_not_part_of_the_answer():
    """AIME-style solutions end with ``\\boxed{104.}``; math-verify alone reads that as no answer."""
    texts = [r"so \boxed{104.}", r"\boxed{\frac{1}{2} .}", r"\boxed{105.}", r"\boxed{3.5.}", r"\boxed{1, 2, \ldots}"]
    assert math_accuracy_reward(texts, answer=["104", r"\frac{1}{2}", "104", "3.5", "1"]) == [1.0, 1.0, 0.0, 1.0, 0.0]


def test_math_a_boxed_answer_longer_than_max_answer_chars_scores_zero():
    """``max_answer_chars`` bounds what math-verify (sympy) is asked to parse: a longer box scores 0.0 unparsed,
    even one that would match the gold answer (as it does under a larger limit)."""
    text = r"\boxed{1.000000000000}"  # 14 characters in the box
    assert MathAccuracyReward(max_answer_chars=100)([text], answer=["1"]) == [1.0]
    assert MathAccuracyReward(max_answer_chars=10)([text], answer=["1"]) == [0.0]


def test_gold_answer_takes_the_last_hash_mark_and_skips_a_field_with_an_unclosed_box():
    """GSM8K-style gold: the text after the LAST ``####``. A field whose box is never closed holds no usable answer:
    the next field (``solution`` after ``answer``) decides, and with none the row has no gold (``None``: not
    scored, rather than scored against the raw text ``\\boxed{12``)."""
    assert extract_gold_answer(None, "step #### 5 then #### 18") == "18"
    assert extract_gold_answer(r"\boxed{12", "#### 7") == "7"
    assert extract_gold_answer(None, r"so \boxed{12") is None


def test_gold_text_writes_a_float32_column_value_with_float32s_shortest_digits():
    """A float32 column's 2.861023e-06 reads back as the float64 2.86102294921875e-06, whose repr has exactly 15
    significant digits: ``gold_text`` promises float32's shortest digits from 15 digits on, written positionally
    (reference: the float32's repr through ``decimal``)."""
    value = float(numpy.float32(2.861023e-06))
    assert len(decimal.Decimal(repr(value)).normalize().as_tuple().digits) == 15  # the boundary case
    expected = format(decimal.Decimal(str(numpy.float32(value))), "f")
    assert expected == "0.000002861023"
    assert gold_text(value) == expected


def test_math_accepts_trl_kwargs_and_logs():
    logged = {}
    kwargs = dict(TRL_KWARGS, log_extra=lambda name, values: logged.setdefault(name, values))
    assert math_accuracy_reward([r"\boxed{18}"], answer=["18"], **kwargs) == [1.0]
    assert logged == {"math_gold": ["18"], "math_boxed_pred": ["18"]}


def test_math_in_worker_thread():
    """math-verify's signal-based timeout only works in the main thread; the reward must still work elsewhere."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", math_accuracy_reward([r"\boxed{2}"], answer=["2"])))
    thread.start()
    thread.join()
    assert out["r"] == [1.0]


def test_math_reward_pickles():
    reward = pickle.loads(pickle.dumps(MathAccuracyReward(parsing_timeout=2)))
    assert reward.__name__ == "math_accuracy_reward" and reward([r"\boxed{1}"], answer=["1"]) == [1.0]
    assert math_accuracy_reward.__name__ == "math_accuracy_reward"


# ------------------------------------------------------------------------------------------------------------ format


def test_boxed_format_reward():
    texts = [r"\boxed{1}", r"\boxed{1} and \boxed{2}", r"\boxed{}", r"\boxed{1", "none", r"\boxed{\frac{1}{2}}"]
    assert boxed_format_reward(texts, **TRL_KWARGS) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert boxed_format_reward(as_chat([r"\boxed{1}"])) == [1.0]


def test_boxed_format_reward_needs_a_box_that_shows_something():
    """A box that prints nothing (LaTeX spacing, phantoms, empty groups, invisible characters) scored 1.0 as a
    formatted answer (a red-team of the rewards)."""
    empty = [r"\boxed{\,}", r"\boxed{{}}", r"\boxed{\phantom{}}", "\\boxed{\u200b}", r"\boxed{\phantom{\frac{1}{2}}}",
             r"\boxed{ \quad \; ~ }", r"\boxed{\text{ }}", r"\boxed{{\hphantom{0}}\,}", "\\boxed{\ufeff\u00a0}"]
    shown = [r"\boxed{\alpha}", r"\boxed{\phantom{0}1}", r"\boxed{\text{A}}", r"\boxed{\{\}}", r"\boxed{-}",
             r"\boxed{\emptyset}", r"\boxed{x\,y}"]
    assert boxed_format_reward(empty) == [0.0] * len(empty)
    assert boxed_format_reward(shown) == [1.0] * len(shown)


def test_think_format_reward():
    texts = [
        "<think>reasoning</think>answer",
        "  <think>\nr\n</think>\n\\boxed{1}",
        "<think>r</think>",  # no answer
        "<think></think>answer",  # empty reasoning
        "x <think>r</think>answer",  # text before <think>
        "<think>a<think>b</think>answer",  # two opening tags
        "answer only",
    ]
    assert think_format_reward(texts, **TRL_KWARGS) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert think_format_reward(as_chat(texts[:1])) == [1.0]
    opened = ThinkFormatReward(prompt_opens_think=True)
    assert opened(["reasoning</think>answer", "<think>r</think>a"]) == [1.0, 0.0]
    assert pickle.loads(pickle.dumps(opened)).__name__ == "think_format_reward"


# -------------------------------------------------------------------------------------------------------------- code


def test_extract_code():
    text = "Here:\n```python\ndef f():\n    return 1\n```\nand finally\n```python\ndef f():\n    return 2\n```\n"
    assert extract_code(text) == "def f():\n    return 2\n"
    assert extract_code("```\nx = 1\n```") == "x = 1\n"
    assert extract_code("```python\nx = 1\n```\nOutput:\n```\n1\n```") == "x = 1\n"  # tagged block wins
    assert extract_code("```js\nlet x;\n```") is None
    assert extract_code("```python\nunterminated") is None
    assert extract_code("no code") is None


def test_extract_code_reads_any_line_ending_and_an_indented_fence():
    # a fence written with lone CRs was not found; one inside a Markdown list item kept its indent (IndentationError)
    assert extract_code("```python\rdef f():\r    return 1\r```") == "def f():\n    return 1\n"
    assert extract_code("```python\r\nx = 1\r\n```") == "x = 1\n"
    listed = "1. The code:\n   ```python\n   def f():\n       return 1\n   ```\n"
    assert extract_code(listed) == "def f():\n    return 1\n"
    # a fence at the start of its line keeps its lines as written: a body that continues a function header
    assert extract_code("```python\n    return x\n```") == "    return x\n"
    assert extract_code("Here: ```python\n  x = 1\n```") == "  x = 1\n"
    # code at the margin under an indented fence keeps its lines (its body lost the indentation it needs)
    margin = "    ```python\ndef f(x):\n    return x + 1\n    ```"
    compile(extract_code(margin), "margin", "exec")
    assert extract_code("  ```python\n  def f():\n\n      return 1\n  ```") == "def f():\n\n    return 1\n"
    # a line of a multi-line string may sit at the margin: the others still lose the fence's indent
    string = '1. Code:\n   ```python\n   def f():\n       return """a\nb"""\n   ```\n'
    assert extract_code(string) == 'def f():\n    return """a\nb"""\n'


def test_build_tests():
    assert build_tests(["assert f(1) == 1", " "]) == ["assert f(1) == 1"]
    check = "def check(c):\n    assert c(1) == 1"
    assert build_tests(test=check, entry_point="f") == [f"{check}\n\ncheck(f)\n"]
    assert build_tests() is None and build_tests([]) is None
    # A JSON-encoded list must be decoded: run as-is it would be a list literal that always "passes".
    assert build_tests('["assert f(1) == 2", "assert f(2) == 3"]') == ["assert f(1) == 2", "assert f(2) == 3"]
    assert build_tests("assert f(1) == 2") == ["assert f(1) == 2"]
    assert build_tests("[]") is None


def _fenced(code):
    return f"Solution:\n```python\n{code}\n```"


def test_code_reward_correct_wrong_and_partial():
    good = _fenced("def add(a, b):\n    return a + b")
    half = _fenced("def add(a, b):\n    return a + b if a else 0")
    tests = ["assert add(1, 2) == 3", "assert add(0, 5) == 5"]
    rows = {"tests": [tests] * 5}
    completions = [good, half, "no code at all", as_chat([good])[0], _fenced("syntax error(")]
    assert code_execution_reward(completions, **rows, **{**TRL_KWARGS, "prompts": ["p"] * 5}) == [
        1.0,
        0.0,
        0.0,
        1.0,
        0.0,
    ]
    partial = make_code_reward(timeout=10, partial_credit=True)
    assert partial(completions, **rows) == [1.0, 0.5, 0.0, 1.0, 0.0]


def test_code_reward_humaneval_style_and_missing_tests():
    test = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n"
    good, bad = _fenced("def square(x):\n    return x * x"), _fenced("def square(x):\n    return x + x")
    rewards = code_execution_reward([good, bad, good], test=[test, test, None], entry_point=["square"] * 3)
    assert rewards == [1.0, 0.0, None]


def test_code_reward_factory_pickles_and_names():
    reward = make_code_reward(timeout=30.0, memory_mb=256, partial_credit=True)
    clone = pickle.loads(pickle.dumps(reward))
    assert clone.__name__ == "code_execution_reward" and code_execution_reward.__name__ == "code_execution_reward"
    assert clone.limits.timeout == 30.0 and clone.limits.memory_mb == 256 and clone.partial_credit
    assert clone([_fenced("x = 1")], tests=[["assert x == 1"]]) == [1.0]


def test_code_reward_runs_concurrently(monkeypatch):
    """max_workers=4: the four sandboxes run at the same time. Each waits at a barrier until all four have started,
    so a serial reward cannot pass, however fast or loaded the machine (the timeout only bounds a hang)."""
    from trl_diffusion.rewards import code_reward

    barrier = threading.Barrier(4, timeout=60)
    run_tests = code_reward.run_tests

    def together(*args, **kwargs):
        barrier.wait()
        return run_tests(*args, **kwargs)

    monkeypatch.setattr(code_reward, "run_tests", together)
    reward = make_code_reward(timeout=30, max_workers=4)
    assert reward([_fenced("ok = True")] * 4, tests=[["assert ok"]] * 4) == [1.0] * 4


@pytest.mark.parametrize(
    "program",
    ["while True:\n    pass", "import os\nos._exit(0)", "import sys\nsys.exit(0)", "raise SystemExit(0)"],
    ids=["infinite-loop", "os-exit", "sys-exit", "system-exit"],
)
def test_code_reward_hostile_programs_score_zero(program):
    reward = make_code_reward(timeout=1.0, partial_credit=True)
    # tests any program that lets them run passes (`assert True` itself is refused as checking nothing)
    assert reward([_fenced(program)], tests=[["assert isinstance(1, int)", "assert len('ab') == 2"]]) == [0.0]


def test_code_reward_printed_fake_report_is_ignored():
    fake = 'print("\\n" + "0" * 32 + \'{"passed": 1, "errors": []}\')\nimport os\nos._exit(0)'
    assert make_code_reward(partial_credit=True)([_fenced(fake)], tests=[["assert isinstance(1, int)"]]) == [0.0]
