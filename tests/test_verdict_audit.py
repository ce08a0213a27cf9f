"""Two holes in the code reward's verdict logic (an audit of trl_diffusion/rewards), each fixed.

1. A test of a function whose name is a builtin or a standard-library module (``string``, ``filter``) was verified
   only if the program bound that name in a way the static ``program_bindings`` saw. A program that bound it
   dynamically (``globals()['string'] = ...``, ``builtins.filter = ...``) moved the test into the unverified mode,
   where an object whose ``__eq__`` always answers True passed it: 1.0 without a solution. Now the plan's kind
   depends on the test alone; the program's bindings can only fail a verified test. Related: a program that
   defined a builtin the *expected* side of a test calls (``assert f(3) == sorted([3, 1, 2])`` with its own
   ``sorted``) made that call a probe, so it computed the expected value itself; that now fails the test.
2. ``decode`` limited distinct numbers and strings of one hash, but not tuples, whose hashes a program can make
   collide with distinct numbers: a set of ~16k of them held the trainer for ~3 s. Every set member and dict key,
   decoded or built by the check, is now counted.
"""

import pytest

from trl_diffusion.rewards import make_code_reward, run_tests
from trl_diffusion.rewards.sandbox import SandboxLimits
from trl_diffusion.rewards.verdict import _MAX_SAME_HASH, decode, judge, plan_test

LIMITS = SandboxLimits(timeout=10.0, memory_mb=512)
YES = "class Yes:\n    __eq__ = lambda self, other: True\n    __hash__ = object.__hash__\n"
STRING_TESTS = ["assert string(3) == 'aaa'", "assert string(0) == ''"]
FILTER_TESTS = ["assert filter([1, 2, 3, 4]) == [2, 4]"]


def _completion(program):
    return f"```python\n{program}\n```"


# ------------------------------------------------------------------------------------ 1. the plan ignores the program


@pytest.mark.parametrize(
    "program, tests",
    [
        (YES + "globals()['string'] = lambda n: Yes()\n", STRING_TESTS),
        (YES + "import builtins\nbuiltins.filter = lambda xs: Yes()\n", FILTER_TESTS),
        (YES + "exec('def string(n):\\n    return Yes()')\n", STRING_TESTS),
        (YES + "vars()['string'] = lambda n: Yes()\n", STRING_TESTS),
    ],
    ids=["globals", "builtins-attribute", "exec", "vars"],
)
def test_binding_a_library_name_dynamically_cannot_forge_a_pass(program, tests):
    result = run_tests(program, tests, LIMITS)
    assert result.status == "ok" and result.outcomes == [False] * len(tests), result
    assert result.verified == len(tests)  # decided outside the sandbox, not run the forgeable way
    assert make_code_reward(timeout=10.0)([_completion(program)], tests=[tests]) == [0.0]
    assert make_code_reward(timeout=10.0, allow_unverified=False)([_completion(program)], tests=[tests]) == [0.0]


@pytest.mark.parametrize(
    "program, tests",
    [
        ("def string(n):\n    return 'a' * n\n", STRING_TESTS),
        ("globals()['string'] = lambda n: 'a' * n\n", STRING_TESTS),
        ("def filter(xs):\n    return [x for x in xs if x % 2 == 0]\n", FILTER_TESTS),
        ("import builtins\nbuiltins.filter = lambda xs: [x for x in xs if x % 2 == 0]\n", FILTER_TESTS),
    ],
    ids=["def-string", "globals-string", "def-filter", "builtins-filter"],
)
def test_honest_programs_pass_verified_however_they_bind_the_name(program, tests):
    extra = [
        "assert len(string(3)) == 3",
        "assert sorted(string(2)) == ['a', 'a']",
        "assert string(2).upper() == 'AA'",
    ]
    tests = tests + (extra if tests is STRING_TESTS else ["assert sorted(filter([4, 3, 2])) == [2, 4]"])
    result = run_tests(program, tests, LIMITS)
    assert result.status == "ok" and all(result.outcomes) and result.verified == len(tests), result
    assert make_code_reward(timeout=10.0, allow_unverified=False)([_completion(program)], tests=[tests]) == [1.0]


def test_a_builtin_the_program_defines_cannot_compute_the_expected_side():
    """``sorted`` here is the test's, not the program's (the test is about ``f``): a program that defines its own
    no longer gets its own function run as a probe for the expected value."""
    program = "def sorted(xs):\n    return 0\n\ndef f(n):\n    return 0\n"
    tests = ["assert f(3) == sorted([3, 1, 2])"]
    result = run_tests(program, tests, LIMITS)
    assert result.outcomes == [False] and "redefines" in result.errors[0], result
    assert run_tests("def f(n):\n    return [1, 2, 3]\n", tests, LIMITS).outcomes == [True]
    # A test about the program's own ``sorted`` still runs it.
    assert run_tests("def sorted(x):\n    return x\n", ["assert sorted([2, 1]) == [2, 1]"], LIMITS).outcomes == [True]


