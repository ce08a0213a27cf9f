"""Run untrusted Python (model-written code plus its tests) in a separate, resource-limited process.

Why a separate process: model completions are arbitrary programs. They may loop forever, fork-bomb, allocate all
memory, flood stdout, write files, read secrets or open sockets. Everything here is designed so that such a program
costs one bounded sandbox run and a reward of 0.0, never a hung or crashed trainer.

How (Linux only). The parent :func:`run_tests`:

* creates a fresh temporary directory (deleted afterwards) as the child's cwd;
* starts ``python -I -c <this file>`` with an EMPTY environment except ``PATH=/usr/bin:/bin``, all other file
  descriptors closed, in a new session (process group); when ``unshare`` works on this machine it is wrapped in
  ``unshare --net --pid --fork --kill-child --mount-proc`` (as non-root: also ``--user --map-root-user``), so the
  child has no network interfaces but a downed loopback, sees only its own processes, and dies with its group;
* sends the program, tests and limits on stdin, reads stdout+stderr through a pipe capped at ``max_output_bytes``,
  and on timeout, overflow or exit SIGKILLs the whole process group (``os.killpg``; without a PID namespace,
  also every process of the run's own uid).

The child (``_child_main`` below, executed from this same file's source, importing only the standard library):

* in a private mount namespace: covers home directories and ``/run`` with empty tmpfs mounts (keeping the
  interpreter's own directories visible, even under an unreadable ``/root``), then makes every mount read-only
  except its own directory (a kernel-enforced read-only view of the filesystem);
* when started as root: drops to a fresh, otherwise unused uid/gid for this run. This is required: Linux does not
  apply ``RLIMIT_NPROC`` to root, so without it a fork bomb would not be contained; a uid of its own makes the
  limit per sandbox. If it cannot drop, it refuses to run the program (fail closed);
* sets ``no_new_privs``, drops any remaining capabilities, sets ``RLIMIT_CPU``, ``RLIMIT_AS``, ``RLIMIT_NPROC``,
  ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` and ``RLIMIT_CORE=0``, and arms a watchdog that kills its process group;
* installs Python-level guards (see ``_install_guards``): no sockets, no exec/spawn of other programs, no writes
  outside its directory, no reading other processes' ``/proc`` entries. These hold even where the kernel
  mechanisms are unavailable, but code that calls the OS directly (``ctypes``) can bypass them;
* runs the program, then each test in the program's namespace, and reports the result on a line tagged with a
  random per-run nonce, so ordinary prints cannot fake a pass.

``docs/rewards.md`` lists exactly what is and is not guaranteed in each environment.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import secrets
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
_PROBE_TIMEOUT = 10.0


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits for one sandbox run.

    Attributes:
        timeout: wall-clock seconds for the whole run (start-up, program and all tests).
        cpu_seconds: ``RLIMIT_CPU`` per process; ``None`` means ``ceil(timeout) + 1``.
        memory_mb: ``RLIMIT_AS`` (virtual address space) per process, in MiB.
        max_processes: ``RLIMIT_NPROC``: processes+threads of the sandbox uid (see the module docstring).
        max_output_bytes: stdout+stderr bytes read before the run is killed and scored as failed.
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


@dataclass
class SandboxResult:
    """Outcome of one sandbox run.

    ``status`` is one of: ``"ok"`` (the harness finished and reported; tests may still have failed), ``"timeout"``,
    ``"output_limit"``, ``"crashed"`` (killed by a signal, e.g. a limit), ``"error"`` (exited without a report,
    e.g. ``os._exit``), ``"sandbox_error"`` (the sandbox itself could not run; the program never ran).
    """

    status: str
    passed: int = 0
    total: int = 0
    returncode: int | None = None
    output: str = ""
    duration: float = 0.0
    errors: list[str] = field(default_factory=list)
    isolation: dict[str, Any] = field(default_factory=dict)

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

_LAUNCHERS: dict[tuple[str, int, int | None], list[str] | None] = {}
_LAUNCHER_LOCK = threading.Lock()
_SOURCE: str | None = None


def run_tests(
    program: str,
    tests: list[str],
    limits: SandboxLimits | None = None,
    python: str | None = None,
    run_as_uid: int | None = None,
) -> SandboxResult:
    """Run ``program`` and then each test snippet (in the program's namespace) in a fresh sandbox.

    Each test is a Python snippet (typically one ``assert``); it passes if it runs without raising. Never raises
    and never outlives ``limits.timeout`` by more than the kill/cleanup time: every failure becomes a
    :class:`SandboxResult` with ``passed=0``. ``python`` defaults to the current interpreter. When this process is
    root the program runs as ``run_as_uid`` (uid and gid); the default, ``None``, picks a fresh unused uid per run
    so that the process limit of one sandbox is not shared with any other process on the machine.
    """
    limits = limits or SandboxLimits()
    python = python or sys.executable
    try:
        launcher = _get_launcher(python, run_as_uid)
        if launcher is None:
            return SandboxResult("sandbox_error", total=len(tests), errors=["no working sandbox launcher (see logs)"])
        return _run_once(launcher, python, program, list(tests), limits, run_as_uid)
    except Exception as exc:  # the caller must never see an exception from here
        return SandboxResult("sandbox_error", total=len(tests), errors=[f"{type(exc).__name__}: {exc}"])


def isolation_report(python: str | None = None, run_as_uid: int | None = None) -> dict[str, Any]:
    """Run a trivial program and return which isolation mechanisms were active (for logs, docs and tests)."""
    result = run_tests("pass", ["pass"], SandboxLimits(timeout=_PROBE_TIMEOUT), python, run_as_uid)
    return dict(result.isolation, status=result.status)


def _get_launcher(python: str, run_as_uid: int | None) -> list[str] | None:
    """Pick (once per interpreter) the strongest ``unshare`` prefix that runs a trivial program end to end."""
    key = (python, os.geteuid(), run_as_uid)
    with _LAUNCHER_LOCK:
        if key not in _LAUNCHERS:
            _LAUNCHERS[key] = _probe_launchers(python, run_as_uid)
        return _LAUNCHERS[key]


def _probe_launchers(python: str, run_as_uid: int | None) -> list[str] | None:
    """Try the candidate launchers from strongest to weakest; ``[]`` means "no unshare", ``None`` nothing works."""
    candidates: list[list[str]] = []
    unshare = shutil.which("unshare", path=os.environ.get("PATH", _MIN_PATH) + ":/usr/sbin:/sbin")
    if unshare and sys.platform.startswith("linux"):
        user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
        pid = ["--pid", "--fork", "--kill-child"]
        for flags in (["--net", *pid, "--mount-proc"], ["--net", *pid], ["--net"]):
            candidates.append([unshare, *user, *flags, "--"])
    candidates.append([])
    errors = []
    for launcher in candidates:
        result = _run_once(launcher, python, "pass", ["pass"], SandboxLimits(timeout=_PROBE_TIMEOUT), run_as_uid)
        if result.all_passed:
            return launcher
        errors.append(f"{' '.join(launcher) or '(plain)'}: {result.status} {result.errors} {result.output[-300:]}")
    import logging

    logging.getLogger(__name__).error("Code sandbox unusable; every code reward will be 0.0.\n%s", "\n".join(errors))
    return None


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
    launcher: list[str], python: str, program: str, tests: list[str], limits: SandboxLimits, run_as_uid: int | None
) -> SandboxResult:
    """One sandbox run with a given launcher prefix; see :func:`run_tests`."""
    start = time.monotonic()
    drop = (_fresh_uid() if run_as_uid is None else run_as_uid) if os.geteuid() == 0 else None
    workdir = tempfile.mkdtemp(prefix="trl_diffusion_sandbox_")
    proc: subprocess.Popen | None = None
    try:
        os.chmod(workdir, 0o700)
        if drop is not None:
            os.chown(workdir, drop, drop)
        nonce = secrets.token_hex(16)
        config = {
            "program": program,
            "tests": tests,
            "nonce": nonce,
            "workdir": workdir,
            "drop_uid": drop,
            "fresh_uid": drop is not None and run_as_uid is None,
            "mount_ns": "--mount-proc" in launcher,
            "hide_dirs": _dirs_to_hide(),
            "parent_ns": {kind: _ns_inode(kind) for kind in ("mnt", "net", "pid", "user")},
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
            env={"PATH": _MIN_PATH},
            start_new_session=True,
            close_fds=True,
        )
        # Fed from a thread so that a child that never reads cannot block us past the deadline.
        threading.Thread(target=_feed, args=(proc.stdin, json.dumps(config).encode()), daemon=True).start()
        output, status = _collect(proc, start + limits.timeout, limits.max_output_bytes)
        _kill_group(proc)
        if config["fresh_uid"] and "--pid" not in launcher:
            _kill_uid(drop)  # without a PID namespace, this also catches processes that left the group
        returncode = _reap(proc)
        return _parse(output, status, returncode, nonce, len(tests), time.monotonic() - start, launcher)
    finally:
        if proc is not None and proc.returncode is None:  # only reached through an unexpected exception
            _kill_group(proc)
            _reap(proc)
        _rmtree(workdir)


def _dirs_to_hide() -> list[str]:
    """Directories replaced by an empty tmpfs inside a mount namespace: homes (credentials) and ``/run`` (sockets)."""
    dirs = ["/root", "/home", "/run", "/var/run", os.path.expanduser("~")]
    return [d for d in dirs if os.path.isabs(d) and d != "/"]


def _fresh_uid() -> int:
    """A uid no other live sandbox of this machine uses: derived from our pid and a per-process counter."""
    return _UID_BASE + ((os.getpid() % (1 << 21)) << 10 | next(_UID_COUNTER) % 1024)


def _feed(pipe: Any, data: bytes) -> None:
    """Write the run's config to the child's stdin and close it; a dead child is not an error here."""
    try:
        pipe.write(data)
        pipe.close()
    except (OSError, ValueError):
        pass


def _collect(proc: subprocess.Popen, deadline: float, max_bytes: int) -> tuple[bytes, str]:
    """Read the child's output until EOF, the deadline, or ``max_bytes``; return (output, status so far)."""
    import selectors

    buf = bytearray()
    fd = proc.stdout.fileno()
    exited_at: float | None = None
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if now >= deadline:
                return bytes(buf), "timeout"
            # Once the main process is gone, leftovers that keep the pipe open get a short grace period only.
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                return bytes(buf), "exited"
            if not sel.select(min(deadline - now, 0.05)):
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return bytes(buf), "exited"
            buf += chunk
            if len(buf) > max_bytes:
                return bytes(buf[:max_bytes]), "output_limit"


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


def _rmtree(path: str) -> None:
    """Delete the sandbox directory, even if the program removed permissions from its own sub-directories."""
    try:
        shutil.rmtree(path)
    except OSError:
        for root, dirs, _files in os.walk(path):
            for name in dirs:
                sub = os.path.join(root, name)
                try:
                    if not os.path.islink(sub):
                        os.chmod(sub, 0o700)
                except OSError:
                    pass
        shutil.rmtree(path, ignore_errors=True)


def _parse(
    output: bytes, status: str, returncode: int | None, nonce: str, n_tests: int, duration: float, launcher: list[str]
) -> SandboxResult:
    """Turn raw output into a :class:`SandboxResult`; only a nonce-tagged report line counts as a result."""
    tag = ("\n" + nonce).encode()
    report: dict[str, Any] | None = None
    pos = output.rfind(tag)
    if pos >= 0:
        try:
            report = json.loads(output[pos + len(tag) :].split(b"\n", 1)[0])
        except ValueError:
            report = None
        output = output[:pos]
    text = output.decode("utf-8", errors="replace")
    isolation = dict(report.get("isolation", {})) if report else {}
    isolation["launcher"] = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(launcher)) or "plain"
    result = SandboxResult(status, total=n_tests, returncode=returncode, output=text, duration=duration)
    result.isolation = isolation
    if status in ("timeout", "output_limit"):
        return result
    if report is None:  # died by a signal (a limit, the watchdog) or exited without reporting
        result.status = "crashed" if returncode is not None and (returncode < 0 or returncode > 128) else "error"
        return result
    if "sandbox_error" in report:
        result.status = "sandbox_error"
        result.errors = [str(report["sandbox_error"])]
        return result
    result.status = "ok"
    result.passed = min(max(int(report.get("passed", 0)), 0), n_tests)
    result.errors = [str(e) for e in report.get("errors", [])]
    return result


