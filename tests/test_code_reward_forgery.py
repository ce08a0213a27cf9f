"""Forgery attempts against the code reward: a wrong program must never obtain a pass.

Every attack pairs the wrong solution ``def f(x): return 0`` with the test ``assert f(2) == 4`` and tries to turn
the verdict into a pass without knowing the expected value: rewriting the tests through stack frames, calling the
harness's report function, finding secrets or the tests themselves through the garbage collector or by reading its
own memory, patching what the harness calls after the program ran, writing a forged report to every descriptor,
returning objects whose comparison always succeeds, and redefining builtins the test uses. All but the descriptor
attack (aimed at the new report pipe) scored 1.0 against the former in-process harness. Each attack prints what it
managed to do, so the tests also check that it really reached the harness (an attack that silently did nothing
would prove nothing).
"""

import json
import os

import pytest

from trl_diffusion.rewards import make_code_reward, run_tests
from trl_diffusion.rewards.code_reward import build_tests
from trl_diffusion.rewards.sandbox import SandboxLimits

TEST = ["assert f(2) == 4"]
WRONG = "def f(x):\n    return 0\n"
LIMITS = SandboxLimits(timeout=5.0, memory_mb=256)


def _reward(program, tests=TEST, **kwargs):
    reward = make_code_reward(timeout=5.0, memory_mb=256, partial_credit=True)
    return reward([f"```python\n{program}\n```"], tests=[tests], **kwargs)[0]


def test_correct_program_still_passes():
    assert _reward("def f(x):\n    return x * 2\n") == 1.0
    assert _reward(WRONG) == 0.0


FRAME_REWRITE = WRONG + """
import sys
touched = 0

def rewrite(items):
    global touched
    for i, item in enumerate(items):
        if isinstance(item, str):
            items[i] = "pass"  # a test snippet
            touched += 1
        elif isinstance(item, dict) and isinstance(item.get("probes"), list):
            item["probes"] = ["True"] * len(item["probes"])  # every probe now answers True
            touched += 1

frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()):
        if isinstance(value, list):
            rewrite(value)
        elif isinstance(value, dict):
            for key in ("tests", "specs"):
                if isinstance(value.get(key), list):
                    rewrite(value[key])
    frame = frame.f_back
print("rewrote", touched)
"""


def test_frame_walking_cannot_rewrite_the_tests():
    result = run_tests(FRAME_REWRITE, TEST, LIMITS)
    assert "rewrote" in result.output and "rewrote 0" not in result.output, result.output
    assert result.outcomes == [False] and _reward(FRAME_REWRITE) == 0.0


FRAME_REPORT = WRONG + """
import sys
frame = sys._getframe()
while frame is not None:
    report = frame.f_locals.get("report")
    if callable(report):
        print("calling the harness's report function", flush=True)
        entry = {"passed": True, "has": [], "values": [["v", ["b", True]]]}
        report({"passed": 1, "errors": [], "results": [entry], "isolation": {}})
    frame = frame.f_back
"""


def test_calling_the_report_function_cannot_forge_a_pass():
    result = run_tests(FRAME_REPORT, TEST, LIMITS)
    assert "calling the harness's report function" in result.output
    assert result.outcomes == [False] and _reward(FRAME_REPORT) == 0.0


GC_SEARCH = WRONG + """
import gc, json, os, re, sys
found = None
for obj in gc.get_objects():
    if isinstance(obj, dict):
        texts = [v for v in obj.values() if isinstance(v, str)]
        texts += [t for v in obj.values() if isinstance(v, list) for t in v if isinstance(t, str)]
        for text in texts:
            match = re.search(r"f\\(2\\) == (\\d+)", text)
            if match:
                found = int(match.group(1))
        nonce = obj.get("nonce")
        if isinstance(nonce, str):  # forge a report tagged with the secret
            print("found the nonce", flush=True)
            sys.stdout.write("\\n" + nonce + json.dumps({"passed": 1, "errors": []}) + "\\n")
            sys.stdout.flush()
            os._exit(0)
if found is not None:
    print("found the expected value", flush=True)
    def f(x):
        return found
print("gc search done")
"""
DECOY = 'decoy = {"text": "assert f(2) == 4"}\n'


def test_garbage_collector_holds_no_secret_and_no_expected_value():
    result = run_tests(GC_SEARCH, TEST, LIMITS)
    assert "gc search done" in result.output and "found" not in result.output, result.output
    assert result.outcomes == [False] and _reward(GC_SEARCH) == 0.0
    # Control: had the expected value been anywhere in the process, the search would have found and used it.
    control = run_tests(DECOY + GC_SEARCH, TEST, LIMITS)
    assert "found the expected value" in control.output and control.outcomes == [True]


