"""Code tasks against Gen-Verse/dLLM-RL (10b4fd1): its code prompts, extraction, test execution and reward.

The expected prompts are dLLM-RL's templates (``sample/trado_sample.py``, ``llada_sample.py``, ``dream_sample.py``
and the ``*_rl_rollout.py`` copies) rendered as jinja2 renders them: ``template + prefix``, final newline dropped.
"""

from __future__ import annotations

import pytest

from trl_diffusion.eval.datasets import problems_from_rows
from trl_diffusion.eval.evaluate import EvalConfig, score_completions
from trl_diffusion.rewards import (
    extract_code_official,
    make_official_code_reward,
    official_code_outcomes,
    official_code_reward,
)

FUNCTION_ASK = ("Place your code within a single Python code block ```python ```. Do not include more than one code "
                "block. ")
STDIO_ASK = "You should put your code in ```python ```. Use input() to read input and print() to produce output in " \
            "your script. "
PREFIX = "```python\ndef add(a, b):\n"


def _rows(question="Add two numbers.", prefix=PREFIX):
    function = {"question": question, "test_method": "function", "prefix": prefix, "test_time_limit": 1,
                "test_list": ["assert add(1, 2) == 3", "assert add(2, 2) == 4"]}
    stdio = {"question": question, "test_method": "stdio", "test_time_limit": 1,
             "test_input": ["1 2\n", "3 4\n"], "test_output": ["3\n", "7\n"]}
    return function, stdio


@pytest.mark.parametrize("preset, function_prompt, stdio_prompt", [
    ("dllm_rl_sdar",
     f"<|im_start|>user\nAdd two numbers.\n{FUNCTION_ASK}<|im_end|>\n<|im_start|>assistant\n```python\ndef add(a, b):",
     f"<|im_start|>user\nThis is the problem:\nAdd two numbers.\n{STDIO_ASK}<|im_end|>\n<|im_start|>assistant"),
    ("dllm_rl_sdar_think",
     f"<|im_start|>user\nAdd two numbers.\n{FUNCTION_ASK}<|im_end|>\n<|im_start|>assistant\n```python\ndef add(a, b):",
     f"<|im_start|>user\nThis is the problem:\nAdd two numbers.\n{STDIO_ASK}<|im_end|>\n<|im_start|>assistant<think>"),
    ("dllm_rl_llada",
     f"<|startoftext|><|start_header_id|>user<|end_header_id|>Add two numbers.\n{FUNCTION_ASK}<|eot_id|>"
     "<|startoftext|><|start_header_id|>assistant<|end_header_id|>\n```python\ndef add(a, b):",
     f"<|startoftext|><|start_header_id|>user<|end_header_id|>This is the problem:\nAdd two numbers.\n {STDIO_ASK}"
     "<|eot_id|><|startoftext|><|start_header_id|>assistant<|end_header_id|>"),
    ("dllm_rl_dream",
     f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nAdd two numbers.\n{FUNCTION_ASK}"
     "<|im_end|>\n<|im_start|>assistant\n```python\ndef add(a, b):",
     f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nThis is the problem:\n"
     f"Add two numbers.\n{STDIO_ASK}<|im_end|>\n<|im_start|>assistant"),
])
def test_dllm_rl_presets_give_code_rows_dllm_rls_code_prompts(preset, function_prompt, stdio_prompt):
    """Before, a dllm_rl_* preset gave code rows the math prompt ("put your final answer within \\boxed{}") and left
    the function row's prefix out of the prompt."""
    function, stdio = problems_from_rows(list(_rows()), preset)
    assert function.prompt == function_prompt and stdio.prompt == stdio_prompt
    assert function.response_prefix == PREFIX and function.prefix == "" and function.time_limit == 1.0
    assert stdio.stdio and stdio.response_prefix == ""


def test_dllm_rl_function_prompt_without_prefix_ends_at_assistant():
    """jinja2 drops the final newline of template + prefix: with an empty prefix that is the template's own."""
    (function,) = problems_from_rows([_rows(prefix="")[0]], "dllm_rl_sdar")
    assert function.prompt.endswith(f"{FUNCTION_ASK}<|im_end|>\n<|im_start|>assistant")


