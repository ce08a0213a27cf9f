"""Adversarial review of the code sandbox: attacks that escaped it or hurt the trainer, each fixed."""

import os
import secrets
import signal
import sys
import time

import pytest

from trl_diffusion.rewards import sandbox
from trl_diffusion.rewards.sandbox import SandboxLimits, run_tests


def _pids_named(name: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/comm", encoding="utf-8", errors="replace") as f:
                    if f.read().strip() == name:
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def test_namespace_init_that_left_the_group_does_not_outlive_the_run(monkeypatch):
    """Without a memory cgroup, killing ``unshare``'s process group was the only cleanup with a PID namespace: a
    program that cleared its parent-death signal, called ``setsid()`` and blocked holding the GIL (so the in-sandbox
    watchdog thread never ran) survived the run, re-parented to the host's init."""
    launcher, _ = sandbox._get_launcher(sys.executable, None) or ([], False)
    if "--pid" not in launcher:
        pytest.skip("no PID namespace on this machine")
    monkeypatch.setattr(sandbox, "_get_launcher", lambda python, uid: (launcher, False))  # as without a cgroup
    marker = "lost" + secrets.token_hex(5)
    program = f"""
import ctypes, os
libc = ctypes.CDLL(None)
libc.prctl(15, ctypes.c_char_p(b"{marker}"), 0, 0, 0)  # PR_SET_NAME: so the test can find it
libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG = 0
os.setsid()
ctypes.PyDLL(None).sleep(120)  # holds the GIL: the watchdog thread never runs; no CPU time is used
"""
    try:
        result = run_tests(program, ["assert f() == 1"], SandboxLimits(timeout=2.0))
        assert result.status == "timeout" and result.passed == 0
        deadline = time.monotonic() + 20.0
        while _pids_named(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _pids_named(marker) == []
    finally:
        for pid in _pids_named(marker):
            os.kill(pid, signal.SIGKILL)