MEMORY_SCAN = WRONG + """
import ctypes, re
ctypes.CDLL(None).prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: after a uid change /proc/self/mem is root's otherwise
found = None
with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb", 0) as mem:
    for line in maps:
        fields = line.split()
        if "rw" not in fields[1] or len(fields) > 5 and fields[5].startswith("/"):
            continue
        start, end = (int(x, 16) for x in fields[0].split("-"))
        try:
            mem.seek(start)
            data = mem.read(min(end - start, 64 << 20))
        except (OSError, ValueError, OverflowError):
            continue
        for match in re.finditer(rb"assert f\\(2\\) == (\\d+)", data):
            found = int(match.group(1))
if found is not None:
    print("found the expected value in memory", flush=True)
    def f(x):
        return found
print("memory scan done")
"""


def test_expected_values_are_not_in_the_sandboxed_process():
    result = run_tests(MEMORY_SCAN, TEST, LIMITS)
    assert "memory scan done" in result.output and "found" not in result.output, result.output
    assert result.outcomes == [False] and _reward(MEMORY_SCAN) == 0.0
    control = run_tests(DECOY + MEMORY_SCAN, TEST, LIMITS)
    assert "found the expected value in memory" in control.output and control.outcomes == [True]


PATCH_AFTER_RUN = WRONG + """
import builtins, json, json.encoder
entry = {"passed": True, "has": [], "values": [["v", ["b", True]]]}
forged = json.dumps({"passed": 1, "errors": [], "results": [entry]})

class Forger(json.encoder.JSONEncoder):
    def encode(self, obj):
        return forged

json._default_encoder = Forger()  # json.dumps() without arguments uses this module global
json.dumps = lambda *a, **k: forged

class Always:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__

builtins.type = lambda *a: int  # a harness asking type() / isinstance() would see an int
builtins.isinstance = lambda *a: True
builtins.issubclass = lambda *a: True
def f(x):
    return Always()
print("patched json and builtins")
"""


def test_patching_what_the_harness_calls_later_cannot_forge_a_pass():
    result = run_tests(PATCH_AFTER_RUN, TEST, LIMITS)
    assert "patched json and builtins" in result.output
    assert result.outcomes == [False] and _reward(PATCH_AFTER_RUN) == 0.0


WRITE_ALL_FDS = WRONG + """
import json, os
entry = {"passed": True, "has": [], "values": [["v", ["b", True]]]}
forged = json.dumps({"passed": 1, "errors": [], "results": [entry], "isolation": {}}).encode()
written = 0
for fd in range(3, 64):
    try:
        os.write(fd, forged)
        written += 1
    except OSError:
        pass
print("forged reports written:", written, flush=True)
os._exit(0)
"""


def test_forged_report_on_every_descriptor_is_still_judged_here():
    result = run_tests(WRITE_ALL_FDS, TEST, LIMITS)
    assert "forged reports written: 0" not in result.output and "forged reports written" in result.output
    assert result.outcomes == [False] and _reward(WRITE_ALL_FDS) == 0.0


ALWAYS_EQUAL = """
class Always:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __bool__(self):
        return True
    __hash__ = object.__hash__
"""


@pytest.mark.parametrize(
    "returned",
    [
        "Always()",
        "type('E', (int,), {'__eq__': lambda s, o: True, '__hash__': int.__hash__})(0)",
        "type('S', (str,), {'__eq__': lambda s, o: True, '__hash__': str.__hash__})('0')",
        "type('L', (list,), {'__eq__': lambda s, o: True})([0])",
        "type('D', (dict,), {'__eq__': lambda s, o: True})()",
        "type('F', (float,), {'__eq__': lambda s, o: True, '__hash__': float.__hash__})(0.0)",
        # claims to be an int to isinstance() through __class__
        "type('C', (Always,), {'__class__': property(lambda s: int)})()",
        # looks like a numpy scalar whose .item() is again a lying object
        "type('N', (), {'__module__': 'numpy', 'item': lambda s: Always()})()",
    ],
    ids=["eq-object", "int-subclass", "str-subclass", "list-subclass", "dict-subclass", "float-subclass",
         "fake-class", "fake-numpy"],
)  # fmt: skip
def test_objects_that_lie_about_equality_do_not_pass(returned):
    program = ALWAYS_EQUAL + f"def f(x):\n    return {returned}\n"
    tests = ["assert f(2) == 4", "assert f(2) == '4'", "assert f(2) == [4]", "assert f(2) == {'a': 4}",
             "assert not f(2) != 4", "assert 4 == f(2)", "assert f(2) in [4]"]  # fmt: skip
    result = run_tests(program, tests, LIMITS)  # the reward is result.fraction (partial credit) or all_passed
    assert result.status == "ok" and not any(result.outcomes) and result.verified == len(tests)


def test_truthiness_cannot_be_faked():
    program = ALWAYS_EQUAL + "def is_even(x):\n    return Always()\n"
    assert _reward(program, ["assert is_even(3)"]) == 0.0
    assert _reward("def is_even(x):\n    return x % 2 == 0\n", ["assert is_even(4)", "assert not is_even(3)"]) == 1.0


