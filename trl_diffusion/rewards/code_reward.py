"""Code execution reward: run the completion's last Python code block against the row's tests in the sandbox.

Tests come from the dataset row in one of two shapes:

* ``tests``: a list of assert statements (MBPP style), each counted as one test; a single string is one test;
* ``test`` + ``entry_point``: a HumanEval-style ``test`` string that defines ``check(candidate)``; it is run as one
  test, ``check(<entry_point>)`` (a test that calls ``check`` itself, or defines none, runs as it is). The entry
  point is a function's name, or a method of a class the program defines (LeetCode's ``Solution().twoSum``: one
  instance per test, as natively).

A column that holds no test snippets (stdin/stdout cases, numbers) or tests that check nothing (``f(2) == 4`` without
``assert``, test functions nothing calls) is a ``ValueError`` naming the row and column: run as they are, they would
pass every program.

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
import functools
import json
import re
from collections.abc import Callable, Iterable
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
    Blocks in other languages are ignored and an unterminated block (a truncated completion) does not count. Line
    endings of every kind are read (``\r\n``, a lone ``\r``: a fence written with them was not found). A fence
    indented on its line (inside a Markdown list item) has that indentation removed from its lines, as CommonMark
    reads it (its code failed with an IndentationError); a block after a fence at the line's start keeps its lines
    as written (a function body continuing a header).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # as Python reads source lines
    blocks = [(_LANG.match(match.group(1)).group(1).lower(), _without_fence_indent(text, match))
              for match in _FENCE.finditer(text)]
    for wanted in (lambda lang: lang in _PYTHON_TAGS, lambda lang: lang == ""):
        chosen = [body for lang, body in blocks if wanted(lang)]
        if chosen:
            return chosen[-1]
    return None


def _without_fence_indent(text: str, fence: re.Match) -> str:
    """The body of a ``_FENCE`` match without the opening fence's indentation (when only white space precedes it on
    its line): up to that much white space taken from the start of each line, as CommonMark reads an indented fence
    -- unless the lines as written are Python and that reading is not (code at the margin under an indented
    fence, whose body would lose the indentation it needs); a line of a multi-line string may sit at the margin."""
    body, lead = fence.group(2), text[text.rfind("\n", 0, fence.start()) + 1:fence.start()]
    if not lead or lead.strip():
        return body
    dedented = re.sub(rf"(?m)^[ \t]{{1,{len(lead)}}}", "", body)
    return body if _parses(body) and not _parses(dedented) else dedented


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError, MemoryError, RecursionError):  # ValueError: a null byte
        return False
    return True


def build_tests(tests: Any = None, test: Any = None, entry_point: Any = None) -> list[str] | None:
    """Turn one row's test columns into a list of snippets for the sandbox; ``None`` if the row has no tests.

    Raises ``ValueError`` for a column that holds no test snippets (stdin/stdout cases, numbers) or tests that check
    nothing (see :func:`_vacuous`): run as they are, they would pass every program."""
    if tests is not None:
        return checked_snippets(column_items(tests, "tests"), "tests") or None
    if isinstance(test, str) and test.strip():
        return checked_snippets([_with_check_call(test, entry_point)], "test")
    return None


def _with_check_call(test: str, entry_point: Any) -> str:
    """A HumanEval ``test`` as its harness runs it: followed by ``check(<entry_point>)`` where it defines ``check``
    and does not call it at its top level. A test that calls ``check`` itself (an export ending with the call) or
    defines none (plain asserts) runs as it is: a second call made the snippet one the verdict module cannot decide,
    so a program could forge its pass, and a call of a ``check`` the test does not define failed every program but
    one that defines ``check`` itself."""
    if not entry_point:
        return test
    call = f"{test}\n\ncheck({entry_point})\n"
    try:
        tree = ast.parse(test)
    except SyntaxError:
        return call  # fails in the sandbox, as any program's run of it
    defines = any(isinstance(node, _FUNCTIONS) and node.name == "check" for node in tree.body)
    top_level = [node for node in tree.body if not isinstance(node, _FUNCTIONS)
                 and not (isinstance(node, ast.If) and _is_main_guard(node.test))]
    calls = any(_called(node) == "check" for statement in top_level for node in ast.walk(statement))
    return call if defines and not calls else test


def column_items(value: Any, column: str) -> list[Any]:
    """The items of a test column: a list, or a string holding a list (JSON or a Python literal, ``str(list)``, e.g.
    a CSV export: run as one test it would be a list literal that always passes) or else one snippet."""
    if value is None:
        return []
    if isinstance(value, str):
        decoded = decode_list_string(value)
        return decoded if decoded is not None else [value]
    if isinstance(value, (dict, bytes)) or not isinstance(value, Iterable):
        raise ValueError(f"the `{column}` column holds {_describe(value)}, not a list of test snippets."
                         f"{_stdio_hint(value)}")
    return list(value)


def checked_snippets(items: list[Any], column: str) -> list[str]:
    """The non-blank snippets of a row's ``items``; ``ValueError`` naming ``column`` for an item that is not a string
    of Python, or tests that would pass every program (see :func:`_vacuous`)."""
    snippets = []
    for item in items:
        if item is None:  # a nullable list column's empty entry
            continue
        if not isinstance(item, str):
            raise ValueError(f"the `{column}` column holds {_describe(item)} where a test snippet (a string of "
                             f"Python such as 'assert f(2) == 4') is expected.{_stdio_hint(item)}")
        if item.strip():
            snippets.append(item)
    problem = _vacuous(tuple(snippets))
    if problem:
        raise ValueError(f"the `{column}` column holds {problem}")
    return snippets


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_STDIO_KEYS = frozenset(("input", "inputs", "output", "outputs", "stdin", "stdout", "test_cases", "input_output"))


def _describe(value: Any) -> str:
    """What a test column holds, for an error: the keys of a dict, else its type and start."""
    if isinstance(value, dict):
        return f"a dict with keys {', '.join(_clip(key) for key in list(value)[:6])}"
    return f"{type(value).__name__} {_clip(value)}"


def _stdio_hint(value: Any) -> str:
    """Where stdin/stdout cases (APPS / TACO ``input_output``, ``verification_info``, ``{"input", "output"}``) run."""
    if not (isinstance(value, dict) and _STDIO_KEYS & {str(key).lower() for key in value}):
        return ""
    return (" It looks like stdin/stdout test cases: those run with official_code_reward (or the eval's code_tests "
            "format) on rows with test_method='stdio' and `test_input` / `test_output` lists of strings.")


def _clip(value: Any) -> str:
    """``repr(value)``, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# a GRPO batch repeats each row once per completion; 512 rows of large tests (HumanEval+: ~130 KB) hold < 100 MB
