"""A trainer killed during a reward (SIGTERM: a preempted job, ``torchrun`` stopping its workers; SIGKILL) runs no
cleanup. Its code sandbox and its math workers end with it; the sandbox run's directory and cgroups are left, and
the next process's first run removes them, never a directory or cgroup a live run still uses."""

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from processes import REWARDS_WITHOUT_MODELS, alive, command_line, descendants, pids_named

from trl_diffusion.rewards import leftovers
from trl_diffusion.rewards.cgroup import CgroupRoot, cpu_cgroup_root, memory_cgroup_root
from trl_diffusion.rewards.dllm_rl_math import SympyWorker, boot_source
from trl_diffusion.rewards.leftovers import FRESH_UID_PREFIX, WORKDIR_PREFIX, new_workdir, remove_orphaned_workdirs
from trl_diffusion.rewards.math_verify_check import boot_command
from trl_diffusion.rewards.sandbox import SandboxLimits, _get_launcher, run_tests

_TRAINER = """
import os, sys, threading, time
from trl_diffusion.rewards.sandbox import SandboxLimits, _get_launcher, run_tests
print(" ".join(_get_launcher(sys.executable, None)[0]), flush=True)  # the launcher probe's own runs are over
program = sys.argv[1]
if sys.argv[2] == "fork":  # a DataLoader-style fork taken while the run is in progress, which outlives the trainer
    threading.Thread(target=run_tests, args=(program, ["assert True"], SandboxLimits(timeout=120))).start()
    time.sleep(3)
    if os.fork() == 0:
        time.sleep(60)
        os._exit(0)
    time.sleep(100)
run_tests(program, ["assert True"], SandboxLimits(timeout=120))
"""
_SLEEP = "import time\ntime.sleep(100)\n"
_SLEEP_HOLDING_THE_GIL = "import ctypes\nctypes.PyDLL(None).sleep(100)\n"  # no Python thread of its runs meanwhile
_QUICK = REWARDS_WITHOUT_MODELS + """
from trl_diffusion.rewards.sandbox import run_tests
result = run_tests("x = 1\\n", ["assert x == 1"])
print(result.status, result.passed)
"""


def _workdirs(directory) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith(WORKDIR_PREFIX))


