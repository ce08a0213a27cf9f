"""Decide code tests outside the sandbox: split each ``assert`` into program calls (run in the sandbox) and a check
(evaluated here, on plain data), so that the expected values never enter the sandboxed process.

A test such as ``assert f([3, 1]) == [1, 3]`` becomes one *probe*, ``f([3, 1])``, which the sandbox evaluates and
sends back as tagged plain data (None, bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set,
frozenset), and the *check* ``<probe 0> == [1, 3]``, which :func:`judge` evaluates in this process with a small
interpreter over exact builtin values. Whatever the program does inside its process (patch builtins, walk frames,
forge output, return objects whose ``__eq__`` always answers True) it can only change the plain values it sends
back, i.e. its own answers; it never sees the expected values and never evaluates the comparison.

What counts as a probe (evaluated in the sandbox): an expression rooted at a program name (a name the test does not
import and that is neither a builtin nor a standard-library module; or HumanEval's ``candidate``), followed by
attribute accesses, subscripts and calls whose arguments are *inputs*: literals, containers of literals, arithmetic
on them and calls of builtins or of modules (``f(list(range(5)))``, ``f(math.pi)``). An argument that contains
another program call is not an input (``check(f(x), 4)`` would evaluate the comparison inside the sandbox), so
such tests are not decomposed. A direct call of a standard-library module's name (``string(3)``: a module cannot be
called, so natively this is always the program's function) counts as a program call too.

A test that calls no program name is about a library-named function (the task's entry point is called ``filter``,
``round``, ...). Which of its calls are probes is decided from the test alone, never from the program (see
:func:`plan_test`), so no program can choose how its tests are run: the one builtin or module the test calls that
the check cannot evaluate itself (``filter([1, 2, 3, 4])``) is the *subject*, and its calls with literal arguments
are probes, whether the program binds the name (its function runs) or not (the real one runs, in the sandbox).

What the check may contain (evaluated here): literals and displays, arithmetic (with size and cost caps), comparisons,
``and``/``or``/``not``, conditional expressions, subscripts and slices, a fixed set of pure builtins (``abs``,
``len``, ``set``, ``sorted``, ``round``, ``isinstance``, ...), ``math`` functions and constants, and pure methods of
plain values (``str.split``, ``dict.items``, ...). Probes may only sit where Python evaluates unconditionally (not in
the right operand of ``and``/``or``, a later link of a chained comparison, or a branch of ``x if c else y``), so
they run exactly as often and in the same order as natively.

Test shapes that decompose: a snippet of ``assert`` statements (MBPP; imports allowed), and a HumanEval-style
snippet ``[imports] [METADATA = {...}] def check(candidate): <asserts and imports> check(<entry_point>)``.

LeetCode-style tests (``newfacade/LeetCodeDataset``) name a method of a class the program defines: the entry point
``Solution().twoSum``, run as ``check(Solution().twoSum)``, or plain ``assert Solution().twoSum([2, 7], 9) == [0, 1]``.
Both decompose. The entry point may be a program name followed by attribute accesses and calls with input arguments;
the sandbox evaluates it once per test, before the test's probes, and every ``candidate(...)`` of that test calls the
same bound method: exactly as natively, where ``check(Solution().twoSum)`` builds one instance before ``check`` runs
(so a solution that keeps state in its instance behaves the same). In an assert, a method called on a fresh instance,
``Name(<inputs>).method(<inputs>)``, is a probe (natively each such assert builds its own instance, and so does each
probe) when the name is a program name written as a class (CapWords: its first letter is upper case) and ``method`` is
not a dunder, whatever its name (``Solution().count(0)`` is the program's method, not ``list.count``): a test that
calls a method on what a *function* returned (``make(x).equals(y)``) usually means a library method whose argument is
the expected value, so it stays unverified (``f(x).count(1)`` runs ``list.count`` here, on the plain value).
Anything else (loops, assignments, helper functions, ``print``) is *unverified*: it runs the old way, inside the
sandbox, where the program can forge its result (see ``docs/rewards.md``).

LeetCode's linked-list and binary-tree problems compare structures through helpers that the row's prompt defines
(``list_node``, ``tree_node``, ``is_same_list``, ``is_same_tree``; the prompt goes before the completion, so they are
the program's names). Where the test does not bind these names itself (by an import, or as ``check``'s parameter), a
call ``list_node(<literals>)`` or ``tree_node(<literals>)`` is an *input* of a probe
(``candidate(head=list_node([1, 2]))``: the program's helper builds it in the sandbox, as natively), and
``is_same_list(a, b)`` / ``is_same_tree(a, b)`` is decided here when each of ``a`` and ``b`` is a probe or the
matching builder with literal arguments: a probe compared this way is sent back in a plain form
(:func:`_is_same_list`, :func:`_is_same_tree`), the builder's structure is made here from the literals with the
prompt's own steps (:func:`_list_node`, :func:`_tree_node`; the program's builder never sees the expected values), and
the comparison follows the prompt's helper on the plain forms (the section on plain forms, at the end of this module,
lists where that differs from running the helpers natively). The helpers a check uses must be bound in the program
(``Plan.has``), as natively. Any other use of them (``f(x) == list_node([1])``, keyword arguments,
``is_same_list(f(x), None)``, a chain such as ``list_node([1]).val``) stays unverified.
"""

from __future__ import annotations

import ast
import builtins
import math
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MAX_DEPTH", "Plan", "ProbeError", "decode", "judge", "plan_test", "plan_tests", "program_bindings"]

MAX_DEPTH = 100  # nesting depth of a value sent back by a probe (the sandbox's encoder uses the same bound)
_MAX_ITEMS = 10**7  # largest sequence an arithmetic operation of a check may build
_MAX_BITS = 10**6  # largest integer (in bits) ``**`` and ``<<`` of a check may build
# Largest product of two integers' sizes (bits) that ``%``, ``//``, ``divmod``, ``math.gcd`` and ``round`` of a check
# may take: quadratic algorithms, about 10-30 ms here (1.3 s for ``%``, 2.4 s for ``gcd`` of 2M- and 1M-bit probes).
_MAX_BIT_PRODUCT = 10**10
_MAX_SAME_HASH = 16  # distinct numbers/strings of one hash in a probe's value (see decode)

