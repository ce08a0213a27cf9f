"""LeetCode-style tests are decided outside the sandbox, so a program cannot forge their verdict.

``newfacade/LeetCodeDataset`` (and the sets built from it) ship HumanEval-style tests whose entry point is a method
of a class the program defines: ``entry_point = "Solution().twoSum"``, ``test = "def check(candidate): assert
candidate(nums=[2, 7, 11, 15], target=9) == [0, 1] ..."``, run as ``check(Solution().twoSum)``; other sets write
``assert Solution().twoSum([2, 7, 11, 15], 9) == [0, 1]``. Both shapes used to be *unverified*: they ran inside
the sandbox, where the program decides the verdict. Of the forgeries below, these scored 1.0 there (code reward,
all-or-nothing): an object whose ``__eq__`` always answers True (both shapes), a list subclass with such an
``__eq__`` (both), patching ``builtins.sorted`` / ``builtins.len`` around such an object (both), ``__init__``
replacing ``check``'s code (the ``check`` shape: ``Solution()`` is built after ``check`` is looked up, before it
runs) and a class attribute that switches the method to forged answers after its first call (both). Patching
``AssertionError``, ``os._exit(0)``, ``sys.exit`` in the method, printing a fake report and ``SystemExit`` in
``__init__`` scored 0.0 already. All of them score 0.0 now, with every test verified (decided outside the
sandbox), which is what each test below checks.

Instances: natively ``check(Solution().twoSum)`` builds ONE instance before ``check`` runs and every assert calls
its bound method, while each plain ``assert Solution().twoSum(...)`` builds its own; the probes keep exactly that
(``test_instances_are_shared_exactly_as_natively``).
"""

import pytest
from code_verdicts import fenced, native_outcomes, run_verified

from trl_diffusion.eval import problems_from_rows, score_completions
from trl_diffusion.rewards import build_tests, make_code_reward
from trl_diffusion.rewards.dllm_rl_code import make_official_code_reward, official_code_reward
from trl_diffusion.rewards.sandbox import SandboxLimits
from trl_diffusion.rewards.verdict import plan_test

LIMITS = SandboxLimits(timeout=5.0, memory_mb=256)
ENTRY = "Solution().twoSum"
CHECK = (
    "def check(candidate):\n"
    "    assert candidate(nums = [2,7,11,15], target = 9) == [0,1]\n"
    "    assert candidate(nums = [3,2,4], target = 6) == [1,2]\n"
    "    assert sorted(candidate(nums = [3,3], target = 6)) == [0,1]\n"
)
PLAIN = [
    "assert Solution().twoSum([2,7,11,15], 9) == [0, 1]",
    "assert Solution().twoSum(nums=[3,2,4], target=6) == [1, 2]",
]
CORRECT = """
class Solution:
    def twoSum(self, nums, target):
        seen = {}
        for i, x in enumerate(nums):
            if target - x in seen:
                return [seen[target - x], i]
            seen[x] = i
"""
WRONG = """
class Solution:
    def twoSum(self, nums, target):
        return [0, 0]
"""
ALWAYS_EQUAL = """
class AlwaysEqual:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __iter__(self):
        return iter([0, 1])
"""
FORGERIES = {
    "always_equal": ALWAYS_EQUAL
    + """
class Solution:
    def twoSum(self, nums, target):
        return AlwaysEqual()
""",
    "list_subclass_eq": """
class Forged(list):
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    __hash__ = None

class Solution:
    def twoSum(self, nums, target):
        return Forged([0, 1])
""",
    "patched_builtins": ALWAYS_EQUAL
    + """
import builtins
builtins.sorted = lambda *args, **kwargs: AlwaysEqual()
builtins.len = lambda *args: 2

class Solution:
    def twoSum(self, nums, target):
        return AlwaysEqual()
""",
    "patched_assertion_error": """
import builtins
class Harmless(Exception):
    pass
builtins.AssertionError = Harmless

class Solution:
    def twoSum(self, nums, target):
        return [0, 0]
""",
    "init_replaces_check": """
class Solution:
    def __init__(self):
        check = globals().get("check")
        if check is not None:
            check.__code__ = (lambda candidate: None).__code__

    def twoSum(self, nums, target):
        return [0, 0]
""",
    "os_exit_in_method": """
import os
class Solution:
    def twoSum(self, nums, target):
        os._exit(0)
""",
    "sys_exit_in_method": """
import sys
class Solution:
    def twoSum(self, nums, target):
        sys.exit(0)
""",
    "prints_fake_results": """
import json
class Solution:
    def twoSum(self, nums, target):
        print(json.dumps({"results": [{"passed": True}] * 3, "passed": 3, "total": 3}))
        print("All tests passed")
        return [0, 0]
""",
    "system_exit_in_init": """
class Solution:
    def __init__(self):
        raise SystemExit(0)
    def twoSum(self, nums, target):
        return [0, 1]
""",
    "class_attribute_switches": ALWAYS_EQUAL
    + """
class Solution:
    answered = False
    def twoSum(self, nums, target):
        if Solution.answered:
            return AlwaysEqual()
        Solution.answered = True
        return [0, 1]
""",
}