def _cgroups_of(pid: int) -> list[str]:
    roots = [root for root in (memory_cgroup_root(), cpu_cgroup_root()) if root is not None]
    return [
        os.path.join(root.path, name) for root in roots for name in os.listdir(root.path) if f"_{pid}_" in name
    ]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _kill_mid_run(tmp_path, program: str, how: signal.Signals, fork: bool = False,
                  whole_package: bool = False) -> tuple[int, str, set[int]]:
    """Start a trainer whose run executes ``program`` (time limit 120 s), kill it with ``how`` once the program
    runs, and return its pid, its launcher and the sandbox's processes, after checking that those are gone within
    20 s (they ended with their trainer, not at their time limit). ``whole_package``: the trainer imports all of
    trl_diffusion (torch, transformers, TRL), as a real one has; else only the rewards (REWARDS_WITHOUT_MODELS)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    source = _TRAINER if whole_package else REWARDS_WITHOUT_MODELS + _TRAINER
    trainer = subprocess.Popen([sys.executable, "-c", source, program, "fork" if fork else "-"], env=env,
                               stdout=subprocess.PIPE, text=True)
    forks: set[int] = set()
    try:
        launcher = trainer.stdout.readline().strip()
        deadline = time.monotonic() + 60
        while not (_workdirs(tmp_path) and (memory_cgroup_root() is None or _cgroups_of(trainer.pid))):
            assert time.monotonic() < deadline and trainer.poll() is None, "the run never started"
            time.sleep(0.1)
        time.sleep(4 if fork else 0.5)  # the program is running (and the fork is made)
        sandbox = descendants(trainer.pid)
        forks = {pid for pid in sandbox if command_line(pid) == command_line(trainer.pid)}
        assert sandbox - forks
        trainer.send_signal(how)
        assert trainer.wait(timeout=30) == -how
        sandbox -= forks
        deadline = time.monotonic() + 20  # well inside the run's time limit
        while any(alive(pid) for pid in sandbox) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in sandbox if alive(pid)], launcher
        if fork:
            assert any(alive(pid) for pid in forks)  # the fork still holds whatever it inherited
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for pid in forks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return trainer.pid, launcher, sandbox


def test_a_trainer_killed_mid_run_ends_its_sandbox_and_the_next_process_cleans_up(tmp_path):
    trainer, _, _ = _kill_mid_run(tmp_path, _SLEEP, signal.SIGTERM, whole_package=True)
    left = _workdirs(tmp_path)
    assert len(left) == 1  # what the killed trainer left
    assert left[0].startswith(FRESH_UID_PREFIX) == (os.geteuid() == 0)  # root's runs have uids of their own
    old = time.time() - 3600
    os.utime(tmp_path / left[0], (old, old))  # a minute has passed
    if memory_cgroup_root() is not None:
        assert _cgroups_of(trainer)
        for path in _cgroups_of(trainer):
            os.utime(path, (old, old))

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    quick = subprocess.run([sys.executable, "-c", _QUICK], env=env, capture_output=True, text=True, timeout=120)
    assert quick.stdout.split() == ["ok", "1"], quick.stderr
    assert _workdirs(tmp_path) == []
    assert _cgroups_of(trainer) == []


def test_a_fork_of_the_trainer_does_not_keep_its_run_alive(tmp_path):
    """A fork that never execs (a DataLoader or ``multiprocessing`` worker) got copies of the run's lifeline and
    directory lock: the run went on to its time limit, and its directory could not be swept, while the fork lived."""
    _kill_mid_run(tmp_path, _SLEEP, signal.SIGKILL, fork=True)
    left = _workdirs(tmp_path)
    assert len(left) == 1
    old = time.time() - 3600
    os.utime(tmp_path / left[0], (old, old))
    assert remove_orphaned_workdirs(str(tmp_path)) == [str(tmp_path / left[0])]


def test_a_program_holding_the_interpreter_ends_with_its_trainer(tmp_path):
    """The watchdog thread cannot run while the program holds the GIL (a C call); with ``setpriv`` the launcher
    itself dies with the trainer's thread (a parent-death signal), and with a PID namespace everything inside it."""
    if not (shutil.which("setpriv") and shutil.which("unshare")):
        pytest.skip("no setpriv / unshare here: the sandbox's own watchdog is the only backstop")
    _, launcher, _ = _kill_mid_run(tmp_path, _SLEEP_HOLDING_THE_GIL, signal.SIGKILL)
    assert "setpriv --pdeathsig KILL" in launcher and "--pid" in launcher


_LAUNCHED_TRAINER = REWARDS_WITHOUT_MODELS + """
import sys
from trl_diffusion.rewards import sandbox
from trl_diffusion.rewards.sandbox import SandboxLimits, run_tests
program, python, launcher = sys.argv[1], sys.argv[2], sys.argv[3:]
sandbox._get_launcher = lambda python, uid: (launcher, False)  # as on a machine where only this one works
print(run_tests("pass", ["pass"], SandboxLimits(timeout=20), python=python).status, flush=True)
run_tests(program, ["assert True"], SandboxLimits(timeout=120), python=python)
"""
_FORKED_AND_HOLDING = """
import ctypes, fcntl, os
libc = ctypes.CDLL(None)
if {disarm}:  # clear O_ASYNC on every descriptor that has it: the lifeline's, if this process shares its open file
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            if flags & os.O_ASYNC:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_ASYNC)
        except OSError:
            pass
libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG 0 (no parent-death signal): refused where the seccomp filter runs
holder = ctypes.PyDLL(None)  # its calls keep the interpreter's lock: no watchdog thread runs
if os.fork() == 0:
    libc.prctl(15, ctypes.c_char_p(b"{marker}"), 0, 0, 0)  # PR_SET_NAME, so the test finds it
    holder.sleep(100)
    os._exit(0)
libc.prctl(15, ctypes.c_char_p(b"{marker}"), 0, 0, 0)
holder.sleep(100)
"""