_PURE_BUILTINS = {
    name: getattr(builtins, name)
    for name in (
        "abs", "all", "any", "ascii", "bin", "bool", "chr", "complex", "dict", "divmod", "enumerate", "float",
        "frozenset", "hex", "int", "isinstance", "len", "list", "max", "min", "oct", "ord", "repr", "reversed",
        "round", "set", "sorted", "str", "sum", "tuple", "type", "zip",
    )
}  # fmt: skip
_MATH = {
    name: getattr(math, name)
    for name in (
        "acos", "asin", "atan", "atan2", "ceil", "copysign", "cos", "degrees", "e", "exp", "fabs", "floor", "fsum",
        "gcd", "hypot", "inf", "isclose", "isfinite", "isinf", "isnan", "log", "log10", "log2", "nan", "pi",
        "radians", "sin", "sqrt", "tan", "tau", "trunc",
    )
}  # fmt: skip
_MODULES = {"math": _MATH}
_STR_METHODS = {
    "capitalize", "casefold", "count", "endswith", "find", "index", "isalnum", "isalpha", "isascii", "isdecimal",
    "isdigit", "isidentifier", "islower", "isnumeric", "isspace", "istitle", "isupper", "join", "lower", "lstrip",
    "rfind", "rindex", "rsplit", "rstrip", "split", "splitlines", "startswith", "strip", "swapcase", "title", "upper",
}  # fmt: skip
_METHODS = {
    str: _STR_METHODS,
    bytes: _STR_METHODS - {"casefold", "isdecimal", "isidentifier", "isnumeric"},
    list: {"count", "index"},
    tuple: {"count", "index"},
    dict: {"get", "items", "keys", "values"},
    set: {"isdisjoint", "issubset", "issuperset", "union", "intersection", "difference", "symmetric_difference"},
    frozenset: {"isdisjoint", "issubset", "issuperset", "union", "intersection", "difference",
                "symmetric_difference"},
}  # fmt: skip
_ALL_METHODS = set().union(*_METHODS.values())
# The helpers of LeetCode rows' prompts: each comparison's builder, and the plain form ("list", "tree") in which the
# sandbox sends back a probe given to it (see _Planner._same).
_COMPARERS = {"is_same_list": "list_node", "is_same_tree": "tree_node"}
_BUILDERS = {"list_node": "list", "tree_node": "tree"}
_HELPERS = frozenset(_COMPARERS) | frozenset(_BUILDERS)
# Builtins that consume an iterable whole, in order, whatever it is: a probe that is their only positional argument
# is sent back as its items ("items"), so a program may return a generator, map, dict view or its own iterable there
# (``set(f(x)) == {1, 2}``), as natively; the builtin then runs here on the list of items, with the same result.
_CONSUMERS = (list, tuple, set, frozenset, sorted)
_BINOPS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
    ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.BitAnd: operator.and_,
}  # fmt: skip
_UNARYOPS = {ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Not: operator.not_, ast.Invert: operator.invert}
_CMPOPS = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.Is: operator.is_, ast.IsNot: operator.is_not,
    ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
}  # fmt: skip
# Names that are never the program's own unless it defines them: builtins and standard-library modules.
_LIBRARY_NAMES = frozenset(dir(builtins)) | frozenset(sys.stdlib_module_names)
# Standard-library modules that are not builtins: ``string(3)`` can only ever call the program's function.
_MODULE_NAMES = frozenset(sys.stdlib_module_names) - frozenset(dir(builtins))


def _sum(iterable: Any, start: Any = 0) -> Any:
    """``sum`` over numbers only (summing lists is quadratic: a program-chosen list could stall the check).

    Integers are exact, so the leading run of them is added smallest first, with the same result: left to right, a
    program-chosen ``[2**2_000_000, 1, 1, ...]`` copies the huge running total once per item (seconds of the
    trainer's GIL for a 1 MB report). What follows (a float, ...) is added in the native order."""
    if not isinstance(start, (int, float, complex)):
        raise TypeError("sum() with a non-numeric start is not available to the parent-side check")
    items = list(iterable)
    if type(start) not in (int, bool):
        return sum(items, start)
    n = 0
    while n < len(items) and type(items[n]) in (int, bool):
        n += 1
    head = sorted(items[:n], key=lambda value: abs(value).bit_length())
    return sum(items[n:], start + sum(head))


def _limit_int_cost(*bits: int) -> None:
    """Refuse integer division, gcd or rounding on operands of these sizes when it would hold the trainer's GIL for
    long: its cost grows with the product of the two largest sizes, and a probe can send a 2M-bit integer."""
    top = sorted(bits)[-2:]
    if len(top) == 2 and top[0] * top[1] > _MAX_BIT_PRODUCT:
        raise MemoryError("the check's integers are too large to divide, round or take the gcd of here")


def _divmod(a: Any, b: Any, /) -> Any:
    """``divmod`` under :func:`_limit_int_cost`."""
    if isinstance(a, int) and isinstance(b, int):
        _limit_int_cost(a.bit_length(), b.bit_length())
    return divmod(a, b)


def _gcd(*integers: Any) -> int:
    """``math.gcd`` under :func:`_limit_int_cost`."""
    _limit_int_cost(*(i.bit_length() for i in integers if isinstance(i, int)))
    return math.gcd(*integers)


def _round(number: Any, ndigits: Any = None) -> Any:
    """``round``; an integer rounded to ``ndigits < 0`` is divided by ``10 ** -ndigits``: both are capped."""
    if isinstance(number, int) and isinstance(ndigits, int) and ndigits < 0:
        power = -ndigits * 10 // 3 + 1  # bits of 10 ** -ndigits
        if power > _MAX_BITS:
            raise MemoryError("the check would build an integer that is too large")
        _limit_int_cost(number.bit_length(), power)
    return round(number, ndigits)


_PURE_BUILTINS.update(sum=_sum, divmod=_divmod, round=_round)
_MATH["gcd"] = _gcd
_PARENT_NAMES = frozenset(_PURE_BUILTINS) | frozenset(_MODULES)  # library names the check can evaluate itself


class Unverifiable(Exception):
    """The test has a shape whose verdict cannot be decided outside the sandbox."""


class ProbeError(Exception):
    """A probe raised in the sandbox, or its value could not be sent back as plain data."""


@dataclass(frozen=True)
class Plan:
    """How one test snippet is run and decided.

    ``kind``: ``"verified"`` (probes run in the sandbox, the asserts are decided by :func:`judge`), ``"unverified"``
    (the snippet runs inside the sandbox, which reports whether it raised) or ``"failed"`` (decided without running:
    not Python, or a check that would call a builtin the program redefines; ``reason`` says which).
    """

    source: str
    kind: str
    reason: str = ""
    global_imports: tuple[str, ...] = ()
    local_imports: tuple[str, ...] = ()
    # HumanEval's entry point (``add``, LeetCode's ``Solution().twoSum``): evaluated once per test in the sandbox and
    # bound to ``param`` for all its probes, as natively (``check(Solution().twoSum)`` builds one instance).
    candidate: str | None = None
    param: str | None = None
    has: tuple[str, ...] = ()  # names the program must bind (modules and helpers the check uses), as natively
    probes: tuple[str, ...] = ()
    # Per probe, how the sandbox sends its value back: "" (plain data), "list" or "tree" (a structure's plain form,
    # for is_same_list / is_same_tree; see _Planner._same), "items" (the list of its items: see _CONSUMERS).
    shapes: tuple[str, ...] = ()
    checks: tuple[ast.expr, ...] = field(default=(), repr=False)
    names: dict[str, Any] = field(default_factory=dict, repr=False)
    asserts: tuple[tuple[str, range], ...] = field(default=(), repr=False)  # (source, its probes) per check

    def sandbox_spec(self) -> dict[str, Any]:
        """What the sandbox needs to run this test's probes (no expected values)."""
        return {
            "global_imports": list(self.global_imports),
            "local_imports": list(self.local_imports),
            "candidate": self.candidate,
            "param": self.param,
            "has": list(self.has),
            "probes": list(self.probes),
            "shapes": list(self.shapes),
        }


