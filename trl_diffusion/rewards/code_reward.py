"""Code execution reward: run the completion's last Python code block against the row's tests in the sandbox.

Tests come from the dataset row in one of two shapes:

* ``tests``: a list of assert statements (MBPP style), each counted as one test; a single string is one test;
* ``test`` + ``entry_point``: a HumanEval-style ``test`` string that defines ``check(candidate)``; it is run as one
  test, ``check(<entry_point>)``. The entry point is a function's name, or a method of a class the program defines
  (LeetCode's ``Solution().twoSum``: one instance per test, as natively).

Every run goes through :func:`trl_diffusion.rewards.sandbox.run_tests`, so a program that fails, crashes, times out
or exceeds a limit scores 0.0; the reward function never raises for anything a completion does. Tests are decided
outside the sandboxed process where their shape allows (``assert f(x) == y`` and the like, HumanEval ``check``
bodies made of asserts, LeetCode's ``check(Solution().twoSum)`` and ``assert Solution().twoSum(...) == ...``; see
:mod:`trl_diffusion.rewards.verdict`), so a program cannot forge a pass; other tests run inside it, where it can,
unless ``allow_unverified=False``. Completions are run concurrently in a small thread pool (each run is its own
process, so threads only wait on pipes).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .format_reward import check_column_lengths, completion_to_text, missing_column_error
from .sandbox import SandboxLimits, SandboxResult, resolve_python, run_tests
from .verdict import plan_test

__all__ = ["CodeExecutionReward", "build_tests", "code_execution_reward", "extract_code", "make_code_reward"]

# The info line may not hold a backtick (as in CommonMark); the language is read from it separately. Matching it
# inside this pattern (``[A-Za-z...]*[^\n]*``) backtracked quadratically over a long line without a newline.
_FENCE = re.compile(r"```([^`\n]*)\n(.*?)```", re.DOTALL)
_LANG = re.compile(r"[ \t]*([A-Za-z0-9_+.-]*)")
_PYTHON_TAGS = {"python", "py", "python3"}


def extract_code(text: str) -> str | None:
    """Return the body of the last ```` ```python ```` block, else of the last untagged ```` ``` ```` block, else None.

    Tagged blocks win so that a trailing untagged block (often sample output) is not mistaken for the solution.
    Blocks in other languages are ignored and an unterminated block (a truncated completion) does not count.
    """
    blocks = [(_LANG.match(info).group(1).lower(), body) for info, body in _FENCE.findall(text)]
    for wanted in (lambda lang: lang in _PYTHON_TAGS, lambda lang: lang == ""):
        chosen = [body for lang, body in blocks if wanted(lang)]
        if chosen:
            return chosen[-1]
    return None


def build_tests(tests: Any = None, test: Any = None, entry_point: Any = None) -> list[str] | None:
    """Turn one row's test columns into a list of snippets for the sandbox; ``None`` if the row has no tests."""
    if isinstance(tests, str):
        decoded = _json_list(tests)
        tests = decoded if decoded is not None else [tests]
    if tests is not None:
        snippets = [str(t) for t in tests]
        snippets = [t for t in snippets if t.strip()]
        return snippets or None
    if isinstance(test, str) and test.strip():
        if not entry_point and _defines_uncalled_check(test):
            raise ValueError("a HumanEval-style `test` defines check(candidate) but its row has no `entry_point`: "
                             "run as it is, the test would call nothing and pass every program. Give the "
                             "`entry_point` column (the function's name).")
        return [f"{test}\n\ncheck({entry_point})\n" if entry_point else test]
    return None


def _defines_uncalled_check(test: str) -> bool:
    """Whether ``test`` defines ``check`` at its top level and never calls it there (HumanEval's ``test``, which
    needs ``check(<entry_point>)`` after it). Only parsed, never run; a test that does not parse is left to fail."""

    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return False
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check" for node in tree.body):
        return False
    outside = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return not any(isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "check"
                   for node in outside for call in ast.walk(node))


