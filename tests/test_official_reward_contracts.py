"""Contracts of the dLLM-RL reward reproductions (Gen-Verse/dLLM-RL at 10b4fd1) and of the code reward that the other
test files leave open: single rules of the official math normalisation, and the official code harness's limits and
output comparison. Each test pins one rule that a plausible edit could drop without any other test noticing."""

import hashlib

import pytest

from trl_diffusion.rewards.code_reward import build_tests, extract_code
from trl_diffusion.rewards.dllm_rl_code import official_code_outcomes
from trl_diffusion.rewards.dllm_rl_math import is_equiv, latex_equal, normalize_final_answer, repeatness


def test_hendrycks_drops_a_trailing_text_unit():
    r"""Hendrycks strip_string (math_utils.py 277-346) drops a trailing \text{ unit}, else right answers score 0."""
    assert is_equiv(r"10\text{ apples}", "10")


def test_hendrycks_drops_left_and_right():
    r"""Hendrycks strip_string deletes \left/\right, so a sized bracket equals a plain one as in the official."""
    assert is_equiv(r"\left(3,4\right)", "(3,4)")


def test_hendrycks_drops_thousands_commas():
    """Hendrycks strip_string deletes commas itself; Minerva alone would keep them in 1,000.5."""
    assert is_equiv("1,000.5", "1000.5")


def test_slash_fraction_only_for_canonical_integers():
    r"""Official _fix_a_slash_b rewrites a/b only when f'{a}/{b}' reproduces it: 03/4 is not \frac{3}{4}."""
    assert is_equiv("3/4", r"\frac{3}{4}")
    assert not is_equiv("03/4", r"\frac{3}{4}")


def test_unnormalisable_strings_compare_raw():
    """Official is_equiv falls back to raw-string equality when normalisation fails (two text units)."""
    answer = r"12\text{ cm}\text{ long}"
    assert is_equiv(answer, answer)
    assert not is_equiv(answer, "12")


def test_none_equals_only_none():
    """Official is_equiv: None equals None (True) and nothing else."""
    assert is_equiv(None, None)
    assert not is_equiv(None, "5")


def test_function_rows_get_two_seconds_of_slack():
    """A function row runs under test_time_limit + 2 s (rl_execute.py spawn_slack): 1.3 s of work passes."""
    code = "import time\ntime.sleep(1.3)\ndef f():\n    return 1"
    assert official_code_outcomes(code, "function", ["assert f() == 1"]) == [True]


def test_repeatness_threshold_is_one_fifth():
    """repeatness (math_utils.py 15-55) flags above 0.2 of n(n+1)/2: ~0.25 is flagged, ~0.18 is not."""
    head = "".join(hashlib.sha256(str(i).encode()).hexdigest()[:4] for i in range(50))
    assert repeatness(head + "a" * 200)
    assert not repeatness(head + "a" * 150)


class _Expr:
    """A parsed expression for ``latex_equal``'s ``parse``: structure is the text, value a fixed number."""

    def __init__(self, text, value):
        self.text, self.value = text, value

    def __eq__(self, other):
        return isinstance(other, _Expr) and self.text == other.text

    __hash__ = None

    def evalf(self):
        return self.value


def test_latex_equal_accepts_equal_numeric_values():
    """Official _is_latex_equal (161-178) accepts equal evalf values of different parses before normalising."""
    values = {r"\$\frac{1}{2}": 0.5, "0.5": 0.5, "x": 1.0}
    parse = lambda text: _Expr(text, values[text])  # noqa: E731
    assert latex_equal(r"\$\frac{1}{2}", "0.5", parse=parse)
    assert not latex_equal(r"\$\frac{1}{2}", "x", parse=parse)


def test_stdio_cases_get_no_slack():
    """A stdio case gets test_time_limit alone (default 1 s, no spawn_slack in worker_stdio): 1.5 s fails."""
    code = "import time\ntime.sleep(1.5)\nprint(input())"
    assert official_code_outcomes(code, "stdio", test_input=["7"], test_output=["7"]) == [False]


def _unparsable(text):
    raise ValueError(text)


def test_minerva_drops_thousands_commas_of_an_integer():
    """Minerva normalize_final_answer (118-152) removes an integer's commas: '1,000 dollars' matches 1000."""
    assert not is_equiv("1,000 dollars", "1000")
    assert normalize_final_answer("1,000") == "1000"
    assert latex_equal("1,000 dollars", "1000", parse=_unparsable)