def plan_test(source: Any, shadowed: frozenset[str] = frozenset()) -> Plan:
    """Split one test snippet into sandbox probes and parent-side checks (see the module docstring).

    Whether a test is verified or unverified depends on the test alone: the snippet is planned first as if the
    program defined no library name, and that plan's kind is final unless it is ``"verified"``. A program binds
    names in ways no static analysis sees (``globals()['filter'] = ...``, ``builtins.round = ...``, ``exec``), so
    a plan that depended on :func:`program_bindings` would let a program pick the forgeable unverified mode.

    ``shadowed``: builtin or standard-module names the program defines itself (:func:`program_bindings`). Only the
    names the check could evaluate itself (its pure builtins and ``math``) matter, and only for a verified test,
    which they can keep verified or fail, never make unverified: in a test that calls no program name, the one of
    them whose calls hold all the test's other calls of such names and of unknown library functions in their
    arguments (``round(2.5)``, ``sum(range(5))``) is the test's subject, and its calls with input arguments are
    probes (natively they call the program's function); any other use of such a name fails the test rather than
    evaluating the real builtin in its place (or the program's one in the sandbox, where it could compute the
    expected side: ``f(x) == sorted([3, 1])``).
    """
    if not isinstance(source, str):
        return Plan(str(source), "failed", f"a test must be a string, got {type(source).__name__}")
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError) as exc:
        return Plan(source, "failed", f"{type(exc).__name__}: {exc}")
    plan = _plan(source, tree, frozenset())
    shadowed = frozenset(shadowed) & _PARENT_NAMES
    if plan.kind != "verified" or not shadowed:
        return plan
    own = _plan(source, tree, shadowed)
    if own.kind == "unverified":  # not expected; in any case the program must not choose this mode
        return Plan(source, "failed", f"the program redefines a name the test uses ({own.reason})")
    return own


def _plan(source: str, tree: ast.Module, shadowed: frozenset[str]) -> Plan:
    try:
        return _Planner(source, shadowed).plan(tree)
    except _Shadowed as exc:
        return Plan(source, "failed", str(exc))
    except (Unverifiable, RecursionError) as exc:
        return Plan(source, "unverified", str(exc) or type(exc).__name__)


def plan_tests(tests: list[Any], shadowed: frozenset[str] = frozenset()) -> list[Plan]:
    """:func:`plan_test` for each of a row's tests, in order, where every test after the row's first unverified one
    becomes unverified (``run_tests(ordered=True)``): natively it runs after that snippet, in the state it left
    (names it bound, objects it changed, ``sys`` settings), so it runs after it in the unverified run; the verified
    probes never share a process with an unverified snippet, which may hold expected values. Depends on the tests
    alone."""
    plans = [plan_test(test, shadowed) for test in tests]
    first = next((i for i, plan in enumerate(plans) if plan.kind == "unverified"), len(plans))
    # after it a test runs in the sandbox anyway, so one failed for a builtin the program redefines runs too
    return [Plan(plan.source, "unverified") if i > first else plan for i, plan in enumerate(plans)]


def program_bindings(program: str) -> frozenset[str]:
    """Builtin and standard-module names the program defines itself (``def``, ``class``, assignment, ``global``),
    found statically. Imports are not counted: ``from numpy import sum`` keeps the name's meaning. A program this
    interpreter cannot parse (a syntax error, or syntax of a newer Python than this one) counts as defining them
    all: the checks fail closed rather than evaluate a builtin it may redefine."""
    try:
        tree = ast.parse(program)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return _LIBRARY_NAMES
    names: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Global):
            names.update(node.names)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            stack.extend(n for n in ast.walk(node) if isinstance(n, ast.Global))
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return frozenset(names & _LIBRARY_NAMES)


class _Shadowed(Exception):
    """A check would evaluate a builtin that the program redefines."""


_NOT_ALLOWED = object()  # an imported name the parent-side check cannot use