def _check_reward(program, **kwargs):
    reward = make_code_reward(timeout=5.0, memory_mb=256, **kwargs)
    return reward([fenced(program)], test=[CHECK], entry_point=[ENTRY])[0]


def _plain_reward(program, **kwargs):
    reward = make_code_reward(timeout=5.0, memory_mb=256, **kwargs)
    return reward([fenced(program)], tests=[PLAIN])[0]


def _run(program, tests):
    return run_verified(program, tests, LIMITS)


def test_both_leetcode_shapes_are_planned_verified():
    [snippet] = build_tests(test=CHECK, entry_point=ENTRY)
    plan = plan_test(snippet)
    assert plan.kind == "verified", plan.reason
    assert plan.candidate == ENTRY and plan.param == "candidate"
    assert plan.probes == (
        "candidate(nums=[2, 7, 11, 15], target=9)",
        "candidate(nums=[3, 2, 4], target=6)",
        "candidate(nums=[3, 3], target=6)",
    )
    # The expected values never enter the sandbox: they are in the parent-side check only.
    assert "[0, 1]" not in repr(plan.sandbox_spec()) and "[1, 2]" not in repr(plan.sandbox_spec())
    for test, probe in zip(
        PLAIN, ["Solution().twoSum([2, 7, 11, 15], 9)", "Solution().twoSum(nums=[3, 2, 4], target=6)"]
    ):
        plan = plan_test(test)
        assert plan.kind == "verified" and plan.probes == (probe,), plan.reason
        assert "[0, 1]" not in repr(plan.sandbox_spec()) and "[1, 2]" not in repr(plan.sandbox_spec())


def test_only_decidable_neighbours_are_verified():
    """The mode is decided from the test alone. A method called on what a *function* returned (``make(x).equals(y)``,
    a library method whose argument is the expected value), a dunder, a helper building the input, and an entry point
    built from a program call stay unverified; their LeetCode neighbours are verified."""
    kinds = {
        "assert Solution().twoSum([2, 7], 9) == [0, 1]": "verified",
        "assert Solution(3).twoSum(nums=[2, 7], target=9)[0] == 0": "verified",
        "assert make([2, 7]).equals([0, 1])": "unverified",
        "assert Solution().__eq__([0, 1])": "unverified",
        "assert Solution().twoSum(helper([2, 7]), 9) == [0, 1]": "unverified",
        "assert Solution().twoSum([2, 7], 9).index(1) == 1": "verified",  # .index runs here, on the plain value
        CHECK + "\n\ncheck(Solution().twoSum)\n": "verified",
        CHECK + "\n\ncheck(Solution(3).twoSum)\n": "verified",
        CHECK + "\n\ncheck(Solution(helper()).twoSum)\n": "unverified",
        CHECK + "\n\ncheck(Solution()[0])\n": "unverified",
    }
    assert {test: plan_test(test).kind for test in kinds} == kinds


@pytest.mark.parametrize("shape", ["check", "plain"])
def test_a_correct_solution_passes_and_a_wrong_one_fails(shape):
    reward = _check_reward if shape == "check" else _plain_reward
    tests = build_tests(test=CHECK, entry_point=ENTRY) if shape == "check" else PLAIN
    assert reward(CORRECT) == 1.0 and reward(WRONG) == 0.0
    assert _run(CORRECT, tests).all_passed
    assert not any(_run(WRONG, tests).outcomes)
    # allow_unverified=False now scores these rows instead of leaving them out.
    assert reward(CORRECT, allow_unverified=False) == 1.0 and reward(WRONG, allow_unverified=False) == 0.0


