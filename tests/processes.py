"""Test helpers for the sandbox tests: the processes of this machine, found by name through ``/proc``.

Used by ``tests/test_review_sandbox.py``, ``tests/test_sandbox_contracts.py`` and
``tests/test_killed_trainer_cleanup.py`` to check that nothing a run started outlives it (or its trainer), and
``REWARDS_WITHOUT_MODELS`` for their trainer processes.
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


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (which may hold any bytes): state, parent pid, ..."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` names a process that has not exited (a zombie waiting to be reaped has)."""
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def descendants(pid: int) -> set[int]:
    """Every process below ``pid``: its children, theirs, and so on."""
    parents = {}
    for entry in os.listdir("/proc"):
        fields = _stat_fields(int(entry)) if entry.isdigit() else None
        if fields is not None:
            parents[int(entry)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def command_line(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces (empty once it has exited)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


SECCOMP_CALL = 'isolation["seccomp"] = _install_seccomp()'


def source_without_the_filter(source: str) -> str:
    """The sandbox's runner source without its seccomp filter, as on an architecture the filter does not know (or a
    kernel without seccomp): what the cleanup must still handle there, a program that calls the C library to leave
    the run's process group (``setpgid``) or to clear its parent-death signal (``prctl``), which the filter refuses
    and the Python guards do not see."""
    assert SECCOMP_CALL in source, f"the sandbox source no longer has {SECCOMP_CALL!r}: update this helper"
    return source.replace(SECCOMP_CALL, 'isolation["seccomp"] = False')


REWARDS_WITHOUT_MODELS = """
import importlib.util as _util, sys as _sys, types as _types
_package = _types.ModuleType("trl_diffusion")
_package.__path__ = list(_util.find_spec("trl_diffusion").submodule_search_locations)
_sys.modules["trl_diffusion"] = _package
"""
"""Source a test's trainer process runs before it imports ``trl_diffusion.rewards``: the package's own ``__init__``
(the model registration, which imports torch, transformers and TRL: about 5 s of CPU a process) is skipped, and the
reward modules, which import none of them, load as they are. For the trainers of tests/test_killed_trainer_cleanup.py
(which keeps one with the whole package) and tests/test_sandbox_limits.py's trainer as PID 1."""