class _Planner:
    def __init__(self, source: str, shadowed: frozenset[str]) -> None:
        self.source = source
        self.shadowed = shadowed
        self.imported: dict[str, Any] = {}  # name -> module table (dict), whitelisted value, or _NOT_ALLOWED
        self.param: str | None = None
        self.probes: list[str] = []
        self.shapes: list[str] = []
        self.has: list[str] = []
        self.names: dict[str, Any] = {}  # what the parent-side check may reference, by (placeholder) name
        # Library names whose calls are probes in this test (see _choose_subjects), with the test their arguments
        # must pass: _literal, or _input for a builtin the program defines.
        self.subjects: dict[str, Callable[[ast.expr | None], bool]] = {}

    def plan(self, tree: ast.Module) -> Plan:
        body, candidate, global_imports, local_imports = tree.body, None, [], []
        check = _humaneval_check(body)
        if check is not None:
            func, entry = check
            for stmt in body[:-1]:
                if stmt is func or _is_docstring(stmt):
                    continue
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    global_imports.append(self._import(stmt))
                elif not _is_unused_literal_assignment(stmt, tree):
                    raise Unverifiable(f"unsupported statement before check(): {ast.unparse(stmt)[:80]}")
            if not self._entry_point(entry):
                raise Unverifiable(f"unsupported entry point: check({ast.unparse(entry)[:80]})")
            candidate = ast.unparse(entry)
            self.param, body = func.args.args[0].arg, func.body
        asserts = []
        for stmt in body:
            if isinstance(stmt, ast.Assert):
                asserts.append(stmt.test)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                (local_imports if check is not None else global_imports).append(self._import(stmt))
            elif not (isinstance(stmt, ast.Pass) or _is_docstring(stmt)):
                raise Unverifiable(f"unsupported statement: {ast.unparse(stmt)[:80]}")
        self._choose_subjects(asserts)
        checks, sources = [], []
        for test in asserts:
            first = len(self.probes)
            checks.append(self._check(test, conditional=False))
            sources.append((ast.unparse(test), range(first, len(self.probes))))
        return Plan(
            self.source, "verified", global_imports=tuple(global_imports), local_imports=tuple(local_imports),
            candidate=candidate, param=self.param, has=tuple(self.has), probes=tuple(self.probes),
            shapes=tuple(self.shapes), checks=tuple(checks), names=self.names, asserts=tuple(sources),
        )  # fmt: skip

    def _import(self, stmt: ast.Import | ast.ImportFrom) -> str:
        """Record the names an import binds (whitelisted ``math`` members stay usable); return its source."""
        if isinstance(stmt, ast.Import):
            for alias in stmt.names:
                top = alias.name.split(".")[0]
                whole = alias.asname is not None or alias.name == top  # binds the module itself
                table = _MODULES.get(alias.name) if whole else None
                self.imported[alias.asname or top] = _NOT_ALLOWED if table is None else table
        else:
            table = _MODULES.get(stmt.module or "", {}) if stmt.level == 0 else {}
            for alias in stmt.names:
                if alias.name == "*":
                    raise Unverifiable("star import")
                self.imported[alias.asname or alias.name] = table.get(alias.name, _NOT_ALLOWED)
        return ast.unparse(stmt)

    # -- classification ------------------------------------------------------------------------------------------

    def _is_program_name(self, name: str) -> bool:
        return name == self.param or (name not in self.imported and name not in _LIBRARY_NAMES)

    def _is_program_call(self, node: ast.expr) -> bool:
        """A chain rooted at a program name, or at a direct call of a module's name (``string(3)``, ``string(3)[0]``:
        a module is not callable, so natively that is the program's function or an error)."""
        root = _root_name(node)
        if root is None:
            return False
        if self._is_program_name(root):
            return True
        return root in _MODULE_NAMES and root not in self.imported and isinstance(_first_link(node), ast.Call)

    def _entry_point(self, node: ast.expr) -> bool:
        """What ``check(...)`` may be given: a name (HumanEval's function), or a program name followed by attribute
        accesses and calls with input arguments (``Solution().twoSum``, LeetCode's entry points). The sandbox
        evaluates it once per test (``Plan.candidate``), as natively; its arguments are the test's, not expected
        values (those are in the asserts), and it runs before the probes, in the same order as natively."""
        if isinstance(node, ast.Name):
            return True
        while isinstance(node, (ast.Attribute, ast.Call)):
            if isinstance(node, ast.Call):
                if not self._inputs(node):
                    return False
                node = node.func
            else:
                node = node.value
        return isinstance(node, ast.Name) and self._is_program_name(node.id)

    def _instance_method(self, func: ast.Attribute) -> bool:
        """``Name(<inputs>).method``: a method of a fresh instance of a class the program defines (``Solution()
        .twoSum``), decided from the test alone: the name is a program name written as a class (CapWords) and the
        method is not a dunder. Its name does not matter: ``Solution().count(0)`` is the program's method, even
        though plain values have a ``count`` too (the instance is the program's object, not a plain value). A
        method called on what a function returned (``make(x).equals(y)``, ``f(x).all()``, ``f(x).count(1)``) is
        usually a library type's, whose argument may be the expected value: not a probe. ``candidate`` is never
        taken for a class (HumanEval's entry points are functions)."""
        owner, name = func.value, func.attr
        if name.startswith("__") and name.endswith("__"):
            return False
        if not (isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name)):
            return False
        cls = owner.func.id
        return cls != self.param and cls[:1].isupper() and self._is_program_name(cls)

    def _is_helper(self, name: str) -> bool:
        """A name of the LeetCode prompt's helpers that means the helper: the test does not import it and it is not
        ``check``'s parameter (a test that binds it otherwise, by ``def`` or assignment, is unverified anyway)."""
        return name in _HELPERS and name != self.param and name not in self.imported

    def _builder(self, node: ast.expr | None) -> str | None:
        """``list_node(<literals>)`` or ``tree_node(<literals>)``: the helper's name, else ``None``. Only literals,
        so that a structure built here, from the expected side, holds nothing but the test's own data."""
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BUILDERS):
            return None
        return node.func.id if self._is_helper(node.func.id) and self._inputs(node, _literal) else None

    def _choose_subjects(self, asserts: list[ast.expr]) -> None:
        """Pick the library function a test that calls no program name is about, from the test alone.

        Its *subject* is the one builtin or module it calls with no parent-side meaning (``filter([1, 2, 3, 4])``,
        ``collections.Counter('ab')``; ``range`` in ``sorted(range(3))``); with two or more of them the test is
        ambiguous (``filter([1, 2]) == list(map(...))``: the program could compute the expected side) and stays
        unverified. With ``shadowed`` (a verified test only), a pure builtin the test calls that the program defines
        becomes the subject instead, if every other such call and every call of an unknown library function is in
        its arguments (``round(sum(range(5)))``); any use of the others fails the test (``_parent_value``).
        """
        nodes = [n for test in asserts for n in ast.walk(test)]
        if any(isinstance(n, ast.Name) and self._is_program_name(n.id) for n in nodes):
            return
        if any(isinstance(n, (ast.Call, ast.Attribute, ast.Subscript)) and self._is_program_call(n) for n in nodes):
            return
        calls = [n for n in nodes if isinstance(n, ast.Call) and _root_name(n) in _LIBRARY_NAMES]
        calls = [c for c in calls if _root_name(c) not in self.imported]
        # Calls the check cannot evaluate here as the real builtin: unknown to it, or defined by the program.
        risky = [c for c in calls if _root_name(c) not in _PARENT_NAMES or _root_name(c) in self.shadowed]
        for name in sorted({_root_name(c) for c in risky} & self.shadowed):
            inside = {id(n) for c in calls if _root_name(c) == name for a in _arguments(c) for n in ast.walk(a)}
            if all(_root_name(c) == name or id(c) in inside for c in risky):  # at most one name can pass
                if all(self._wraps_only_inputs(c) for c in calls if _root_name(c) == name):
                    self.subjects[name] = self._input
                return
        unknown = {_root_name(c) for c in calls} - _PARENT_NAMES
        if len(unknown) == 1:
            self.subjects[unknown.pop()] = _literal

    def _wraps_only_inputs(self, call: ast.Call) -> bool:
        """Whether a call of a builtin the program defines may run as the test's subject without taking an expected
        value into the sandbox: its arguments call nothing (``round(2.5, 1)``), or each of them is a call of a
        library function the check cannot evaluate, with literal arguments (``sum(range(5))``). Otherwise the
        builtin wraps the function under test together with other values, which may be the expected ones
        (``abs(round(2.675, 2) - 2.68) < 1e-9``, ``math.isclose(round(x), 3)``, ``sum(range(5), -10) == 0``): the
        program's ``abs`` would compute the comparison itself."""
        args = _arguments(call)
        if not any(isinstance(n, ast.Call) for a in args for n in ast.walk(a)):
            return True
        return all(
            isinstance(a, ast.Call)
            and _root_name(a) in _LIBRARY_NAMES
            and _root_name(a) not in _PARENT_NAMES
            and _root_name(a) not in self.imported
            and self._inputs(a, _literal)
            and _literal_chain(a.func)
            for a in args
        )

    def _has_probe(self, node: ast.expr) -> bool:
        """Whether ``node`` holds a probe (see :meth:`_probe_root`)."""
        return any(isinstance(n, ast.expr) and self._probe_root(n) for n in ast.walk(node))

    def _probe_root(self, node: ast.expr) -> bool:
        """A program call or a call of the test's subject (``_choose_subjects``): a name, then attributes,
        subscripts and calls whose arguments are all inputs (for a subject that is not the program's for sure:
        literals, so that a real library function never combines values the program computed with the test's).
        A chain rooted at one of the LeetCode prompt's helpers is never a probe: ``list_node([5, 4])`` is the expected
        side (``_same`` builds it here), ``is_same_list(...)`` the comparison (``_same`` decides it here)."""
        root = _root_name(node)
        if root is not None and self._is_helper(root):
            return False
        if self._is_program_call(node):
            return self._chain(node, self._input)
        if root not in self.subjects or not _calls_in(node):
            return False
        return self._chain(node, self.subjects[root])

    def _chain(self, node: ast.expr, argument: Callable[[ast.expr | None], bool]) -> bool:
        if isinstance(node, ast.Name):
            return True
        if isinstance(node, ast.Attribute):
            return self._chain(node.value, argument)
        if isinstance(node, ast.Subscript):
            return self._chain(node.value, argument) and argument(node.slice)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and (func.attr in _ALL_METHODS or _calls_in(func.value)):
                # A method of a returned value, or one plain values have: decided here, on the plain value, since
                # its arguments may be expected values (``.startswith(y)``, ``.equals(y)``); except a method of a
                # fresh instance of a program class (``Solution().twoSum(...)``, ``Solution().count(0)``), which is
                # the function under test.
                if not self._instance_method(func):
                    return False
            return self._chain(func, argument) and self._inputs(node, argument)
        return False

    def _inputs(self, call: ast.Call, argument: Callable[[ast.expr | None], bool] | None = None) -> bool:
        argument = argument or self._input
        return all(not isinstance(a, ast.Starred) and argument(a) for a in call.args) and all(
            k.arg is not None and argument(k.value) for k in call.keywords
        )

    def _input(self, node: ast.expr | None) -> bool:
        """An argument computed without the program: literals, displays, operators, non-program names and calls."""
        if node is None or isinstance(node, ast.Constant):
            return True
        if isinstance(node, ast.Name):
            return not self._is_program_name(node.id)
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return all(not isinstance(e, ast.Starred) and self._input(e) for e in node.elts)
        if isinstance(node, ast.Dict):
            return all(k is not None and self._input(k) for k in node.keys) and all(map(self._input, node.values))
        if isinstance(node, ast.UnaryOp):
            return self._input(node.operand)
        if isinstance(node, ast.BinOp):
            return self._input(node.left) and self._input(node.right)
        if isinstance(node, ast.Slice):
            return self._input(node.lower) and self._input(node.upper) and self._input(node.step)
        if isinstance(node, ast.Attribute):
            return self._input(node.value)
        if isinstance(node, ast.Subscript):
            return self._input(node.value) and self._input(node.slice)
        if isinstance(node, ast.Call):  # the prompt's helpers build the test's structures (list_node([1, 2]))
            return self._builder(node) is not None or (self._input(node.func) and self._inputs(node))
        return False

    # -- the parent-side check -----------------------------------------------------------------------------------

    def _check(self, node: ast.expr, conditional: bool) -> ast.expr:
        """Return ``node`` with every probe replaced by a placeholder; raise :class:`Unverifiable` if unsupported."""
        if self._probe_root(node):
            return self._probe(node, conditional)
        sub = self._check
        if isinstance(node, ast.Constant):
            return node
        if isinstance(node, ast.Name):
            return self._name(node.id, self._parent_value(node.id))
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            if any(isinstance(e, ast.Starred) for e in node.elts):
                raise Unverifiable("starred expression")
            return type(node)(elts=[sub(e, conditional) for e in node.elts], ctx=ast.Load())
        if isinstance(node, ast.Dict):
            if any(k is None for k in node.keys):
                raise Unverifiable("dict unpacking")
            pairs = [(sub(k, conditional), sub(v, conditional)) for k, v in zip(node.keys, node.values)]
            return ast.Dict(keys=[k for k, _ in pairs], values=[v for _, v in pairs])
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARYOPS:
            return ast.UnaryOp(op=node.op, operand=sub(node.operand, conditional))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            left = sub(node.left, conditional)
            if isinstance(node.op, ast.Mod) and not isinstance(left, ast.Constant):
                left = ast.Call(func=self._name("#no_format", _no_format), args=[left], keywords=[])
            return ast.BinOp(left=left, op=node.op, right=sub(node.right, conditional))
        if isinstance(node, ast.BoolOp):
            values = [sub(v, conditional or i > 0) for i, v in enumerate(node.values)]
            return ast.BoolOp(op=node.op, values=values)
        if isinstance(node, ast.Compare) and all(type(op) in _CMPOPS for op in node.ops):
            operands = [node.left, *node.comparators]
            for op, a, b in zip(node.ops, operands, operands[1:]):
                # probes are decoded one by one: two are never the same object here (f(1) is not f(2) would hold)
                if isinstance(op, (ast.Is, ast.IsNot)) and self._has_probe(a) and self._has_probe(b):
                    raise Unverifiable(f"identity of two program results: {ast.unparse(node)[:80]}")
            left = sub(node.left, conditional)  # first: probes are numbered, and run, in evaluation order
            comparators = [sub(c, conditional or i > 0) for i, c in enumerate(node.comparators)]
            return ast.Compare(left=left, ops=node.ops, comparators=comparators)
        if isinstance(node, ast.IfExp):
            test = sub(node.test, conditional)
            return ast.IfExp(test=test, body=sub(node.body, True), orelse=sub(node.orelse, True))
        if isinstance(node, ast.Subscript):
            return ast.Subscript(
                value=sub(node.value, conditional), slice=sub(node.slice, conditional), ctx=ast.Load()
            )
        if isinstance(node, ast.Slice):
            parts = [None if p is None else sub(p, conditional) for p in (node.lower, node.upper, node.step)]
            return ast.Slice(*parts)
        if isinstance(node, ast.Attribute):
            return self._module_member(node)
        if isinstance(node, ast.Call):
            if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
                raise Unverifiable("argument unpacking")
            func = node.func
            if isinstance(func, ast.Name) and func.id in _COMPARERS and self._is_helper(func.id):
                return self._same(node, conditional)
            if isinstance(func, ast.Name):
                func = self._name(func.id, self._parent_value(func.id))
                if (any(self.names[func.id] is consumer for consumer in _CONSUMERS) and len(node.args) == 1
                        and self._probe_root(node.args[0])):
                    args = [self._probe(node.args[0], conditional, "items")]
                    probes = len(self.probes)
                    keywords = [ast.keyword(arg=k.arg, value=sub(k.value, conditional)) for k in node.keywords]
                    if len(self.probes) != probes:  # natively they run before the items are taken: not here
                        raise Unverifiable(f"a program call in a keyword of {func.id}: {ast.unparse(node)[:80]}")
                    return ast.Call(func=func, args=args, keywords=keywords)
            elif isinstance(func, ast.Attribute) and self._is_module(func.value):
                func = self._module_member(func)
            elif isinstance(func, ast.Attribute) and func.attr in _ALL_METHODS:
                func = ast.Attribute(value=sub(func.value, conditional), attr=func.attr, ctx=ast.Load())
            else:
                raise Unverifiable(f"unsupported call: {ast.unparse(node)[:80]}")
            args = [sub(a, conditional) for a in node.args]
            keywords = [ast.keyword(arg=k.arg, value=sub(k.value, conditional)) for k in node.keywords]
            return ast.Call(func=func, args=args, keywords=keywords)
        raise Unverifiable(f"unsupported expression: {ast.unparse(node)[:80]}")

    def _probe(self, node: ast.expr, conditional: bool, shape: str = "") -> ast.Name:
        """Record ``node`` as the next probe (its value sent back as ``shape``, see ``Plan.shapes``); return its
        placeholder. Probes run unconditionally in the sandbox, so one in a conditional position is refused."""
        if conditional:
            if _root_name(node) in self.shadowed:  # evaluated here in the plan without ``shadowed``
                raise _Shadowed(f"the check calls {_root_name(node)!r}, which the program redefines")
            raise Unverifiable(f"program call in a conditionally evaluated position: {ast.unparse(node)[:80]}")
        self.probes.append(ast.unparse(node))
        self.shapes.append(shape)
        return self._name(f"#probe{len(self.probes) - 1}", None)

    def _same(self, node: ast.Call, conditional: bool) -> ast.Call:
        """``is_same_list(a, b)`` / ``is_same_tree(a, b)`` of the LeetCode prompt, decided here: each argument is a
        probe, whose structure the sandbox sends back in plain form, or the matching builder with literal arguments
        (``list_node([5, 4])``), built here. Both are compared by the helper's plain-form twin (``_HELPER_TWINS``).
        Any other argument (a constant, a keyword, the other kind of builder) leaves the test unverified."""
        name = node.func.id
        builder = _COMPARERS[name]
        if len(node.args) != 2 or node.keywords:
            raise Unverifiable(f"unsupported call: {ast.unparse(node)[:80]}")
        args: list[ast.expr] = []
        for arg in node.args:  # in Python's order: probes are numbered, and run, in evaluation order
            if self._builder(arg) == builder:
                args.append(self._built(arg, conditional))
            elif self._probe_root(arg):
                args.append(self._probe(arg, conditional, _BUILDERS[builder]))
            else:
                raise Unverifiable(f"unsupported argument of {name}: {ast.unparse(arg)[:80]}")
        self._need(name)
        return ast.Call(func=self._name(f"#{name}", _HELPER_TWINS[name]), args=args, keywords=[])

    def _built(self, call: ast.Call, conditional: bool) -> ast.Call:
        """A builder's call (``list_node([5, 4])``) made here, on its literal arguments (see ``_builder``)."""
        name = call.func.id
        self._need(name)
        args = [self._check(a, conditional) for a in call.args]
        keywords = [ast.keyword(arg=k.arg, value=self._check(k.value, conditional)) for k in call.keywords]
        return ast.Call(func=self._name(f"#{name}", _HELPER_TWINS[name]), args=args, keywords=keywords)

    def _need(self, name: str) -> None:
        """The check uses ``name`` as the program binds it natively: the sandbox reports whether it is bound."""
        if name not in self.has:
            self.has.append(name)

    def _name(self, name: str, value: Any) -> ast.Name:
        if not name.startswith("#probe"):
            self.names[name] = value
        return ast.Name(id=name, ctx=ast.Load())

    def _parent_value(self, name: str) -> Any:
        """The value a name has in the parent-side check (whitelisted builtins and ``math`` members only)."""
        if name in self.imported:
            value = self.imported[name]
            if value is _NOT_ALLOWED or type(value) is dict:
                raise Unverifiable(f"{name!r} is not available to the parent-side check")
            return value
        if name in self.shadowed:
            raise _Shadowed(f"the check uses {name!r}, which the program redefines")
        if name in _PURE_BUILTINS:
            return _PURE_BUILTINS[name]
        raise Unverifiable(f"{name!r} is not available to the parent-side check")

    def _is_module(self, node: ast.expr) -> bool:
        if not isinstance(node, ast.Name):
            return False
        return type(self.imported.get(node.id)) is dict or (node.id not in self.imported and node.id in _MODULES)

    def _module_member(self, node: ast.Attribute) -> ast.Name:
        """``math.isclose`` and the like, as a flat name; natively the module must be bound, so probe for that."""
        if not self._is_module(node.value):
            raise Unverifiable(f"unsupported attribute: {ast.unparse(node)[:80]}")
        module = node.value.id
        table = self.imported.get(module) or _MODULES[module]
        if node.attr not in table:
            raise Unverifiable(f"{module}.{node.attr} is not available to the parent-side check")
        if module not in self.imported:
            if module in self.shadowed:
                raise _Shadowed(f"the check uses {module!r}, which the program redefines")
            self._need(module)
        return self._name(f"{module}.{node.attr}", table[node.attr])