def _start_launched_trainer(program: str, launcher: list[str]) -> subprocess.Popen | None:
    """A trainer running ``program`` with ``launcher``, started with the first interpreter the sandbox runs with that
    launcher (as root without namespaces, its per-run uid must be able to read it: this one may be under /root), once
    its first run passed; or None. (The trainer's first run is the probe: no separate process per interpreter.)"""
    for python in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
        if python:
            trainer = subprocess.Popen([sys.executable, "-c", _LAUNCHED_TRAINER, program, python, *launcher],
                                       stdout=subprocess.PIPE, text=True)
            if trainer.stdout.readline().strip() == "ok":
                return trainer
            trainer.kill()
            trainer.wait()
    return None


@pytest.mark.parametrize("launcher, disarm", [("plain", False), ("unshare without setpriv", False),
                                              ("default", False), ("unshare without setpriv", True),
                                              ("unshare --fork without namespaces", True)])
def test_a_killed_trainers_run_ends_with_its_forks_and_a_program_holding_the_interpreter(launcher, disarm):
    """The kernel kills the run's process group when the trainer dies (the lifeline's owner and I/O signal). Without
    that, with no ``unshare`` (a container, a non-root user without user namespaces) the sandbox's interpreter died
    by its parent-death signal (unless the program cleared it) and a process it forked lived on, sleeping for good;
    with ``unshare --fork`` but no ``setpriv``, so did everything, as the watchdog thread cannot run while the
    program holds the interpreter's lock. (The namespace's first process ignores the group's signal; ``unshare``'s
    ``--kill-child``, a parent-death signal, ends it, which the program can no longer clear.) With ``unshare --fork``
    the program's lifeline is an open file of its own, so clearing ``O_ASYNC`` on it changes nothing (``disarm``),
    also with no namespace at all (the weakest ``unshare`` launcher); without ``unshare`` the program shares the
    armed open file, and that is left (docs/rewards.md)."""
    if launcher == "plain":
        prefix = []
    elif launcher == "unshare --fork without namespaces":  # the weakest unshare launcher, where none can be made
        if shutil.which("unshare") is None:
            pytest.skip("no unshare here")
        prefix = [shutil.which("unshare"), "--fork", "--kill-child", "--"]
    else:
        found = (_get_launcher(sys.executable, None) or ([], False))[0]
        if "--pid" not in found:
            pytest.skip("no PID namespace on this machine")
        without_setpriv = found[found.index("--pdeathsig") + 2:] if "--pdeathsig" in found else found
        prefix = found if launcher == "default" else without_setpriv
    marker = "kt" + secrets.token_hex(5)
    trainer = _start_launched_trainer(_FORKED_AND_HOLDING.format(marker=marker, disarm=disarm), prefix)
    if trainer is None:
        pytest.skip("no interpreter runs in the sandbox with this launcher here")
    try:
        deadline = time.monotonic() + 60
        while len(pids_named(marker)) < 2:
            assert time.monotonic() < deadline and trainer.poll() is None, "the program never forked"
            time.sleep(0.1)
        trainer.kill()
        trainer.wait(timeout=30)
        deadline = time.monotonic() + 15  # well inside the run's time limit
        while left := [pid for pid in pids_named(marker) if alive(pid)]:
            assert time.monotonic() < deadline, f"{len(left)} of the run's processes outlived the trainer"
            time.sleep(0.1)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
        for pid in pids_named(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_only_unheld_old_sandbox_directories_are_removed(tmp_path, monkeypatch):
    old = time.time() - 3600
    orphan = tmp_path / f"{WORKDIR_PREFIX}orphan"
    (orphan / "inner").mkdir(parents=True)
    (orphan / "inner" / "f").write_text("left")
    young = tmp_path / f"{WORKDIR_PREFIX}young"
    young.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "kept.txt").write_text("the host's")
    os.symlink(outside, tmp_path / f"{WORKDIR_PREFIX}link")  # a link is never followed
    (tmp_path / f"{WORKDIR_PREFIX}file").write_text("not a directory")
    other = tmp_path / "unrelated_dir"
    other.mkdir()
    for path in (orphan, outside, other):
        os.utime(path, (old, old))
    (tmp_path / "live").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "live"))
    held_path, held_fd = new_workdir()  # a live run's directory: held by this process
    try:
        os.utime(held_path, (old, old))
        assert remove_orphaned_workdirs(str(tmp_path), min_age=60) == [str(orphan)]
        assert remove_orphaned_workdirs(os.path.dirname(held_path), min_age=0) == []
        assert os.path.isdir(held_path)
    finally:
        os.rmdir(held_path)
        os.close(held_fd)
    assert young.is_dir() and other.is_dir() and (outside / "kept.txt").read_text() == "the host's"
    assert (tmp_path / f"{WORKDIR_PREFIX}link").is_symlink() and (tmp_path / f"{WORKDIR_PREFIX}file").is_file()
    assert remove_orphaned_workdirs(str(tmp_path), min_age=0) == [str(young)]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_a_directory_of_another_user_is_kept(tmp_path):
    theirs = tmp_path / f"{WORKDIR_PREFIX}theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    per_run = tmp_path / f"{WORKDIR_PREFIX}per_run_uid"
    per_run.mkdir()
    os.chown(per_run, 100_000_123, 100_000_123)  # a sandbox's own uid (root runs each sandbox as a fresh one)
    assert remove_orphaned_workdirs(str(tmp_path), min_age=0) == [str(per_run)]
    assert theirs.is_dir()