def test_keyword_arguments_reach_the_method_by_name(tmp_path):
    """``candidate(nums=..., target=...)`` binds by name: a method whose parameters are named otherwise fails, one
    that takes them in another order passes; positional calls bind by position. The same verdicts as natively."""
    renamed = (
        CORRECT.replace("nums, target", "a, b")
        .replace("enumerate(nums)", "enumerate(a)")
        .replace("target - x", "b - x")
    )
    tests = build_tests(test=CHECK, entry_point=ENTRY)
    assert native_outcomes(renamed, tests, tmp_path) == [False] == _run(renamed, tests).outcomes
    assert native_outcomes(renamed, PLAIN, tmp_path) == [True, False] == _run(renamed, PLAIN).outcomes
    swapped = CORRECT.replace("nums, target", "target, nums")
    assert native_outcomes(swapped, tests, tmp_path) == [True] == _run(swapped, tests).outcomes
    assert native_outcomes(swapped, PLAIN, tmp_path) == [False, True] == _run(swapped, PLAIN).outcomes


def test_several_asserts_each_count_and_fail_alone(tmp_path):
    tests = [
        *PLAIN,
        "assert Solution().twoSum(nums=[3, 3], target=6) == [0, 1]",
        "assert Solution().twoSum([1, 5], 6) == [1, 0]",
    ]
    result = _run(CORRECT, tests)
    assert result.outcomes == [True, True, True, False] == native_outcomes(CORRECT, tests, tmp_path)
    assert (
        make_code_reward(timeout=5.0, memory_mb=256, partial_credit=True)([fenced(CORRECT)], tests=[tests])[0] == 0.75
    )
    # In a check, the first failing assert fails the one test, as natively.
    first_wrong = CHECK.replace("== [1,2]", "== [2,1]")
    assert _check_reward(CORRECT) == 1.0
    assert (
        make_code_reward(timeout=5.0, memory_mb=256)([fenced(CORRECT)], test=[first_wrong], entry_point=[ENTRY])[0]
        == 0.0
    )


STATEFUL = """
class Solution:
    built = 0
    def __init__(self):
        Solution.built += 1
        self.calls = 0
    def tally(self, x):
        self.calls += 1
        return [Solution.built, self.calls]
"""


def test_instances_are_shared_exactly_as_natively(tmp_path):
    """``check(Solution().tally)``: one instance for the whole check (its calls are 1, 2, 3); plain asserts: one
    instance per assert. The probes' verdicts equal the native ones, also for the wrong expectations."""
    check = (
        "def check(candidate):\n    assert candidate(x=0) == [1, 1]\n    assert candidate(0) == [1, 2]\n"
        "    assert candidate(x=5)[1] == 3\n"
    )
    fresh = check.replace("[1, 2]", "[2, 1]")  # what a fresh instance per probe would answer
    for test, expected in ((check, [True]), (fresh, [False])):
        tests = build_tests(test=test, entry_point="Solution().tally")
        assert native_outcomes(STATEFUL, tests, tmp_path) == expected == _run(STATEFUL, tests).outcomes
    plain = [
        "assert Solution().tally(0) == [1, 1]",
        "assert Solution().tally(x=0) == [2, 1]",
        "assert Solution().tally(0)[1] == 2",
    ]
    assert native_outcomes(STATEFUL, plain, tmp_path) == [True, True, False] == _run(STATEFUL, plain).outcomes
    # Each test of a row builds its own instance, as each check(...) call natively does; the class attribute counting
    # them is shared by all, as natively (the second check sees built == 2).
    two = build_tests(test=check, entry_point="Solution().tally") * 2
    assert native_outcomes(STATEFUL, two, tmp_path) == [True, False] == _run(STATEFUL, two).outcomes