def _literal_chain(node: ast.expr) -> bool:
    """A name followed by attribute accesses only (``range``, ``collections.Counter``)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name)


def _calls_in(node: ast.expr) -> bool:
    """Whether an attribute/subscript chain contains a call (so it is a returned value, not a program object)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Call):
            return True
        node = node.value
    return False


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _first_link(node: ast.expr) -> ast.expr:
    """The attribute access, subscript or call applied to the root name of a chain (the node itself if none)."""
    while True:
        inner = node.func if isinstance(node, ast.Call) else getattr(node, "value", None)
        if not isinstance(inner, (ast.Attribute, ast.Subscript, ast.Call)):
            return node
        node = inner


def _arguments(call: ast.Call) -> list[ast.expr]:
    return [*call.args, *(k.value for k in call.keywords)]


def _literal(node: ast.expr | None) -> bool:
    """Literals, displays of them and operators on them: an argument nothing but the test can compute."""
    if node is None or isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return all(not isinstance(e, ast.Starred) and _literal(e) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _literal(k) for k in node.keys) and all(map(_literal, node.values))
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) and _literal(node.right)
    if isinstance(node, ast.Slice):
        return _literal(node.lower) and _literal(node.upper) and _literal(node.step)
    return False


def _no_format(value: Any) -> Any:
    """``%`` with a computed left operand: refuse string formatting (a program-chosen format could be huge)."""
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError("string formatting with a computed format is not available to the parent-side check")
    return value