@pytest.mark.parametrize("row", [
    {"prompt": "def f():\n", "test": "def check(c):\n    assert c() == 1\n", "entry_point": "f"},
    {"text": "Write f.", "test_list": ["assert f() == 1"]},
])
def test_dllm_rl_presets_refuse_rows_of_other_code_formats(row):
    """HumanEval / MBPP as published have no question / prefix columns: the preset's prompt cannot be built."""
    with pytest.raises(ValueError, match="code_tests"):
        problems_from_rows([row], "dllm_rl_sdar")


def test_extract_code_official_reads_only_python_fences():
    assert extract_code_official("```python\n  x = 1\n```\ntext\n```python\ny = 2\n```") == "y = 2"
    assert extract_code_official("```\nx = 1\n```") is None  # untagged: not dLLM-RL's
    assert extract_code_official("```py\nx = 1\n```") is None
    assert extract_code_official("```python\nx = 1\n") is None  # unterminated
    assert extract_code_official("```python x = 1```") == "x = 1"  # no line break needed
    assert extract_code_official(PREFIX + "    return a + b\n```") == "def add(a, b):\n    return a + b"


def test_official_code_reward_counts_passed_tests():
    """The number of tests passed (z-scored by the trainer), over prefix + completion for function rows; one
    sandbox run per stdio case; no python block, or a program that exits, passes nothing."""
    function, stdio = _rows()
    rows = [function, function, function, stdio]
    completions = [
        "    return a + b\n```",  # continues the prefix: both asserts pass
        "    return 3\n```",  # one of two
        "    exit()\n```\nexit()",  # SystemExit: dLLM-RL passes everything, we pass nothing
        "```python\na, b = map(int, input().split())\nprint(a + b if a == 1 else 0)\n```",  # one case of two
    ]
    columns = {k: [r.get(k) for r in rows] for k in ("test_method", "test_list", "test_input", "test_output",
                                                     "prefix", "test_time_limit")}
    assert official_code_reward(completions, **columns) == [2.0, 1.0, 0.0, 1.0]
    assert official_code_reward(["x"], test_method=[None]) == [None]  # not a dLLM-RL code row
    with pytest.raises(ValueError, match="`prefix` column"):
        official_code_reward(completions, **{**columns, "prefix": ["", ""]})


def test_official_code_outcomes_time_limit_is_the_rows_plus_slack():
    """dLLM-RL gives a function completion test_time_limit + 2 s in all."""
    code = "import time\ntime.sleep(3)\ndef f():\n    return 1"
    outcomes = official_code_outcomes(code, "function", ["assert f() == 1"], time_limit=0.1, function_slack=1.0)
    assert outcomes == [False]
    assert official_code_outcomes(None, "stdio", test_input=["1"], test_output=["1"]) == [False]
    with pytest.raises(ValueError, match="test_method"):
        official_code_outcomes("x = 1", "assert", ["assert x == 1"])
    assert make_official_code_reward(name="c").__name__ == "c"


def test_eval_scores_the_prefix_the_prompt_ends_with():
    """With a preset the completion continues the prefix in the prompt; both graders read prefix + completion."""
    (function,) = problems_from_rows([_rows()[0]], "dllm_rl_sdar")
    completions = ["    return a + b\n```", "    return a + b\n```", "```\ndef add(a, b):\n    return a + b\n```"]
    sandbox, official, untagged = (
        score_completions([function], [completions[0]])[0],
        score_completions([function], [completions[1]], code_grader="official")[0],
        score_completions([function], [completions[2]], code_grader="official")[0],
    )
    assert sandbox["reward"] == 1.0 and official["reward"] == 1.0 and official["tests_passed"] == 2
    # a new fence closes the prefix's block: dLLM-RL runs the bare signature, a syntax error
    assert untagged["reward"] == 0.0
    with pytest.raises(ValueError, match="code_grader"):
        score_completions([function], completions[:1], code_grader="strict")
    with pytest.raises(ValueError, match="code_grader"):
        EvalConfig(code_grader="strict").check_code_grader()
