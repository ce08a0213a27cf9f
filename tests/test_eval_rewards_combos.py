"""Combination checks of the evaluation loop and of the rewards as TRL calls them: output files across runs, metrics
recomputed from the samples file, and test / gold columns that used to give credit no completion had earned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trl_diffusion.eval import evaluate, pass_at_k, problems_from_rows, score_completions
from trl_diffusion.rewards import (
    build_tests,
    code_execution_reward,
    extract_gold_answer,
    math_accuracy_reward,
    official_code_reward,
    official_math_reward,
)
from trl_diffusion.testing import build_tokenizer, tiny_model

ROWS = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(1, 4)]
PASS = "```python\npass\n```"
ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]


def _files(out: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(out.iterdir())}


def test_a_rerun_that_fails_at_its_first_batch_leaves_the_earlier_files_as_they_were(tmp_path):
    """The samples file was opened (truncated) before the first ``generate``: a re-run into the same output_dir that
    stopped there with a clear error (prompt + max_new_tokens beyond the model's positions) left an empty samples
    file beside the earlier run's metrics file, which still described the rows that were gone."""
    model, tokenizer = tiny_model("sdar", max_position_embeddings=64), build_tokenizer()
    common = dict(dataset=ROWS, model=model, tokenizer=tokenizer, prompt_template="{question}",
                  output_dir=str(tmp_path), progress=False)
    report = evaluate(max_new_tokens=8, **common)
    before = _files(tmp_path)
    assert len(before[Path(report["samples_file"]).name].splitlines()) == len(ROWS)
    with pytest.raises(ValueError, match="positions"):
        evaluate(max_new_tokens=80, **common)
    assert _files(tmp_path) == before


def test_a_run_that_fails_after_writing_rows_leaves_no_stale_metrics_file(tmp_path):
    """A re-run that broke off after some batches kept the earlier run's metrics file beside its own partial rows."""
    model, tokenizer = tiny_model("sdar", max_position_embeddings=64), build_tokenizer()
    common = dict(dataset=ROWS, model=model, tokenizer=tokenizer, prompt_template="{question}", max_new_tokens=8,
                  output_dir=str(tmp_path), progress=False, batch_size=1)
    report = evaluate(**common)
    generate, calls = model.generate, []

    def failing_generate(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("interrupted")
        return generate(*args, **kwargs)

    model.generate = failing_generate
    with pytest.raises(RuntimeError, match="interrupted"):
        evaluate(**common)
    assert not Path(report["metrics_file"]).exists()
    assert len(Path(report["samples_file"]).read_text().splitlines()) == 1


def test_metrics_equal_a_recomputation_from_the_samples_file(tmp_path):
    """num_samples > 1, sampling, a batch size that does not divide the work and an unscored row (a gold answer
    math-verify cannot parse): the printed metrics, the metrics file and the samples file agree."""
    rows = [*ROWS, {"question": "What is it?", "answer": "}{"}]
    model, tokenizer = tiny_model("sdar", max_position_embeddings=128), build_tokenizer()
    report = evaluate(dataset=rows, model=model, tokenizer=tokenizer, prompt_template="{question}", max_new_tokens=4,
                      num_samples=3, temperature=1.0, pass_k=[1, 2, 3], batch_size=5, output_dir=str(tmp_path),
                      progress=False)
    samples = [json.loads(line) for line in Path(report["samples_file"]).read_text().splitlines()]
    assert sorted((r["index"], r["sample"]) for r in samples) == [(i, s) for i in range(len(rows)) for s in range(3)]
    scored = [r["reward"] for r in samples if r["reward"] is not None]
    metrics = report["metrics"]
    assert metrics["num_unscored"] == 3 and metrics["num_scored"] == len(scored) == 9
    assert metrics["accuracy"] == pytest.approx(sum(scored) / len(scored))
    for k in (1, 2, 3):
        per_problem = [[r for r in samples if r["index"] == i] for i in range(len(ROWS))]
        expected = [pass_at_k(3, sum(bool(r["correct"]) for r in rs), k) for rs in per_problem]
        assert metrics[f"pass@{k}"] == pytest.approx(sum(expected) / len(expected))
    assert json.loads(Path(report["metrics_file"]).read_text()) == json.loads(json.dumps(report))


LITERAL_TESTS = str(ADD_TESTS)  # "['assert add(1, 2) == 3', ...]": what str(list), e.g. a CSV export, writes


def test_a_test_column_holding_a_python_list_literal_is_decoded():
    """A tests / test_list string written as a Python literal (not JSON) ran as one test, a list literal that always
    passes: ``pass`` scored 1.0 with the code reward, dLLM-RL's code reward and both eval graders."""
    assert build_tests(LITERAL_TESTS) == ADD_TESTS
    assert code_execution_reward([PASS, ADD], tests=[LITERAL_TESTS] * 2) == [0.0, 1.0]
    assert official_code_reward([PASS, ADD], test_method=["function"] * 2, test_list=[LITERAL_TESTS] * 2) == [0.0, 2.0]
    problems = problems_from_rows([{"question": "Add two numbers.", "test_method": "function",
                                    "test_list": LITERAL_TESTS}])
    assert problems[0].tests == ADD_TESTS
    for grader in ("sandbox", "official"):
        results = score_completions(problems * 2, [PASS, ADD], code_grader=grader)
        assert [r["reward"] for r in results] == [0.0, 1.0]


def test_a_humaneval_test_without_entry_point_is_an_error():
    """A HumanEval-style ``test`` (it defines ``check(candidate)``) in a row without an ``entry_point`` was run as it
    was: it defines check, calls nothing, and so passed every program (``pass`` scored 1.0)."""
    test = "def check(candidate):\n    assert candidate(1, 2) == 3\n"
    for entry_point in (None, [None], [""]):
        with pytest.raises(ValueError, match="entry_point"):
            code_execution_reward([PASS], test=[test], entry_point=entry_point)
    with pytest.raises(ValueError, match="entry_point"):
        problems_from_rows([{"prompt": "def add(a, b):\n", "test": test, "entry_point": ""}])
    assert code_execution_reward([PASS, ADD], test=[test] * 2, entry_point=["add"] * 2) == [0.0, 1.0]
    # a test that calls what it defines, or defines no check, needs no entry point
    assert code_execution_reward([ADD], test=[test + "check(add)\n"]) == [1.0]
    assert code_execution_reward([PASS, ADD], test=["assert add(1, 2) == 3\n"] * 2) == [0.0, 1.0]


@pytest.mark.parametrize("gold", ["\\boxed{}", "\\boxed{ }", "#### ", "The total is #### ", float("nan")])
def test_an_empty_gold_answer_is_no_gold(gold):
    """An empty box or nothing after ``####`` gave the gold answer ``""``: dLLM-RL's grader then scored the empty
    answer ``\\boxed{}`` 1.0, and eval accepted the row as having a gold answer. A missing value in a numeric column
    (NaN) gave the gold ``"nan"``, which ``\\boxed{nan}`` matched with both graders."""
    assert extract_gold_answer(answer=gold) is None
    assert extract_gold_answer(answer=gold, solution="7") == "7"  # the next field is read, as for an unclosed box
    completions = ["\\boxed{}", "\\boxed{7}", "\\boxed{nan}"]
    assert official_math_reward(completions, answer=[gold] * 3) == [None, None, None]
    assert math_accuracy_reward(completions, answer=[gold] * 3) == [None, None, None]
    with pytest.raises(ValueError, match="no usable gold answer"):
        problems_from_rows([{"question": "q", "answer": gold}])


def test_code_rewards_without_their_test_columns_are_an_error():
    """Passed none of their test columns (MBPP names them ``test_list``), the code rewards scored every row None: a
    TraceRL run logged reward None and trained nothing. The math rewards already raise for a missing gold column."""
    with pytest.raises(ValueError, match=r"code_execution_reward reads the tests .*\['test_list'\]"):
        code_execution_reward([ADD], test_list=[ADD_TESTS])
    with pytest.raises(ValueError, match=r"official_code_reward reads the test kind .*\['tests'\]"):
        official_code_reward([ADD], tests=[ADD_TESTS])
    assert code_execution_reward([ADD], tests=[None]) == [None]  # a row without tests scores None, as before
    with pytest.raises(ValueError, match=r"official_code_reward reads the test kind .*\['test_list'\]"):
        official_code_reward([ADD], test_list=[ADD_TESTS])  # its own columns count as passed (review)