def _humaneval_check(body: list[ast.stmt]) -> tuple[ast.FunctionDef, ast.expr] | None:
    """``(def check(candidate), entry point)`` if the snippet ends with ``check(<entry point>)`` calling a local def
    (:meth:`_Planner._entry_point` decides which entry points decompose)."""
    if not body or not isinstance(body[-1], ast.Expr) or not isinstance(body[-1].value, ast.Call):
        return None
    call = body[-1].value
    if not (isinstance(call.func, ast.Name) and len(call.args) == 1 and not call.keywords):
        return None
    defs = [s for s in body[:-1] if isinstance(s, ast.FunctionDef) and s.name == call.func.id]
    if len(defs) != 1:
        return None
    func = defs[0]
    a = func.args
    if func.decorator_list or len(a.args) != 1 or a.posonlyargs or a.kwonlyargs or a.vararg or a.kwarg:
        return None
    return func, call.args[0]


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def _is_unused_literal_assignment(stmt: ast.stmt, tree: ast.Module) -> bool:
    """``METADATA = {...}``: a literal bound to a name nothing else in the snippet reads (it is not run)."""
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
        return False
    try:
        ast.literal_eval(stmt.value)
    except (ValueError, SyntaxError, TypeError, RecursionError):
        return False
    name = stmt.targets[0].id
    return not any(isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load) for n in ast.walk(tree))


# ----------------------------------------------------------------------------------------------------------------
# Plain data coming back from the sandbox
# ----------------------------------------------------------------------------------------------------------------


def decode(encoded: Any) -> Any:
    """Rebuild a value from the sandbox's tagged encoding; only exact builtin types can come out of it.

    Raises ``ValueError`` for anything malformed (only a program that writes to the report channel itself can
    produce that), for a value holding more than ``_MAX_SAME_HASH`` distinct numbers or strings of one hash
    (``k * (2**61 - 1)`` for many ``k``), and for a set, frozenset or dict whose members (keys) include more than
    ``_MAX_SAME_HASH`` distinct values of one hash (tuples or frozensets of distinct numbers can be solved to share a
    hash): a set or dict of those, built here by the decoder or by a check such as ``set(f(x)) == {...}`` (which
    :func:`judge` limits the same way), takes quadratic time while holding the trainer's GIL. The cost is linear in
    the size of the encoding: every value is hashed a bounded number of times (frozensets cache their hash).
    """
    return _decode(encoded, 0, {})