# --------------------------------------------------------------------------------------------------------------------
# Child side: everything below runs inside the sandbox process (stdlib only; no package imports).
# --------------------------------------------------------------------------------------------------------------------

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_NOATIME, _MS_NODIRATIME, _MS_BIND, _MS_MOVE, _MS_REC = 32, 1024, 2048, 4096, 8192, 16384
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
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_SECUREBITS, _PR_SET_NO_NEW_PRIVS = 1, 24, 28, 38
# SECBIT_NOROOT, _LOCKED, SECBIT_NO_SETUID_FIXUP, _LOCKED, SECBIT_KEEP_CAPS_LOCKED: root gains no caps on exec.
_SECUREBITS = 0b101111


def _child_main() -> None:
    """Entry point inside the sandbox: read the config, isolate, limit, guard, run, report, exit."""
    config = json.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    report_fd = os.dup(1)  # private copy of stdout, so the program closing fd 1 cannot hide the report
    tag = ("\n" + config["nonce"]).encode()
    # Bound now, so a program that monkeypatches json/os cannot forge or suppress the report.
    dumps, write, exit_now, streams = json.dumps, os.write, os._exit, (sys.stdout, sys.stderr)

    def report(payload: dict[str, Any]) -> None:
        for stream in streams:
            try:
                stream.flush()
            except Exception:
                pass
        write(report_fd, tag + dumps(payload).encode() + b"\n")
        exit_now(0)

    isolation: dict[str, Any] = {}
    try:
        parent_ns = config["parent_ns"]
        for kind in ("net", "pid", "mnt", "user"):
            isolation[f"{kind}ns"] = parent_ns.get(kind) is not None and _ns_inode(kind) != parent_ns[kind]
        # RLIMIT_NPROC counts per uid, or per user namespace (Linux >= 5.14): is that set ours alone?
        isolation["process_limit_scope"] = "sandbox" if config["fresh_uid"] or isolation["userns"] else "uid"
        workdir = config["workdir"]
        isolation["readonly_fs"], isolation["hidden_dirs"] = False, []
        if config["mount_ns"] and isolation["mntns"]:
            ro, hidden = _setup_mounts(workdir, config["drop_uid"], config["hide_dirs"], config["max_disk_bytes"])
            isolation["readonly_fs"], isolation["hidden_dirs"] = ro, hidden
        os.chdir(workdir)
        isolation.update(_drop_privileges(config["drop_uid"]))
        # Started only now: capabilities, securebits and no_new_privs are per thread and inherited by new threads.
        _start_watchdog(float(config["wall_seconds"]) + 1.0)
        _set_limits(config)
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"  # numeric libraries must not start one thread per core under RLIMIT_NPROC
        _install_guards(workdir)
    except Exception as exc:
        report({"sandbox_error": f"{type(exc).__name__}: {exc}", "isolation": isolation})
    passed, errors = _run_program(config["program"], config["tests"])
    report({"passed": passed, "errors": errors, "isolation": isolation})


