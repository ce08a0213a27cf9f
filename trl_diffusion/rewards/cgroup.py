"""A memory cgroup, and a CPU cgroup, per sandbox run, where the host lets this process create them (parent side
only).

``RLIMIT_AS`` bounds each process; only a cgroup bounds the sandbox as a whole: every process it forks, the files
it writes to its tmpfs, memfd and other shared memory, and the kernel memory charged to it. The sandbox child
joins the run's cgroup (by writing to its ``cgroup.procs``) before it sets anything else up, so everything the
program does is charged to it; when the cgroup is full the kernel reclaims and then OOM-kills inside it.

Supported: cgroup v1 with a writable ``memory`` hierarchy (``memory.limit_in_bytes``, and
``memory.memsw.limit_in_bytes`` so swap is no way around it), and cgroup v2 where this process's cgroup can hand
the ``memory`` controller to a child (``memory.max``, ``memory.swap.max = 0``). Typically that means root outside a
container, or a container given a writable cgroup; elsewhere :func:`memory_cgroup_root` is ``None`` and the
sandbox falls back to the per-process limits (``docs/rewards.md`` states the resulting bound).

The CPU cgroup shares the CPU per run rather than per process: with the default equal weights, runs in parallel get
equal shares whatever number of processes each one starts, so a program that forks busy processes (each in a new
session, which would give each its own scheduler autogroup) cannot slow the programs scored beside it into their
time limits. cgroup v1: a group in the ``cpu`` hierarchy (:func:`cpu_cgroup_root`); v2: the run's memory cgroup
itself, once this process's cgroup hands the ``cpu`` controller to its children too (best effort).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["CgroupRoot", "cpu_cgroup_root", "memory_cgroup_root"]

_COUNTER = itertools.count()
_LOCK = threading.Lock()
_CACHE: dict[str, CgroupRoot | None] = {}


def _after_fork_in_child() -> None:
    """A fork made while another thread probed would wait forever on its lock: the fork gets a fresh one."""
    global _LOCK
    _LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass(frozen=True)
class CgroupRoot:
    """The directory under which per-run cgroups are created, the hierarchy's version (1 or 2), and the controller
    they are made for (``"memory"``, or ``"cpu"``: a v1 ``cpu`` hierarchy)."""

    path: str
    version: int
    controller: str = "memory"

    def create(self, memory_bytes: int = 0) -> str:
        """Make a fresh cgroup and return its directory: limited to ``memory_bytes`` (swap included) for memory, with
        the default CPU weight for cpu."""
        path = os.path.join(self.path, f"trl_sandbox_{self.controller}_{os.getpid()}_{next(_COUNTER)}")
        os.mkdir(path)
        if self.controller == "cpu":
            return path
        try:
            if self.version == 1:
                _write(path, "memory.limit_in_bytes", memory_bytes)
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    _write(path, "memory.memsw.limit_in_bytes", memory_bytes)
            else:
                _write(path, "memory.max", memory_bytes)
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(path, "memory.swap.max", 0)
        except BaseException:  # an OSError, or an interrupt: the cgroup is not left behind
            os.rmdir(path)
            raise
        return path

    def peak(self, path: str) -> int | None:
        """Highest memory charged to the run's cgroup (``None`` where the kernel does not report it)."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            with open(os.path.join(path, name), encoding="ascii") as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def remove_orphans(self, min_age: float = 60.0) -> list[str]:
        """Remove the per-run cgroups of this controller whose creator (the pid in the name) is not running, that
        hold no process (the kernel refuses to remove one that does) and that are older than ``min_age`` seconds (a
        live run's cgroup is empty only between its creation and the sandbox joining it, and a creator in another
        PID namespace looks gone from here); returns their paths. A trainer killed during a run (SIGTERM, SIGKILL)
        leaves its run's cgroups; the sandbox itself dies with it."""
        removed = []
        pattern = re.compile(rf"trl_sandbox_{self.controller}_([0-9]{{1,10}})_[0-9]+")
        try:
            names = os.listdir(self.path)
        except OSError:
            return removed
        for name in names:
            path = os.path.join(self.path, name)
            match = pattern.fullmatch(name)
            try:
                if match is None or _running(int(match[1])) or time.time() - os.stat(path).st_mtime < min_age:
                    continue
                os.rmdir(path)
                removed.append(path)
            except (OSError, OverflowError):  # still holds a process, gone already; a pid no process can have
                pass
        return removed

    def destroy(self, path: str) -> bool:
        """SIGKILL every process left in the cgroup, then remove it; ``False`` if it could not be removed."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            pids = _pids(path)
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            try:
                os.rmdir(path)
                return True
            except FileNotFoundError:
                return True
            except OSError:
                time.sleep(0.02)
        return False


def memory_cgroup_root() -> CgroupRoot | None:
    """Where this process may create memory-limited child cgroups (probed once), or ``None``."""
    with _LOCK:
        if "root" not in _CACHE:
            _CACHE["root"] = _probe("memory")
        return _CACHE["root"]


def cpu_cgroup_root() -> CgroupRoot | None:
    """Where this process may create per-run groups in a cgroup v1 ``cpu`` hierarchy (probed once), or ``None``
    (under v2 the memory cgroup carries the CPU share: see the module docstring)."""
    with _LOCK:
        if "cpu" not in _CACHE:
            _CACHE["cpu"] = _probe("cpu")
        return _CACHE["cpu"]


def _probe(controller: str) -> CgroupRoot | None:
    for root in _candidates(controller):
        try:
            path = root.create(64 * 1024 * 1024)
        except OSError:
            continue
        if root.destroy(path):
            return root
    return None


def _candidates(controller: str) -> Iterator[CgroupRoot]:
    """This process's cgroup directory for ``controller`` in each mounted hierarchy (v1 first: hybrid hosts put the
    controllers there); for ``"cpu"``, v1 only."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            own = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open("/proc/self/mountinfo", encoding="utf-8") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return
    for version in (1, 2) if controller == "memory" else (1,):
        for hierarchy, controllers, rel in own:
            if controller == "cpu" and "memory" in controllers.split(","):
                continue  # cpu mounted with memory: the run's memory cgroup is its CPU group (a second one would
                # move the sandbox out of the first)
            if (version == 1 and controller in controllers.split(",")) or (version == 2 and hierarchy == "0"):
                for fields in mounts:
                    directory = _directory(fields, version, rel, controller)
                    if directory is not None and (version == 1 or _v2_delegates_memory(directory)):
                        yield CgroupRoot(directory, version, controller)


