"""dLLM-RL's code reward and code check (Gen-Verse/dLLM-RL at 10b4fd1), on its code schema, run in our sandbox.

dLLM-RL's rows (its PrimeIntellect training set, its LiveCodeBench / MBPP / HumanEval files) hold ``test_method``
(``function`` or ``stdio``), ``test_list`` (asserts; ``function``) or ``test_input`` / ``test_output`` (``stdio``),
``prefix`` (``function``: the start of the answer, written at the end of the prompt) and ``test_time_limit``.
What it does with them, rule for rule:

* **Code** (``extract_code`` in ``sample/*_rl_rollout.py`` / ``*_sample.py``): the last
  ``re.findall(r"```python(.*?)```", text, re.DOTALL)`` match, stripped, where ``text`` is ``prefix`` + completion
  for ``function`` rows and the completion for ``stdio`` rows. Untagged or ``py`` fences do not count.
* **function** (``reward/rl_execute.py``, ``evaluate_function_dataset``): the code runs, then each assert in its
  namespace; one process per completion, ``test_time_limit + 2`` s (default limit 1) for all of it; a timeout or
  an exception in the code fails every test.
* **function**: the code is run through ``textwrap.dedent`` (which also blanks whitespace-only lines inside string
  literals), and the asserts run in order in one namespace (a test sees the names earlier tests bound).
* **stdio** (``evaluate_stdio_dataset``, ``worker_stdio``): one process per test case with ``test_time_limit`` s,
  ``__name__ == "__main__"``; ``input`` is a global that ignores its prompt and returns the next of the input's
  ``splitlines()``, ``sys.stdin`` a separate ``StringIO`` of the input, ``sys.stdout`` a ``StringIO``
  (:func:`official_stdio_program`); passes if its output equals the expected one up to whitespace
  (``" ".join(x.split())``); an exception fails the case.
* **Reward** (``reward/rl_code_reward.py``): the number of tests passed, z-scored in the group by the trainer (no
  length rule for code). The eval metric (``reward/reward.py``) counts a sample correct when every test passes.

Deliberate differences: a program (or test) that raises ``SystemExit`` passes every test there (``exit()`` at the top
of a completion earns the full reward); here it fails them, as in :mod:`.code_reward`. A ``test_list`` that holds
no test snippets (not strings; data, such as stdin/stdout cases) or tests that check nothing (``f(2) == 4`` without
``assert`` passes every program there) is a ``ValueError`` naming the row, as in :func:`.code_reward.build_tests`.
"""

from __future__ import annotations

import math
import re
import textwrap
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from .code_reward import checked_snippets, column_items, decode_list_string
from .format_reward import check_column_lengths, completion_to_text, missing_column_error
from .sandbox import SandboxLimits, SandboxResult, resolve_python, run_tests
from .verdict import plan_test

__all__ = [
    "DEFAULT_TIME_LIMIT",
    "OfficialCodeReward",
    "extract_code_official",
    "make_official_code_reward",
    "official_code_outcomes",
    "official_code_reward",
    "official_stdio_program",
    "run_official",
    "stdio_program",
    "stdio_test",
]

_FENCE = re.compile(r"```python(.*?)```", re.DOTALL)
DEFAULT_TIME_LIMIT = 1.0
"""dLLM-RL's ``test_time_limit`` when a row has none (``item.get("test_time_limit", 1)``)."""
FUNCTION_SLACK = 2.0
"""Seconds dLLM-RL adds to a ``function`` row's limit (``spawn_slack``); its ``stdio`` cases get none."""