def test_redefining_a_builtin_the_test_uses_does_not_help():
    """Natively ``sorted`` would be the program's own: a fake one would pass. Here the test fails instead."""
    program = WRONG + "def sorted(*args, **kwargs):\n    return [1, 2, 3]\nabs = lambda x: 0\n"
    assert _reward(program, ["assert sorted(f(2)) == [1, 2, 3]"]) == 0.0
    assert _reward(program, ["assert abs(f(2) - 4) < 1e-9"]) == 0.0
    result = run_tests(program, ["assert sorted(f(2)) == [1, 2, 3]"], LIMITS)
    assert result.outcomes == [False] and "redefines" in result.errors[0]
    # A call of the program's own function of that name, with plain inputs, is still run and judged.
    assert run_tests("def sorted(x):\n    return x\n", ["assert sorted([2, 1]) == [2, 1]"], LIMITS).outcomes == [True]


def test_exiting_or_raising_inside_the_call_fails():
    for body in ("import os\n    os._exit(0)", "import sys\n    sys.exit(0)", "raise SystemExit(0)"):
        assert _reward(f"def f(x):\n    {body}\n") == 0.0


HUMANEVAL_TEST = (
    "\n\nMETADATA = {'author': 'x', 'dataset': 'test'}\n\n\ndef check(candidate):\n"
    "    assert candidate([1, 3, 2]) == [1, 3, 3]\n    assert candidate([]) == []\n\n"
)


def test_humaneval_check_is_decided_outside_the_sandbox():
    good = "def running_max(xs):\n    out, best = [], None\n    for x in xs:\n        best = x if best is None " \
           "else max(best, x)\n        out.append(best)\n    return out\n"  # fmt: skip
    forging = ALWAYS_EQUAL + "def running_max(xs):\n    return Always()\n" + GC_SEARCH.replace(WRONG, "")
    reward = make_code_reward(timeout=5.0, memory_mb=256)
    rows = {"test": [HUMANEVAL_TEST] * 2, "entry_point": ["running_max"] * 2}
    assert reward([f"```python\n{good}\n```", f"```python\n{forging}\n```"], **rows) == [1.0, 0.0]
    result = run_tests(forging, [f"{HUMANEVAL_TEST}check(running_max)\n"], LIMITS)
    assert result.verified == 1 and result.outcomes == [False] and "found" not in result.output


def test_a_test_that_calls_check_itself_or_defines_none_stays_decided_outside():
    """A ``test`` ending with ``check(f)`` (or made of plain asserts) beside an ``entry_point`` got a second call
    appended: the snippet was no longer one the verdict module decides, so an always-equal object passed inside the
    sandbox (and, for plain asserts, a right program failed on the undefined ``check`` while a forger defined one)."""
    calls = "def check(candidate):\n    assert candidate(2) == 4\n    assert candidate(3) == 9\n\ncheck(f)\n"
    asserts = "assert f(2) == 4\nassert f(3) == 9\n"
    right = "```python\ndef f(x):\n    return x * x\n```"
    forging = f"```python\n{ALWAYS_EQUAL}def f(x):\n    return Always()\n\ndef check(candidate):\n    pass\n```"
    reward = make_code_reward(timeout=5.0, memory_mb=256)
    for test in (calls, asserts):
        logged = {}
        assert reward([right, forging], test=[test] * 2, entry_point=["f"] * 2,
                      log_metric=logged.__setitem__) == [1.0, 0.0]
        assert logged["code_execution/verified_frac"] == 1.0
        assert build_tests(test=test, entry_point="f") == [test]


def test_report_is_plain_json_and_only_probe_values_travel():
    """The sandbox's job description holds the program and the probes, never an expected value."""
    from trl_diffusion.rewards.verdict import plan_test

    plan = plan_test("assert math.isclose(f(2), 3.25, rel_tol=1e-3)\nassert sorted(g([5, 1])) == [1, 5]")
    spec = json.dumps(plan.sandbox_spec())
    assert plan.kind == "verified" and plan.probes == ("f(2)", "g([5, 1])")
    assert "3.25" not in spec and "[1, 5]" not in spec


def test_rows_must_match_completions():
    reward = make_code_reward(timeout=5.0)
    with pytest.raises(ValueError, match="tests"):
        reward(["a", "b"], tests=[["assert True"]])
    with pytest.raises(ValueError, match="entry_point"):
        reward(["a"], test=["def check(c):\n    pass\n"], entry_point=["f", "g"])


# ---------------------------------------------------------------------------------------------------------- exactness