def _directory(fields: list[str], version: int, rel: str, controller: str = "memory") -> str | None:
    """The host directory of cgroup ``rel`` if this mountinfo line is the matching hierarchy's mount."""
    if "-" not in fields:
        return None
    sep = fields.index("-")
    fstype, superopts, root, mountpoint = fields[sep + 1], fields[sep + 3], fields[3], fields[4]
    if (version == 1 and (fstype != "cgroup" or controller not in superopts.split(","))) or (
        version == 2 and fstype != "cgroup2"
    ):
        return None
    if root != "/" and not (rel == root or rel.startswith(root + "/")):
        return None
    suffix = rel[len(root) :] if root != "/" else rel
    directory = os.path.normpath(mountpoint + "/" + suffix.lstrip("/"))
    return directory if os.path.isdir(directory) else None


def _v2_delegates_memory(directory: str) -> bool:
    """Whether children of ``directory`` can get the memory controller (enabling it if this process may); the cpu
    controller is handed down too where it can be (best effort: a CPU share per run, see the module docstring)."""
    try:
        with open(os.path.join(directory, "cgroup.subtree_control"), encoding="ascii") as f:
            enabled = f.read().split()
    except OSError:
        return False
    if "cpu" not in enabled:
        try:
            _write(directory, "cgroup.subtree_control", "+cpu")
        except OSError:
            pass
    if "memory" in enabled:
        return True
    try:
        _write(directory, "cgroup.subtree_control", "+memory")  # EBUSY where this cgroup holds processes
        return True
    except OSError:
        return False


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def _pids(path: str) -> list[int]:
    try:
        with open(os.path.join(path, "cgroup.procs"), encoding="ascii") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def _write(directory: str, name: str, value: object) -> None:
    with open(os.path.join(directory, name), "w", encoding="ascii") as f:
        f.write(str(value))
