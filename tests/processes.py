"""Test helper for the sandbox tests: the processes of this machine, found by name through ``/proc``.

Used by ``tests/test_review_sandbox.py`` and ``tests/test_sandbox_contracts.py`` to check that nothing a run started
outlives it.
"""

import os


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