HONEST = """
import math
from collections import Counter, OrderedDict, namedtuple
import numpy as np

P = namedtuple("P", "x y")
value = 5


def f(x):
    return x * 2


def g(xs):
    return sorted(xs)


def h(s):
    return s.upper()


def nothing():
    return None


def nested():
    return (1, [2, 3], {"a": {4}})


def counts(s):
    return Counter(s)


def point():
    return P(1, 2)


def tenth():
    return 0.1 + 0.2


def big():
    return 2**200


def nan():
    return float("nan")


def fails():
    raise ValueError("no")


def generator():
    return (i for i in range(3))


def misc(kind):
    return {"c": 1 + 2j, "b": b"ab", "fs": frozenset({1, 2}), "od": OrderedDict([("b", 1), ("a", 2)]),
            "np": np.int64(4), "npf": np.float64(0.5), "arr": np.array([1, 2]), "t": True}[kind]
"""
ASSERTS = """
assert f(2) == 4
assert f(2) == 5
assert f(2.5) == 5.0
assert f('ab') == 'abab'
assert g([3, 1, 2]) == [1, 2, 3]
assert g([3, 1, 2]) == (1, 2, 3)
assert tuple(g([3, 1])) == (1, 3)
assert h('x') == 'X'
assert h('x').lower() == 'x'
assert h('a b').split() == ['A', 'B']
assert h('abc').startswith('AB')
assert nothing() is None
assert nothing() == None
assert not nothing()
assert nested() == (1, [2, 3], {'a': {4}})
assert nested()[1][0] == 2
assert counts('aab') == {'a': 2, 'b': 1}
assert counts('aab')['a'] == 2
assert sorted(counts('aba').items()) == [('a', 2), ('b', 1)]
assert point() == (1, 2)
assert point().x == 1
assert tenth() == 0.3
assert math.isclose(tenth(), 0.3)
assert abs(tenth() - 0.3) < 1e-9
assert round(tenth(), 2) == 0.3
assert big() == 2 ** 200
assert big() > 10 ** 60
assert nan() != nan()
assert math.isnan(nan())
assert fails() == 1
assert generator() == [0, 1, 2]
assert misc('c') == 1 + 2j
assert misc('c').real == 1
assert misc('b') == b'ab'
assert misc('fs') == {1, 2}
assert misc('od') == {'a': 2, 'b': 1}
assert list(misc('od')) == ['b', 'a']
assert misc('np') == 4
assert abs(misc('npf') - 0.5) < 1e-12
assert misc('arr') == [1, 2]
assert misc('t') is True
assert value == 5
assert 3 < f(2) < 5
assert f(2) in [4, 5]
assert len(g([1, 2, 3])) == 3
assert set(g([1, 1, 2])) == {1, 2}
assert isinstance(f(2), int)
assert type(f(2)) == int
assert str(f(2)) == '4'
assert f(10) // 3 == 6
assert max(g([5, 9, 1])) == 9
assert sum(g([1, 2])) == 3
assert math.sqrt(f(8)) == 4
assert missing(1) == 2
assert f(2) == 4 and f(3) == 6
""".strip().splitlines()


def _native(program, tests):
    """The obvious harness: run the program and each test in one namespace (trusted code only)."""
    namespace = {"__name__": "solution"}
    exec(program, namespace)
    outcomes = []
    for test in tests:
        try:
            exec(test, namespace)
            outcomes.append(True)
        except Exception:
            outcomes.append(False)
    return outcomes


def test_verdicts_equal_native_execution_for_honest_programs():
    result = run_tests(HONEST, ASSERTS, SandboxLimits(timeout=20.0, memory_mb=1024))
    native = _native(HONEST, ASSERTS)
    assert result.status == "ok", result.errors
    # (``misc('arr') == [1, 2]`` raises natively, ambiguous truth value; here an array is not plain data: both fail.)
    differ = [(t, n) for t, n, o in zip(ASSERTS, native, result.outcomes) if n != o]
    assert differ == [], differ
    assert sum(native) >= 40 and not all(native)  # a real mix of passing and failing tests
    assert result.verified == len(ASSERTS) - 1  # only the and-chain with a second program call runs unverified


def _rows(name):
    path = os.path.join(os.path.dirname(__file__), "fixtures", "eval", name)
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_fixture_solutions_pass_and_are_verified():
    humaneval = _rows("humaneval_sample.jsonl")
    mbpp = [row for row in _rows("code_tests_sample.jsonl") if row["test_method"] == "function"]
    completions = [f"```python\n{row['prompt']}{row['canonical_solution']}\n```" for row in humaneval]
    wrong = [f"```python\n{row['prompt']}    return None\n```" for row in humaneval]
    reward = make_code_reward(timeout=10.0)
    rows = {"test": [r["test"] for r in humaneval] * 2, "entry_point": [r["entry_point"] for r in humaneval] * 2}
    assert reward(completions + wrong, **rows) == [1.0] * len(humaneval) + [0.0] * len(humaneval)
    strict = make_code_reward(timeout=10.0, allow_unverified=False)
    assert strict([f"```python\n{row['solution']}\n```" for row in mbpp], tests=[r["test_list"] for r in mbpp]) == [
        1.0
    ] * len(mbpp)
    from trl_diffusion.rewards import build_tests
    from trl_diffusion.rewards.verdict import plan_test

    for row in humaneval:
        assert plan_test(build_tests(test=row["test"], entry_point=row["entry_point"])[0]).kind == "verified"