@functools.lru_cache(maxsize=512)
def _vacuous(snippets: tuple[str, ...]) -> str | None:
    """Why a row's tests would pass every program that runs, or ``None``. A snippet must not be data or drop a
    comparison's result (``f(2) == 4``); a test function (``check``, ``test_*``) that checks must run; and what the
    row runs must check something: an ``assert``, a ``raise``, an ``assert*`` call, an exit (``sys.exit``: a failure
    here), or a run of a function of the row that does (called, passed to a call as in ``map(one, xs)``, or
    registered by a decorator the row defines), or creating a class whose ``__init__`` does. A unittest case checks
    nothing by itself (its failures are only recorded): the row must run it and assert the result. Other snippets
    (``push(1)``, helpers, docstrings) may sit beside the checks. A function's body runs only when it runs, and never
    under ``if __name__ == "__main__":`` (tests run in the program's module, ``solution``). Only parsed, never run; a
    snippet that does not parse is left to fail. Strict on purpose: a refused row is a clear error, a vacuous one
    would silently score every program 1.0."""
    trees, unparsed = [], False
    for snippet in snippets:
        try:
            tree = ast.parse(snippet)
            data = _data(snippet, tree)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            unparsed = True
            continue
        if data:
            return f"data, not a test: {_clip(snippet)} ({_describe(data[0])}).{_stdio_hint(data[0])}"
        trees.append((snippet, tree))
    nodes = [n for _, t in trees for n in ast.walk(t)]
    cases = [c for c in nodes if isinstance(c, ast.ClassDef) and any(_name(b) == "TestCase" for b in c.bases)]
    in_cases = {id(m) for c in cases for m in ast.walk(c)}
    functions = [n for n in nodes if isinstance(n, _FUNCTIONS) and id(n) not in in_cases]
    # a decorator that defines no inner function returns what it was given (a wrapper, @timeout, defines one)
    registrars = {f.name for f in functions if not any(isinstance(n, _FUNCTIONS) for n in ast.walk(f) if n is not f)}
    checking: set[str] = set()
    while True:  # functions that check, directly or through another such one
        more = {f.name for f in functions if f.name not in checking and _checks(ast.walk(f), checking, registrars)}
        if not more:
            break
        checking |= more
    checking |= {c.name for c in nodes if isinstance(c, ast.ClassDef) and id(c) not in in_cases and any(
        isinstance(m, _FUNCTIONS) and m.name == "__init__" and _checks(ast.walk(m), checking, registrars)
        for m in c.body)}  # this class's own __init__ (another class's checking __init__ shares the name)
    executed = [list(_executed(tree.body)) for _, tree in trees]
    # what runs: the calls the module level makes, then those in the bodies of the functions they run
    run = {name for ran in executed for n in ran for name in _runs(n)}
    run |= {f.name for f in functions if _registered(f, registrars)}
    while True:
        more = {name for f in functions if f.name in run for n in _executed(f.body) for name in _runs(n)} - run
        if not more:
            break
        run |= more
    case = next((c for c in cases if c.name not in run), None)
    if case is not None:  # unittest.main() / discovery look in __main__, not in the program's module
        return (f"a unittest.TestCase ({case.name}) that nothing runs here (unittest.main() collects tests from "
                f"__main__; tests run in the program's module, `solution`): run it explicitly, e.g. "
                f"unittest.TextTestRunner().run(unittest.defaultTestLoader.loadTestsFromTestCase({case.name})), "
                "and assert the result was successful.")
    for (snippet, _tree), ran in zip(trees, executed):
        dropped = next((n.value for n in ran if isinstance(n, ast.Expr) and _compares(n.value)), None)
        if dropped is not None:
            try:
                shown = ast.unparse(dropped)[:80]
            except RecursionError:  # a very long expression: its start is in the snippet shown
                shown = "..."
            return (f"a comparison whose result is dropped, which passes every program: {_clip(snippet)}: write "
                    f"`assert {shown}`.")
    for snippet, tree in trees:  # pytest / HumanEval test functions that nothing runs: their checks never run
        idle = {f.name for f in ast.walk(tree) if isinstance(f, _FUNCTIONS) and id(f) not in in_cases
                and (f.name == "check" or f.name.startswith("test")) and f.name in checking} - run
        if idle:
            return (f"a test whose checks never run, which passes every program: {_clip(snippet)}: "
                    f"{_uncalled(tree, idle)}")
    for (snippet, _tree), ran in zip(trees, executed):  # a test whose only checks always hold
        vacuous = [n for n in ran if isinstance(n, ast.Assert) and _always_true(n.test)]
        if vacuous and not _checks([n for n in ran if n not in vacuous], checking, registrars):
            return f"an assert that holds whatever the program does, which passes every program: {_clip(snippet)}."
    if trees and not unparsed and not any(_checks(ran, checking, registrars) for ran in executed):
        return (f"no test that checks anything (no `assert`, `raise`, `assert*` call or exit runs), so every program "
                f"would pass: {_clip(snippets[0])}.")
    return None