def test_minerva_keeps_the_first_dollar_span():
    """Minerva normalisation keeps the first $...$ span of an answer and drops the words around it."""
    assert normalize_final_answer("so $5$ apples") == "5"


def test_stdio_output_compared_up_to_all_whitespace():
    """dLLM-RL compares stdio output as ' '.join(x.split()): inner spaces and newlines all count as one."""
    code = "print('1   2')\nprint(3)"
    assert official_code_outcomes(code, "stdio", test_input=[""], test_output=["1 2 3"]) == [True]


def test_stdio_input_raises_eof_when_exhausted():
    """Official worker_stdio's input() raises EOFError after the last line, so read-until-EOF loops end."""
    code = "while True:\n    try:\n        line = input()\n    except EOFError:\n        break\n    print(line)"
    assert official_code_outcomes(code, "stdio", test_input=["a\nb"], test_output=["a\nb"]) == [True]


def test_minerva_drops_a_metre_unit():
    r"""Minerva turns \text{m} into \text{} and deletes it, so 5\text{m} is 5 (Hendrycks needs a space)."""
    assert not is_equiv(r"5\text{m}", "5")
    assert normalize_final_answer(r"5\text{m}") == "5"


def test_stdio_program_runs_as_main():
    """Official worker_stdio runs code with __name__ == '__main__', so main-guarded solutions print."""
    code = "def main():\n    print(int(input()) * 2)\n\nif __name__ == '__main__':\n    main()"
    assert official_code_outcomes(code, "stdio", test_input=["21"], test_output=["42"]) == [True]


def test_frac_followed_by_one_character_leaves_the_string_as_it_was():
    r"""Official _fix_fracs returns the whole string when a \frac has one character after it."""
    assert not is_equiv(r"\frac12+\frac3", r"\frac{1}{2}+\frac3")


def test_stdio_exception_fails_the_case_even_after_right_output():
    """Official worker_stdio turns an exception into 'error: ...' output, failing even a right printout."""
    code = "print(5)\nraise ValueError('late')"
    assert official_code_outcomes(code, "stdio", test_input=[""], test_output=["5"]) == [False]


def test_code_reward_reads_py_and_python3_fences():
    """Our code reward reads py/python3 fences as Python, ahead of a later untagged (sample output) block."""
    assert extract_code("```py\nx = 1\n```\n```\nsample output\n```") == "x = 1\n"
    assert extract_code("```python3\ny = 2\n```") == "y = 2\n"


def test_code_reward_fence_tag_is_case_insensitive():
    """A capitalised Python fence tag counts, so a model writing ```Python does not score 0."""
    assert extract_code("```Python\nz = 3\n```") == "z = 3\n"


def test_test_method_is_read_case_insensitively():
    """test_method is read case-insensitively, so rows exported as 'Function' are scored, not refused."""
    assert official_code_outcomes("def f():\n    return 1", "Function", ["assert f() == 1"]) == [True]


def test_code_reward_decodes_a_python_literal_test_list():
    """A tests column written as str(list) is decoded into asserts, not run as one always-true literal."""
    column = "['assert f(1) == 1', 'assert f(2) == 2']"
    assert build_tests(tests=column) == ["assert f(1) == 1", "assert f(2) == 2"]


def test_stdio_row_with_unequal_inputs_and_outputs_is_refused():
    """A stdio row with more inputs than outputs is refused: zipping would silently drop cases."""
    with pytest.raises(ValueError, match="2 test inputs but 1 outputs"):
        official_code_outcomes("print(1)", "stdio", test_input=["1", "2"], test_output=["1"])


def test_boolean_time_limit_is_refused():
    """A boolean test_time_limit is refused rather than read as float(True) = 1 s, as the eval loader does."""
    with pytest.raises(ValueError, match="test_time_limit"):
        official_code_outcomes("x = 1", "function", ["assert x == 1"], time_limit=True)


def test_stdio_columns_written_as_json_strings_are_decoded():
    """stdio columns stored as JSON strings become one case per item, not one case fed the JSON text."""
    outcomes = official_code_outcomes("print(input())", "stdio", test_input='["3", "4"]', test_output='["3", "4"]')
    assert outcomes == [True, True]


def test_a_function_row_whose_sandbox_fails_gets_one_false_per_test(tmp_path):
    """A function row the sandbox cannot run still gets one False per test (0 passed), not no reward."""
    tests = ["assert f() == 1", "assert f() == 2"]
    missing = str(tmp_path / "no-such-python")
    assert official_code_outcomes("def f():\n    return 1", "function", tests, python=missing) == [False, False]
