"""Contracts of the code reward's parent-side verdicts (``trl_diffusion.rewards.verdict``): which tests are decided
outside the sandbox, which are refused, and how the check judges the plain values the probes send back. Pure
functions only: each probe's value is given to ``judge`` directly, as the sandbox would send it back."""

import pytest

from trl_diffusion.rewards.verdict import ProbeError, decode, judge, plan_test, plan_tests, program_bindings


def _verdict(test, values, shadowed=frozenset()):
    """Plan ``test`` (which must be verified) and judge it on the given probe values."""
    plan = plan_test(test, shadowed)
    assert plan.kind == "verified", plan
    assert len(plan.probes) == len(values), plan.probes
    return judge(plan, values)


# ------------------------------------------------------------------------------------------------- planning


def test_a_redefined_builtin_that_would_leave_a_verified_test_unverified_fails_it():
    """A program's bindings can fail a verified test but never move it to the forgeable unverified mode."""
    test = "assert sorted(round(2.5), key=round(1)) == [2]"
    assert plan_test(test).kind == "verified"
    assert plan_test(test, frozenset({"round"})).kind == "failed"


def test_every_test_after_the_first_unverified_one_is_unverified():
    """Tests that follow an unverified snippet run after it in the sandbox, starting with the very next one."""
    plans = plan_tests(["assert f(1) == 1", "x = 1\nassert f(x) == 1", "assert f(2) == 2", "assert f(3) == 3"])
    assert [p.kind for p in plans] == ["verified", "unverified", "unverified", "unverified"]


def test_program_bindings_count_global_declarations_and_deletions():
    """``global sorted`` and ``del sorted`` bind the name as surely as ``def sorted``."""
    assert program_bindings("def f():\n    global sorted\n    sorted = 1\n") == frozenset({"sorted"})
    assert program_bindings("global round\n") == frozenset({"round"})
    assert program_bindings("del round\n") == frozenset({"round"})


def test_checks_parameter_is_the_program_even_when_named_like_a_builtin():
    """``def check(sorted)``: ``sorted(...)`` calls the entry point in the sandbox, never the real builtin here."""
    plan = plan_test("def check(sorted):\n    assert sorted([3, 1]) == [1, 3]\n\ncheck(f)")
    assert plan.kind == "verified" and plan.probes == ("sorted([3, 1])",) and plan.param == "sorted"
    assert judge(plan, [[3, 1]]) is not None
    assert judge(plan, [[1, 3]]) is None


def test_an_entry_point_built_from_a_program_call_is_not_decomposed():
    """The entry point's arguments must be inputs: ``check(Solution(make(1)).twoSum)`` stays unverified."""
    test = "def check(candidate):\n    assert candidate(1) == 2\n\ncheck(Solution(make(1)).twoSum)"
    assert plan_test(test).kind == "unverified"
    assert plan_test(test.replace("make(1)", "[1]")).kind == "verified"


@pytest.mark.parametrize(
    "test",
    [
        "def check(C):\n    assert C().twoSum(1) == 2\n\ncheck(f)",  # a class-like name that is check's parameter
        "assert solution().twoSum(1) == 2",  # not written as a class
        "assert Solution().__eq__([1, 2])",  # a dunder would receive the expected value
        "assert f(1).equals([1, 2])",  # a method of a returned value, given the expected value
        "assert check(f(1), 4)",  # a program call inside a program call's arguments
        "assert f(1) == string.digits",  # a module attribute the program could bind
        "assert f(1) == list_node([1])",  # a builder outside is_same_list / is_same_tree
        "assert is_same_list(f(1), list_node(list((1, 2))))",  # a builder with non-literal arguments
        "assert is_same_list(f(1), list_node([1]), extra=1)",  # a comparer with keywords
        "assert (filter.__name__, filter([1, 2])) == ('f', [2])",  # the subject used without a call
        "import math\nassert f(1) == math",  # a module as a value
        "assert f(1) or f(2)",  # probe in the right operand of or
        "assert 1 < f(1) < f(2)",  # probe in a later link of a chained comparison
        "assert (f(1) if True else 0) == 1",  # probe in a branch of a conditional expression
        "X = [1]\n\ndef check(candidate):\n    assert candidate(1) == X\n\ncheck(f)",  # a literal the check reads
        "@dec\ndef check(candidate):\n    assert candidate(1) == 1\n\ncheck(f)",  # a decorated check
        "def check(candidate):\n    assert candidate(1) == 1\n\n"  # check defined twice: natively the last runs
        "def check(candidate):\n    assert candidate(1) == 2\n\ncheck(f)",
        "assert f(1) is not f(2)",  # identity of two results: decoded one by one, never the same object here
        "assert f(1)[0] is f(1)[1]",
    ],
)
def test_shapes_the_parent_cannot_decide_stay_unverified(test):
    """Tests whose probes could see an expected value, or run where Python would not, are not decomposed."""
    assert plan_test(test).kind == "unverified"


