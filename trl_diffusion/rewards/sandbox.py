"""Run untrusted Python (model-written code) in a separate, resource-limited process, and decide its tests outside it.

Why a separate process: model completions are arbitrary programs. They may loop forever, fork-bomb, allocate all
memory, flood stdout, write files, read secrets, open sockets, or try to fake a passing result. Everything here is
designed so that such a program costs one bounded sandbox run and a failed test, never a hung or crashed trainer and
never a pass it did not earn.

How tests are decided (see :mod:`trl_diffusion.rewards.verdict`): each test is split, in this process, into *probes*
(the program calls, e.g. ``f(2)``) and a *check* (e.g. ``<probe> == 4``). Only the probes go to the sandbox; it sends
their results back as tagged plain data over a pipe of its own, and the checks are evaluated here. The expected values
never enter the sandboxed process, so nothing the program does there can produce a pass. Tests that cannot be split
(loops, assignments, ...) run the old way, in a separate sandbox run that reports whether they raised: that verdict
*can* be forged by the program, and :attr:`SandboxResult.verified` says how many tests avoided it.

How the sandbox is built (Linux only). The parent :func:`run_tests`:

* creates a fresh temporary directory and, where the host allows it, a memory cgroup for the run
  (:mod:`trl_diffusion.rewards.cgroup`) that bounds everything the sandbox holds: all its processes, its files and
  any shared memory, and a CPU cgroup (cgroup v1's ``cpu`` hierarchy, or the memory cgroup under v2) that gives
  the run one CPU share, however many processes it starts;
* starts ``python -I -c <this file>`` with an EMPTY environment except ``PATH=/usr/bin:/bin``, all other file
  descriptors closed except the report pipe and a lifeline pipe's read end, in a new session; when ``unshare`` works
  on this machine it is wrapped in ``unshare --net --ipc --pid --fork --kill-child --mount-proc`` (as non-root: also
  ``--user --map-root-user``), itself started through ``setpriv --pdeathsig KILL`` where that works, so that the
  kernel kills it, and so the PID namespace, when the trainer's thread that started it dies;
* has the kernel SIGKILL the run's process group when this process dies, however it dies (``_arm_lifeline``: the
  lifeline's read end is owned by the group and signals it when its only write end, ours, closes), so a killed
  trainer's run ends with it (a PID namespace's first process, which the kernel shields from that signal, ends by
  its parent-death signal when ``unshare`` dies; without ``unshare --fork`` the program shares the armed open file
  and can turn the signal off, ``docs/rewards.md``);
* sends the program, the probes and the limits on stdin, reads stdout+stderr (capped at ``max_output_bytes``) and the
  report pipe (same cap), and on timeout, overflow or exit SIGKILLs the whole process group, the cgroup, the PID
  namespace's first process (through a pidfd taken before the program starts), and (without a PID namespace) every
  process of the run's own uid.

The child (``_child_main`` below, executed from this same file's source, importing only the standard library):

* joins the run's cgroups first (memory; CPU: one share per run, whatever it forks);
* in a private mount namespace: builds a new root holding only the system directories (``/usr``, ``/bin``, ``/lib*``,
  ``/sbin``, ``/etc``) and the interpreter's own directories (not the folders ``.pth`` files add), read-only, plus
  ``/dev/{null,zero,full,random,urandom}``, its own ``/proc``, and a size-limited tmpfs as its working directory
  inside an otherwise empty ``/tmp``; then
  ``pivot_root``\\ s into it, so no other host file or socket exists for it;
* when started as root: drops to a fresh, otherwise unused uid/gid for this run (``RLIMIT_NPROC`` does not apply to
  root, and a uid of its own makes the limit per sandbox); if it cannot, it refuses to run the program (fail closed);
* sets ``no_new_privs``, drops every capability, installs a seccomp filter that refuses ``memfd_create``,
  ``memfd_secret``, SysV ``shmget``/``semget``/``msgget``, ``mq_open`` and ``io_uring_setup`` (memory that no
  per-process limit counts), ``ptrace``, ``process_vm_readv``/``writev`` and ``pidfd_getfd``, and limits,
  scheduling, priority and I/O priority of any process but the caller (``prlimit64``, ``sched_set*``,
  ``setpriority``, ``ioprio_set``) and ``kill`` of a negative pid (without a PID namespace the trainer is visible:
  ``prlimit(<trainer>, RLIMIT_CPU, (1, 1))`` would kill it), and ``setsid`` (a process in a session of its own
  leaves the run's process group and gets a scheduler autogroup of its own: 29 busy ones pushed correct programs
  scored beside them past their time limits) and ``setpgid`` (a group of its own is out of reach of the watchdog's
  ``killpg``: without a PID namespace, all that ends a run once its trainer has died), and ``prctl``'s
  ``PR_SET_PDEATHSIG`` (a PID namespace's first process that cleared its parent-death signal, which ``unshare
  --kill-child`` sets, outlived a killed trainer: the kernel shields it from other signals), the commands that set
  an I/O signal's owner or number (a kill of another group by other means; on the lifeline, its kill turned off),
  and new namespaces (``clone3``: ``ENOSYS``), applies Landlock (file
  writes only beneath its directory; no TCP, abstract sockets or signals outside, where the kernel's Landlock
  version has them), sets ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` and
  ``RLIMIT_CORE=0``, and
  arms a watchdog that kills its process group at the time limit or as soon as the lifeline pipe closes (the
  parent, which holds its only write end, has died: a trainer killed by SIGTERM or SIGKILL);
* installs Python-level guards (see ``_install_guards``): no sockets, no exec/spawn, no writes outside its
  directory, no reading other processes' ``/proc`` entries, no signals, limits, scheduling or priority changes of
  processes outside the program's own process group. These hold even where the kernel mechanisms are
  unavailable, but code that calls the OS directly (``ctypes``) can bypass them;
* writes the setup's line to its report pipe: the isolation it achieved (above), or the error that kept it from
  running the program (status ``sandbox_error``);
* runs the program, then the probes (or, in a separate run, the unverified tests' snippets, in order), converts each
  probe's value to tagged plain data with functions bound before the program ran, and writes the report to its pipe.

The program can write to the report pipe too, but only after the setup's line: the parent takes the isolation and a
``sandbox_error`` from that line alone, so a ``sandbox_error`` the program writes is its own failed run (``error``),
never one the metrics blame on the sandbox, and isolation values it writes are ignored.

``docs/rewards.md`` lists exactly what is and is not guaranteed in each environment.
"""

from __future__ import annotations

import itertools
import json
import math
import numbers
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SandboxLimits", "SandboxResult", "isolation_report", "run_tests"]

_MIN_PATH = "/usr/bin:/bin"
# Root runs each sandbox as its own unused uid from this range, so RLIMIT_NPROC (counted per uid) is per sandbox.
_UID_BASE = 100_000_000
_UID_COUNTER = itertools.count()
_UID_SLOT_BITS = 21  # a fresh uid: _UID_BASE + (pid's slot << 10 | counter): pid % 2**21, counter % 1024
_PROBE_TIMEOUT = 10.0
_MAX_DEPTH = 100  # nesting depth of a probe's value (verdict.MAX_DEPTH; repeated: the child imports no package)
_COUNT_LIMITS = ("memory_mb", "max_processes", "max_output_bytes", "max_file_bytes", "max_disk_bytes",
                 "max_open_files")