def test_unverifiable_tests_run_inside_or_give_none():
    loop = "for x in range(3):\n    assert f(x) == 2 * x"
    good = "```python\ndef f(x):\n    return 2 * x\n```"
    assert make_code_reward(timeout=5.0)([good], tests=[[loop]]) == [1.0]
    assert make_code_reward(timeout=5.0, allow_unverified=False)([good, good], tests=[[loop], TEST]) == [None, 1.0]
    result = run_tests("def f(x):\n    return 2 * x\n", [loop, "assert f(2) == 4"], LIMITS)
    assert (result.passed, result.verified, result.outcomes) == (2, 1, [True, True])
    metrics = {}
    make_code_reward(timeout=5.0)([good], tests=[[loop, "assert f(2) == 4"]], log_metric=metrics.__setitem__)
    assert metrics["code_execution/verified_frac"] == 0.5
    # a copy with its own name logs under it (two copies' metrics were averaged under one key)
    metrics = {}
    make_code_reward(timeout=5.0, name="strict")([good], tests=[[loop]], log_metric=metrics.__setitem__)
    assert sorted(metrics) == ["strict/sandbox_error_frac", "strict/timeout_frac", "strict/verified_frac"]


# ---------------------------------------------------------------------------------------------- planner (no sandbox)


@pytest.mark.parametrize(
    "test, kind, probes",
    [
        ("assert f(2) == 4", "verified", ("f(2)",)),
        ("assert math.isclose(f(2), 3.1, rel_tol=1e-3)", "verified", ("f(2)",)),
        ("assert f('abc').startswith('ab')", "verified", ("f('abc')",)),  # the method runs here, on the value
        ("assert s.count(3) == 2", "verified", ("s",)),
        ("assert f(list(range(3)))[0] == 0", "verified", ("f(list(range(3)))[0]",)),
        ("import math\nassert f(math.pi) > 3", "verified", ("f(math.pi)",)),
        ("assert f(1) == 1 or g(2) == 2", "unverified", ()),  # g(2) only runs if the first test fails
        ("assert 0 < f(1) < g(2)", "unverified", ()),
        ("assert np.allclose(f(x), [1, 2])", "unverified", ()),  # would compare inside the sandbox
        ("assert check(f(1), 4)", "unverified", ()),
        ("assert f(3) == [i * i for i in range(3)]", "unverified", ()),
        ("for x in range(3):\n    assert f(x) == x", "unverified", ()),
        ("assert f(2) ==", "failed", ()),
    ],
)
def test_plan_shapes(test, kind, probes):
    from trl_diffusion.rewards.verdict import plan_test

    plan = plan_test(test)
    assert (plan.kind, plan.probes) == (kind, probes), plan.reason


def test_parent_check_caps_program_chosen_sizes_and_decodes_strictly():
    from trl_diffusion.rewards.verdict import ProbeError, decode, judge, plan_test

    assert judge(plan_test("assert f(1) * 10**9 == 'x'"), ["xx"]).startswith("MemoryError")
    assert judge(plan_test("assert 2 ** f(1) > 0"), [10**8]).startswith("MemoryError")
    assert judge(plan_test("assert f(1) % 3 == ''"), ["%0999999999d"]).startswith("TypeError")
    assert judge(plan_test("assert '%d' % f(1) == '4'"), [4]) is None  # a constant format is fine
    assert judge(plan_test("assert f(1) == 2"), [ProbeError("ZeroDivisionError: x")]) == "ZeroDivisionError: x"
    assert decode(["t", [["i", "-ff"], ["f", "0x1.8p+1"], ["s", "a"], ["N"]]]) == (-255, 3.0, "a", None)
    assert type(decode(["d", [["t", [["b", True], ["F", [["i", "1"]]]]]]])) is dict
    for bad in (["x", 1], ["i", 5], ["b", 1], ["d", [["l", [["i", "1"]]]]], ["l"], "s", ["S", [["l", []]]]):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)


SHORT_REPORT = """
def f(x):
    return x * x

import json, os, sys
frame = sys._getframe()
while frame is not None:
    config = frame.f_locals.get("config")
    if isinstance(config, dict) and "report_fd" in config:
        print("writing a report without the names", flush=True)
        entry = {"has": HAS, "values": [["v", ["f", (4.0).hex()]]] * VALUES}
        os.write(config["report_fd"], json.dumps({"results": [entry]}).encode())
        os._exit(0)
    frame = frame.f_back
"""