def _start_watchdog(seconds: float) -> None:
    """Kill our own process group after ``seconds`` even if the parent has died (a backstop, not the main timer)."""

    sleep, killpg, exit_now = time.sleep, os.killpg, os._exit  # bound before the program can patch them

    def fire() -> None:
        sleep(seconds)
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


def _setup_mounts(workdir: str, drop_uid: int | None, hide: list[str], disk_bytes: int) -> tuple[bool, list[str]]:
    """In our private mount namespace: hide ``hide`` dirs, put a ``disk_bytes`` tmpfs on ``workdir``, then make
    every other mount read-only.

    Returns (whether ``/`` is now read-only, the directories actually hidden). Only called after checking that our
    mount namespace differs from the parent's, and everything is first made ``MS_PRIVATE`` so nothing done here
    can propagate to the host.
    """
    libc = _libc()
    if not _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE, None):
        return False, []
    needed = _interpreter_paths(workdir)
    if drop_uid is not None:
        hide = hide + _blocked_ancestors(needed, drop_uid)
    hidden = _hide_dirs(libc, workdir, needed, hide)
    options = f"size={int(disk_bytes)},mode=0700" + ("" if drop_uid is None else f",uid={drop_uid},gid={drop_uid}")
    if not _mount(libc, "tmpfs", workdir, "tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, options):
        return False, hidden
    root_ok = False
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        mounts = [line.split() for line in f]
    for fields in mounts:
        target = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # mountinfo escapes
        if target == workdir or target.startswith(workdir + "/"):
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        for opt in fields[5].split(","):
            flags |= _MOUNT_OPTION_FLAGS.get(opt, 0)
        ok = _mount(libc, None, target, None, flags, None)
        root_ok = root_ok or (ok and target == "/")
    return root_ok, hidden


def _interpreter_paths(workdir: str) -> set[str]:
    """Directories the program needs: the interpreter's prefixes and import path, plus the sandbox directory."""
    needed = {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, workdir, *sys.path] if p and os.path.isdir(p)}
    needed.add(os.path.dirname(os.path.realpath(sys.executable)))
    return {p for p in needed if not any(p != q and p.startswith(q + "/") for q in needed)}