def _json_list(text: str) -> list[str] | None:
    """Decode a JSON-encoded list of test strings (some datasets store them so), or one written as a Python literal
    (``str(list)``, e.g. a CSV export: ``"['assert f(1) == 2']"``); ``None`` if it is not one.

    Without this, such a column would be executed as a harmless list literal and "pass" without running any test.
    """
    value = decode_list_string(text)
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def decode_list_string(text: str) -> list | None:
    """The list a string column holds: JSON (``'["a", "b"]'``), else a Python literal (``"['a', 'b']"``, what
    ``str(list)`` writes); ``None`` if the text is neither. Run as a test, either would be a list literal that
    always passes. Only parsed (``ast.literal_eval``), never run."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
        if text.lstrip().startswith("["):
            try:
                value = ast.literal_eval(text.strip())
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                value = None
    return value if isinstance(value, list) else None


class CodeExecutionReward:
    """Callable reward: fraction of tests passed (``partial_credit=True``) or 1.0 only if all pass (default).

    Rows without tests get ``None`` (TRL leaves them out), and so do rows with a test that cannot be decided outside
    the sandbox when ``allow_unverified=False``; completions without a code block get 0.0. A callable class (not a
    closure) so it pickles for multi-process rollouts.
    """

    def __init__(
        self,
        timeout: float = 10.0,
        memory_mb: int = 1024,
        partial_credit: bool = False,
        max_workers: int = 4,
        max_processes: int = 32,
        max_output_bytes: int = 1_000_000,
        python: str | None = None,
        name: str = "code_execution_reward",
        allow_unverified: bool = True,
    ) -> None:
        self.limits = SandboxLimits(
            timeout=timeout, memory_mb=memory_mb, max_processes=max_processes, max_output_bytes=max_output_bytes
        )
        self.partial_credit = partial_credit
        self.max_workers = max(1, max_workers)
        self.python = resolve_python(python)
        self.__name__ = name
        self.allow_unverified = allow_unverified

    def __call__(
        self,
        completions: list[Any],
        tests: list[Any] | None = None,
        test: list[Any] | None = None,
        entry_point: list[Any] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        n = len(completions)
        if tests is None and test is None:
            given = kwargs if entry_point is None else {**kwargs, "entry_point": entry_point}
            raise missing_column_error(self.__name__, "tests", "'tests' (a list of asserts) or 'test' (a check "
                                       "function)", given, "dataset.rename_column('test_list', 'tests')")
        check_column_lengths(self.__name__, n, {"tests": tests, "test": test, "entry_point": entry_point})
        rows = zip(
            tests if tests is not None else [None] * n,
            test if test is not None else [None] * n,
            entry_point if entry_point is not None else [None] * n,
        )
        jobs = [(extract_code(completion_to_text(c)), self._snippets(*row)) for c, row in zip(completions, rows)]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, max(n, 1))) as pool:
            results = list(pool.map(lambda job: self._run(*job), jobs))
        if log_metric is not None and n:
            # a copy with its own name logs under it, so that two configured copies' metrics are not averaged
            prefix = "code_execution" if self.__name__ == "code_execution_reward" else self.__name__
            for status in ("timeout", "sandbox_error"):
                log_metric(f"{prefix}/{status}_frac", sum(r is not None and r.status == status for r in results) / n)
            ran = [r for r in results if r is not None and r.total]
            if ran:
                log_metric(f"{prefix}/verified_frac", sum(r.verified for r in ran) / sum(r.total for r in ran))
        return [self._reward(r, job[1]) for r, job in zip(results, jobs)]

    def _snippets(self, tests: Any, test: Any, entry_point: Any) -> list[str] | None:
        """The row's test snippets; ``None`` (no reward) if it has none, or has an unverifiable one and
        ``allow_unverified`` is off."""
        snippets = build_tests(tests, test, entry_point)
        if snippets and not self.allow_unverified and any(plan_test(t).kind == "unverified" for t in snippets):
            return None
        return snippets

    def _run(self, code: str | None, snippets: list[str] | None) -> SandboxResult | None:
        if snippets is None or code is None:
            return None
        return run_tests(code, snippets, self.limits, self.python)

    def _reward(self, result: SandboxResult | None, snippets: list[str] | None) -> float | None:
        if snippets is None:
            return None
        if result is None:
            return 0.0
        return result.fraction if self.partial_credit else float(result.all_passed)


def make_code_reward(
    timeout: float = 10.0,
    memory_mb: int = 1024,
    partial_credit: bool = False,
    max_workers: int = 4,
    max_processes: int = 32,
    max_output_bytes: int = 1_000_000,
    python: str | None = None,
    name: str = "code_execution_reward",
    allow_unverified: bool = True,
) -> CodeExecutionReward:
    """Build a configured, picklable code execution reward (see :class:`CodeExecutionReward`).

    Args:
        timeout: wall-clock seconds per completion (program plus all its tests; twice that if a row mixes tests
            decided outside the sandbox with tests that are not: they run separately).
        memory_mb: memory of the whole sandbox in MiB where a memory cgroup is available, and always the
            address-space limit of each sandbox process.
        partial_credit: reward the fraction of tests passed instead of 1.0 only when all pass.
        max_workers: completions run concurrently (each in its own sandbox process).
        max_processes: process/thread limit inside the sandbox (contains fork bombs).
        max_output_bytes: stdout+stderr cap; a program printing more scores 0.0.
        python: interpreter for the sandbox (default: the current one): a path or a name on PATH, resolved (and
            checked: ValueError) when the reward is built.
        name: ``__name__`` shown in TRL logs; give distinct names to several configured copies.
        allow_unverified: run tests that cannot be decided outside the sandbox (loops, assignments, helper
            functions) inside it, where a program can forge their result (default, as in HumanEval's own harness);
            ``False`` gives such rows ``None`` instead, so no reward can be forged.
    """
    return CodeExecutionReward(
        timeout, memory_mb, partial_credit, max_workers, max_processes, max_output_bytes, python, name,
        allow_unverified,
    )  # fmt: skip


_DEFAULT = CodeExecutionReward()


def code_execution_reward(
    completions: list[Any],
    tests: list[Any] | None = None,
    test: list[Any] | None = None,
    entry_point: list[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """Code execution reward with the default limits (10 s, 1 GiB, all-or-nothing); see :func:`make_code_reward`."""
    return _DEFAULT(completions, tests=tests, test=test, entry_point=entry_point, **kwargs)