_STDIO_HARNESS = '''import atexit as _atexit
import builtins as _builtins
import gc as _gc
import io as _io
import os as _os
import sys as _sys
import tempfile as _tempfile
import threading as _threading
import types as _types
import weakref as _weakref

_SOLUTION = compile({source!r}, "<solution>", "exec")
_HOME = _os.getcwd()  # the sandbox directory: each case starts there, as a judged process would


def _flush(stream):  # what an exiting interpreter does with sys.stdout (a closed or odd object is left alone)
    try:
        if not getattr(stream, "closed", False):
            stream.flush()
    except Exception:
        pass


def _write_input(fd, text):
    data = text.encode("utf-8")
    view = memoryview(data)
    try:
        while view:  # a short write, then an error: RLIMIT_FSIZE (max_file_bytes) or a full sandbox directory
            view = view[_os.write(fd, view):]
    except OSError as exc:
        raise RuntimeError(f"sandbox: the case's input ({{len(data)}} bytes) does not fit the sandbox's "
                           f"max_file_bytes / max_disk_bytes: {{exc}}") from None
    _os.lseek(fd, 0, _os.SEEK_SET)


_BUFFERED_FILES = frozenset((_io.TextIOWrapper, _io.BufferedWriter, _io.BufferedRandom, _io.BufferedRWPair))


def _flush_open_files():
    # every file still open is flushed before the program's objects are collected, as an exiting interpreter's
    # teardown releases them one by one: the cycle collector may close a raw file before the buffer on top of it
    # (`self.out = open(1, "w")` in an object, a list, a closure) has written its bytes
    for obj in _gc.get_objects():
        if type(obj) in _BUFFERED_FILES:  # a type test, not isinstance: this runs over every object of the program
            _flush(obj)


class _Namespace:  # a marker in the program's globals: alive after the collection means the globals are too
    pass


def _exit_as_an_interpreter(holder, opened, running):
    # CPython's shutdown order: threading's exit hooks (concurrent.futures stops idle pool workers there), the
    # program's threads joined, its atexit handlers, sys.stdout flushed; then its objects are finalized with their
    # globals intact and print() writing descriptor 1, and globals that survive (held by a daemon thread, a cache
    # of typing, a reference stored away) are cleared. ``holder``: the one reference to the program's module.
    for hook in reversed(getattr(_threading, "_threading_atexits", [])):
        try:
            hook()
        except Exception:  # the interpreter reports it and goes on exiting
            pass
    futures = _sys.modules.get("concurrent.futures.thread")
    if futures is not None:  # the hook shut pools down for good: the next case may start new ones
        futures._shutdown = False
        futures._threads_queues.clear()
    for thread in _threading.enumerate():  # `Thread(target=main).start()`
        if thread not in running and not thread.daemon:
            thread.join()
    _atexit._run_exitfuncs()
    _atexit._clear()
    logging = _sys.modules.get("logging")
    if logging is not None:  # a fresh interpreter has no handlers: the next case's basicConfig() must take effect
        for logger in (logging.root, *logging.Logger.manager.loggerDict.values()):
            for handler in list(getattr(logger, "handlers", ())):
                _flush(handler)
                logger.removeHandler(handler)
    _weakref.finalize._shutdown = False  # its atexit hook turned every later finalizer off
    _weakref.finalize._registered_with_atexit = False
    _flush(_sys.stdout)
    _flush(_sys.__stdout__)
    _flush_open_files()
    _sys.stdin = _sys.__stdin__ = opened[0]
    _sys.stdout = _sys.__stdout__ = opened[1]
    marker = _Namespace()
    holder[0].__dict__["__stdio_case__"] = marker
    namespace = _weakref.ref(marker)
    del marker
    holder.clear()
    _gc.collect()
    if namespace() is not None:
        _clear_globals_holding(namespace)
        _gc.collect()


def _clear_globals_holding(namespace):
    marker = namespace()
    for referrer in _gc.get_referrers(marker):
        if isinstance(referrer, dict) and referrer.get("__stdio_case__") is marker:
            referrer.clear()


def _stdio_run(stdin_text):
    # A judged process, case by case: descriptors 0 and 1 are files holding the input and catching the output (so
    # open(0), os.read(0), os.write(1), fileno() and sys.__stdout__ work), and the case ends as the interpreter
    # exits (a file the program opened on descriptor 0 or 1 is flushed and closed in its own case).
    streams = (_sys.stdin, _sys.stdout, _sys.__stdin__, _sys.__stdout__)
    real_main = _sys.modules.get("__main__")
    for stream in streams:
        _flush(stream)
    _os.chdir(_HOME)
    _atexit._clear()  # the sandbox exits with os._exit: only the program's handlers are ever run
    in_fd, in_path = _tempfile.mkstemp(dir=_HOME)
    out_fd, out_path = _tempfile.mkstemp(dir=_HOME)
    saved = _os.dup(0), _os.dup(1)
    opened = ()
    try:
        _write_input(in_fd, stdin_text)
        _os.dup2(in_fd, 0)
        _os.dup2(out_fd, 1)
        # a POSIX interpreter's standard streams: no newline translation ("\\r\\n" keeps its "\\r")
        opened = (open(0, encoding="utf-8", newline="\\n", closefd=False),
                  open(1, "w", encoding="utf-8", newline="\\n", closefd=False))
        _sys.stdin = _sys.__stdin__ = opened[0]
        _sys.stdout = _sys.__stdout__ = opened[1]
        main = _types.ModuleType("__main__")  # a script's module: pickle, dataclasses and typing look classes up there
        main.__builtins__ = _builtins
        _sys.modules["__main__"] = main
        running = set(_threading.enumerate())
        failure = None
        try:
            exec(_SOLUTION, main.__dict__)
        except SystemExit:
            pass
        except BaseException as exc:  # raised after the exit steps, without the frames that hold the globals
            failure = exc.with_traceback(None)
            failure.__context__ = failure.__cause__ = None
        _sys.modules["__main__"] = real_main
        holder = [main]
        del main
        _exit_as_an_interpreter(holder, opened, running)
        for stream in opened:  # what a real process would lose (fd 1 closed first) must not reach the real fd 1
            try:
                stream.close()
            except Exception:
                pass
        if failure is not None:
            raise failure
        with open(out_path, "rb") as printed:
            return printed.read().decode("utf-8", "replace")
    finally:
        _os.dup2(saved[0], 0)
        _os.dup2(saved[1], 1)
        for fd in (*saved, in_fd, out_fd):
            _os.close(fd)
        _sys.stdin, _sys.stdout, _sys.__stdin__, _sys.__stdout__ = streams
        _sys.modules["__main__"] = real_main
        for path in (in_path, out_path):
            _os.unlink(path)
'''