def _limit_same_hash(values: Any) -> None:
    """Refuse values about to become members of one set or keys of one dict if more than ``_MAX_SAME_HASH``
    distinct ones share a hash (building the container would take quadratic time). One ``hash()`` per value and at
    most ``_MAX_SAME_HASH`` equality tests, each no costlier than reading the value: linear in the values' size."""
    values = list(values)
    hashes = list(map(hash, values))
    if len(set(hashes)) == len(hashes):  # the usual case, at C speed
        return
    seen: dict[int, list[Any]] = {}
    for value, value_hash in zip(values, hashes):
        same = seen.setdefault(value_hash, [])
        if value not in same:
            if len(same) >= _MAX_SAME_HASH:
                raise ValueError(f"more than {_MAX_SAME_HASH} distinct values share one hash")
            same.append(value)


def _decode(encoded: Any, depth: int, hashes: dict[int, list[Any]]) -> Any:
    if depth > MAX_DEPTH or not isinstance(encoded, list) or not encoded or not isinstance(encoded[0], str):
        raise ValueError("malformed value")
    tag, args = encoded[0], encoded[1:]
    if tag == "N" and not args:
        return None
    if len(args) != 1:
        raise ValueError("malformed value")
    arg = args[0]
    if tag == "b" and type(arg) is bool:
        return arg
    if tag in "sifcy" and len(tag) == 1:
        return _scalar(tag, arg, hashes)
    if tag == "Y" and type(arg) is str:
        return bytearray.fromhex(arg)
    if type(arg) is not list:
        raise ValueError("malformed value")
    if tag == "d":
        pairs = [_decode(p, depth + 1, hashes) for p in arg]  # each pair is encoded as a tuple
        if not all(type(p) is tuple and len(p) == 2 for p in pairs):
            raise ValueError("malformed dict")
        _limit_same_hash(key for key, _ in pairs)
        return dict(pairs)
    items = [_decode(item, depth + 1, hashes) for item in arg]
    containers = {"l": list, "t": tuple, "S": set, "F": frozenset}
    if tag not in containers:
        raise ValueError("malformed value")
    if tag in ("S", "F"):
        _limit_same_hash(items)
    return containers[tag](items)


def _scalar(tag: str, arg: Any, hashes: dict[int, list[Any]]) -> Any:
    """Decode a hashable scalar and count it among the distinct values of its hash."""
    if tag == "s" and type(arg) is str:
        value = arg
    elif tag == "i" and type(arg) is str:
        value = int(arg, 16)
    elif tag == "f" and type(arg) is str:
        value = float.fromhex(arg)
    elif tag == "c" and type(arg) is list and len(arg) == 2 and all(type(p) is str for p in arg):
        value = complex(float.fromhex(arg[0]), float.fromhex(arg[1]))
    elif tag == "y" and type(arg) is str:
        value = bytes.fromhex(arg)
    else:
        raise ValueError("malformed value")
    same = hashes.setdefault(hash(value), [])
    if value not in same:
        if len(same) >= _MAX_SAME_HASH:
            raise ValueError(f"more than {_MAX_SAME_HASH} distinct values share one hash")
        same.append(value)
    return value


# ----------------------------------------------------------------------------------------------------------------
# The parent-side check
# ----------------------------------------------------------------------------------------------------------------


class _Raised:
    """A probe that raised in the sandbox: evaluating it raises :class:`ProbeError`, as the call would natively."""

    def __init__(self, message: str) -> None:
        self.message = message


def judge(plan: Plan, values: list[Any]) -> str | None:
    """Evaluate the plan's asserts with the probes' values; ``None`` if all hold, else the reason it failed.

    ``values[i]`` is the decoded value of probe ``i``, or a :class:`ProbeError` if it raised or could not be sent
    back. Any exception while evaluating a check fails the test, as it would natively.
    """
    env = dict(plan.names)
    for i, value in enumerate(values):
        env[f"#probe{i}"] = _Raised(str(value)) if isinstance(value, ProbeError) else value
    for check, (source, probes) in zip(plan.checks, plan.asserts):
        try:
            if not _eval(check, env):
                got = ", ".join(f"{plan.probes[i][:60]} = {_short(values[i])}" for i in probes)
                return f"AssertionError: assert {source[:120]}" + (f" ({got})" if got else "")
        except ProbeError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever a native assert would raise, the test fails
            return f"{type(exc).__name__}: {str(exc)[:200]}"
    return None


def _short(value: Any) -> str:
    """``repr(value)`` for a failure message, cut to 80 characters."""
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's limit on printed digits (sys.get_int_max_str_digits), maybe nested
        if isinstance(value, int):
            return f"<int of {value.bit_length()} bits>"
        return f"<{type(value).__name__} holding an integer too large to print>"
    return text if len(text) <= 80 else text[:77] + "..."