@pytest.mark.parametrize("has,values", [([], 1), ([True], 2), (["yes"], 1)])
def test_a_report_cannot_drop_the_names_a_test_needs(has, values):
    # `math` is never imported, so natively the test is a NameError; a report whose "has" list was empty (or not
    # one True per name) skipped that check, and one with an extra value was judged on the first
    program = SHORT_REPORT.replace("HAS", json.dumps(has)).replace("VALUES", str(values))
    tests = ["assert math.isclose(f(2), 4.0)"]
    result = run_tests(program, tests, LIMITS)
    assert "writing a report without the names" in result.output, result.output
    assert result.outcomes == [False] and _reward(program, tests) == 0.0
    assert _reward("import math\n\ndef f(x):\n    return x * x\n", tests) == 1.0  # control: with the import


# Test columns that check nothing passed every program (reward 1.0 for `pass`): each is refused before any run.
PYTEST_STYLE = "from solution import double\n\ndef test_small():\n    assert double(2) == 4\n"
MAIN_GUARDED = "def check(candidate):\n    assert candidate(2) == 4\n\nif __name__ == '__main__':\n    check(double)\n"
STDIO_HINT = "test_method='stdio'"


@pytest.mark.parametrize(
    "columns,found",
    [
        ({"tests": json.dumps([{"input": "2", "output": "4"}])}, STDIO_HINT),  # a JSON list of dicts
        ({"tests": [{"input": "2", "output": "4"}]}, STDIO_HINT),  # a Hub list-of-structs column
        ({"tests": json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})}, STDIO_HINT),  # APPS / TACO input_output
        ({"tests": json.dumps({"language": "python", "test_cases": [{"input": "2", "type": None}]})}, STDIO_HINT),
        ({"tests": {"inputs": ["2\n"], "outputs": ["4\n"]}}, STDIO_HINT),
        ({"tests": [2, 4]}, "holds int 2"),
        ({"tests": ["2"]}, "data, not a test"),
        ({"tests": ["double(2) == 4", "double(3) == 6 and double(1) == 2"]}, "`assert double(2) == 4`"),
        ({"tests": ["assert double(1) == 2", "double(3) == 6"]}, "comparison whose result is dropped"),
        ({"tests": ["import math", "double(2)"]}, "no test that checks anything"),
        ({"test": PYTEST_STYLE}, "defines test_small and nothing calls"),
        ({"tests": [PYTEST_STYLE]}, "defines test_small and nothing calls"),
        ({"test": MAIN_GUARDED}, "only under `if __name__"),
        ({"test": "def check(candidate):\n    assert candidate(2) == 4\n"}, "entry_point"),
        ({"tests": ["import pytest\n\n@pytest.mark.parametrize('x', [1, 2])\ndef test_a(x):\n"
                    "    assert double(x) == 2 * x\n"]}, "defines test_a and nothing calls"),
        ({"tests": ["assert True", "def test_a():\n    assert double(1) == 2\n"]}, "defines test_a and nothing"),
        # a review round's bypasses: a wrapper decorator the row defines, a lambda nobody calls, a check called only
        # by a function nobody calls, a TestCase named only inside itself (super(T, self)), a 1000-term comparison
        ({"tests": ["def timeout(s):\n    def wrap(f):\n        def run(*a):\n            return f(*a)\n"
                    "        return run\n    return wrap\n\n@timeout(5)\ndef test_a():\n"
                    "    assert double(1) == 2\n"]}, "defines test_a and nothing"),
        ({"tests": ["def test_a():\n    assert double(1) == 2\n\nrun_all = lambda: test_a()"]}, "test_a"),
        ({"tests": ["def check(c):\n    assert c(1) == 2\n\ndef main():\n    check(double)"]}, "never calls it"),
        ({"tests": ["import unittest\nclass T(unittest.TestCase):\n    def setUp(self):\n"
                    "        super(T, self).setUp()\n    def test_a(self):\n        self.assertEqual(double(2), 4)\n"
                    "\np = unittest.main(argv=['x'], exit=False)\nassert p.result.wasSuccessful()"]},
         "(T) that nothing"),
        ({"tests": ["double(1) " + "+ 0 " * 1000 + "== 2"]}, "comparison whose result is dropped"),
        # a sixth red-team: asserts that hold whatever the program does (a tuple is always true)
        ({"tests": ["assert True"]}, "an assert that holds whatever the program does"),
        ({"tests": ["assert True or double(2) == 4", "assert double(1) == 2"]}, "holds whatever"),
        ({"tests": ["assert (double(2) == 5, 'double')"]}, "holds whatever"),
        ({"tests": ["import math\nassert not 0", "assert double(1) == 2"]}, "holds whatever"),
        ({"tests": ["class A:\n    def __init__(self):\n        assert double(1) == 2\n\nclass B:\n"
                    "    def __init__(self):\n        self.x = 1\n\nB()"]}, "no test that checks anything"),
        ({"tests": ["def check(c):\n    assert c(1) == 2\n\nns = object\nns.check"]}, "never calls it"),
        ({"tests": ["import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n"
                    "        self.assertEqual(double(2), 4)\n\nunittest.TextTestRunner().run("
                    "unittest.defaultTestLoader.loadTestsFromTestCase(T))"]}, "no test that checks anything"),
        ({"tests": ["import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n"
                    "        self.assertEqual(double(2), 4)\n\nr = unittest.main(argv=['x'], exit=False)\n"
                    "assert r.result.wasSuccessful()"]}, "unittest.TestCase (T) that nothing runs"),
    ],
)
def test_test_columns_that_check_nothing_are_refused(columns, found):
    reward = make_code_reward(timeout=5.0, memory_mb=256)
    rows = {name: [["assert double(1) == 2"] if name == "tests" else None, value] for name, value in columns.items()}
    with pytest.raises(ValueError, match=r"code_execution_reward: row 1 of the batch: the `tests?` column") as info:
        reward(["```python\npass\n```"] * 2, **rows)
    assert found in str(info.value)