"""``SandboxLimits`` fields that are whole numbers >= 1."""
_MAX_NODES = 1_000_000  # values in one probe's result


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandbox run.

    Attributes:
        timeout: wall-clock seconds for the whole run (start-up, program and all tests).
        cpu_seconds: ``RLIMIT_CPU`` per process; ``None`` means ``ceil(timeout) + 1``.
        memory_mb: memory of the whole sandbox in MiB where a memory cgroup is available (all processes, files in
            its directory, shared memory); always also ``RLIMIT_AS`` (address space) of each process.
        max_processes: ``RLIMIT_NPROC``: processes+threads of the sandbox uid (see the module docstring).
        max_output_bytes: stdout+stderr bytes read before the run is killed and scored as failed; also the cap on
            the report (the probes' values, JSON: all the captured outputs of the stdio tests of one run).
        max_file_bytes: ``RLIMIT_FSIZE``: largest file the program may write.
        max_disk_bytes: size of the sandbox directory (a tmpfs; only where a mount namespace is available).
        max_open_files: ``RLIMIT_NOFILE``.
    """

    timeout: float = 10.0
    cpu_seconds: int | None = None
    memory_mb: int = 1024
    max_processes: int = 32
    max_output_bytes: int = 1_000_000
    max_file_bytes: int = 16 * 1024 * 1024
    max_disk_bytes: int = 64 * 1024 * 1024
    max_open_files: int = 256

    def __post_init__(self) -> None:
        """Refuse limits no run could pass under (``memory_mb=0``, ``max_output_bytes=0``: every program would fail
        and score 0) or that fail only inside a run (``timeout=inf``): a clear error when the limits are built."""
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, numbers.Real):
            raise ValueError(f"SandboxLimits.timeout must be a number of seconds, got {self.timeout!r}.")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(f"SandboxLimits.timeout must be finite and > 0, got {self.timeout}.")
        counts = {name: getattr(self, name) for name in _COUNT_LIMITS}
        if self.cpu_seconds is not None:
            counts["cpu_seconds"] = self.cpu_seconds
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"SandboxLimits.{name} must be an int >= 1, got {value!r}.")


@dataclass
class SandboxResult:
    """Outcome of one :func:`run_tests` call.

    ``status`` is one of: ``"ok"`` (the harness finished and reported; tests may still have failed), ``"timeout"``,
    ``"output_limit"``, ``"crashed"`` (killed by a signal, e.g. a limit), ``"error"`` (exited without a valid
    report, e.g. ``os._exit``), ``"sandbox_error"`` (the sandbox itself could not run; the program never ran).
    ``outcomes[i]`` says whether test ``i`` passed; ``verified`` counts the tests whose verdict was decided outside
    the sandbox (the others ran the old way and a program can forge their result).
    """

    status: str
    passed: int = 0
    total: int = 0
    returncode: int | None = None
    output: str = ""
    duration: float = 0.0
    errors: list[str] = field(default_factory=list)
    isolation: dict[str, Any] = field(default_factory=dict)
    verified: int = 0
    outcomes: list[bool] = field(default_factory=list)

    @property
    def all_passed(self) -> bool:
        """True iff the run completed and every test (at least one) passed."""
        return self.status == "ok" and self.total > 0 and self.passed == self.total

    @property
    def fraction(self) -> float:
        """Fraction of tests passed; 0.0 unless the run completed normally."""
        return self.passed / self.total if self.status == "ok" and self.total > 0 else 0.0


# --------------------------------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------------------------------

_LAUNCHERS: dict[tuple[str, int, int | None], tuple[list[str], bool] | None] = {}
_LAUNCHER_LOCK = threading.Lock()
_INIT_EXIT_WAIT = 2.0
"""Seconds ``_stop_run`` lets ``unshare`` reap the killed init and exit before it kills ``unshare``'s group."""
_SOURCE: str | None = None
_PARENT_ONLY_FDS: set[int] = set()
"""The runs' lifeline and report write ends and directory locks: a fork of this process (a DataLoader or
``multiprocessing`` worker) closes its copies, or a run would outlive this process as long as the fork lives."""


def _after_fork_in_child() -> None:
    """In a fork of this process: close the runs' parent-only descriptors, and replace the launcher lock, which
    another thread may have held (probing) at the fork, so that the fork's own runs do not wait on it forever."""
    global _LAUNCHER_LOCK
    for fd in list(_PARENT_ONLY_FDS):
        try:
            os.close(fd)
        except OSError:
            pass
    _PARENT_ONLY_FDS.clear()
    _LAUNCHER_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@dataclass
class _Run:
    """What one sandbox process produced."""

    status: str
    report: dict[str, Any] | None
    output: str
    returncode: int | None
    duration: float
    isolation: dict[str, Any]


def run_tests(
    program: str,
    tests: list[str],
    limits: SandboxLimits | None = None,
    python: str | None = None,
    run_as_uid: int | None = None,
    ordered: bool = False,
) -> SandboxResult:
    """Run ``program`` in a fresh sandbox and decide each test snippet (typically one ``assert``).

    Verified tests are decided from a run of their probes alone, unverified ones in another run, in order. A
    verified test therefore does not see what an earlier unverified test did (``x = add(1, 2)`` then
    ``assert x == 3`` fails); with ``ordered=True`` every test after the row's first unverified one runs after it,
    unverified, as natively and as dLLM-RL's grader (``run_official``) runs them, at the cost of verdicts a program
    can forge.

    A test passes if it would run without raising in the program's namespace; how that is decided (outside the
    sandbox where possible) is described in the module docstring. Never raises and never outlives
    ``limits.timeout`` by more than the kill/cleanup time (twice that when some tests are verified and some are
    not: they run separately): every failure becomes a :class:`SandboxResult` with ``passed=0``. ``python``
    (an absolute path: :func:`resolve_python`) defaults to the current interpreter. When this process is root the
    program runs as ``run_as_uid`` (uid and gid); the default, ``None``, picks a fresh unused uid per run so that the
    process limit of one sandbox is not shared with any other process on the machine.
    """
    from .verdict import plan_test, plan_tests, program_bindings

    limits = limits or SandboxLimits()
    python = os.fsdecode(python) if python else sys.executable  # a str, bytes or Path
    tests = list(tests)
    try:
        chosen = _get_launcher(python, run_as_uid)
        if chosen is None:
            return SandboxResult("sandbox_error", total=len(tests), errors=["no working sandbox launcher (see logs)"])
        shadowed = program_bindings(program) if isinstance(program, str) else frozenset()
        plans = plan_tests(tests, shadowed) if ordered else [plan_test(test, shadowed) for test in tests]
        return _run_plans(chosen, python, program, plans, limits, run_as_uid, ordered)
    except Exception as exc:  # the caller must never see an exception from here
        return SandboxResult("sandbox_error", total=len(tests), errors=[f"{type(exc).__name__}: {exc}"])


def resolve_python(python: str | None) -> str | None:
    """The absolute path of the interpreter ``python`` names, found as the caller's shell finds it (a bare name on
    ``PATH``, a path relative to the current directory, a pyenv shim with its ``PYENV_VERSION``), by starting it
    once; ``None`` stays ``None`` (the current interpreter).

    The sandbox starts the interpreter from an empty working directory with a minimal ``PATH``, where none of those
    would resolve: every run would be a ``sandbox_error`` (reward 0.0). Raises ``ValueError`` naming ``python`` when
    it cannot be started. Warns when it is a newer Python than this one: programs and tests are parsed here (for the
    checks made outside the sandbox) with this interpreter's grammar, so syntax new in that version fails those
    checks (closed: a test fails that natively could pass).
    """
    if python is None:
        return None
    query = "import sys; print(sys.executable); print(*sys.version_info[:2])"
    try:
        found = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"python={python!r} cannot be started: {exc}") from None
    lines = found.stdout.split("\n")
    version = tuple(int(part) for part in lines[1].split() if part.isdigit()) if len(lines) > 1 else ()
    if found.returncode != 0 or len(version) != 2 or not os.path.isabs(lines[0]):
        detail = found.stderr.strip()[-300:] or found.stdout.strip()[-300:] or f"exit status {found.returncode}"
        raise ValueError(f"python={python!r} did not run as a Python interpreter: {detail}")
    if version > sys.version_info[:2]:
        import logging

        logging.getLogger(__name__).warning(
            "python=%r is Python %s, this process Python %s: programs and tests are parsed here with this Python's "
            "grammar, so syntax new in %s fails the tests checked outside the sandbox; run the trainer on the same "
            "Python", python, ".".join(map(str, version)), ".".join(map(str, sys.version_info[:2])),
            ".".join(map(str, version)),
        )  # fmt: skip
    return lines[0]


def isolation_report(python: str | None = None, run_as_uid: int | None = None) -> dict[str, Any]:
    """Run a trivial program and return which isolation mechanisms were active (for logs, docs and tests)."""
    result = run_tests("pass", ["pass"], SandboxLimits(timeout=_PROBE_TIMEOUT), python, run_as_uid)
    return dict(result.isolation, status=result.status)


def _run_plans(
    chosen: tuple[list[str], bool],
    python: str,
    program: str,
    plans: list[Any],
    limits: SandboxLimits,
    run_as_uid: int | None,
    ordered: bool = False,
) -> SandboxResult:
    """Run the verified tests' probes and the unverified snippets (in order, in one namespace) in separate runs, so
    the snippets' expected values never share a process with the probes that decide verified tests; decide every
    test here. ``ordered`` (every verified test comes before the first unverified one): the snippets' run first
    runs the verified tests' probes again (imports, side effects; no expected values, results unused), as one
    process runs a whole row natively."""
    from .verdict import ProbeError, decode, judge

    verified = [i for i, p in enumerate(plans) if p.kind == "verified"]
    unverified = [i for i, p in enumerate(plans) if p.kind == "unverified"]
    outcomes, reasons = [False] * len(plans), {i: p.reason for i, p in enumerate(plans) if p.kind == "failed"}
    runs = []
    if verified or not unverified:
        specs = [plans[i].sandbox_spec() for i in verified]
        run = _run_once(chosen, python, {"program": program, "specs": specs}, limits, run_as_uid)
        runs.append(run)
        for i, entry in zip(verified, _report_results(run, len(verified)) or []):
            values, reason = _probe_values(entry, decode, ProbeError)
            if reason is None and (len(entry["has"]) != len(plans[i].has) or len(values) != len(plans[i].probes)):
                reason = "malformed report: not one entry per name and per probe"  # only a forger writes one
            if reason is None:
                missing = [name for name, bound in zip(plans[i].has, entry["has"]) if bound is not True]
                reason = f"NameError: name {missing[0]!r} is not defined" if missing else judge(plans[i], values)
            outcomes[i], reasons[i] = reason is None, reason
    if unverified:
        replayed = [plans[i].sandbox_spec() for i in verified] if ordered else []
        specs = replayed + [{"exec": plans[i].source} for i in unverified]
        run = _run_once(chosen, python, {"program": program, "specs": specs}, limits, run_as_uid)
        runs.append(run)
        for i, entry in zip(unverified, (_report_results(run, len(specs)) or [])[len(replayed):]):
            error = entry.get("error")
            outcomes[i], reasons[i] = entry.get("passed") is True, None if error is None else str(error)[:300]
    status = next((r.status for r in runs if r.status != "ok"), "ok")
    if status != "ok":
        outcomes = [False] * len(plans)
    program_errors = [r.report["program_error"] for r in runs if r.report and r.report.get("program_error")]
    errors = [f"program: {program_errors[0]}"] if program_errors else []
    errors += [f"test {i}: {reasons[i]}" for i in range(len(plans)) if not outcomes[i] and reasons.get(i)]
    for run in runs:
        if run.report and "sandbox_error" in run.report:
            errors.insert(0, str(run.report["sandbox_error"]))
    return SandboxResult(
        status,
        passed=sum(outcomes),
        total=len(plans),
        returncode=runs[-1].returncode,
        output="".join(r.output for r in runs),
        duration=sum(r.duration for r in runs),
        errors=errors[:20],
        isolation=runs[0].isolation,
        verified=len(verified),
        outcomes=outcomes,
    )


def _report_results(run: _Run, expected: int) -> list[dict[str, Any]] | None:
    """The per-test entries of a finished run's report; turns ``run`` into an ``"error"`` if they are malformed."""
    if run.status != "ok" or run.report is None:
        return None
    if run.report.get("program_error"):
        return None
    results = run.report.get("results")
    if not isinstance(results, list) or len(results) != expected or not all(isinstance(r, dict) for r in results):
        run.status = "error"
        return None
    return results


def _probe_values(entry: dict[str, Any], decode: Any, probe_error: type) -> tuple[list[Any], str | None]:
    """Decode one verified test's probe results; a malformed entry fails the test (only a forger produces one)."""
    if "error" in entry:
        return [], str(entry["error"])[:300]
    values = []
    try:
        if not isinstance(entry.get("has"), list) or not isinstance(entry.get("values"), list):
            raise ValueError("malformed entry")
        for item in entry["values"]:
            kind, payload = item
            if kind == "v":
                values.append(decode(payload))
            elif kind in ("e", "u"):
                prefix = "" if kind == "e" else "not plain data: "
                values.append(probe_error(f"{prefix}{str(payload)[:300]}"))
            else:
                raise ValueError("malformed entry")
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        return [], f"malformed report: {exc}"
    return values, None


def _get_launcher(python: str, run_as_uid: int | None) -> tuple[list[str], bool] | None:
    """Pick (once per interpreter) the strongest launcher prefix (``setpriv --pdeathsig KILL unshare ...``, weaker
    ``unshare`` ones, none), and whether to use a memory cgroup. Before the first probe, once per process, remove
    what trainers killed during a run left (not on a probe's clock: a large leftover tree takes seconds)."""
    from .cgroup import cpu_cgroup_root, memory_cgroup_root
    from .leftovers import sweep_once

    sweep_once((memory_cgroup_root(), cpu_cgroup_root()))
    key = (python, os.geteuid(), run_as_uid)
    with _LAUNCHER_LOCK:
        if key not in _LAUNCHERS:
            _LAUNCHERS[key] = _probe_launchers(python, run_as_uid)
        return _LAUNCHERS[key]