def _eval(node: ast.expr, env: dict[str, Any]) -> Any:
    """A small interpreter for the node types :class:`_Planner` lets through, over plain values only."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        value = env[node.id]
        if isinstance(value, _Raised):
            raise ProbeError(value.message)
        return value
    if isinstance(node, ast.Tuple):
        return tuple(_eval(e, env) for e in node.elts)
    if isinstance(node, ast.List):
        return [_eval(e, env) for e in node.elts]
    if isinstance(node, ast.Set):
        return {_eval(e, env) for e in node.elts}
    if isinstance(node, ast.Dict):
        return {_eval(k, env): _eval(v, env) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp):
        return _UNARYOPS[type(node.op)](_eval(node.operand, env))
    if isinstance(node, ast.BinOp):
        return _binop(type(node.op), _eval(node.left, env), _eval(node.right, env))
    if isinstance(node, ast.BoolOp):
        for value in node.values:
            result = _eval(value, env)
            if bool(result) == isinstance(node.op, ast.Or):
                break
        return result
    if isinstance(node, ast.Compare):
        left = _eval(node.left, env)
        for op, comparator in zip(node.ops, node.comparators):
            right = _eval(comparator, env)
            result = _CMPOPS[type(op)](left, right)
            if not result:
                break
            left = right
        return result
    if isinstance(node, ast.IfExp):
        return _eval(node.body, env) if _eval(node.test, env) else _eval(node.orelse, env)
    if isinstance(node, ast.Subscript):
        return _eval(node.value, env)[_eval(node.slice, env)]
    if isinstance(node, ast.Slice):
        return slice(*(None if p is None else _eval(p, env) for p in (node.lower, node.upper, node.step)))
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Attribute):  # a method of a plain value
            owner = _eval(node.func.value, env)
            if node.func.attr not in _METHODS.get(type(owner), ()):
                raise AttributeError(f"{type(owner).__name__}.{node.func.attr} is not available to the check")
            func = getattr(owner, node.func.attr)
        else:
            owner, func = None, _eval(node.func, env)
        args = [_eval(a, env) for a in node.args]
        kwargs = {k.arg: _eval(k.value, env) for k in node.keywords}
        # Whatever builds a set or a dict from an iterable the program chose (``set(f(x))``, ``dict(zip(...))``,
        # ``s.issubset(f(x))``) gets its members counted first, as the decoder does (see decode).
        if (func is set or func is frozenset) and len(args) == 1:
            args = [_hashable(args[0])]
        elif func is dict and len(args) == 1 and type(args[0]) is not dict:
            args = [_pairs(args[0])]
        elif type(owner) in (set, frozenset) and node.func.attr in _SET_METHODS:
            args = [_hashable(a) for a in args]
        return func(*args, **kwargs)
    raise TypeError(f"unsupported node {type(node).__name__}")  # unreachable for planned checks


_SET_METHODS = _METHODS[set]  # each takes iterables, of which some build a set (``issubset``, ``union``)
_KEYS, _ITEMS = type({}.keys()), type({}.items())


def _hashable(value: Any) -> Any:
    """``value`` (an iterable) ready to be hashed member by member, under :func:`_limit_same_hash`. Sets, frozensets,
    dicts and their keys were built under the limit; anything else is read once (an iterator as well) and checked."""
    if type(value) in (set, frozenset, dict, _KEYS):
        return value
    if type(value) is _ITEMS:  # (key, value) pairs: their hashes are not the keys' hashes
        _limit_same_hash(value)
        return value
    items = list(value)
    _limit_same_hash(items)
    return items


def _pairs(value: Any) -> list[tuple[Any, ...]]:
    """The ``(key, value)`` pairs ``dict(value)`` would read, with the keys checked by :func:`_limit_same_hash`."""
    pairs = [tuple(pair) for pair in value]
    _limit_same_hash(pair[0] for pair in pairs if len(pair) == 2)
    return pairs


def _binop(op: type, left: Any, right: Any) -> Any:
    """``left <op> right`` with caps on the sizes a program-chosen operand could blow up and on the cost of integer
    division, and the same-hash limit on the set that ``|``, ``&``, ``^`` and ``-`` of a dict view build from both
    operands."""
    views = (_KEYS, _ITEMS)
    if op in (ast.BitOr, ast.BitAnd, ast.BitXor, ast.Sub) and (type(left) in views or type(right) in views):
        left, right = _hashable(left), _hashable(right)
    if op is ast.Mult:
        for count, seq in ((left, right), (right, left)):
            if isinstance(count, int) and isinstance(seq, (str, bytes, bytearray, list, tuple)):
                if count * len(seq) > _MAX_ITEMS:
                    raise MemoryError("the check would build a sequence that is too large")
    if op is ast.Pow and isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
        if right * left.bit_length() > _MAX_BITS:
            raise MemoryError("the check would build an integer that is too large")
    if op is ast.LShift and isinstance(left, int) and isinstance(right, int) and right > _MAX_BITS:
        raise MemoryError("the check would build an integer that is too large")
    if op in (ast.Mod, ast.FloorDiv) and isinstance(left, int) and isinstance(right, int):
        _limit_int_cost(left.bit_length(), right.bit_length())
    return _BINOPS[op](left, right)


# ----------------------------------------------------------------------------------------------------------------
# LeetCode's linked lists and binary trees, as plain forms
# ----------------------------------------------------------------------------------------------------------------
# A probe given to ``is_same_list`` comes back from the sandbox (sandbox._make_encoder) as ``(values, falsy_end)``:
# the ``.val`` of each node along ``.next`` (each encoded as plain data) and whether the walk stopped at a falsy
# node rather than at ``None``. One given to ``is_same_tree`` comes back as ``(shape, values)`` in level order:
# ``shape`` holds "1" for each node and "0" for each missing child (``None`` or a falsy object), ``values`` the
# nodes' ``.val``; flat, so a tree deeper than MAX_DEPTH (a skewed one) travels as well. Both forms are canonical:
# two structures compare equal under the prompt's helper exactly when their forms do, value by value.
#
# Deliberate differences from running the prompt's helpers natively, all on what the program returns:
# * the helpers recurse once per node (list) or level (tree), so natively a list longer than about 1000 nodes, or a
#   tree deeper than that, raises RecursionError and fails; here the whole structure is compared (up to the
#   encoder's node budget), so a right answer passes;
# * anything that raises while the sandbox walks the structure (a ``.val`` property, ``__bool__``), or a ``.val``
#   that is not plain data, fails the probe as a whole, even where natively the comparison would stop before that
#   node (at an earlier value that differs); so does a cycle (a list revisiting a node; a tree runs into the node
#   budget), which natively compares False against a finite structure. Only ``not is_same_list(...)`` and the like
#   can tell: such a test fails here where natively it might pass;
# * ``.val`` values are compared as plain data (natively the program's ``__eq__`` / ``__ne__`` answer), and the
#   expected side is built here from the test's literals with the prompt's steps, whatever the program binds to
#   ``list_node`` / ``tree_node`` (natively the program's own builder would make it); the program's
#   ``is_same_list`` / ``is_same_tree`` are never called.


def _list_node(values: Any) -> tuple[list[Any], bool]:
    """The plain form of the prompt's ``list_node(values)``, by its steps: ``None`` for empty ``values``, else a
    node for ``values[0]`` followed by one for each item of ``values[1:]``."""
    if not values:
        return [], False
    return [values[0], *values[1:]], False


def _tree_node(values: Any) -> tuple[str, list[Any]]:
    """The plain form of the prompt's ``tree_node(values)``, by its steps. Its queue hands out nodes in the order
    they were made, which is level order, each taking the next two entries of ``values`` as its left and right child
    (``None``: no child); so the children it makes, in that order, are the level-order form itself, and only the
    queue's length needs keeping."""
    if not values:
        return "0", []
    shape, vals = ["1"], [values[0]]
    i, queue = 1, 1
    while queue:
        queue -= 1
        for _side in ("left", "right"):
            child = i < len(values) and values[i] is not None
            if child:
                vals.append(values[i])
                queue += 1
            shape.append("1" if child else "0")
            i += 1
    return "".join(shape), vals


def _list_form(value: Any) -> tuple[list[Any], bool]:
    """``value`` if it is a linked list's plain form; only a program writing its own report sends anything else."""
    if type(value) is tuple and len(value) == 2 and type(value[0]) is list and type(value[1]) is bool:
        return value
    raise ValueError("malformed linked list")


def _tree_form(value: Any) -> tuple[str, list[Any]]:
    """``value`` if it is a binary tree's plain form (one value per node); else ``ValueError``, as ``_list_form``."""
    if type(value) is tuple and len(value) == 2 and type(value[0]) is str and type(value[1]) is list:
        shape, vals = value
        if not shape.strip("01") and shape.count("1") == len(vals):
            return value
    raise ValueError("malformed binary tree")


def _is_same_list(p1: Any, p2: Any) -> bool:
    """The prompt's ``is_same_list`` on plain forms: both lists end at ``None`` after the same number of nodes, and
    their values are pairwise ``==``. A falsy node never matches (natively ``not p1`` answers False there, even for
    two falsy nodes); ``None`` matches ``None`` (``list_node([])``)."""
    (vals1, falsy1), (vals2, falsy2) = _list_form(p1), _list_form(p2)
    if falsy1 or falsy2 or len(vals1) != len(vals2):
        return False
    return all(a == b for a, b in zip(vals1, vals2))


def _is_same_tree(p: Any, q: Any) -> bool:
    """The prompt's ``is_same_tree`` on plain forms: the same shape (a falsy node is a missing one, as natively),
    and no pair of values ``!=``."""
    (shape1, vals1), (shape2, vals2) = _tree_form(p), _tree_form(q)
    return shape1 == shape2 and not any(a != b for a, b in zip(vals1, vals2))


# What the check calls in place of the prompt's helpers (see _Planner._same).
_HELPER_TWINS = {
    "is_same_list": _is_same_list, "is_same_tree": _is_same_tree, "list_node": _list_node, "tree_node": _tree_node,
}  # fmt: skip