def test_the_official_grader_refuses_test_lists_that_check_nothing():
    from trl_diffusion.rewards import make_official_code_reward

    reward = make_official_code_reward()
    for test_list in (json.dumps([{"input": "2", "output": "4"}]), ["double(2) == 4"], [{"input": "2"}], [4]):
        with pytest.raises(ValueError, match=r"official_code_reward: row 1 of the batch: the `test_list` column"):
            reward(["```python\npass\n```"] * 2, test_method=["function"] * 2,
                   test_list=[["assert double(1) == 2"], test_list])


def test_test_formats_that_check_stay_accepted():
    from trl_diffusion.rewards import build_tests

    mbpp = ["assert double(2) == 4", "for x in range(3):\n    assert double(x) == 2 * x",
            "if double(1) != 2:\n    raise AssertionError", "import numpy\nnumpy.testing.assert_equal(double(1), 2)"]
    assert build_tests(mbpp) == mbpp
    assert build_tests(test=MAIN_GUARDED, entry_point="double") == [f"{MAIN_GUARDED}\n\ncheck(double)\n"]
    called = PYTEST_STYLE + "\ntest_small()\n"
    assert build_tests(test=called) == [called]
    # in a row, a snippet may set up state, or define a check, for the ones after it (run in order, unverified)
    steps = ["push(1)", "x = pop()", "def same(a, b):\n    assert a == b", "same(x, 1)"]
    assert build_tests(steps) == steps
    nested = "def check(candidate):\n    def one(x):\n        assert candidate(x) == 2 * x\n    one(1)\n"
    assert build_tests(test=nested, entry_point="double") == [f"{nested}\n\ncheck(double)\n"]
    reward = make_code_reward(timeout=5.0, memory_mb=256)
    right, wrong = "```python\ndef double(x):\n    return 2 * x\n```", "```python\ndef double(x):\n    return 0\n```"
    assert reward([right, wrong], test=[MAIN_GUARDED] * 2, entry_point=["double"] * 2) == [1.0, 0.0]
    assert reward([right, wrong], tests=[mbpp[:3]] * 2) == [1.0, 0.0]
    # shapes a first version refused (review): a row checks when anything that runs checks; functions used by
    # reference run; exits fail here; a docstring, an unused helper or a None entry sit beside checks
    checking_rows = [
        ["import sys\nif double(1) != 2:\n    sys.exit(1)"],
        ["if double(1) != 2:\n    exit('wrong')"],
        ["class Checker:\n    def __init__(self, f):\n        assert f(1) == 2\n\nChecker(double)"],
        ["def check(c):\n    def one(x):\n        assert c(x) == 2 * x\n    list(map(one, [1, 2]))\n\ncheck(double)"],
        ['"""Tests for double."""', "assert double(2) == 4"],
        ["def debug(x):\n    assert x\n", "assert double(2) == 4", None],
        ["T = []\ndef register(f):\n    T.append(f)\n    return f\n\n@register\ndef test_a():\n"
         "    assert double(1) == 2\n\nfor t in T:\n    t()"],
    ]
    for row in checking_rows:
        assert build_tests(row) == [snippet for snippet in row if snippet is not None]
    assert reward([right, wrong], tests=[checking_rows[0]] * 2) == [1.0, 0.0]
    assert reward([right, wrong], tests=[checking_rows[2]] * 2) == [1.0, 0.0]
    # strict on purpose (a refused row is a clear error; a vacuous one scores every program 1.0): tests run only
    # through a list, or checker classes run through __call__ / __exit__, are refused, with the row's start named
    for row in (["def test_a():\n    assert double(1) == 2\n\nfor t in (test_a,):\n    t()"],
                ["class Checker:\n    def __call__(self, f):\n        assert f(1) == 2\n\nChecker()(double)"]):
        with pytest.raises(ValueError, match="passes every program|no test that checks anything"):
            build_tests(row)