def _probe_launchers(python: str, run_as_uid: int | None) -> tuple[list[str], bool] | None:
    """Try launchers from strongest to weakest (first with a memory cgroup, if the host offers one, then without)
    and keep the first that runs a trivial program end to end; ``[]`` means "no unshare", ``None`` nothing works."""
    from .cgroup import memory_cgroup_root

    if not _startable(python):  # every launcher would fail alike: say so once, and score nothing
        import logging

        logging.getLogger(__name__).error(
            "Code sandbox unusable; every code reward will be 0.0: the interpreter %r cannot be started from the "
            "sandbox (an absolute path to an executable, or a name on %s; see sandbox.resolve_python).",
            python, _MIN_PATH,
        )  # fmt: skip
        return None
    candidates: list[list[str]] = []
    search = os.environ.get("PATH", _MIN_PATH) + ":/usr/sbin:/sbin"
    unshare, setpriv = shutil.which("unshare", path=search), shutil.which("setpriv", path=search)
    if unshare and sys.platform.startswith("linux"):
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        fork = ["--fork", "--kill-child"]  # unshare waits for the sandbox and holds its armed lifeline
        # The last has no namespace (where none can be made): unshare --fork still keeps the lifeline safe.
        for flags in (["--net", "--ipc", "--pid", *fork, "--mount-proc"], ["--net", "--ipc", "--pid", *fork],
                      ["--net", "--ipc", *fork], [*fork]):
            args = [unshare, *(user if flags != fork else []), *flags, "--"]
            if setpriv:  # unshare dies with this thread, and with a PID namespace everything inside with it
                candidates.append([setpriv, "--pdeathsig", "KILL", *args])
            candidates.append(args)
    candidates.append([])
    errors = []
    for use_cgroup in [True, False] if memory_cgroup_root() is not None else [False]:
        for launcher in candidates:
            config = {"program": "pass", "specs": [{"probes": [], "has": []}]}
            run = _run_once((launcher, use_cgroup), python, config, SandboxLimits(timeout=_PROBE_TIMEOUT), run_as_uid)
            if _report_results(run, 1) is not None:
                if setpriv and launcher and launcher[0] == unshare:  # the same launcher behind setpriv failed
                    import logging

                    logging.getLogger(__name__).warning(
                        "`setpriv --pdeathsig KILL` does not run the sandbox here, so a trainer killed during a run "
                        "leaves that run's end to the sandbox's watchdog thread: %s", errors[-1],
                    )  # fmt: skip
                return launcher, use_cgroup
            name = " ".join(launcher) or "(plain)"
            errors.append(f"{name} (cgroup: {use_cgroup}): {run.status} {run.report} {run.output[-300:]}")
    import logging

    logging.getLogger(__name__).error("Code sandbox unusable; every code reward will be 0.0.\n%s", "\n".join(errors))
    return None


def _startable(python: str) -> bool:
    """Whether the sandbox can start ``python``: it runs from an empty directory with ``PATH`` = ``_MIN_PATH``, so a
    path must be absolute (and executable) and a bare name must be found there."""
    if os.sep in python:
        return os.path.isabs(python) and os.access(python, os.X_OK)
    return shutil.which(python, path=_MIN_PATH) is not None


def _runner_source() -> str:
    """The source of this module, which the child executes as its ``__main__`` (it only needs the stdlib)."""
    global _SOURCE
    if _SOURCE is None:
        with open(os.path.abspath(__file__), encoding="utf-8") as f:
            _SOURCE = f.read()
    return _SOURCE


def _ns_inode(kind: str) -> int | None:
    """Inode of this process's namespace of ``kind`` (e.g. ``"net"``), so the child can prove it is in a new one."""
    try:
        return os.stat(f"/proc/self/ns/{kind}").st_ino
    except OSError:
        return None


def _run_once(
    chosen: tuple[list[str], bool], python: str, job: dict[str, Any], limits: SandboxLimits, run_as_uid: int | None
) -> _Run:
    """One sandbox process running ``job`` (program, specs) with a given launcher prefix and cgroup choice; its
    output and its report are each capped at ``limits.max_output_bytes``."""
    from .cgroup import cpu_cgroup_root, memory_cgroup_root
    from .leftovers import new_workdir

    launcher, use_cgroup = chosen
    start = time.monotonic()
    drop = (_fresh_uid() if run_as_uid is None else run_as_uid) if os.geteuid() == 0 else None
    fresh_uid = drop is not None and run_as_uid is None
    cgroup_root = memory_cgroup_root() if use_cgroup else None
    cpu_root = cpu_cgroup_root() if use_cgroup else None
    cgroup = cpu_cgroup = workdir = None
    proc: subprocess.Popen | None = None
    read_fd = write_fd = init_fd = workdir_lock = lifeline_read = lifeline = -1
    try:
        workdir, workdir_lock = new_workdir(fresh_uid)  # inside: an interrupt leaves none behind
        _PARENT_ONLY_FDS.add(workdir_lock)
        read_fd, write_fd = os.pipe()
        lifeline_read, lifeline = os.pipe()  # we hold the only write end: the sandbox sees it close when we die
        _PARENT_ONLY_FDS.update((write_fd, lifeline))  # a fork's copy of the report's write end would delay its end
        os.chmod(workdir, 0o700)
        if drop is not None:
            os.chown(workdir, drop, drop)
        if cgroup_root is not None:
            cgroup = cgroup_root.create(limits.memory_mb * 1024 * 1024)
        if cpu_root is not None:
            try:
                cpu_cgroup = cpu_root.create()
            except OSError:  # best effort: the run then keeps the per-process (or per-session) scheduling
                cpu_cgroup = None
        config = {
            **job,
            "report_fd": write_fd,
            "lifeline_fd": lifeline_read,
            "lifeline_held_by_launcher": "--fork" in launcher,
            "workdir": workdir,
            "cgroup": cgroup,
            "cpu_cgroup": cpu_cgroup,
            "drop_uid": drop,
            "fresh_uid": fresh_uid,
            "mount_ns": "--mount-proc" in launcher,
            "parent_ns": {kind: _ns_inode(kind) for kind in ("mnt", "net", "pid", "user", "ipc")},
            "cpu_seconds": limits.cpu_seconds or math.ceil(limits.timeout) + 1,
            "memory_bytes": limits.memory_mb * 1024 * 1024,
            "max_processes": limits.max_processes,
            "max_file_bytes": limits.max_file_bytes,
            "max_disk_bytes": limits.max_disk_bytes,
            "max_open_files": limits.max_open_files,
            "wall_seconds": limits.timeout,
        }
        proc = subprocess.Popen(
            [*launcher, python, "-I", "-c", _runner_source()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=workdir,
            env={"PATH": _MIN_PATH, "MALLOC_ARENA_MAX": "2"},  # a thread's malloc arena reserves 64 MiB of RLIMIT_AS
            start_new_session=True,
            close_fds=True,
            pass_fds=(write_fd, lifeline_read),
        )
        _PARENT_ONLY_FDS.discard(write_fd)
        os.close(write_fd)
        armed = _arm_lifeline(lifeline_read, proc.pid)  # before the child has its program: it cannot have moved yet
        os.close(lifeline_read)
        write_fd = lifeline_read = -1
        if "--fork" in launcher:  # before the child has its program: it cannot have moved yet
            init_fd = _namespace_init(proc, start + limits.timeout)
        # Fed from a thread so that a child that never reads cannot block us past the deadline.
        threading.Thread(target=_feed, args=(proc.stdin, json.dumps(config).encode()), daemon=True).start()
        output, report, status = _collect(proc, read_fd, start + limits.timeout, limits.max_output_bytes)
        _stop_run(proc, init_fd)
        if config["fresh_uid"] and "--pid" not in launcher:
            _kill_uid(drop)  # without a PID namespace, this also catches processes that left the group
        isolation: dict[str, Any] = {"lifeline_signal": armed}
        if cgroup is not None:
            isolation["memory_peak_bytes"] = cgroup_root.peak(cgroup)
            _destroy_cgroup(cgroup_root, cgroup)
            cgroup = None
        if cpu_cgroup is not None:
            _destroy_cgroup(cpu_root, cpu_cgroup)
            cpu_cgroup = None
        if config["fresh_uid"] and not config["mount_ns"]:
            _remove_files_of(drop)  # it could write to world-writable directories (/tmp, /dev/shm)
        returncode = _reap(proc)
        return _finish(output, report, status, returncode, time.monotonic() - start, launcher, isolation)
    finally:
        if proc is not None and proc.returncode is None:  # only reached through an unexpected exception
            _stop_run(proc, init_fd)
            _reap(proc)
        if cgroup is not None:
            _destroy_cgroup(cgroup_root, cgroup)
        if cpu_cgroup is not None:
            _destroy_cgroup(cpu_root, cpu_cgroup)
        _PARENT_ONLY_FDS.difference_update((write_fd, lifeline, workdir_lock))  # before closing: numbers are reused
        for fd in (read_fd, write_fd, init_fd, lifeline_read, lifeline):
            if fd >= 0:
                os.close(fd)
        if workdir is not None:
            _rmtree(workdir)
        if workdir_lock >= 0:
            os.close(workdir_lock)  # after the removal: a sweep never takes a directory still being removed


def _arm_lifeline(lifeline_read: int, group: int) -> bool:
    """Have the kernel SIGKILL the run's process group ``group`` when the lifeline's write end closes.

    We hold the only write end, so it closes when this process dies, however it dies. The signal is set on the read
    end's open file (the sandbox's copy is the same file): its owner is the run's group, and its I/O signal, sent
    when the last writer goes, SIGKILL. The kernel delivers it, so it needs no thread of the sandbox to run (a
    program holding the interpreter's lock in a C call), and reaches processes the program forked (they stay in the
    group: ``setsid`` and ``setpgid`` are refused). A PID namespace's first process is shielded from it by the
    kernel; ``unshare``, in the group, dies, and its ``--kill-child`` (a parent-death signal, which the seccomp
    filter keeps the program from clearing) ends that process. The owner is kept by the kernel as the group itself,
    not its number, so a reused number is never signalled. Returns False where ``fcntl`` refuses it (the watchdog
    and the parent-death signals remain)."""
    import fcntl

    try:
        fcntl.fcntl(lifeline_read, fcntl.F_SETOWN, -group)
        fcntl.fcntl(lifeline_read, getattr(fcntl, "F_SETSIG", 10), signal.SIGKILL)  # 10: Linux's number
        fcntl.fcntl(lifeline_read, fcntl.F_SETFL, fcntl.fcntl(lifeline_read, fcntl.F_GETFL) | os.O_ASYNC)
    except OSError:
        return False
    return True


def _destroy_cgroup(root: Any, path: str) -> None:
    if not root.destroy(path):
        import logging

        logging.getLogger(__name__).warning("could not remove the sandbox cgroup %s (a process would not die)", path)


def _fresh_uid() -> int:
    """A uid no other live sandbox of this machine uses: derived from our pid (its slot) and a per-process counter.
    A dead process's uids come back with its pid: see :func:`_uid_slot_in_use`."""
    return _UID_BASE + ((os.getpid() % (1 << _UID_SLOT_BITS)) << 10 | next(_UID_COUNTER) % 1024)


def _uid_slot_in_use(uid: int) -> bool:
    """Whether a live process has the pid slot of the fresh ``uid``: the process that made it, or one that reuses its
    slot (a pid reused, or 2**21 apart) and may run sandboxes as that very uid now."""
    slot = (uid - _UID_BASE) >> 10
    return any(int(entry) % (1 << _UID_SLOT_BITS) == slot for entry in os.listdir("/proc") if entry.isdigit())


def _feed(pipe: Any, data: bytes) -> None:
    """Write the run's config to the child's stdin, its length first, and close it; a dead child is not an error
    here. The child reads exactly that many bytes, not up to end of file: a fork of the trainer made while the run
    starts (a DataLoader worker) holds a copy of the pipe's write end, and the run would wait for it to exit."""
    try:
        pipe.write(b"%d\n" % len(data) + data)
        pipe.close()
    except (OSError, ValueError):
        pass


def _collect(proc: subprocess.Popen, report_fd: int, deadline: float, max_bytes: int) -> tuple[bytes, bytes, str]:
    """Read the child's output and report until both end, the deadline, or ``max_bytes`` in either.

    Returns (output, report, status so far).
    """
    import selectors

    buffers = {proc.stdout.fileno(): bytearray(), report_fd: bytearray()}
    exited_at: float | None = None
    with selectors.DefaultSelector() as sel:
        for fd in buffers:
            sel.register(fd, selectors.EVENT_READ)
        status = "exited"
        while sel.get_map():
            now = time.monotonic()
            if now >= deadline:
                status = "timeout"
                break
            # Once the main process is gone, leftovers that keep a pipe open get a short grace period only.
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                break
            for key, _ in sel.select(min(deadline - now, 0.05)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fd)
                    continue
                buffers[key.fd] += chunk
                if len(buffers[key.fd]) > max_bytes:
                    status = "output_limit"
            if status == "output_limit":
                break
    output, report = bytes(buffers[proc.stdout.fileno()]), bytes(buffers[report_fd])
    return output[:max_bytes], report, status


def _finish(
    output: bytes,
    report_bytes: bytes,
    status: str,
    returncode: int | None,
    duration: float,
    launcher: list[str],
    isolation: dict[str, Any],
) -> _Run:
    """Interpret what a sandbox process left: the setup's line (its isolation, or the sandbox error that kept the
    program from running), then the report, which counts only if complete. The program can write to the pipe only
    after the setup's line, so a ``sandbox_error`` or ``isolation`` in what follows is its own: a failed run."""
    setup_line, _, rest = report_bytes.partition(b"\n")
    setup = _json_object(setup_line)
    report = _json_object(rest) if status == "exited" and setup is not None else None
    text = output.decode("utf-8", errors="replace")
    reported = setup.get("isolation") if setup else None
    isolation = {**(reported if isinstance(reported, dict) else {}), **isolation}
    isolation["launcher"] = " ".join(os.path.basename(a) if os.path.isabs(a) else a for a in launcher) or "plain"
    if status != "exited":
        return _Run(status, None, text, returncode, duration, isolation)
    if setup is not None and "sandbox_error" in setup:
        return _Run("sandbox_error", setup, text, returncode, duration, isolation)
    if report is None or "sandbox_error" in report:  # died by a signal (a limit, the OOM killer), or exited without
        failed = "crashed" if returncode is not None and (returncode < 0 or returncode > 128) else "error"
        return _Run(failed, None, text, returncode, duration, isolation)  # reporting, or the program wrote one
    return _Run("ok", report, text, returncode, duration, isolation)


def _json_object(data: bytes) -> dict[str, Any] | None:
    """The JSON object ``data`` holds, else ``None``."""
    try:
        value = json.loads(data) if data else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _remove_files_of(uid: int) -> None:
    """Delete what a fresh per-run uid left in the world-writable directories (no mount namespace: it could write
    there). Entries directly inside them only; nothing else is writable by a uid that owns no directory."""
    for directory in ("/tmp", "/var/tmp", "/dev/shm"):
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    _rmtree(entry.path)
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


def _namespace_init(proc: subprocess.Popen, deadline: float) -> int:
    """A pidfd of ``unshare --fork``'s child, the PID namespace's init, taken while it still waits for its config.

    Killing that process ends every process of the namespace. Killing ``unshare``'s process group does not reach it
    if the program cleared its parent-death signal and left the group (``prctl``, ``setsid``), or killed
    ``unshare`` itself; it would then outlive the run, re-parented to the host's init, where a pidfd still names it.
    ``-1`` if it cannot be found before ``deadline`` or this kernel has no pidfds (then only a cgroup catches it).
    """
    while time.monotonic() < deadline and proc.poll() is None:
        for pid in _children_of(proc.pid):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            except (AttributeError, OSError):
                return -1
            if _parent_of(pid) == proc.pid:  # not a reused pid: the descriptor names unshare's child
                return fd
            os.close(fd)
        time.sleep(0.002)
    return -1


def _children_of(parent: int) -> list[int]:
    """Pids whose parent is ``parent``."""
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit() and _parent_of(int(entry)) == parent]