@pytest.mark.skipif(os.geteuid() != 0, reason="per-run uids are root's")
def test_an_orphaned_run_of_a_fresh_uid_takes_that_uids_processes_and_shared_temp_files(tmp_path):
    """A killed trainer's run as root without a mount namespace or Landlock could leave files straight in /tmp (and
    /var/tmp, /dev/shm), and, where nothing else killed them, processes; the run's normal end removes both by its
    uid. The sweep does the same for the uid of an orphaned directory made for a fresh uid, and only for such a
    uid: a caller's fixed ``run_as_uid`` may be shared with other things, and a fresh uid whose pid slot a live
    process has may be in use again."""
    free_slot = next(slot for slot in range(1000, 1 << 21) if not any(
        int(entry) % (1 << 21) == slot for entry in os.listdir("/proc") if entry.isdigit()))
    fresh, fixed = 100_000_000 + (free_slot << 10), 100_000_000 + (free_slot << 10) + 1
    reused = 100_000_000 + ((os.getpid() % (1 << 21)) << 10) + 7  # a live process has its slot: it may use it
    left, kept, sleepers = {}, {}, {}
    try:
        for uid, prefix in ((fresh, FRESH_UID_PREFIX), (fixed, WORKDIR_PREFIX), (reused, FRESH_UID_PREFIX)):
            directory = tmp_path / f"{prefix}{uid}"
            directory.mkdir()
            os.chown(directory, uid, uid)
            old = time.time() - 3600
            os.utime(directory, (old, old))
            files = left if uid == fresh else kept
            for shared in ("/tmp", "/dev/shm"):
                if os.path.isdir(shared):
                    path = os.path.join(shared, f"trl_test_{uid}_{secrets.token_hex(4)}")
                    with open(path, "w") as f:
                        f.write("left by the run")
                    os.chown(path, uid, uid)
                    files[path] = uid
            sleepers[uid] = subprocess.Popen(["sleep", "60"], user=uid, group=uid)
        assert sorted(remove_orphaned_workdirs(str(tmp_path), min_age=60)) == sorted(
            str(tmp_path / f"{prefix}{uid}")
            for uid, prefix in ((fresh, FRESH_UID_PREFIX), (fixed, WORKDIR_PREFIX), (reused, FRESH_UID_PREFIX)))
        assert sleepers[fresh].wait(timeout=10) == -signal.SIGKILL
        assert sleepers[fixed].poll() is None and sleepers[reused].poll() is None
        assert [path for path in left if os.path.exists(path)] == []
        assert all(os.path.exists(path) for path in kept)
    finally:
        for sleeper in sleepers.values():
            sleeper.kill()
            sleeper.wait()
        for path in (*left, *kept):
            if os.path.exists(path):
                os.unlink(path)