_OFFICIAL_STDIO_HARNESS = '''import io as _io
import sys as _sys

_SOLUTION = compile({source!r}, "<solution>", "exec")


def _stdio_run(stdin_text):
    lines = iter(stdin_text.splitlines())

    def fake_input(prompt=""):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError("No more input")

    real_in, real_out = _sys.stdin, _sys.stdout
    out = _io.StringIO()
    _sys.stdin, _sys.stdout = _io.StringIO(stdin_text), out
    try:
        exec(_SOLUTION, {{"__name__": "__main__", "input": fake_input}})  # exec adds the builtins' dict
    except SystemExit:
        pass
    except Exception as exc:
        return f"error: {{exc}}"
    finally:
        _sys.stdin, _sys.stdout = real_in, real_out
    return out.getvalue()
'''


def stdio_program(code: str) -> str:
    """The sandbox program for a stdin/stdout solution: ``_stdio_run(input)`` runs ``code`` once with that input
    as a judge would: file descriptors 0 and 1 are files holding the input and catching the output (so
    ``input()``, ``sys.stdin.buffer``, ``open(0)``, ``os.read(0, n)``, ``os.write(1, b)`` and fast-I/O wrappers
    over ``fileno()`` all work, and ``input()`` prints its prompt); ``__name__ == "__main__"``; ``SystemExit``
    ends the run normally; the case ends as an interpreter exits (threads joined, ``atexit`` handlers run,
    ``sys.stdout`` flushed, the program's objects finalized). Returns what it printed."""
    return _STDIO_HARNESS.format(source=code)


def official_stdio_program(code: str) -> str:
    """dLLM-RL's ``worker_stdio`` as a sandbox program (same ``_stdio_run`` as :func:`stdio_program`): ``input`` is
    a global that ignores its prompt and returns the next of ``stdin_text.splitlines()``, ``sys.stdin`` is a separate
    ``StringIO`` of the same text (no ``.buffer``: reading bytes fails, as there), ``sys.stdout`` a ``StringIO``, and
    an exception makes the output ``"error: <message>"``."""
    return _OFFICIAL_STDIO_HARNESS.format(source=code)