def _uncalled(tree: ast.Module, names: set[str]) -> str:
    """Why the functions ``names`` of ``tree``, which check, never run."""
    guarded = {_called(n) for g in _main_guards(tree) for s in g.body for n in ast.walk(s)} & names
    if guarded:
        return (f"it calls {', '.join(sorted(guarded))} only under `if __name__ == \"__main__\":`, which does not run "
                "here (the test runs in the program's module, `solution`): call it at the top level.")
    if "check" in names:
        return ("it defines check(candidate) and never calls it (HumanEval style): give the `entry_point` column "
                "(the function's name), or end the test with check(<entry point>).")
    return (f"it defines {', '.join(sorted(names))} and nothing calls them (pytest-style tests, e.g. KodCode's, are "
            "not collected here): call them at its end, or write the test as asserts.")


def _always_true(node: ast.expr) -> bool:
    """A condition true without reading the program: a true constant (``True``, ``1``, ``'x'``), a non-empty tuple,
    list or set display (``assert (f(2) == 4, "message")``, always true), ``not`` a false constant, ``or`` with such an
    operand, ``and`` of such operands."""
    if isinstance(node, ast.Constant):
        return bool(node.value)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not) and isinstance(node.operand, ast.Constant):
        return not node.operand.value
    if isinstance(node, ast.BoolOp):
        return (any if isinstance(node.op, ast.Or) else all)(map(_always_true, node.values))
    return False


def _compares(node: ast.expr) -> bool:
    """A comparison, or ``and`` / ``or`` of comparisons."""
    if isinstance(node, ast.BoolOp):
        return all(map(_compares, node.values))
    return isinstance(node, ast.Compare)


