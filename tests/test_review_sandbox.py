"""Adversarial review of the code sandbox: attacks that escaped it or hurt the trainer, each fixed."""

import os
import secrets
import signal
import sys
import time

import pytest
from processes import pids_named, source_without_the_filter, still_running_after

from trl_diffusion.rewards import sandbox
from trl_diffusion.rewards.sandbox import SandboxLimits, run_tests


def test_namespace_init_that_left_the_group_does_not_outlive_the_run(monkeypatch):
    """Without a memory cgroup, killing ``unshare``'s process group was the only cleanup with a PID namespace: a
    program that cleared its parent-death signal, left the process group and blocked holding the GIL (so the
    in-sandbox watchdog thread never ran) survived the run, re-parented to the host's init. (It called ``setsid()``;
    ``setpgid(0, 0)`` leaves the group as well. Both, and clearing the parent-death signal, are refused where the
    seccomp filter runs, so this runs without it, as on an architecture the filter does not know: the namespace's
    kill must not depend on the filter.)"""
    launcher, _ = sandbox._get_launcher(sys.executable, None) or ([], False)
    if "--pid" not in launcher:
        pytest.skip("no PID namespace on this machine")
    monkeypatch.setattr(sandbox, "_SOURCE", source_without_the_filter(sandbox._runner_source()))
    monkeypatch.setattr(sandbox, "_get_launcher", lambda python, uid: (launcher, False))  # as without a cgroup
    marker = "lost" + secrets.token_hex(5)
    program = f"""
import ctypes, os
libc = ctypes.CDLL(None)
libc.prctl(15, ctypes.c_char_p(b"{marker}"), 0, 0, 0)  # PR_SET_NAME: so the test can find it
libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG = 0
libc.setpgid(0, 0)  # a process group of its own: killing the run's group does not reach it
ctypes.PyDLL(None).sleep(120)  # holds the GIL: the watchdog thread never runs; no CPU time is used
"""
    try:
        result = run_tests(program, ["assert f() == 1"], SandboxLimits(timeout=2.0))
        assert result.status == "timeout" and result.passed == 0
        assert still_running_after(marker, 20.0) == []
    finally:
        for pid in pids_named(marker):
            os.kill(pid, signal.SIGKILL)


P = 2**61 - 1  # hash(k * P) == 0 for every int k: distinct values the program can choose freely


def test_decode_refuses_many_distinct_values_of_one_hash():
    """A set (or a check's ``set(f(x))``) of n such values costs n**2 comparisons in the trainer, under its GIL:
    32000 of them (1 MB, the default report cap) held the trainer for seconds per completion."""
    from trl_diffusion.rewards.verdict import _MAX_SAME_HASH, decode

    def ints(values, tag="l"):
        return [tag, [["i", format(v, "x")] for v in values]]

    colliding = [k * P for k in range(_MAX_SAME_HASH + 1)]
    for tag in ("l", "S", "t", "F"):
        with pytest.raises(ValueError, match="share one hash"):
            decode(ints(colliding, tag))
    with pytest.raises(ValueError, match="share one hash"):
        decode(["d", [["t", [["i", format(v, "x")], ["N"]]] for v in colliding]])
    with pytest.raises(ValueError, match="share one hash"):  # nested in tuples, as set elements
        decode(["S", [["t", [["i", format(v, "x")]]] for v in colliding]])
    assert decode(ints(colliding[:-1], "S")) == set(colliding[:-1])
    assert decode(ints([P] * 1000)) == [P] * 1000  # equal values are one value
    assert decode(ints(range(100_000), "S")) == set(range(100_000))
    assert len(decode(["l", [["f", "nan"]] * 100])) == 100  # every NaN hashes by identity


def test_probe_of_colliding_values_fails_instead_of_stalling_the_trainer():
    program = f"def f(x):\n    return [k * {P} for k in range(2000)]\n"
    tests = ["assert set(f(1)) == {0}", "assert len(f(1)) == 2000", f"assert f(1)[1] == {P}"]
    result = run_tests(program, tests, SandboxLimits(timeout=20.0))
    # The value is refused, so even the length check fails (a deliberate difference from native execution); a
    # single element of it is plain data.
    assert result.status == "ok" and result.outcomes == [False, False, True], result
    assert "share one hash" in result.errors[0] and "share one hash" in result.errors[1]


def test_extract_code_is_linear_in_a_long_line_without_newline():
    """The fence pattern backtracked quadratically over a fence followed by a long line (a degenerate repetition
    such as a policy emits): about 30 s for these 300k characters, in the trainer's main thread."""
    from trl_diffusion.rewards.code_reward import extract_code

    text = "```" + "python" * 50_000
    start = time.monotonic()
    assert extract_code(text) is None
    assert time.monotonic() - start < 10.0  # a generous "it did not stall" bound, not a speed check
    assert extract_code("```Python3 extra words\nx = 1\n```") == "x = 1\n"  # the tag is the info line's first word
    assert extract_code("``` py\nx = 1\n```\n```js\ny\n```") == "x = 1\n"