def stdio_test(test_input: str, test_output: str) -> str:
    """One stdio test for :func:`stdio_program`: the output must equal ``test_output`` up to whitespace. The sandbox
    runs only the call; the comparison is decided outside it (``verdict``), so the expected output never enters the
    sandboxed process."""
    return f"assert _stdio_run({test_input!r}).split() == {test_output!r}.split()"


def stdio_tests(test_input: Any, test_output: Any, row: str = "a stdio row") -> list[str]:
    """A stdio row's ``test_input`` / ``test_output`` columns as :func:`stdio_test` snippets, one per pair. Columns
    of unequal length are refused, naming the ``row``: ``zip`` would drop the extra inputs or outputs, and the row
    would be graded on fewer tests than it has."""
    inputs, outputs = as_string_list(test_input), as_string_list(test_output)
    if len(inputs) != len(outputs):
        raise ValueError(f"{row} has {len(inputs)} test inputs but {len(outputs)} outputs.")
    return [stdio_test(i, o) for i, o in zip(inputs, outputs)]


def extract_code_official(text: str) -> str | None:
    """dLLM-RL's extraction: the last ``` ```python ... ``` ``` match, stripped; ``None`` without one (dLLM-RL runs a
    sentence instead, which fails every test)."""
    matches = _FENCE.findall(text)
    return matches[-1].strip() if matches else None


def as_string_list(value: Any) -> list[str]:
    """A test column as a list of strings (a JSON-encoded list in a string column is decoded, and so is one written
    as a Python literal, ``str(list)``: run as one test it would be a list literal that always passes)."""
    if isinstance(value, str):
        decoded = decode_list_string(value)
        value = decoded if decoded is not None else [value]
    return [str(v) for v in (value or [])]


def run_official(
    program: str,
    tests: list[str],
    stdio: bool,
    time_limit: float | None = None,
    limits: SandboxLimits | None = None,
    python: str | None = None,
    function_slack: float = FUNCTION_SLACK,
    stdio_slack: float = 0.0,
) -> SandboxResult:
    """Run ``tests`` against ``program`` with dLLM-RL's time limits: one sandbox run of ``time_limit +
    function_slack`` seconds for a ``function`` row (program and all asserts), one run of ``time_limit +
    stdio_slack`` seconds per test for a ``stdio`` row (``program`` from :func:`stdio_program`). ``limits`` gives
    the other sandbox limits; ``time_limit`` ``None`` is dLLM-RL's default, 1 s. ``outcomes`` has one verdict per
    test; ``status`` is the first run's that was not ``"ok"``."""
    limit = time_limit_seconds(time_limit)
    base = limits or SandboxLimits()
    if not stdio:  # dLLM-RL runs `exec(textwrap.dedent(snippet))`
        result = run_tests(textwrap.dedent(program), tests, replace(base, timeout=limit + function_slack), python,
                           ordered=True)  # its asserts run in order in one namespace
        result.outcomes = result.outcomes or [False] * len(tests)  # a sandbox error reports no outcomes
        return result
    case_limits = replace(base, timeout=limit + stdio_slack)
    runs = [run_tests(program, [test], case_limits, python) for test in tests]
    outcomes = [run.all_passed for run in runs]
    return SandboxResult(
        next((r.status for r in runs if r.status != "ok"), "ok"),
        passed=sum(outcomes),
        total=len(tests),
        returncode=runs[-1].returncode if runs else None,
        output="".join(r.output for r in runs)[-10_000:],
        duration=sum(r.duration for r in runs),
        errors=[f"test {i}: {e}" for i, r in enumerate(runs) for e in r.errors][:20],
        isolation=runs[0].isolation if runs else {},
        verified=sum(r.verified for r in runs),
        outcomes=outcomes,
    )