def _parent_of(pid: int) -> int | None:
    """The parent pid from ``/proc/<pid>/stat`` (after the last ``)``: the command name may hold any bytes)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rpartition(b")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _stop_run(proc: subprocess.Popen, init_fd: int) -> None:
    """SIGKILL a run: the PID namespace's init first (``init_fd``; its death ends every process of the namespace),
    then, unless ``unshare`` has meanwhile reaped it and exited, ``unshare``'s process group.

    Killed in the same instant, ``unshare`` could not reap its child: the init would be re-parented, a zombie, to
    the machine's (container's) PID 1 or a subreaper, which a trainer running as PID 1 (``docker run`` without
    ``--init``, a Kubernetes pod) never reaps: one zombie per timed-out run, until the container's pid limit stops
    every fork. Once ``unshare`` has exited its group is left alone: its pid may already name another process."""
    if init_fd >= 0:
        _kill_pidfd(init_fd)
        if _exits_draining(proc, _INIT_EXIT_WAIT):
            return
    _kill_group(proc)


def _exits_draining(proc: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` for ``proc`` to exit (and reap it) while discarding what it still writes to its output
    pipe: after an output-limited run the pipe is full, and ``unshare`` reports its child's death there (util-linux
    2.38: "sigprocmask unblock failed"), so it would block on that write instead of exiting."""
    import selectors

    if proc.stdout is None or proc.stdout.closed:  # nothing left to drain
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout.fileno(), selectors.EVENT_READ)
        while proc.poll() is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            for key, _ in sel.select(min(remaining, 0.05)):
                try:
                    chunk = os.read(key.fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:  # its end closed: nothing more can block it
                    sel.unregister(key.fd)
    return True


def _kill_pidfd(fd: int) -> None:
    """SIGKILL the process a pidfd names (``-1``: none); ignore "already gone"."""
    if fd >= 0:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's whole process group (it leads its own session); ignore "already gone"."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass


def _kill_uid(uid: int) -> None:
    """SIGKILL every process whose real uid is ``uid`` (only used for a fresh per-run uid that nothing else has)."""
    for _ in range(10):
        found = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as f:
                    uid_line = next((line for line in f if line.startswith("Uid:")), "")
                if uid_line.split()[1:2] == [str(uid)]:
                    os.kill(int(entry), signal.SIGKILL)
                    found = True
            except (OSError, IndexError):
                pass
        if not found:
            return


def _reap(proc: subprocess.Popen) -> int | None:
    """Wait briefly for the (already killed) child and close its pipes."""
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None
    finally:
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


def _rmtree(path: str) -> bool:
    """Delete a directory the program wrote in, whatever it made of it: sub-directories without permissions, or
    nested deeper than Python's recursion limit (``shutil.rmtree`` recurses once per level, and a RecursionError
    from it turned the run into a sandbox error and left the tree behind). Never raises: a directory that cannot be
    removed is logged and left (``False``); one already gone counts as removed."""
    try:
        shutil.rmtree(path)
    except (OSError, RecursionError):
        try:
            _remove_flattening(path)
        except OSError as error:
            if os.path.lexists(path):
                import logging

                logging.getLogger(__name__).warning("could not remove the sandbox directory %s: %s", path, error)
                return False
    return True


def _remove_flattening(path: str) -> None:
    """Remove the tree at ``path`` without recursion: each directory directly under ``path`` has its entries moved up
    into ``path`` (a rename on one file system, by descriptor: no path is ever longer than two names), then is
    removed, until ``path`` is empty. At most two directory descriptors are open at any time."""
    top = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    moved = itertools.count()
    try:
        while entries := list(os.scandir(top)):
            for entry in entries:
                if not entry.is_dir(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=top)
                    continue
                _make_searchable(entry.name, top)  # a directory
                sub = os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
                try:
                    for child in list(os.scandir(sub)):
                        if child.is_dir(follow_symlinks=False):  # moving a directory writes its ".." entry
                            _make_searchable(child.name, sub)
                        while True:  # a name not taken in `path`, which the program may have used too
                            target = f".trl_diffusion_removed_{next(moved)}"
                            try:
                                os.stat(target, dir_fd=top, follow_symlinks=False)
                            except FileNotFoundError:
                                break
                        os.rename(child.name, target, src_dir_fd=sub, dst_dir_fd=top)
                finally:
                    os.close(sub)
                os.rmdir(entry.name, dir_fd=top)
    finally:
        os.close(top)
    os.rmdir(path)


def _make_searchable(name: str, dir_fd: int) -> None:
    """``chmod 0700`` the directory ``name`` in ``dir_fd``, never through a symbolic link: a program still running
    (another run's, in a directory the leftover sweep removes) could swap the directory for a link to any path
    between the listing and the chmod, which as root would change that path's mode. Raises ``OSError`` (ENOTDIR) if
    ``name`` is no longer a directory."""
    fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        os.chmod(f"/proc/self/fd/{fd}", 0o700)  # the descriptor's own directory: no path is resolved again
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------------------------
# Child side: everything below runs inside the sandbox process (stdlib only; no package imports).
# --------------------------------------------------------------------------------------------------------------------

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_REC = 32, 1024, 2048, 4096, 16384
_MS_PRIVATE, _MS_RELATIME, _MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
_MOUNT_OPTION_FLAGS = {
    "nosuid": _MS_NOSUID,
    "nodev": _MS_NODEV,
    "noexec": _MS_NOEXEC,
    "noatime": _MS_NOATIME,
    "nodiratime": _MS_NODIRATIME,
    "relatime": _MS_RELATIME,
    "strictatime": _MS_STRICTATIME,
}
_MNT_DETACH = 2
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_SECCOMP, _PR_SET_NO_NEW_PRIVS = 1, 24, 28, 22, 38
# SECBIT_NOROOT, _LOCKED, SECBIT_NO_SETUID_FIXUP, _LOCKED, SECBIT_KEEP_CAPS_LOCKED: root gains no caps on exec.
_SECUREBITS = 0b101111
_SECBIT_NO_SETUID_FIXUP = 0b100
_SYSTEM_DIRS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc")
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Per architecture: pivot_root's number, the seccomp audit arch, whether x32 numbers exist, and the refused calls
# (memory no per-process limit counts, and SysV/POSIX IPC objects that outlive the process without an IPC namespace).
_SYSCALLS = {
    "x86_64": (155, 0xC000003E, True, {"memfd_create": 319, "memfd_secret": 447, "shmget": 29, "semget": 64,
                                       "msgget": 68, "mq_open": 240, "io_uring_setup": 425, "ptrace": 101,
                                       "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
                                       "setsid": 112, "setpgid": 109, "setns": 308}),
    "aarch64": (41, 0xC00000B7, False, {"memfd_create": 279, "memfd_secret": 447, "shmget": 194, "semget": 190,
                                        "msgget": 186, "mq_open": 180, "io_uring_setup": 425, "ptrace": 117,
                                        "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
                                        "setsid": 157, "setpgid": 154, "setns": 268}),
}  # fmt: skip
# Calls that act on another process named by their arguments, allowed only on the caller itself: without a PID
# namespace the trainer and the other runs are visible, and as the same (non-root) user a program could otherwise
# set the trainer's RLIMIT_CPU (killing it), pin it to one CPU, lower its priority, or signal every process of the
# user (``kill(-1)``). Per architecture: name -> (number, {argument index: the only value allowed}); ``kill`` is
# refused for a negative pid (another process group, or -1: all of the user's processes).
_SELF_ONLY = {
    "x86_64": {"prlimit64": (302, {0: 0}), "sched_setaffinity": (203, {0: 0}), "sched_setscheduler": (144, {0: 0}),
               "sched_setparam": (142, {0: 0}), "sched_setattr": (314, {0: 0}), "setpriority": (141, {0: 0, 1: 0}),
               "ioprio_set": (251, {0: 1, 1: 0})},
    "aarch64": {"prlimit64": (261, {0: 0}), "sched_setaffinity": (122, {0: 0}), "sched_setscheduler": (119, {0: 0}),
                "sched_setparam": (118, {0: 0}), "sched_setattr": (274, {0: 0}), "setpriority": (140, {0: 0, 1: 0}),
                "ioprio_set": (30, {0: 1, 1: 0})},
}  # fmt: skip
_KILL = {"x86_64": 62, "aarch64": 129}
# Calls refused for some values of one argument: name -> (number, argument index, refused values).
# * prctl's PR_SET_PDEATHSIG: a program that cleared its parent-death signal (which ``unshare --kill-child`` and the
#   sandbox set) outlived a killed trainer as a PID namespace's first process, which no other signal reaches;
# * fcntl's F_SETOWN, F_SETSIG, F_SETOWN_EX and ioctl's FIOSETOWN, SIOCSPGRP: an I/O signal owned by another process
#   group is a ``kill`` of that group by other means (refused above), and on the lifeline's read end they would turn
#   off the kill of the run's group when the trainer dies (``_arm_lifeline``).
_REFUSED_VALUES = {
    "x86_64": {"prctl": (157, 0, (1,)), "fcntl": (72, 1, (8, 10, 15)), "ioctl": (16, 1, (0x8901, 0x8902))},
    "aarch64": {"prctl": (167, 0, (1,)), "fcntl": (25, 1, (8, 10, 15)), "ioctl": (29, 1, (0x8901, 0x8902))},
}
# clone and unshare asking for a new namespace (flags in argument 0: mount, cgroup, UTS, IPC, user, PID, network) or,
# for clone, CLONE_PARENT, and clone3 (its flags are behind a pointer: ENOSYS, so that the C library falls back to
# clone). A PID namespace the program made itself has a first process that the run group's signal does not reach; a
# CLONE_PARENT child is the trainer's own child without a PID namespace, a zombie nothing reaps once killed.
_REFUSED_CLONE_FLAGS = 0x7E028000
_CLONE_AND_UNSHARE = {"x86_64": (56, 272), "aarch64": (220, 97)}
_CLONE3 = 435  # the same number on both


def _child_main() -> None:
    """Entry point inside the sandbox: read the config, isolate, limit, guard, run, report, exit."""
    config = json.loads(sys.stdin.buffer.read(int(sys.stdin.buffer.readline())))  # _feed: the length, then the config
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    report_fd = int(config["report_fd"])
    # Bound now, so a program that monkeypatches json/os cannot change how the report is written. (It can write to
    # the report pipe itself, but only after the setup's line: it can change its answers, nothing more.)
    dumps, write, exit_now, streams = json.dumps, os.write, os._exit, (sys.stdout, sys.stderr)

    def send(payload: dict[str, Any]) -> None:  # one line: json.dumps writes no raw newline
        try:
            data = memoryview((dumps(payload) + "\n").encode())
            while data:
                data = data[write(report_fd, data) :]
        except BaseException:
            exit_now(1)

    def report(payload: dict[str, Any]) -> None:
        for stream in streams:
            try:
                stream.flush()
            except Exception:
                pass
        send(payload)
        exit_now(0)

    isolation: dict[str, Any] = {}
    try:
        if config["lifeline_held_by_launcher"]:  # before the uid changes: the pipe is the parent's
            _private_lifeline(int(config["lifeline_fd"]))
        isolation["memory_cgroup"] = config["cgroup"] is not None and _join_cgroup(config["cgroup"])
        isolation["cpu_cgroup"] = _join_cpu_share(config["cgroup"], config["cpu_cgroup"])
        parent_ns = config["parent_ns"]
        for kind in ("net", "ipc", "pid", "mnt", "user"):
            isolation[f"{kind}ns"] = parent_ns.get(kind) is not None and _ns_inode(kind) != parent_ns[kind]
        # RLIMIT_NPROC counts per uid, or per user namespace (Linux >= 5.14): is that set ours alone?
        isolation["process_limit_scope"] = "sandbox" if config["fresh_uid"] or isolation["userns"] else "uid"
        workdir = config["workdir"]
        isolation["private_root"] = isolation["readonly_fs"] = False
        if config["mount_ns"] and isolation["mntns"]:
            workdir = _setup_root(workdir, config["drop_uid"], config["max_disk_bytes"])
            isolation["private_root"] = isolation["readonly_fs"] = True
        os.chdir(workdir)
        isolation.update(_drop_privileges(config["drop_uid"]))
        # Before any thread exists: the filter then covers every thread and process of the sandbox.
        isolation["seccomp"] = _install_seccomp()
        isolation["landlock"] = _install_landlock(workdir)
        _start_watchdog(float(config["wall_seconds"]) + 1.0, int(config["lifeline_fd"]))
        _set_limits(config)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"  # numeric libraries must not start one thread per core under RLIMIT_NPROC
        encoder = _make_encoder()
        _install_guards(workdir)
    except Exception as exc:
        report({"sandbox_error": f"{type(exc).__name__}: {exc}", "isolation": isolation})
    send({"isolation": isolation})  # the setup's line, before any code of the program runs
    report(_run_job(config, *encoder))


def _private_lifeline(fd: int) -> None:
    """Give this process a lifeline read end of its own: the same pipe, another open file (``/proc/self/fd``).

    The parent armed the open file it passed (``_arm_lifeline``), and ``unshare --fork``, which waits for this
    process, keeps a copy of it; the program, which could change an open file it holds (``fcntl``), then holds none,
    so it cannot turn the lifeline's signal off. A failure keeps the shared open file."""
    try:
        private = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY)
    except OSError:
        return
    os.dup2(private, fd)
    os.close(private)