TESTS = [
    "assert string(3) == 'aaa'",
    "assert filter([1, 2, 3, 4]) == [2, 4]",
    "assert round(2.5) == 3",
    "assert sum(range(5)) == 10",
    "assert len(string(3)) == 3",
    "assert math.isclose(string(3), 3.0)",
    "assert string(3) == 'aaa' and string(0) == ''",
    "assert f(3) == list(range(3))",
    "assert f(3) == sorted([3, 1, 2])",
    "assert sorted(f(2)) == [1, 2, 3]",
    "assert operator.eq(string(3), 'aaa')",
    "assert filter([1, 2, 3, 4]) == sorted([4, 2])",
    "assert filter([1, 2]) == list(range(2))",
    "assert math.comb(5, 2) == 10",
    "assert string == 1",
    "assert isinstance(f(1), list)",
]
SHADOWED = ["string", "filter", "range", "sorted", "round", "sum", "len", "list", "math", "operator", "collections"]


@pytest.mark.parametrize("test", TESTS)
def test_the_program_can_only_fail_a_test_never_choose_its_mode(test):
    base = plan_test(test)
    for shadowed in [{name} for name in SHADOWED] + [set(SHADOWED)]:
        assert plan_test(test, frozenset(shadowed)).kind in (base.kind, "failed"), shadowed


def test_library_named_functions_are_probes_decided_by_the_test_alone():
    expected = {
        "assert string(3) == 'aaa'": ("verified", ("string(3)",)),
        "assert string(len('ab')) == 'aa'": ("verified", ("string(len('ab'))",)),  # a module: only the program's
        "assert filter([1, 2, 3, 4]) == [2, 4]": ("verified", ("filter([1, 2, 3, 4])",)),
        "assert sorted(filter([4, 1])) == [4]": ("verified", ("filter([4, 1])",)),
        # The expected side: a builtin the check cannot evaluate stays with the test (unverified, as before) ...
        "assert f(3) == list(range(3))": ("unverified", ()),
        "assert filter([1, 2]) == list(range(2))": ("unverified", ()),
        # ... and a real library function never compares a program's value with the test's in the sandbox.
        "assert operator.eq(string(3), 'aaa')": ("unverified", ()),
        "assert filter(list(range(10))) == [0, 2]": ("unverified", ()),
    }
    for test, (kind, probes) in expected.items():
        plan = plan_test(test)
        assert (plan.kind, plan.probes) == (kind, probes), (test, plan.reason)
    # What the program defines matters only for builtins the check evaluates, and only verified -> verified/failed.
    assert plan_test("assert round(2.5) == 3", frozenset({"round"})).probes == ("round(2.5)",)
    assert plan_test("assert round(2.5) == 3").probes == ()  # the real round, here
    assert plan_test("assert sum(range(5)) == 10", frozenset({"sum"})).probes == ("sum(range(5))",)
    assert plan_test("assert f(3) == sorted([3, 1, 2])", frozenset({"sorted"})).kind == "failed"
    assert plan_test("assert f(3) == list(range(3))", frozenset({"range"})).kind == "unverified"
    assert plan_test("assert operator.eq(string(3), 'aaa')", frozenset({"operator"})).kind == "unverified"
    assert plan_test("assert f(1) == g(2)").probes == ("f(1)", "g(2)")  # run in the order Python evaluates them


@pytest.mark.parametrize(
    "program, test",
    [
        ("def abs(x):\n    return 0\n", "assert abs(round(2.675, 2) - 2.68) < 1e-9"),
        (
            "class math:\n    isclose = staticmethod(lambda *a, **k: True)\n",
            "assert math.isclose(round(2.675, 2), 2.68)",
        ),
        ("def sum(xs, start=0):\n    return 0\n", "assert sum(range(5), -10) == 0"),
    ],
    ids=["abs-around-difference", "math-isclose", "sum-start"],
)
def test_a_builtin_wrapping_the_subject_and_expected_values_is_not_the_subject(program, test):
    """A program that defines a builtin wrapping both the function under test and other values (possibly the
    expected ones) must not get that builtin run as the probe: it would compute the comparison itself."""
    result = run_tests(program, [test], LIMITS)
    assert result.outcomes == [False] and "redefines" in result.errors[0], result
    reward = make_code_reward(timeout=10.0, allow_unverified=False)
    assert reward([_completion(program)], tests=[[test]]) == [0.0]
    # Honest programs defining the function under test still run it.
    assert plan_test("assert sum(range(5)) == 10", frozenset({"sum"})).probes == ("sum(range(5))",)
    assert plan_test("assert round(2.675, 2) == 2.68", frozenset({"round"})).probes == ("round(2.675, 2)",)