def official_code_outcomes(
    code: str | None,
    test_method: str,
    test_list: Any = None,
    test_input: Any = None,
    test_output: Any = None,
    time_limit: float | None = None,
    limits: SandboxLimits | None = None,
    python: str | None = None,
    function_slack: float = FUNCTION_SLACK,
    stdio_slack: float = 0.0,
) -> list[bool]:
    """One verdict per test of a dLLM-RL row (its columns as arguments) for the extracted ``code`` (``None``: every
    test fails), run by :func:`run_official`."""
    method, tests = _official_tests(test_method, test_list, test_input, test_output)
    if code is None or not tests:
        return [False] * len(tests)
    program = official_stdio_program(code) if method == "stdio" else code
    return run_official(program, tests, method == "stdio", time_limit, limits, python, function_slack,
                        stdio_slack).outcomes


def time_limit_seconds(time_limit: Any) -> float:
    """A row's ``test_time_limit`` in seconds (``None``: dLLM-RL's default, 1 s); ``ValueError`` unless a finite
    number > 0; a boolean is refused, as the eval loader refuses it (``float(True)`` would read it as 1 s)."""
    try:
        limit = math.nan if isinstance(time_limit, bool) else float(DEFAULT_TIME_LIMIT if time_limit is None
                                                                     else time_limit)
    except (TypeError, ValueError):
        limit = math.nan
    if not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"test_time_limit must be a finite number of seconds > 0, got {time_limit!r}.")
    return limit


def _official_tests(test_method: Any, test_list: Any, test_input: Any, test_output: Any) -> tuple[str, list[str]]:
    """A dLLM-RL row's ``test_method`` (lower case) and the test snippets the sandbox runs for it."""
    method = str(test_method).lower()
    if method not in ("function", "stdio"):
        raise ValueError(f"test_method must be 'function' or 'stdio', got {test_method!r}.")
    if method == "function":  # tests that check nothing (data, no assert) are refused: they would pass every program
        return method, checked_snippets(column_items(test_list, "test_list"), "test_list")
    return method, stdio_tests(test_input, test_output)


