r"""`code_tests` function rows whose `prefix` opens the answer's code block (dLLM-RL's files:
"```python\ndef f(x):\n"), evaluated with the default prompt (no `dllm_rl_*` preset).

Before, eval put that prefix, fence included, before the extracted code: every program was a SyntaxError and a
correct completion scored 0.0 under both code graders. Now the prefix's code (the `header`) is shown in the prompt and
goes before the code only when the two parse together; a prefix without a fence is put before the code as before.
"""

from __future__ import annotations

import json

import pytest

from trl_diffusion.eval.datasets import CODE_PROMPT, load_eval_problems, problems_from_rows
from trl_diffusion.eval.evaluate import score_completions

FENCED = "```python\ndef add(a, b):\n"
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]
RIGHT = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
WRONG = "```python\ndef add(a, b):\n    return a - b\n```"
GRADERS = ["sandbox", "official"]


def _row(prefix=FENCED, question="Add two numbers.", tests=TESTS):
    return {"question": question, "test_method": "function", "prefix": prefix, "test_time_limit": 1,
            "test_list": tests}


def _score(problem, completion, grader):
    return score_completions([problem], [completion], code_grader=grader)[0]


def test_fenced_prefix_is_shown_in_the_default_prompt_without_the_fence():
    (problem,) = problems_from_rows([_row()])
    assert problem.prefix == "" and problem.header == "def add(a, b):\n" and problem.response_prefix == ""
    assert problem.prompt.startswith("Add two numbers.\n\n")
    assert "```python\ndef add(a, b):\n```" in problem.prompt  # the header, in a closed block of its own
    assert problem.prompt.count("```python") == 2  # the header's block and the instruction's


@pytest.mark.parametrize("grader", GRADERS)
def test_fenced_prefix_with_default_prompt_scores_right_and_wrong_completions(grader):
    """The audit's repro: both graders gave 0.0 (SyntaxError on the fence) for the right completion."""
    (problem,) = problems_from_rows([_row()])
    right, wrong = _score(problem, RIGHT, grader), _score(problem, WRONG, grader)
    assert right["reward"] == 1.0 and right["tests_passed"] == 2, right
    assert wrong["reward"] == 0.0 and wrong["tests_passed"] == 0, wrong
    assert not any("SyntaxError" in e for e in wrong["errors"]), wrong


def test_a_completion_that_continues_the_header_gets_it_put_before_its_code():
    """Only the body in the block: header + body is the function (`sandbox` keeps the block's indentation)."""
    (problem,) = problems_from_rows([_row()])
    assert _score(problem, "```python\n    return a + b\n```", "sandbox")["reward"] == 1.0
    assert _score(problem, "```python\n    return a * b\n```", "sandbox")["reward"] == 0.0


@pytest.mark.parametrize("grader", GRADERS)
def test_a_complete_header_keeps_its_imports_for_a_completion_that_restates_the_function(grader):
    """A HumanEval-like prefix (imports, signature, docstring) parses with the whole function after it."""
    prefix = '```python\nfrom typing import List\n\n\ndef add(a: List[int], b: int) -> int:\n    """Add."""\n'
    (problem,) = problems_from_rows([_row(prefix, tests=["assert add([1], 2) == 3"])])
    assert problem.header.startswith("from typing import List\n")
    code = "```python\ndef add(a: List[int], b: int) -> int:\n    return sum(a) + b\n```"  # no import of List
    assert _score(problem, code, grader)["reward"] == 1.0


@pytest.mark.parametrize("grader", GRADERS)
def test_custom_template_and_local_file_score_the_same(tmp_path, grader):
    """A --prompt_template is used as written (the header is not added), and scoring reads the header alike."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(_row(question="Add {header} two numbers.")) + "\n")
    _, (problem,) = load_eval_problems(str(path), prompt_template="Solve: {question}")
    assert problem.prompt == "Solve: Add {header} two numbers." and problem.header == "def add(a, b):\n"
    _, (default,) = load_eval_problems(str(path))
    assert default.prompt.startswith("Add {header} two numbers.\n\n")  # the question's braces are kept as written
    assert _score(problem, RIGHT, grader)["reward"] == 1.0 and _score(default, WRONG, grader)["reward"] == 0.0


def test_fence_with_nothing_after_it_gives_the_plain_prompt():
    (problem,) = problems_from_rows([_row("```python\n")])
    assert problem.header == "" and problem.prefix == ""
    assert problem.prompt == CODE_PROMPT.replace("{question}", "Add two numbers.")
    assert _score(problem, RIGHT, "sandbox")["reward"] == 1.0


@pytest.mark.parametrize("grader", GRADERS)
def test_unfenced_prefix_is_put_before_the_code_as_before(grader):
    """A prefix without a fence (imports, setup code) keeps today's behaviour: plain prompt, always prepended."""
    (problem,) = problems_from_rows([_row("import math\n", tests=["assert add(4, 0) == 2"])])
    assert problem.prefix == "import math\n" and getattr(problem, "header", "") == ""  # passes before the fix too
    assert problem.prompt == CODE_PROMPT.replace("{question}", "Add two numbers.")
    code = "```python\ndef add(a, b):\n    return math.isqrt(a + b)\n```"  # math comes from the prefix
    assert _score(problem, code, grader)["reward"] == 1.0


def test_presets_still_continue_the_fenced_prefix():
    (problem,) = problems_from_rows([_row()], "dllm_rl_sdar")
    assert problem.response_prefix == FENCED and getattr(problem, "header", "") == "" and problem.prefix == ""
    assert _score(problem, "    return a + b\n```", "official")["reward"] == 1.0