def _blocked_ancestors(needed: set[str], uid: int) -> list[str]:
    """Topmost directories above ``needed`` paths that ``uid`` may not enter (e.g. ``/root`` with mode 0700)."""
    blocked = []
    for path in sorted(needed):
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts)):
            ancestor = "/" + "/".join(parts[:depth])
            st = os.stat(ancestor)
            if not st.st_mode & 0o001 and st.st_uid != uid:
                blocked.append(ancestor)
                break
    return blocked


def _hide_dirs(libc: Any, workdir: str, needed: set[str], hide: list[str]) -> list[str]:
    """Cover each directory in ``hide`` with an empty tmpfs, keeping the ``needed`` paths below it visible.

    The needed paths are bind-mounted aside, the tmpfs is mounted, and they are moved back to their original
    locations, so every path the interpreter knows about stays valid while the rest (home directories with
    credentials, ``/run`` with service sockets) disappears. Directories containing the sandbox directory, or
    contained in a needed path, are left alone. Returns the directories hidden.
    """
    hidden: list[str] = []
    for index, directory in enumerate(sorted({os.path.realpath(d) for d in hide})):
        inside_needed = any(directory == p or directory.startswith(p + "/") for p in needed)
        inside_hidden = any(directory.startswith(h + "/") for h in hidden)
        if directory == "/" or inside_needed or inside_hidden or workdir.startswith(directory + "/"):
            continue
        if not os.path.isdir(directory):
            continue
        stages = []
        for j, path in enumerate(sorted(p for p in needed if p.startswith(directory + "/"))):
            stage = os.path.join(workdir, f".stage{index}_{j}")
            os.mkdir(stage)
            if _mount(libc, path, stage, None, _MS_BIND | _MS_REC, None):
                stages.append((stage, path))
            else:
                os.rmdir(stage)
        mounted = _mount(libc, "tmpfs", directory, "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755,size=1m")
        for stage, path in stages:
            if mounted:
                os.makedirs(path, mode=0o755, exist_ok=True)
            if not (mounted and _mount(libc, stage, path, None, _MS_MOVE, None)):
                libc.umount2(os.fsencode(stage), _MNT_DETACH)  # never leave a writable view inside workdir
            os.rmdir(stage)
        if mounted:
            hidden.append(directory)
    return hidden