class OfficialCodeReward:
    """dLLM-RL's code reward on its code schema (module docstring): the **number** of tests passed, which the
    trainer z-scores within the group (dLLM-RL's advantage; any scale of it gives the same z-scores). Rows without
    ``test_method`` or without tests get ``None``, and so do rows with a test that cannot be decided outside the
    sandbox when ``allow_unverified=False`` (as in :func:`~trl_diffusion.rewards.make_code_reward`; stdio tests are
    always decided outside). A callable class, so it pickles."""

    def __init__(
        self,
        memory_mb: int = 1024,
        max_workers: int = 4,
        function_slack: float = FUNCTION_SLACK,
        stdio_slack: float = 0.0,
        python: str | None = None,
        name: str = "official_code_reward",
        allow_unverified: bool = True,
        max_output_bytes: int = 1_000_000,
    ) -> None:
        self.limits = SandboxLimits(memory_mb=memory_mb, max_output_bytes=max_output_bytes)
        self.max_workers = max(1, max_workers)
        self.function_slack, self.stdio_slack = function_slack, stdio_slack
        self.python = resolve_python(python)
        self.__name__ = name
        self.allow_unverified = allow_unverified

    def __call__(
        self,
        completions: list[Any],
        test_method: list[Any] | None = None,
        test_list: list[Any] | None = None,
        test_input: list[Any] | None = None,
        test_output: list[Any] | None = None,
        prefix: list[Any] | None = None,
        test_time_limit: list[Any] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        n = len(completions)
        columns = {"test_method": test_method, "test_list": test_list, "test_input": test_input,
                   "test_output": test_output, "prefix": prefix, "test_time_limit": test_time_limit}
        if test_method is None:
            given = {**kwargs, **{name: value for name, value in columns.items() if value is not None}}
            raise missing_column_error(self.__name__, "test kind", "'test_method' ('function' or 'stdio', beside "
                                       "'test_list' or 'test_input'/'test_output')", given,
                                       "dataset.map(lambda row: {'test_method': 'function'})")
        check_column_lengths(self.__name__, n, columns)
        rows = [{k: (v[i] if v is not None else None) for k, v in columns.items()} for i in range(n)]
        for i, row in enumerate(rows):  # every row's tests are checked before any program runs
            if row["test_method"] is not None:
                try:
                    _official_tests(row["test_method"], row["test_list"], row["test_input"], row["test_output"])
                    time_limit_seconds(row["test_time_limit"])
                except ValueError as exc:
                    raise ValueError(f"{self.__name__}: row {i} of the batch: {exc}") from None
        texts = [completion_to_text(c) for c in completions]
        with ThreadPoolExecutor(max_workers=min(self.max_workers, max(n, 1))) as pool:
            return list(pool.map(self._score, texts, rows))

    def check_dataset(self, dataset: Any, split: str = "train") -> None:
        """Raise, naming the row, for a row of an in-memory ``dataset`` whose tests the reward refuses, so that a
        trainer refuses it when built rather than when the row's batch comes up."""
        names = ("test_method", "test_list", "test_input", "test_output")
        if "test_method" not in dataset.column_names:
            return  # the first call names the missing column
        columns = [n for n in (*names, "test_time_limit") if n in dataset.column_names]
        for i, row in enumerate(dataset.with_format(None).select_columns(columns)):  # plain Python rows
            if row["test_method"] is not None:
                try:
                    _official_tests(*(row.get(name) for name in names))
                    time_limit_seconds(row.get("test_time_limit"))
                except ValueError as exc:
                    raise ValueError(f"{self.__name__}: row {i} of the {split} dataset: {exc}") from None

    def _score(self, completion: str, row: dict[str, Any]) -> float | None:
        method = row["test_method"]
        if method is None:
            return None
        if not self.allow_unverified:  # decided from the row alone, before the completion runs
            _, tests = _official_tests(method, row["test_list"], row["test_input"], row["test_output"])
            if any(plan_test(t).kind == "unverified" for t in tests):
                return None
        stdio = str(method).lower() == "stdio"
        code = extract_code_official(completion if stdio else (row["prefix"] or "") + completion)
        outcomes = official_code_outcomes(code, method, row["test_list"], row["test_input"], row["test_output"],
                                          row["test_time_limit"], self.limits, self.python, self.function_slack,
                                          self.stdio_slack)
        return float(sum(outcomes)) if outcomes else None


def make_official_code_reward(
    memory_mb: int = 1024,
    max_workers: int = 4,
    function_slack: float = FUNCTION_SLACK,
    stdio_slack: float = 0.0,
    python: str | None = None,
    name: str = "official_code_reward",
    allow_unverified: bool = True,
    max_output_bytes: int = 1_000_000,
) -> OfficialCodeReward:
    """Build dLLM-RL's code reward (see :class:`OfficialCodeReward`).

    Args:
        memory_mb: memory of each sandbox run (dLLM-RL has no memory limit).
        max_workers: completions checked concurrently.
        function_slack: seconds added to a ``function`` row's ``test_time_limit`` (dLLM-RL: 2).
        stdio_slack: seconds added to each ``stdio`` case's limit (dLLM-RL: 0; its limit also covers starting a
            Python process, as ours covers starting the sandbox).
        python: interpreter for the sandbox (default: the current one): a path or a name on PATH, resolved (and
            checked: ValueError) when the reward is built.
        name: ``__name__`` shown in TRL logs.
        allow_unverified: run tests that cannot be decided outside the sandbox (loops, assignments, helper
            functions) inside it, where a program can forge their result (default, as dLLM-RL does); ``False`` gives
            such rows ``None`` instead, so no reward can be forged (as in
            :func:`~trl_diffusion.rewards.make_code_reward`).
        max_output_bytes: bytes a sandbox run may print, and bytes of its report (a stdio case's output, JSON);
            more fails the test (dLLM-RL has no cap: raise it for tests with very large outputs).
    """
    return OfficialCodeReward(memory_mb, max_workers, function_slack, stdio_slack, python, name, allow_unverified,
                              max_output_bytes)


official_code_reward = OfficialCodeReward()
"""dLLM-RL's code reward with its limits (see :class:`OfficialCodeReward`)."""