def test_a_cgroup_is_removed_only_when_its_creator_is_gone_it_is_empty_and_old(tmp_path):
    dead = _dead_pid()
    root = CgroupRoot(str(tmp_path), 1, "memory")
    names = {
        "orphan": f"trl_sandbox_memory_{dead}_0",
        "young": f"trl_sandbox_memory_{dead}_2",  # maybe a live run of another PID namespace, not yet joined
        "busy": f"trl_sandbox_memory_{dead}_1",  # a cgroup that still holds a process refuses rmdir; so does this
        "own": f"trl_sandbox_memory_{os.getpid()}_0",
        "live": f"trl_sandbox_memory_{os.getppid()}_0",
        "cpu": f"trl_sandbox_cpu_{dead}_0",  # another controller's root sweeps it
        "unrelated": f"other_{dead}_0",
        "huge": "trl_sandbox_memory_99999999999999999999_0",  # names anyone with access could make: no error
        "overflow": "trl_sandbox_memory_9999999999_0",
        "digit": "trl_sandbox_memory_\u00b2_0",
    }
    old = time.time() - 3600
    for key, name in names.items():
        (tmp_path / name).mkdir()
        if key != "young":
            os.utime(tmp_path / name, (old, old))
    (tmp_path / names["busy"] / "cgroup.procs").write_text("1\n")
    assert root.remove_orphans() == [str(tmp_path / names["orphan"])]
    assert sorted(os.listdir(tmp_path)) == sorted(name for key, name in names.items() if key != "orphan")
    assert CgroupRoot(str(tmp_path), 1, "cpu").remove_orphans() == [str(tmp_path / names["cpu"])]
    assert root.remove_orphans(min_age=0) == [str(tmp_path / names["young"])]


def test_a_failing_sweep_is_logged_once_and_never_fails_a_run(monkeypatch, caplog):
    class Broken:
        def remove_orphans(self):
            raise RuntimeError("unreadable cgroup directory")

    monkeypatch.setattr(leftovers, "_swept", False)
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.rewards.leftovers"):
        leftovers.sweep_once((Broken(),))
        leftovers.sweep_once((Broken(),))
    assert leftovers._swept
    assert [r.getMessage() for r in caplog.records] == [
        "Could not remove what killed runs left behind: RuntimeError('unreadable cgroup directory')"
    ]


_HANGING_SERVE = """
import sys, time
def _serve():
    sys.stdout.write("ready\\n")
    sys.stdout.flush()
    sys.stdin.readline()
    time.sleep(1000)  # a comparison that does not end
"""
_MATH_TRAINER = REWARDS_WITHOUT_MODELS + """
import sys
from trl_diffusion.rewards.dllm_rl_math import SympyWorker, boot_source
worker = SympyWorker(timeout=600, command=[sys.executable, "-c", boot_source("hanging"), sys.argv[1]])
worker._started()
print(worker.pid, flush=True)
worker.compare("a", "b")
"""