def _drop_privileges(drop_uid: int | None) -> dict[str, Any]:
    """Become ``drop_uid`` if asked (fail closed), then ``no_new_privs`` and drop every capability."""
    info: dict[str, Any] = {}
    libc = _libc()
    if drop_uid is not None:
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


def _drop_capabilities(libc: Any) -> bool:
    """Clear the bounding, effective, permitted and inheritable capability sets (matters in a user namespace)."""
    import ctypes

    libc.prctl(_PR_SET_SECUREBITS, _SECUREBITS, 0, 0, 0)
    for cap in range(64):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)

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
    """Python-level guards: no sockets, no exec/spawn, no writes outside ``workdir``, no other ``/proc/<pid>``.

    They complement the kernel mechanisms and are the only network/write protection where those are unavailable.
    They are NOT a security boundary on their own: ``ctypes`` or raw syscalls bypass them.
    """
    import _io
    import _posixsubprocess
    import _socket
    import builtins
    import io
    import posix
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

    class NoPopen(sp.Popen):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PermissionError("sandbox: starting other programs is not allowed")

    sp.Popen = NoPopen

    class NoSocket(socket.socket):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PermissionError("sandbox: network access is not allowed")

    class NoRawSocket(_socket.socket):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise PermissionError("sandbox: network access is not allowed")

    def no_network(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError("sandbox: network access is not allowed")

    socket.socket = socket.SocketType = NoSocket
    _socket.socket = _socket.SocketType = NoRawSocket
    for module, name in ((socket, "socketpair"), (socket, "fromfd"), (socket, "create_connection"),
                         (socket, "create_server"), (_socket, "socketpair")):  # fmt: skip
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


def _run_program(program: str, tests: list[str]) -> tuple[int, list[str]]:
    """Execute the program, then each test in its namespace; return (#passed, short error descriptions)."""
    import builtins
    import traceback

    run, build = exec, compile  # bound before the program runs, so it cannot replace them via builtins
    namespace: dict[str, Any] = {"__name__": "solution", "__builtins__": builtins}
    try:
        run(build(program, "<solution>", "exec"), namespace)
    except BaseException as exc:  # SystemExit and KeyboardInterrupt included: the program failed to load
        traceback.print_exc(limit=5)
        return 0, [f"program: {type(exc).__name__}: {str(exc)[:200]}"]
    passed, errors = 0, []
    for index, test in enumerate(tests):
        try:
            run(build(test, f"<test {index}>", "exec"), namespace)
            passed += 1
        except BaseException as exc:
            errors.append(f"test {index}: {type(exc).__name__}: {str(exc)[:200]}")
    return passed, errors[:20]


if __name__ == "__main__":
    _child_main()