# ------------------------------------------------------------------------------------- 2. colliding tuples, refused

M64, MOD = (1 << 64) - 1, (1 << 61) - 1
XX1, XX2, XX5 = 11400714785074694791, 14029467366897019727, 2870177450012600261  # CPython's tuple-hash primes


def _colliding_pairs(n, target=0x0123456789ABCDEF):
    """``n`` pairs ``(a, b)`` of ints with distinct hashes whose tuple hashes are all equal (CPython >= 3.8, 64-bit):
    for each ``a``, solve the second round of the tuple hash for the lane ``hash(b)`` that reaches ``target``."""

    def rotl(x, r):
        return ((x << r) | (x >> (64 - r))) & M64

    before_last = rotl(target * pow(XX1, -1, 1 << 64) & M64, 64 - 31)
    pairs, a = [], 1
    while len(pairs) < n:
        acc = rotl((XX5 + a * XX2) & M64, 31) * XX1 & M64
        lane = (before_last - acc) * pow(XX2, -1, 1 << 64) & M64
        if lane < MOD:
            pairs.append((a, lane))
        elif 2 <= (1 << 64) - lane < MOD:
            pairs.append((a, lane - (1 << 64)))
        a += 1
    if len({hash(p) for p in pairs}) != 1:
        pytest.skip("this interpreter's tuple hash differs")
    return pairs


def _encode(value):
    tags = {tuple: "t", list: "l", set: "S", frozenset: "F"}
    if type(value) is int:
        return ["i", format(value, "x")]
    if type(value) is dict:
        return ["d", [["t", [_encode(k), _encode(v)]] for k, v in value.items()]]
    return [tags[type(value)], [_encode(item) for item in value]]


def test_decode_refuses_set_members_and_dict_keys_of_one_hash():
    pairs = _colliding_pairs(_MAX_SAME_HASH + 1)
    assert len({hash(x) for pair in pairs for x in pair}) == 2 * len(pairs)  # the numbers themselves do not collide
    for value in (set(pairs), frozenset(pairs), dict.fromkeys(pairs, 0), [frozenset(pairs)], {(0, frozenset(pairs))}):
        with pytest.raises(ValueError, match="share one hash"):
            decode(_encode(value))
    assert decode(_encode(set(pairs[:-1]))) == set(pairs[:-1])  # up to the limit
    assert decode(_encode(pairs)) == pairs  # a list builds no set
    assert decode(_encode({(i, -i) for i in range(20_000)})) == {(i, -i) for i in range(20_000)}


def test_checks_that_build_a_set_or_dict_refuse_colliding_members():
    pairs = _colliding_pairs(_MAX_SAME_HASH + 1)
    firsts, seconds = [a for a, _ in pairs], [b for _, b in pairs]
    refused = {
        "assert set(f(1)) == set()": [pairs],
        "assert frozenset(f(1)) == frozenset()": [pairs],
        "assert dict(f(1)) == {}": [[(pair, 0) for pair in pairs]],
        "assert set(zip(f(1), f(2))) == set()": [firsts, seconds],
        "assert dict(zip(f(1), f(2))) == {}": [pairs, seconds],
        "assert set(f(1).items()) == set()": [dict(pairs)],
        "assert f(1).items() | set() == set()": [dict(pairs)],
        "assert f(1).keys() | f(2) == set()": [{}, pairs],
        "assert set().union(f(1)) == set()": [pairs],
        "assert set().issubset(f(1))": [pairs],
        "assert {1}.symmetric_difference(f(1)) == set()": [pairs],
    }
    for test, values in refused.items():
        plan = plan_test(test)
        assert plan.kind == "verified", (test, plan.reason)
        assert "share one hash" in (judge(plan, values) or ""), test
    few = pairs[:-1]
    allowed = {
        "assert set(f(1)) == set(f(2))": [few, list(reversed(few))],
        "assert dict(zip(f(1), f(2))) == dict(f(3))": [few, [0] * len(few), [(p, 0) for p in few]],
        "assert set(f(1).items()) == {(1, 2)}": [{1: 2}],
        "assert f(1).items() | {(3, 4)} == {(1, 2), (3, 4)}": [{1: 2}],
        "assert set().union(f(1), 'ab') == {1, 2, 'a', 'b'}": [[1, 2]],
        "assert {1}.issubset(f(1))": [[2, 1]],
        "assert set(zip(f(1), f(2))) == set(f(3))": [[1, 2], [3, 4], [(2, 4), (1, 3)]],
    }
    for test, values in allowed.items():
        assert judge(plan_test(test), values) is None, test