def _join_cgroup(path: str) -> bool:
    """Move this process into the run's cgroup and check that it took (fail closed: raise otherwise)."""
    with open(os.path.join(path, "cgroup.procs"), "w", encoding="ascii") as f:
        f.write("0")
    name = "/" + os.path.basename(path)
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        if not any(line.rstrip("\n").endswith(name) for line in f):
            raise RuntimeError(f"could not join the run's cgroup {name}")
    return True


def _join_cpu_share(memory_cgroup: str | None, cpu_cgroup: str | None) -> bool:
    """Join the run's v1 CPU cgroup, if it has one; whether the run now has a CPU share of its own (a v1 group, or
    a v2 memory cgroup with the cpu controller). Best effort: a run without one keeps the per-process scheduling."""
    try:
        if cpu_cgroup is not None:
            return _join_cgroup(cpu_cgroup)
        if memory_cgroup is not None and os.path.exists(os.path.join(memory_cgroup, "cgroup.controllers")):
            with open(os.path.join(memory_cgroup, "cgroup.controllers"), encoding="ascii") as f:
                return "cpu" in f.read().split()
    except (OSError, RuntimeError):
        pass
    return False


def _start_watchdog(seconds: float, lifeline_fd: int) -> None:
    """Kill our own process group after ``seconds`` even if the parent has died (a backstop, not the main timer),
    or as soon as the parent is gone: ``lifeline_fd`` is the read end of a pipe whose only write end the parent
    holds, and it reads as closed when the parent exits however it exits (a trainer killed by SIGTERM or SIGKILL
    runs no cleanup; without this its runs went on to their time limit)."""
    import select

    watch, killpg, exit_now, now = select.poll(), os.killpg, os._exit, time.monotonic  # bound before the program
    watch.register(lifeline_fd, select.POLLIN)
    deadline = now() + seconds

    def fire() -> None:
        while (left := deadline - now()) > 0 and not watch.poll(min(left * 1000, 2**31 - 1)):
            pass  # poll's limit is 2**31 - 1 ms (24.8 days); a longer time limit waits in steps
        try:
            killpg(0, signal.SIGKILL)
        finally:
            exit_now(137)

    threading.Thread(target=fire, daemon=True).start()


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount(libc: Any, source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> bool:
    """``mount(2)`` through ctypes; returns success instead of raising."""
    args = [None if s is None else os.fsencode(s) for s in (source, target, fstype)]
    return libc.mount(*args, flags, None if data is None else os.fsencode(data)) == 0


def _setup_root(workdir: str, drop_uid: int | None, disk_bytes: int) -> str:
    """Build a minimal read-only root in ``workdir`` and ``pivot_root`` into it; return the new working directory.

    Only called in a private mount namespace (checked against the parent's), and everything is first made
    ``MS_PRIVATE``, so nothing done here reaches the host. The root holds the system directories and the
    interpreter's own directories (bind mounts), a few device nodes, ``/proc``, and an empty ``/tmp`` holding the
    working directory, a ``disk_bytes`` tmpfs. Afterwards every mount but that one is read-only. Any failure raises:
    a half-built root must not run programs (the launcher probe then picks a weaker launcher).
    """
    import ctypes

    libc = _libc()

    def must(ok: bool, what: str) -> None:
        if not ok:
            raise OSError(ctypes.get_errno(), f"{what} failed")

    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise OSError(f"pivot_root: unknown system call number on {machine}")
    must(_mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None), "making mounts private")
    root = workdir
    must(_mount(libc, "tmpfs", root, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=4m,mode=0755"), "mounting the root")
    root_dev = os.stat(root).st_dev
    wanted = [f"/{name}" for name in _SYSTEM_DIRS if os.path.lexists(f"/{name}")] + _interpreter_paths()
    real = {os.path.realpath(p) for p in wanted if os.path.isdir(p)}
    if "/" in real:
        raise OSError("the interpreter lives in /: a private root cannot leave the host's files out")
    for path in sorted(p for p in real if not any(p.startswith(q + "/") for q in real)):
        _makedirs(root_dev, root + path)
        must(_mount(libc, path, root + path, None, _MS_BIND | _MS_REC, None), f"binding {path}")
    for path in sorted(set(wanted)):  # the original paths must resolve too (merged /usr's /bin -> usr/bin, ...)
        target = os.path.realpath(path)
        if target != path and not os.path.lexists(root + path) and _makedirs(root_dev, os.path.dirname(root + path)):
            os.symlink(target, root + path)
    _makedirs(root_dev, root + "/dev")
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            open(f"{root}/dev/{name}", "w").close()
            must(_mount(libc, f"/dev/{name}", f"{root}/dev/{name}", None, _MS_BIND, None), f"binding /dev/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):  # fmt: skip
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(root + "/proc")
    must(_mount(libc, "/proc", root + "/proc", None, _MS_BIND | _MS_REC, None), "binding /proc")
    inside = "/tmp/" + os.path.basename(workdir)
    _makedirs(root_dev, root + inside)
    options = f"size={int(disk_bytes)},mode=0700" + ("" if drop_uid is None else f",uid={drop_uid},gid={drop_uid}")
    must(_mount(libc, "tmpfs", root + inside, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options), "the tmpfs")
    # POSIX shared memory and semaphores (multiprocessing's locks and queues) live in /dev/shm: here, the program's
    # own directory, under its disk and memory limits
    os.symlink(inside, f"{root}/dev/shm")
    os.mkdir(root + "/.old")
    must(libc.syscall(_SYSCALLS[machine][0], os.fsencode(root), os.fsencode(root + "/.old")) == 0, "pivot_root")
    os.chdir("/")
    must(libc.umount2(b"/.old", _MNT_DETACH) == 0, "detaching the old root")
    os.rmdir("/.old")
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # mountinfo escapes
        if target == inside or target.startswith(inside + "/"):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _MOUNT_OPTION_FLAGS.get(opt, 0)
        must(_mount(libc, None, target, None, flags, None), f"making {target} read-only")
    return inside


def _interpreter_paths() -> list[str]:
    """Directories the interpreter needs: its prefixes (a virtualenv's and its base's), its install locations
    (standard library, site-packages) and the directory of its executable. Not the other entries of its import
    path: a ``.pth`` file in site-packages (what an editable install of the user's own project writes) adds the
    project's folder, with its data (the tests' expected values) and secrets (``.env``)."""
    import sysconfig

    prefixes = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    paths = [*prefixes, *sysconfig.get_paths().values(), os.path.dirname(sys.executable)]
    paths.append(os.path.dirname(os.path.realpath(sys.executable)))
    return [os.path.abspath(p) for p in paths if p and os.path.isdir(p)]


def _makedirs(root_dev: int, path: str) -> bool:
    """``mkdir -p`` that only ever creates directories on the new root's own tmpfs (never through a symlink or a
    bind mount into the host); returns whether ``path`` is now such a directory."""
    import stat

    parent = os.path.dirname(path)
    if parent != path and not os.path.lexists(path) and not _makedirs(root_dev, parent):
        return False
    if not os.path.lexists(path):
        os.mkdir(path, 0o755)
    st = os.lstat(path)
    return stat.S_ISDIR(st.st_mode) and st.st_dev == root_dev


def _drop_privileges(drop_uid: int | None) -> dict[str, Any]:
    """Become ``drop_uid`` if asked (fail closed), then ``no_new_privs`` and drop every capability."""
    info: dict[str, Any] = {}
    libc = _libc()
    if drop_uid is not None:
        # Only root may empty the bounding set and lock the securebits (CAP_SETPCAP), so both happen before the uid
        # change; SECBIT_NO_SETUID_FIXUP is locked off there, so the change still clears every capability.
        _bound_capabilities(libc, _SECUREBITS & ~_SECBIT_NO_SETUID_FIXUP)
        os.setgroups([])
        os.setgid(drop_uid)
        os.setuid(drop_uid)
        if os.getuid() != drop_uid or os.geteuid() != drop_uid or os.getgid() != drop_uid:
            raise RuntimeError("privilege drop did not take effect")
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise RuntimeError("could regain root after privilege drop")
        for path in {sys.base_prefix, sys.prefix, os.path.dirname(os.__file__)}:
            if not os.access(path, os.R_OK | os.X_OK):
                raise RuntimeError(
                    f"the interpreter's files ({path}) are not readable by uid {drop_uid}; use a world-readable "
                    "Python (the `python` argument) or a machine where `unshare` works"
                )
    info["uid"] = os.getuid()
    info["dropped_root"] = drop_uid is not None
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by setuid(); the launcher set it before
    info["no_new_privs"] = libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    info["caps_dropped"] = _drop_capabilities(libc)
    return info


def _bound_capabilities(libc: Any, securebits: int) -> None:
    """Set and lock ``securebits`` and empty the bounding set. Both need CAP_SETPCAP: without it (an unprivileged
    sandbox, or after a uid change already done) the calls fail and change nothing."""
    libc.prctl(_PR_SET_SECUREBITS, securebits, 0, 0, 0)
    for cap in range(64):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)


def _drop_capabilities(libc: Any) -> bool:
    """Clear the bounding, effective, permitted and inheritable capability sets (the first matters in a user
    namespace; as root they were bounded before the uid change)."""
    import ctypes

    _bound_capabilities(libc, _SECUREBITS)

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]

    header = Header(0x20080522, 0)
    data = (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        return False
    with open("/proc/self/status", encoding="ascii") as f:
        caps = [line.split()[1] for line in f if line.startswith(("CapEff", "CapPrm"))]
    return all(int(c, 16) == 0 for c in caps)


def _set_limits(config: dict[str, Any]) -> None:
    """Apply the per-process resource limits (inherited by every process the program forks)."""
    import resource

    cpu = int(config["cpu_seconds"])
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_AS: (config["memory_bytes"],) * 2,
        resource.RLIMIT_NPROC: (config["max_processes"],) * 2,
        resource.RLIMIT_FSIZE: (config["max_file_bytes"],) * 2,
        resource.RLIMIT_NOFILE: (config["max_open_files"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
    }
    for which, value in limits.items():
        resource.setrlimit(which, value)


def _install_guards(workdir: str) -> None:
    """Python-level guards: no sockets, no exec/spawn, no memfd, no writes outside ``workdir``, no other
    ``/proc/<pid>``.

    They complement the kernel mechanisms and are the only network/write protection where those are unavailable.
    They are NOT a security boundary on their own: ``ctypes`` or raw syscalls bypass them.
    """
    import _io
    import _posixsubprocess
    import _socket
    import builtins
    import io
    import posix
    import resource
    import socket
    import subprocess as sp

    root = os.path.realpath(workdir)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def resolve(path: Any, dir_fd: int | None = None) -> str | None:
        if isinstance(path, int):  # an open descriptor: check the file behind it, if it is one (not a pipe)
            try:
                target = os.readlink(f"/proc/self/fd/{path}")
            except OSError:
                return None
            return os.path.realpath(target) if target.startswith("/") else None
        p = os.fsdecode(path)
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else os.getcwd()
        return os.path.realpath(os.path.join(base, p))

    def check_write(path: Any, dir_fd: int | None = None) -> None:
        full = resolve(path, dir_fd)
        if full is not None and full != root and not full.startswith(root + os.sep) and full != os.devnull:
            raise PermissionError(f"sandbox: writing outside the sandbox directory is not allowed: {path!r}")

    def check_read(path: Any, dir_fd: int | None = None) -> None:
        full = resolve(path, dir_fd)
        parts = (full or "").split("/")
        if len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != str(os.getpid()):
            raise PermissionError(f"sandbox: reading other processes' /proc entries is not allowed: {path!r}")

    real_open, real_os_open = builtins.open, os.open

    def guarded_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if any(c in str(mode) for c in "wax+"):
            check_write(file)
        check_read(file)
        return real_open(file, mode, *args, **kwargs)

    def guarded_os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if flags & write_flags:
            check_write(path, dir_fd)
        check_read(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    class GuardedFileIO(_io.FileIO):
        def __init__(self, file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> None:
            if any(c in str(mode) for c in "wax+"):
                check_write(file)
            check_read(file)
            super().__init__(file, mode, *args, **kwargs)

    builtins.open = io.open = _io.open = guarded_open
    io.FileIO = _io.FileIO = GuardedFileIO
    os.open = posix.open = guarded_os_open

    # name -> [(positional index, keyword name, dir_fd keyword)] of every path the call writes.
    path_args = {
        "mkdir": [(0, "path", "dir_fd")],
        "rmdir": [(0, "path", "dir_fd")],
        "remove": [(0, "path", "dir_fd")],
        "unlink": [(0, "path", "dir_fd")],
        "rename": [(0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd")],
        "replace": [(0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd")],
        "link": [(0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd")],  # a hard link inside = the file outside
        "symlink": [(1, "dst", "dir_fd")],
        "chmod": [(0, "path", "dir_fd")],
        "chown": [(0, "path", "dir_fd")],
        "lchown": [(0, "path", None)],
        "fchmod": [(0, "fd", None)],
        "fchown": [(0, "fd", None)],
        "ftruncate": [(0, "fd", None)],
        "truncate": [(0, "path", None)],
        "utime": [(0, "path", "dir_fd")],
        "mkfifo": [(0, "path", "dir_fd")],
        "mknod": [(0, "path", "dir_fd")],
        "setxattr": [(0, "path", None)],
        "removexattr": [(0, "path", None)],
    }
    for name, specs in path_args.items():
        if hasattr(os, name):
            guarded = _path_guard(getattr(os, name), specs, check_write)
            setattr(os, name, guarded)
            setattr(posix, name, guarded)

    def no_exec(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("sandbox: starting other programs is not allowed")

    for name in ("execv", "execve", "execl", "execle", "execlp", "execlpe", "execvp", "execvpe", "spawnv", "spawnve",
                 "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "system", "popen"):  # fmt: skip
        for module in (os, posix):
            if hasattr(module, name):
                setattr(module, name, no_exec)
    _posixsubprocess.fork_exec = no_exec

    # Other processes: signals, resource limits, scheduling and priority only for the program's own processes (the
    # seccomp filter refuses the latter for any process but the caller, and kill() for a negative pid, where it is
    # active; this also covers os.kill of another process, which it cannot tell apart). Without a PID namespace the
    # trainer and the other runs are visible, and as the same user the program could otherwise kill them.
    getpid, getpgid, getpgrp = os.getpid, os.getpgid, os.getpgrp

    def own_process(pid: Any) -> bool:
        try:
            pid = int(pid)
            return pid == 0 or pid == getpid() or (pid > 0 and getpgid(pid) == getpgrp())
        except (OSError, TypeError, ValueError, OverflowError):
            return False

    def refuse(what: str, target: Any) -> None:
        raise PermissionError(f"sandbox: {what} of another process is not allowed: {target!r}")

    real_kill, real_killpg = os.kill, os.killpg

    def guarded_kill(pid: int, sig: int) -> None:
        if not own_process(pid):
            refuse("signalling", pid)
        real_kill(pid, sig)

    def guarded_killpg(pgid: int, sig: int) -> None:
        if pgid != 0:
            refuse("signalling the process group", pgid)
        real_killpg(pgid, sig)

    def self_only(name: str, func: Any, module: Any, index: int = 0, which: int | None = None) -> None:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            args = list(args)
            if which is not None and (not args or args[0] != which):
                refuse(name, args[:1])
            target = args[index] if index < len(args) else None
            try:
                own = int(target) in (0, getpid())
            except (TypeError, ValueError, OverflowError):
                own = False
            if not own:
                refuse(name, target)
            args[index] = 0  # the caller itself, which the seccomp filter allows
            return func(*args, **kwargs)

        setattr(module, name, guarded)

    def refused_setsid() -> None:  # a new session leaves the process group (and the run's scheduler autogroup)
        raise PermissionError("sandbox: starting a new session (setsid) is not allowed")

    def refused_setpgid(*args: Any) -> None:  # a new group is out of reach of the watchdog's killpg
        raise PermissionError("sandbox: changing process groups (setpgid, setpgrp) is not allowed")

    for module in (os, posix):
        module.kill, module.killpg = guarded_kill, guarded_killpg
        module.setsid = refused_setsid
        module.setpgid = module.setpgrp = refused_setpgid
        if hasattr(module, "pidfd_open"):
            real_pidfd_open = module.pidfd_open

            def guarded_pidfd_open(pid: int, *args: Any, _real: Any = real_pidfd_open, **kwargs: Any) -> int:
                if not own_process(pid):
                    refuse("opening a pidfd", pid)
                return _real(pid, *args, **kwargs)

            module.pidfd_open = guarded_pidfd_open
        for name in ("sched_setaffinity", "sched_setscheduler", "sched_setparam"):
            if hasattr(module, name):
                self_only(name, getattr(module, name), module)
        if hasattr(module, "setpriority"):
            self_only("setpriority", module.setpriority, module, index=1, which=os.PRIO_PROCESS)
    self_only("prlimit", resource.prlimit, resource)

    def no_memfd(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("sandbox: memfd_create is not allowed (memory no per-process limit counts)")

    os.memfd_create = posix.memfd_create = no_memfd

    class NoPopen(sp.Popen):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PermissionError("sandbox: starting other programs is not allowed")

    sp.Popen = NoPopen

    class NoSocket(socket.socket):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PermissionError("sandbox: network access is not allowed")

    # An unnamed, already connected AF_UNIX stream pair reaches nothing outside the process (asyncio's event loop
    # needs one): socket.socketpair() makes it, and socket.socket may wrap each of its two descriptors once.
    paired: set[int] = set()
    real_socket, real_pair, raw_init = socket.socket, _socket.socketpair, _socket.socket.__init__

    class NoRawSocket(_socket.socket):
        def __init__(self, family: int = -1, type: int = -1, proto: int = -1, fileno: int | None = None) -> None:
            if fileno not in paired:
                raise PermissionError("sandbox: network access is not allowed")
            paired.discard(fileno)
            raw_init(self, family, type, proto, fileno)

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("sandbox: network access is not allowed")

    def local_pair(family: int | None = None, type: int = socket.SOCK_STREAM, proto: int = 0) -> tuple:
        family = socket.AF_UNIX if family is None else family
        # a datagram pair could sendto() any socket path: only a connected stream pair stays between its two ends
        if family != socket.AF_UNIX or type & ~(socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC) != socket.SOCK_STREAM:
            raise PermissionError("sandbox: network access is not allowed")
        pair = real_pair(family, type, proto)
        paired.update(end.fileno() for end in pair)
        return tuple(real_socket(family, type, proto, end.detach()) for end in pair)

    socket.socket = socket.SocketType = NoSocket
    _socket.socket = _socket.SocketType = NoRawSocket
    socket.socketpair = local_pair
    for module, name in ((socket, "fromfd"), (socket, "create_connection"), (socket, "create_server"),
                         (_socket, "socketpair")):  # fmt: skip
        if hasattr(module, name):
            setattr(module, name, no_network)
    tempfile.tempdir = root  # so tempfile works, inside the sandbox directory


def _path_guard(func: Any, specs: list[tuple[int, str, str | None]], check: Any) -> Any:
    """Wrap an ``os`` function so every path it would modify is checked before the call."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        for index, name, fd_name in specs:
            path = args[index] if index < len(args) else kwargs.get(name)
            if path is not None:
                check(path, kwargs.get(fd_name) if fd_name else None)
        return func(*args, **kwargs)

    guarded.__name__ = getattr(func, "__name__", "guarded")
    return guarded


def _install_seccomp() -> bool:
    """Refuse (``EPERM``) the system calls in ``_SYSCALLS``, those of ``_SELF_ONLY`` aimed at another process,
    ``kill`` of a negative pid, the arguments of ``_REFUSED_VALUES`` and new namespaces (``clone3``: ``ENOSYS``), for
    this process and everything it starts.

    A classic-BPF filter: any other architecture's calls (e.g. 32-bit ``int 0x80``) and x32 calls are refused too,
    so the numbers cannot be dodged. Returns ``False`` on an architecture it does not know or a kernel without
    seccomp; needs ``no_new_privs`` (set before).
    """
    import ctypes
    import errno

    machine = os.uname().machine
    if machine not in _SYSCALLS:
        return False
    _, arch, x32, syscall_numbers = _SYSCALLS[machine]
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    deny, enosys, allow = 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS, 0x7FFF0000
    checks = ([(jge, 0x40000000)] if x32 else []) + [(jeq, nr) for nr in syscall_numbers.values()]
    program = [(load, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, deny), (load, 0, 0, 0)]
    # Each entry: (code, k, where to go if true, if false), "allow"/"deny" or the next instruction (None); then
    # turned into relative jumps. Argument ``i``'s low 32 bits are at offset 16 + 8 * i (pids are 32-bit ints).
    body: list[tuple[int, int, Any, Any]] = [(code, k, "deny", None) for code, k in checks]
    for nr, wanted in _SELF_ONLY[machine].values():
        body.append((jeq, nr, None, len(wanted) * 2 + 1))  # skip this call's argument checks if it is another
        for index, value in wanted.items():
            body += [(load, 16 + 8 * index, None, None), (jeq, value, None, "deny")]
        body.append((ret, allow, None, None))
        body.append((load, 0, None, None))  # reload the call's number for the next check
    for nr, index, values in _REFUSED_VALUES[machine].values():
        body.append((jeq, nr, None, len(values) + 1))  # skip the argument's checks if it is another call
        body.append((load, 16 + 8 * index, None, None))
        body += [(jeq, value, "deny", None) for value in values]
        body.append((load, 0, None, None))
    for nr in _CLONE_AND_UNSHARE[machine]:
        body += [(jeq, nr, None, 2), (load, 16, None, None), (jset, _REFUSED_CLONE_FLAGS, "deny", None),
                 (load, 0, None, None)]
    body.append((jeq, _CLONE3, "enosys", None))
    body += [(jeq, _KILL[machine], None, 2), (load, 16, None, None), (jge, 0x80000000, "deny", None)]
    targets = {"allow": len(body), "deny": len(body) + 1, "enosys": len(body) + 2}
    for pc, (code, k, true, false) in enumerate(body):
        if code == ret:
            program.append((ret, 0, 0, k))
            continue
        if code == load:
            program.append((load, 0, 0, k))
            continue
        jt = 0 if true is None else targets[true] - pc - 1
        jf = 0 if false is None else (false if isinstance(false, int) else targets[false] - pc - 1)
        program.append((code, jt, jf, k))
    program += [(ret, 0, 0, allow), (ret, 0, 0, deny), (ret, 0, 0, enosys)]

    class SockFilter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(SockFilter))]

    filters = (SockFilter * len(program))(*(SockFilter(*insn) for insn in program))
    fprog = SockFprog(len(program), filters)
    return _libc().prctl(_PR_SET_SECCOMP, 2, ctypes.byref(fprog), 0, 0) == 0  # SECCOMP_MODE_FILTER


def _install_landlock(workdir: str) -> int:
    """Landlock: allow writing files (creating, removing, truncating, linking) only beneath ``workdir`` and
    ``/dev/null``; with ABI >= 4 also refuse every TCP bind/connect, with ABI >= 6 connecting to abstract Unix
    sockets and signalling processes outside the sandbox. Returns the ABI version applied (0: unavailable).

    Needs no privileges and no namespace, so it is what stops writes to the host (``/tmp``, ``/dev/shm``, the
    user's files) through ``ctypes`` where there is no private mount namespace.
    """
    import ctypes
    import struct

    libc = _libc()
    create, add_rule, restrict = 444, 445, 446  # the same numbers on every architecture
    abi = libc.syscall(create, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return 0
    # WRITE_FILE, REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR, MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM;
    # then REFER (ABI 2), TRUNCATE (ABI 3), IOCTL_DEV (ABI 5). Reading and executing stay unrestricted.
    writes = sum(1 << bit for bit in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))
    writes |= (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (1 << 15 if abi >= 5 else 0)
    net = 0b11 if abi >= 4 else 0  # BIND_TCP, CONNECT_TCP: handled and never allowed
    scoped = 0b11 if abi >= 6 else 0  # ABSTRACT_UNIX_SOCKET, SIGNAL
    attr = struct.pack("=QQQ", writes, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = libc.syscall(create, ctypes.c_char_p(attr), len(attr), 0)
    if ruleset < 0:
        return 0
    try:
        for path, access in ((workdir, writes), (os.devnull, (1 << 1) | (1 << 14 if abi >= 3 else 0))):
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = struct.pack("=Qi", access, fd)  # landlock_path_beneath_attr (packed)
                if libc.syscall(add_rule, ruleset, 1, ctypes.c_char_p(rule), 0) != 0:
                    return 0
            finally:
                os.close(fd)
        return abi if libc.syscall(restrict, ruleset, 0) == 0 else 0
    finally:
        os.close(ruleset)


def _make_encoder() -> tuple[Any, type]:
    """Return ``(encode, Unrepresentable)``: ``encode(value, shape)`` turns a probe's value into tagged plain data.

    Every function and type it uses is bound here, before the program runs, and values are recognised by their
    exact type or, for subclasses of builtin types (``Counter``, ``namedtuple``, ``IntEnum``), read through the base
    type's own C methods, so nothing the program defines or patches is asked how to encode itself. Only numpy
    scalars (and size-1 arrays) are asked, through ``.item()``, whose result must be plain. Anything else raises
    ``Unrepresentable`` (the test fails). The encoder's output is only ever the program's own answer: the parent
    decodes it into exact builtin types and compares there.

    ``shape`` ``"items"`` (a probe the check gives whole to ``list``, ``tuple``, ``set``, ``frozenset`` or ``sorted``):
    its items, in iteration order (a generator runs, as natively), each encoded as above, as a list.

    ``shape`` ``"list"`` or ``"tree"`` (a probe the check gives to the LeetCode prompt's ``is_same_list`` /
    ``is_same_tree``): the value is a linked list or binary tree of the program's nodes, walked by their ``.val``,
    ``.next`` / ``.left`` / ``.right`` and truth value, and sent back in the plain form ``verdict`` describes (its
    section on plain forms). The walk is iterative and flat (a tree deeper than ``_MAX_DEPTH`` is fine), each node
    counts against ``_MAX_NODES`` like a value, and its ``.val`` is encoded as above; whatever raises on the way fails
    the probe.
    """
    tp, issub, getattr_, fmt, get_name = type, issubclass, getattr, int.__format__, type.__dict__["__name__"].__get__
    id_ = id
    b_bool, b_int, b_float, b_complex, b_str, b_bytes, b_bytearray, b_dict = (
        bool, int, float, complex, str, bytes, bytearray, dict,
    )  # fmt: skip
    float_hex, complex_pos, str_copy, bytes_hex, bytearray_hex = (
        float.hex, complex.__pos__, str.__str__, bytes.hex, bytearray.hex,
    )  # fmt: skip
    dict_items, iterate_any, get_mro = dict.items, iter, type.__dict__["__mro__"].__get__

    def is_array(cls: type) -> bool:
        """numpy's ndarray or a subclass (``matrix``), by the classes' names and modules: numpy is not imported."""
        for base in get_mro(cls):
            try:
                if get_name(base) == "ndarray" and getattr_(base, "__module__", None) == "numpy":
                    return True
            except Exception:
                return True  # a class that cannot say what it is: not plain data
        return False
    sequences = (
        (list, "l", list.__iter__), (tuple, "t", tuple.__iter__), (set, "S", set.__iter__),
        (frozenset, "F", frozenset.__iter__),
    )  # fmt: skip

    class Unrepresentable(Exception):
        """A probe's value is not plain data."""

    def linked_list(head: Any, enc: Any) -> list[Any]:
        """``(values, falsy_end)``: the nodes' ``.val`` along ``.next`` up to ``None`` or to a falsy node (then
        ``falsy_end``: natively ``not p1`` fails the comparison there). A node met twice is a cycle: refused."""
        vals: list[Any] = []
        seen: dict[int, Any] = {}  # id -> node: held, so that no id is reused during the walk
        node = head
        while node is not None:
            if not node:
                return ["t", [["l", vals], ["b", True]]]
            if id_(node) in seen:
                raise Unrepresentable("a cyclic linked list")
            seen[id_(node)] = node
            vals.append(enc(getattr_(node, "val"), 2, True))
            node = getattr_(node, "next")
        return ["t", [["l", vals], ["b", False]]]

    def binary_tree(root: Any, enc: Any, budget: list[int]) -> list[Any]:
        """``(shape, values)`` in level order: "1" per node (and its ``.val`` in ``values``), "0" per missing child,
        ``None`` or falsy (natively ``not p`` makes them alike). A node reached twice is walked twice, as natively;
        a cycle runs into the node budget."""
        shape: list[str] = []
        vals: list[Any] = []
        queue = [root]
        for node in queue:  # grows while it is walked: breadth first
            budget[0] -= 1
            if budget[0] < 0:
                raise Unrepresentable("too large")
            if node is None or not node:
                shape.append("0")
                continue
            shape.append("1")
            vals.append(enc(getattr_(node, "val"), 2, True))
            queue.append(getattr_(node, "left"))
            queue.append(getattr_(node, "right"))
        return ["t", [["s", "".join(shape)], ["l", vals]]]

    def encode(value: Any, shape: str = "") -> list[Any]:
        budget = [_MAX_NODES]

        def enc(x: Any, depth: int, numpy_ok: bool) -> list[Any]:
            budget[0] -= 1
            if depth > _MAX_DEPTH or budget[0] < 0:
                raise Unrepresentable("too large or nested too deeply")
            cls = tp(x)
            if x is None:
                return ["N"]
            if cls is b_bool:
                return ["b", x is True]
            if issub(cls, b_int):
                return ["i", fmt(x, "x")]
            if issub(cls, b_float):
                return ["f", float_hex(x)]
            if issub(cls, b_complex):
                c = complex_pos(x)
                return ["c", [float_hex(c.real), float_hex(c.imag)]]
            if issub(cls, b_str):
                return ["s", str_copy(x)]
            if issub(cls, b_bytes):
                return ["y", bytes_hex(x)]
            if issub(cls, b_bytearray):
                return ["Y", bytearray_hex(x)]
            if issub(cls, b_dict):
                return ["d", [["t", [enc(k, depth + 1, True), enc(v, depth + 1, True)]] for k, v in dict_items(x)]]
            for base, tag, iterate in sequences:
                if issub(cls, base):
                    return [tag, [enc(item, depth + 1, True) for item in iterate(x)]]
            if numpy_ok and getattr_(cls, "__module__", None) == "numpy" and getattr_(x, "item", None) is not None:
                return enc(x.item(), depth + 1, False)
            try:
                name = str_copy(get_name(cls))
            except Exception:
                name = "?"
            raise Unrepresentable(f"a {name} object")

        if shape == "items":  # the argument of a builtin that consumes it whole (verdict._CONSUMERS)
            items = []
            for item in iterate_any(value):
                if is_array(tp(item)):  # a row of an array: natively not its .item() (set() of rows raises)
                    raise Unrepresentable("an array inside the iterable")
                items.append(enc(item, 1, True))
            return ["l", items]
        if shape == "list":
            return linked_list(value, enc)
        if shape == "tree":
            return binary_tree(value, enc, budget)
        return enc(value, 0, True)

    return encode, Unrepresentable


def _run_job(config: dict[str, Any], encode: Any, unrepresentable: type) -> dict[str, Any]:
    """Execute the program (as the module ``solution``), then each spec in order in its namespace: an unverified
    test's snippet (``{"exec": source}``) or a verified test's probes; return the report's results."""
    import builtins
    import sys
    import traceback
    import types

    run, evaluate, compile_ = exec, eval, compile  # bound before the program runs
    builtin_names = builtins.__dict__

    def build(source: str, name: str, mode: str) -> Any:  # not this file's `from __future__ import annotations`
        return compile_(source, name, mode, dont_inherit=True)

    def describe(exc: BaseException) -> str:
        try:
            return f"{type(exc).__name__}: {str(exc)[:200]}"
        except BaseException:
            return "an exception that cannot be described"

    module = types.ModuleType("solution")  # registered, as an imported module is: dataclasses, typing and pickle
    sys.modules["solution"] = module  # look classes' modules up there
    namespace: dict[str, Any] = module.__dict__
    namespace["__builtins__"] = builtin_names  # an imported module's (and dLLM-RL's exec's): the dict
    try:
        run(build(config["program"], "<solution>", "exec"), namespace)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt included: the program failed to load
        traceback.print_exc(limit=5)
        return {"program_error": describe(exc)}
    results: list[dict[str, Any]] = []
    for position, spec in enumerate(config["specs"]):
        if "exec" in spec:
            try:
                run(build(spec["exec"], f"<test {position}>", "exec"), namespace)
                results.append({"passed": True})
            except BaseException as exc:
                results.append({"passed": False, "error": describe(exc)})
            continue
        local: dict[str, Any] = {}
        try:  # the test's own imports (at module level, then inside check()) and HumanEval's candidate
            for source in spec.get("global_imports", []):
                run(build(source, "<test import>", "exec"), namespace)
            if spec.get("candidate"):
                local[spec["param"]] = evaluate(build(spec["candidate"], "<candidate>", "eval"), namespace)
            for source in spec.get("local_imports", []):
                run(build(source, "<test import>", "exec"), namespace, local)
        except BaseException as exc:
            results.append({"error": describe(exc)})
            continue
        has = [name in local or name in namespace or name in builtin_names for name in spec.get("has", [])]
        values: list[list[Any]] = []
        for index, (source, shape) in enumerate(zip(spec.get("probes", []), spec.get("shapes", []))):
            try:
                code = build(f"lambda {', '.join(local)}: ({source})", f"<probe {index}>", "eval")
                values.append(["v", encode(evaluate(code, namespace)(**local), shape)])
            except unrepresentable as exc:
                values.append(["u", describe(exc)])
            except BaseException as exc:
                values.append(["e", describe(exc)])
        results.append({"has": has, "values": values})
    return {"results": results}


if __name__ == "__main__":
    _child_main()