def test_probes_in_a_subscript_are_separate_probes():
    """``f(1)[f(2)]``: both calls are probes and the subscript is taken here, on their plain values."""
    plan = plan_test("assert f(1)[f(2)] == 3")
    assert plan.kind == "verified" and plan.probes == ("f(1)", "f(2)")
    assert judge(plan, [[0, 3], 1]) is None
    assert judge(plan, [[0, 3], 0]) is not None


def test_the_program_must_bind_the_helpers_and_modules_a_check_uses():
    """Natively the check needs the program's ``is_same_list``, ``list_node`` and ``math``: the sandbox checks them."""
    assert set(plan_test("assert is_same_list(f(1), list_node([1]))").has) == {"is_same_list", "list_node"}
    assert plan_test("assert f(1) == math.pi").has == ("math",)
    assert plan_test("assert f(1) == math.pi", frozenset({"math"})).kind == "failed"


# ------------------------------------------------------------------------------------------------- decoding


def test_decode_refuses_malformed_values():
    """Only well-formed tagged data decodes: a bool tag needs a bool, a dict needs (key, value) tuples."""
    with pytest.raises(ValueError):
        decode(["b", 1])
    with pytest.raises(ValueError):
        decode(["d", [["l", [["i", "1"], ["i", "2"]]]]])
    assert decode(["d", [["t", [["i", "1"], ["i", "2"]]]]]) == {1: 2}


def test_decode_nesting_limit():
    """A value nested deeper than ``MAX_DEPTH`` is refused; one exactly at the limit decodes."""
    from trl_diffusion.rewards.verdict import MAX_DEPTH

    def nested(levels):
        value = ["N"]
        for _ in range(levels):
            value = ["l", [value]]
        return value

    assert decode(nested(MAX_DEPTH)) is not None
    with pytest.raises(ValueError):
        decode(nested(MAX_DEPTH + 1))


def test_decode_scalars_keep_their_exact_type_and_parts():
    """Complex numbers keep real and imaginary parts in order; a bytearray stays a bytearray."""
    assert decode(["c", [(1.0).hex(), (2.0).hex()]]) == complex(1.0, 2.0)
    value = decode(["Y", "0001"])
    assert type(value) is bytearray and value == bytearray(b"\x00\x01")


def test_decode_allows_exactly_the_same_hash_limit():
    """Up to ``_MAX_SAME_HASH`` distinct numbers of one hash decode; one more is refused."""
    from trl_diffusion.rewards.verdict import _MAX_SAME_HASH

    def ints(count):
        return ["l", [["i", format(k * (2**61 - 1), "x")] for k in range(1, count + 1)]]

    assert len(decode(ints(_MAX_SAME_HASH))) == _MAX_SAME_HASH
    with pytest.raises(ValueError):
        decode(ints(_MAX_SAME_HASH + 1))


# ------------------------------------------------------------------------------------------------- judging