SPOOF_SANDBOX_ERROR = """
import json, os
forged = json.dumps({"sandbox_error": "RuntimeError: forged", "isolation": {"seccomp": "forged", "pidns": "forged"}})
for fd in range(3, 64):
    try:
        os.write(fd, forged.encode())
    except OSError:
        pass
print("forged a sandbox error", flush=True)
os._exit(0)
"""


def test_a_program_cannot_report_a_sandbox_error_or_its_isolation():
    """A ``sandbox_error`` the program writes to the report pipe made its own run look like a broken sandbox (in
    ``sandbox_error_frac`` and the eval's count), with the isolation values it chose."""
    result = run_tests(SPOOF_SANDBOX_ERROR, TEST, LIMITS)
    assert "forged a sandbox error" in result.output
    assert result.status == "error" and result.passed == 0 and not any("forged" in e for e in result.errors)
    assert "forged" not in (result.isolation.get("seccomp"), result.isolation.get("pidns"))
    logged = {}
    assert _reward(SPOOF_SANDBOX_ERROR, log_metric=logged.__setitem__) == 0.0
    assert logged["code_execution/sandbox_error_frac"] == 0.0


def test_only_the_setup_line_reports_a_sandbox_error_or_the_isolation():
    from trl_diffusion.rewards.sandbox import _finish

    def finish(data):
        return _finish(b"", data, "exited", 0, 0.1, [], {})

    failed = finish(b'{"sandbox_error": "OSError: no cgroup", "isolation": {"seccomp": false}}\n')
    assert failed.status == "sandbox_error" and failed.report["sandbox_error"] == "OSError: no cgroup"
    assert failed.isolation["seccomp"] is False
    setup = b'{"isolation": {"seccomp": true}}\n'
    ran = finish(setup + b'{"results": [], "isolation": {"seccomp": "forged", "extra": 1}}')
    assert ran.status == "ok" and ran.isolation["seccomp"] is True and "extra" not in ran.isolation
    assert finish(setup + b'{"sandbox_error": "forged", "isolation": {}}').status == "error"
    assert finish(b'{"results": []}').status == "error"  # no setup line: the setup never finished


def test_parent_check_caps_the_cost_of_integer_division():
    """Probes of 2M and 1M bits (within the 1 MB report) held the trainer's GIL 1.3 s for ``%``, 2.4 s for gcd."""
    import random
    import time

    from trl_diffusion.rewards.verdict import judge, plan_test

    big, half = random.getrandbits(2_000_000) | 1 << 1_999_999, random.getrandbits(1_000_000) | 1 << 999_999
    for test in ("assert f(1) % g(1) == 0", "assert f(1) // g(1) == 0", "assert divmod(f(1), g(1)) == (0, 0)",
                 "assert math.gcd(f(1), g(1)) == 1", "assert round(f(1), g(1)) == 0"):
        start = time.monotonic()
        assert judge(plan_test(test), [big, -300_000 if "round" in test else half]).startswith("MemoryError"), test
        assert time.monotonic() - start < 0.1, test
    assert judge(plan_test("assert f(1) % 1_000_000_007 == 7 and divmod(f(1), 5) == (1, 2)"), [7]) is None
    assert judge(plan_test("assert math.gcd(f(1), 12) == 6 and round(f(1), -1) == 10"), [6]) is None
    # a failure message shows an integer past Python's printing limit by its size, as an AssertionError
    message = "AssertionError: assert f(1) == 0 (f(1) = <int of 2000000 bits>)"
    assert judge(plan_test("assert f(1) == 0"), [big]) == message


def test_the_official_grader_checks_time_limits_before_any_run():
    """A test_time_limit of 0 raised inside the grader's worker threads, when its batch came up mid-training; it is
    refused with the row's other checks, before any run and when a trainer checks its dataset."""
    from datasets import Dataset

    from trl_diffusion.rewards import make_official_code_reward

    reward = make_official_code_reward()
    columns = {"test_method": ["function"] * 2, "test_list": [["assert f(1) == 1"]] * 2, "test_time_limit": [1, 0]}
    with pytest.raises(ValueError, match=r"row 1 of the batch: test_time_limit must be a finite number"):
        reward(["```python\ndef f(x):\n    return x\n```"] * 2, **columns)
    with pytest.raises(ValueError, match=r"row 1 of the train dataset: test_time_limit must be"):
        reward.check_dataset(Dataset.from_dict(columns))
    reward.check_dataset(Dataset.from_dict({**columns, "test_time_limit": [1, None]}))  # None: dLLM-RL's 1 s
