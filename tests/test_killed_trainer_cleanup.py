"""A trainer killed during a reward (SIGTERM: a preempted job, ``torchrun`` stopping its workers; SIGKILL) runs no
cleanup. Its code sandbox and its math workers end with it; the sandbox run's directory and cgroups are left, and
the next process's first run removes them, never a directory or cgroup a live run still uses."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from trl_diffusion.rewards.cgroup import CgroupRoot, cpu_cgroup_root, memory_cgroup_root
from trl_diffusion.rewards.dllm_rl_math import SympyWorker, boot_source
from trl_diffusion.rewards.leftovers import WORKDIR_PREFIX, new_workdir, remove_orphaned_workdirs
from trl_diffusion.rewards.math_verify_check import boot_command

_SLEEPER = """
import sys
from trl_diffusion.rewards.sandbox import SandboxLimits, _get_launcher, run_tests
_get_launcher(sys.executable, None)  # the launcher probe's own runs are over
print("probed", flush=True)
run_tests("import time\\ntime.sleep(100)\\n", ["assert True"], SandboxLimits(timeout=120))
"""
_QUICK = """
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


def _descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (from /proc): the sandbox's launcher and everything in it."""
    parents = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
        except (OSError, ValueError, IndexError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_trainer_killed_mid_run_ends_its_sandbox_and_the_next_process_cleans_up(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    sleeper = subprocess.Popen([sys.executable, "-c", _SLEEPER], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert sleeper.stdout.readline().strip() == "probed"
        deadline = time.monotonic() + 60
        while not (_workdirs(tmp_path) and (memory_cgroup_root() is None or _cgroups_of(sleeper.pid))):
            assert time.monotonic() < deadline and sleeper.poll() is None, "the run never started"
            time.sleep(0.1)
        time.sleep(0.5)  # the program is running
        sandbox = _descendants(sleeper.pid)
        assert sandbox
        sleeper.send_signal(signal.SIGTERM)
        assert sleeper.wait(timeout=30) == -signal.SIGTERM
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
    deadline = time.monotonic() + 20  # well inside the run's time limit (120 s): it died with its trainer
    while any(_alive(pid) for pid in sandbox) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in sandbox)
    left = _workdirs(tmp_path)
    assert len(left) == 1  # what the killed trainer left
    if memory_cgroup_root() is not None:
        assert _cgroups_of(sleeper.pid)
    old = time.time() - 3600
    os.utime(tmp_path / left[0], (old, old))  # a minute has passed

    quick = subprocess.run([sys.executable, "-c", _QUICK], env=env, capture_output=True, text=True, timeout=120)
    assert quick.stdout.split() == ["ok", "1"], quick.stderr
    assert _workdirs(tmp_path) == []
    assert _cgroups_of(sleeper.pid) == []


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


def test_a_cgroup_is_removed_only_when_its_creator_is_gone_and_it_is_empty(tmp_path):
    dead = _dead_pid()
    root = CgroupRoot(str(tmp_path), 1, "memory")
    names = {
        "orphan": f"trl_sandbox_memory_{dead}_0",
        "busy": f"trl_sandbox_memory_{dead}_1",  # a cgroup that still holds a process refuses rmdir; so does this
        "own": f"trl_sandbox_memory_{os.getpid()}_0",
        "live": f"trl_sandbox_memory_{os.getppid()}_0",
        "cpu": f"trl_sandbox_cpu_{dead}_0",  # another controller's root sweeps it
        "unrelated": f"other_{dead}_0",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    (tmp_path / names["busy"] / "cgroup.procs").write_text("1\n")
    assert root.remove_orphans() == [str(tmp_path / names["orphan"])]
    assert sorted(os.listdir(tmp_path)) == sorted(name for key, name in names.items() if key != "orphan")
    assert CgroupRoot(str(tmp_path), 1, "cpu").remove_orphans() == [str(tmp_path / names["cpu"])]


_HANGING_SERVE = """
import sys, time
def _serve():
    sys.stdout.write("ready\\n")
    sys.stdout.flush()
    sys.stdin.readline()
    time.sleep(1000)  # a comparison that does not end
"""
_TRAINER = """
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
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, str(serve)], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(trainer.stdout.readline())
        time.sleep(2.5)  # the worker's parent watch has looked more than once
        assert _alive(worker)
        trainer.kill()
        trainer.wait(timeout=30)
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_both_math_workers_boot_with_the_parent_watch():
    assert SympyWorker().command[2] == boot_source("_dllm_rl_math_worker")
    assert boot_command(5, 5)[2] == boot_source("_math_verify_check_child")
