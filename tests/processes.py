"""Test helpers for the sandbox tests: the processes of this machine, found by name through ``/proc``.

Used by ``tests/test_review_sandbox.py`` and ``tests/test_sandbox_contracts.py`` to check that nothing a run started
outlives it.
"""

import os
import time


def pids_named(name: str) -> list[int]:
    """The pids whose ``/proc/<pid>/comm`` is ``name`` (processes that end while being read are skipped)."""
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


def still_running_after(name: str, seconds: float) -> list[int]:
    """The pids named ``name`` once none are left or ``seconds`` have passed, whichever comes first (a killed
    process takes a moment to leave ``/proc``)."""
    deadline = time.monotonic() + seconds
    while pids_named(name) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_named(name)