def test_a_probe_that_raised_fails_even_an_assert_it_would_otherwise_pass():
    """A raised probe is not a value: ``assert f(1) is not None`` fails with the probe's error."""
    assert _verdict("assert f(1) is not None", [ProbeError("ZeroDivisionError: boom")]) == "ZeroDivisionError: boom"


def test_and_stops_at_the_first_false_operand():
    """``and`` answers its first falsy operand, as Python does."""
    assert _verdict("assert f(1) == 0 and True", [1]) is not None
    assert _verdict("assert f(1) == 0 and True", [0]) is None
    assert _verdict("assert f(1) == 1 or False", [1]) is None


def test_string_formatting_with_a_computed_format_is_refused():
    """``%`` on a string the program sent back is refused (a program-chosen format could be huge)."""
    assert "formatting" in _verdict("assert f(1) % (1,) == '1'", ["%s"])
    assert _verdict("assert f(1) % 3 == 1", [4]) is None


def test_methods_outside_the_whitelist_are_refused_on_plain_values():
    """Only the listed pure methods of each exact type run in the check (a bytearray has none)."""
    assert "not available" in _verdict("assert f(1).count(1) == 1", [bytearray(b"\x01")])
    assert _verdict("assert f(1).count(1) == 1", [b"\x01"]) is None


@pytest.mark.parametrize(
    "test, value",
    [
        ("assert f(1) * 10000000 == ''", "ab"),  # sequence on the left
        ("assert 10000000 * f(1) == ''", "ab"),  # sequence on the right
        ("assert f(1) ** 300000 == 0", 2**10),
        ("assert 1 << f(1) == 0", 2 * 10**6),
        ("assert math.gcd(f(1), f(1), 1) == 1", 2**200000),
        ("assert round(f(1), -400000) == 0", 5),
    ],
    ids=["mul-left", "mul-right", "pow", "lshift", "gcd", "round"],
)
def test_the_check_refuses_to_build_huge_values(test, value):
    """Arithmetic on a program-chosen operand is capped in size and cost, whichever side the operand is on."""
    plan = plan_test(test)
    assert "MemoryError" in judge(plan, [value] * len(plan.probes))


def test_sum_with_a_non_numeric_start_is_refused():
    """``sum(x, [])`` (quadratic list concatenation) is not available to the check."""
    assert "TypeError" in _verdict("assert sum(f(1), []) == [1, 2]", [[[1], [2]]])
    assert _verdict("assert sum(f(1), 1) == 4", [[1, 2]]) is None


def test_repeated_equal_members_do_not_count_against_the_same_hash_limit():
    """Equal values are one distinct value: ``set(f(1))`` of many equal items passes."""
    assert _verdict("assert set(f(1)) == {1}", [[1] * 40]) is None


# ------------------------------------------------------------------------------------------------- LeetCode forms


def test_linked_list_forms():
    """``is_same_list``: an empty expected list matches ``None``; a falsy end or a malformed form never matches."""
    assert _verdict("assert is_same_list(f(1), list_node([]))", [([], False)]) is None
    assert _verdict("assert is_same_list(f(1), list_node([1]))", [([1], False)]) is None
    assert _verdict("assert is_same_list(f(1), list_node([1]))", [([1], True)]) is not None
    assert _verdict("assert is_same_list(f(1), list_node([1]))", [([1], 0)]) is not None


def test_tree_forms():
    """``tree_node`` keeps falsy values as nodes; a shape whose node count differs from its values is refused."""
    assert _verdict("assert is_same_tree(f(1), tree_node([0, None, 0]))", [("10100", [0, 0])]) is None
    assert _verdict("assert is_same_tree(f(1), tree_node([1]))", [("100", [])]) is not None


def test_identity_with_one_side_the_check_knows_stays_verified():
    """``is`` against None, a type or a literal is decided here as natively: those tests stay verified."""
    tests = ("assert f(1) is None", "assert f(1) is not None", "assert type(f(1)) is int", "assert [1] is not f(1)")
    for test in tests:
        assert plan_test(test).kind == "verified", test