COLLIDING_PROGRAM = """
M64, MOD = (1 << 64) - 1, (1 << 61) - 1
XX1, XX2, XX5 = 11400714785074694791, 14029467366897019727, 2870177450012600261


def rotl(x, r):
    return ((x << r) | (x >> (64 - r))) & M64


class T(tuple):  # distinct hashes inside the sandbox, so building the set is cheap here; sent as plain tuples
    __hash__ = lambda self: id(self)


def f(n):
    before_last = rotl(0x0123456789ABCDEF * pow(XX1, -1, 1 << 64) & M64, 33)
    out, a = [], 1
    while len(out) < n:
        acc = rotl((XX5 + a * XX2) & M64, 31) * XX1 & M64
        lane = (before_last - acc) * pow(XX2, -1, 1 << 64) & M64
        if lane < MOD:
            out.append(T((a, lane)))
        elif 2 <= (1 << 64) - lane < MOD:
            out.append(T((a, lane - (1 << 64))))
        a += 1
    return set(out)
"""


def test_probe_of_colliding_tuples_fails_instead_of_stalling_the_trainer():
    _colliding_pairs(2)  # skips where the tuple hash differs
    result = run_tests(COLLIDING_PROGRAM, ["assert f(200) == {1, 2}", "assert len(f(16)) == 16"], LIMITS)
    assert result.status == "ok" and result.outcomes == [False, True], result
    assert "share one hash" in result.errors[0]


LAZY = (
    "import numpy as np\n"
    "def evens(xs):\n    return (x for x in xs if x % 2 == 0)\n"
    "def doubled(xs):\n    return map(lambda x: 2 * x, xs)\n"
    "def keys(d):\n    return d.keys()\n"
    "class Bag:\n    def __iter__(self):\n        return iter([3, 1, 2])\n"
    "def bag():\n    return Bag()\n"
    "def array():\n    return np.array([2, 1])\n"
    "class Liar:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
    "def liars():\n    return (Liar() for _ in range(2))\n"
    "def rows():\n    return np.array([[1], [2]])\n"
    "def matrix_rows():\n    return np.matrix([[1], [2]])\n"
)


@pytest.mark.parametrize(("test", "passes"), [
    ("assert set(evens([1, 2, 3, 4])) == {2, 4}", True),  # a generator, materialised by set() natively
    ("assert list(doubled([1, 2])) == [2, 4]", True),
    ("assert sorted(keys({'b': 1, 'a': 2})) == ['a', 'b']", True),
    ("assert tuple(evens([4])) == (4,)", True),
    ("assert frozenset(bag()) == frozenset({1, 2, 3})", True),  # the program's own iterable
    ("assert sorted(bag(), reverse=True) == [3, 2, 1]", True),
    ("assert sorted(array()) == [1, 2]", True),
    ("assert evens([2]) == [2]", False),  # natively a generator is not a list
    ("assert list(evens([1])) == [1]", False),
    ("assert set(evens(5)) == set()", False),  # TypeError natively too
    ("assert list(liars()) == [1, 2]", False),  # items must be plain data: no forged __eq__
    ("assert set(rows()) == {1, 2}", False),  # natively TypeError: a row of an array is unhashable
    ("assert set(matrix_rows()) == {1, 2}", False),  # so is a row of an ndarray subclass
])
def test_a_lazy_iterable_given_whole_to_a_consuming_builtin_is_judged_as_natively(test, passes):
    # set(f(x)), list(...), sorted(...), tuple(...), frozenset(...) of a generator, map, dict view or the program's
    # own iterable: natively the builtin consumes it; the probe was "not plain data" (scored 0.0)
    plan = plan_test(test)
    assert plan.kind == "verified", plan
    result = run_tests(LAZY, [test], LIMITS)
    assert result.outcomes == [passes], result.errors


def test_a_program_call_in_a_consuming_builtins_keyword_is_not_verified():
    # natively sorted() evaluates reverse=<probe> before it iterates its argument; a verified run would not
    assert plan_test("assert sorted(f(3), reverse=g()) == [3]").kind == "unverified"
    assert plan_test("assert sorted(f(3), reverse=True) == [3]").kind == "verified"


@pytest.mark.parametrize("value", [-1, 0, 5, 10, 11])
def test_a_chained_comparison_is_judged_as_python_evaluates_it(value):
    """``a <= b <= c`` is ``a <= b and b <= c``: Python stops at the first false link. A check that kept only the
    last link would pass ``assert 0 <= f(1) <= 10`` for ``f(1) == -1`` (-1 <= 10), a reward for a wrong answer."""
    plan = plan_test("assert 0 <= f(1) <= 10")
    assert plan.kind == "verified", plan
    assert (judge(plan, [value]) is None) == (0 <= value <= 10)