def _data(snippet: str, tree: ast.Module) -> list[Any]:
    """``[value]`` if the snippet is only a value (JSON, or a Python literal), else ``[]``."""
    try:
        return [json.loads(snippet)]
    except ValueError:
        pass
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Expr):
        if isinstance(tree.body[0].value, ast.Constant) and isinstance(tree.body[0].value.value, str):
            return []  # a docstring: no data, no check (the row's other snippets must check)
        try:
            return [ast.literal_eval(tree.body[0].value)]
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return []


def _called(node: ast.AST) -> str:
    """The name a call calls (``f`` in ``f(x)`` and ``obj.f(x)``), else ``""``."""
    if not isinstance(node, ast.Call):
        return ""
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _checks(nodes: Iterable[ast.AST], checking: set[str], registrars: set[str]) -> bool:
    """Whether ``nodes`` check: an ``assert`` / ``raise``, an ``assert*`` or exit call, or a run of ``checking``."""
    return any(isinstance(n, (ast.Assert, ast.Raise)) or _exits(n) or "assert" in _called(n).lower()
               or bool(_runs(n) & checking) or (_registered(n, registrars) and n.name in checking) for n in nodes)


def _exits(node: ast.AST) -> bool:
    """``exit()``, ``quit()``, ``sys.exit()`` or ``os._exit()``: a test that exits fails here."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in ("exit", "quit")
    return isinstance(func, ast.Attribute) and (_name(func.value), func.attr) in (("sys", "exit"), ("os", "_exit"))


def _runs(node: ast.AST) -> set[str]:
    """The names a call may run: the function it calls (``f()``, ``obj.f()``) and those it is given as arguments
    (``map(one, xs)``, ``runner(test_a)``)."""
    if not isinstance(node, ast.Call):
        return set()
    given = [*node.args, *(k.value for k in node.keywords)]
    return ({_called(node)} | {a.id for a in given if isinstance(a, ast.Name)}) - {""}


def _registered(node: ast.AST, registrars: set[str]) -> bool:
    """A definition decorated (``@register``, bare) by a function of the row that may register it for a runner."""
    return isinstance(node, _FUNCTIONS) and any(isinstance(d, ast.Name) and d.id in registrars
                                                 for d in node.decorator_list)


def _name(node: ast.AST) -> str:
    """``f`` for ``f`` and ``mod.f``, else ``""``."""
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _main_guards(tree: ast.Module) -> list[ast.If]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.If) and _is_main_guard(n.test)]


def _is_main_guard(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = (test.left, test.comparators[0])
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _executed(body: list[ast.stmt]) -> Iterable[ast.AST]:
    """The nodes that run when ``body`` runs: never ``if __name__ == "__main__":``, nor the bodies of functions."""
    stack: list[ast.AST] = list(body)
    while stack:
        node = stack.pop()
        if isinstance(node, _FUNCTIONS):
            yield node  # the definition runs (its decorators too), not its body
            stack.extend(node.decorator_list)
            continue
        if isinstance(node, ast.Lambda):  # its body runs only when it is called
            continue
        if isinstance(node, ast.If) and _is_main_guard(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


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
        jobs = []
        for i, (completion, row) in enumerate(zip(completions, rows)):
            try:  # every row's tests are checked before any program runs
                snippets = self._snippets(*row)
            except ValueError as exc:
                raise ValueError(f"{self.__name__}: row {i} of the batch: {exc}") from None
            jobs.append((extract_code(completion_to_text(completion)), snippets))
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

    def check_dataset(self, dataset: Any, split: str = "train") -> None:
        """Raise, naming the row, for a row of an in-memory ``dataset`` whose test columns the reward refuses (see
        :func:`build_tests`), so that a trainer refuses it when built rather than when the row's batch comes up."""
        columns = [name for name in ("tests", "test", "entry_point") if name in dataset.column_names]
        if not {"tests", "test"} & set(columns):
            return  # the first call names the missing column
        for i, row in enumerate(dataset.with_format(None).select_columns(columns)):  # plain Python rows
            try:
                self._snippets(row.get("tests"), row.get("test"), row.get("entry_point"))
            except ValueError as exc:
                raise ValueError(f"{self.__name__}: row {i} of the {split} dataset: {exc}") from None

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


code_execution_reward.check_dataset = _DEFAULT.check_dataset  # a trainer checks its datasets with it when built