def test_results_that_differ_natively_still_differ(tmp_path):
    """A tuple is not a list, None is not an answer, an exception fails: the same verdicts as natively."""
    for body in ("return (0, 1)", "return None", "raise ValueError('no')", "return [0, 1.0]", "return [False, True]"):
        program = f"class Solution:\n    def twoSum(self, nums, target):\n        {body}\n"
        tests = [PLAIN[0], *build_tests(test=CHECK.split("\n    assert sorted")[0] + "\n", entry_point=ENTRY)]
        assert _run(program, tests).outcomes == native_outcomes(program, tests, tmp_path), body


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_forgeries_score_zero(name):
    program = FORGERIES[name]
    assert _check_reward(program) == 0.0
    assert _plain_reward(program) == 0.0
    _run(program, build_tests(test=CHECK, entry_point=ENTRY))
    _run(program, PLAIN)


def test_the_forgeries_really_act(tmp_path):
    """Each forgery does what it claims where the program decides: run as the unverified mode runs a test (in the
    program's namespace), the ones the module docstring names pass without solving the task."""
    check = build_tests(test=CHECK, entry_point=ENTRY)
    passing_check = {
        "always_equal",
        "list_subclass_eq",
        "patched_builtins",
        "init_replaces_check",
        "class_attribute_switches",
    }
    for name in sorted(passing_check):
        assert native_outcomes(FORGERIES[name], check, tmp_path) == [True], name
    for name in ("always_equal", "list_subclass_eq", "patched_builtins", "class_attribute_switches"):
        assert native_outcomes(FORGERIES[name], PLAIN, tmp_path) == [True, True], name
    # ... and still fail here, decided outside the sandbox.
    for name in sorted(passing_check):
        assert _run(FORGERIES[name], check).outcomes == [False], name


LEETCODE_ROW = {"task_id": "two-sum", "prompt": "from typing import *\n\n", "test": CHECK, "entry_point": ENTRY}


@pytest.mark.parametrize("grader", ["sandbox", "official"])
def test_eval_graders_decide_leetcode_rows_outside(grader):
    """The eval graders build ``check(<entry_point>)`` the same way (``build_tests``) and share the planning."""
    problems = problems_from_rows([LEETCODE_ROW])
    assert problems[0].tests == build_tests(test=CHECK, entry_point=ENTRY)
    programs = [
        CORRECT,
        WRONG,
        FORGERIES["always_equal"],
        FORGERIES["init_replaces_check"],
        FORGERIES["class_attribute_switches"],
    ]
    results = score_completions(
        problems * len(programs), [fenced(p) for p in programs], limits=LIMITS, code_grader=grader
    )
    assert [r["reward"] for r in results] == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert [r["tests_verified"] for r in results] == [1] * len(programs)


UNVERIFIABLE = [
    "assert Solution().twoSum([2, 7], 9) == [0, 1]",
    "for n in [9]:\n    assert Solution().twoSum([2, 7], n) == [0, 1]",
]


def test_official_code_reward_allow_unverified():
    """``official_code_reward`` takes ``allow_unverified`` with ``make_code_reward``'s meaning: ``False`` gives a row
    with any test that cannot be decided outside the sandbox ``None``; the default still scores it."""
    completions = [fenced(CORRECT), fenced(FORGERIES["always_equal"])]
    strict = make_official_code_reward(memory_mb=256, allow_unverified=False)
    assert official_code_reward.allow_unverified is True
    # The loop runs inside the sandbox: the forgery passes it (1.0) there, but not the verified assert.
    assert official_code_reward(completions, test_method=["function"] * 2, test_list=[UNVERIFIABLE] * 2) == [2.0, 1.0]
    assert strict(completions, test_method=["function"] * 2, test_list=[UNVERIFIABLE] * 2) == [None, None]
    # A LeetCode row, now verified, is scored, and the forgery gets nothing.
    assert strict(completions, test_method=["function"] * 2, test_list=[PLAIN] * 2) == [2.0, 0.0]
    assert official_code_reward(completions, test_method=["function"] * 2, test_list=[PLAIN] * 2) == [2.0, 0.0]
    # stdio rows are always decided outside; the row's other columns still decide the rest.
    echo = fenced("print(input())")
    assert strict([echo], test_method=["stdio"], test_input=[["3\n"]], test_output=[["3"]]) == [1.0]