def test_a_math_worker_ends_with_its_killed_trainer(tmp_path):
    serve = tmp_path / "hanging.py"
    serve.write_text(_HANGING_SERVE)
    trainer = subprocess.Popen([sys.executable, "-c", _MATH_TRAINER, str(serve)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(trainer.stdout.readline())
        time.sleep(2.5)  # the worker's parent watch has looked more than once
        assert alive(worker)
        trainer.kill()
        trainer.wait(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    deadline = time.monotonic() + 15
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker)


def test_both_math_workers_boot_with_the_parent_watch():
    assert SympyWorker().command[2] == boot_source("_dllm_rl_math_worker")
    assert boot_command(5, 5)[2] == boot_source("_math_verify_check_child")


def test_the_watchdog_runs_under_a_time_limit_longer_than_poll_can_wait():
    """``poll`` waits at most 2**31 - 1 ms (24.8 days): a longer limit raised OverflowError in the watchdog thread,
    which then neither watched the lifeline nor enforced the limit."""
    program = "import threading, time\ntime.sleep(0.5)\nthreads = threading.active_count()\n"
    result = run_tests(program, ["assert threads == 2"], SandboxLimits(timeout=3e6, cpu_seconds=5))
    assert result.passed == 1, result.output  # the program's thread and the watchdog's


_FORK_DURING = REWARDS_WITHOUT_MODELS + """
import os, sys, threading, time
from trl_diffusion.rewards import leftovers, sandbox
from trl_diffusion.rewards.sandbox import SandboxLimits, run_tests

where = sys.argv[1]
inside = threading.Event()


def fork_here(original):
    def wrapped(*args, **kwargs):
        if where == "start":  # right after Popen, before the config is sent: the fork holds the stdin pipe
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)  # not the test's output pipe: only the run's descriptors stay open
                os.dup2(null, 2)
                time.sleep(30)
                os._exit(0)
            return original(*args, **kwargs)
        inside.set()  # another thread forks while this one holds the lock
        time.sleep(2)
        return original(*args, **kwargs)
    return wrapped


if where == "start":
    sandbox._get_launcher(sys.executable, None)
    sandbox._namespace_init = fork_here(sandbox._namespace_init)
    result = run_tests("x = 1\\n", ["assert x == 1"], SandboxLimits(timeout=8))
    print(result.status, result.passed, round(result.duration, 1))
    sys.exit(0)
if where == "sweep":
    leftovers.remove_orphaned_workdirs = fork_here(leftovers.remove_orphaned_workdirs)
else:
    sandbox._probe_launchers = fork_here(sandbox._probe_launchers)
threading.Thread(target=sandbox._get_launcher, args=(sys.executable, None)).start()
inside.wait()
child = os.fork()
if child == 0:
    result = run_tests("x = 1\\n", ["assert x == 1"], SandboxLimits(timeout=5))
    os._exit(0 if result.passed == 1 else 1)
deadline = time.monotonic() + 40
while time.monotonic() < deadline:
    pid, status = os.waitpid(child, os.WNOHANG)
    if pid:
        print("child", os.waitstatus_to_exitcode(status))
        sys.exit(0)
    time.sleep(0.1)
os.kill(child, 9)
print("child blocked")
"""


@pytest.mark.parametrize("where", ["start", "probe", "sweep"])
def test_a_fork_of_the_trainer_at_the_wrong_moment_does_not_stall_a_run(where):
    """A fork made while a run starts held the run's stdin (the sandbox read its config up to end of file: a
    correct program timed out); a fork made while another thread probed launchers or swept leftovers inherited the
    held lock, and its own runs waited on it forever."""
    out = subprocess.run([sys.executable, "-c", _FORK_DURING, where], capture_output=True, text=True, timeout=120)
    if where == "start":
        status, passed, seconds = out.stdout.split()
        assert (status, passed) == ("ok", "1") and float(seconds) < 6, out.stdout + out.stderr
    else:
        assert out.stdout.strip() == "child 0", out.stdout + out.stderr
