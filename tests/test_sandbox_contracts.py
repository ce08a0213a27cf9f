"""Contracts of the code sandbox that hold in every environment, including the weakest one a plain CI container
gives (no ``unshare``, no cgroup, root or not): the Python-level guards, the seccomp filter and Landlock checked on
their own (each in a fresh interpreter, so no other mechanism hides a gap), the limits a run gets, the fallback-mode
cleanup, and the parent's decisions (statuses, caps). Tests needing a mechanism the machine lacks skip.
"""

import errno
import io
import json
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys

import pytest
from processes import pids_named, source_without_the_filter, still_running_after

from trl_diffusion.rewards import cgroup, sandbox
from trl_diffusion.rewards.sandbox import SandboxLimits, SandboxResult, isolation_report, run_tests

CHILD_PRELUDE = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("sandbox_child", sys.argv[1])
sandbox = sys.modules["sandbox_child"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)


def attempt(call):
    try:
        call()
    except Exception as exc:
        return type(exc).__name__
    return "done"
"""


def _in_fresh_interpreter(script: str, *args: str, python: str = sys.executable) -> dict:
    """Run ``script`` in a new interpreter (its own process group, so this process is "another process" to it) with
    the sandbox module loaded from its file as ``sandbox`` (stdlib only, as in the sandbox); return its last line's
    JSON."""
    done = subprocess.run(
        [python, "-I", "-c", CHILD_PRELUDE + script, sandbox.__file__, *args],
        capture_output=True,
        text=True,
        timeout=60,
        process_group=0,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _kill_named(name: str) -> None:
    for pid in pids_named(name):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _python_without_namespaces() -> str | None:
    """An interpreter the sandbox runs with the weakest launcher (no unshare, no cgroup): this one, else the
    system's (as root the sandbox's own uid must be able to read it); ``None`` if neither runs."""
    job = {"program": "pass", "specs": [{"probes": [], "has": []}]}
    for python in (sys.executable, shutil.which("python3", path="/usr/bin:/bin")):
        if python and sandbox._report_results(
            sandbox._run_once(([], False), python, job, SandboxLimits(timeout=10.0), None), 1
        ):
            return python
    return None


@pytest.fixture
def plain(monkeypatch):
    """Runs with the weakest launcher, what a plain container gets; yields the interpreter to run them with."""
    python = _python_without_namespaces()
    if python is None:
        pytest.skip("no interpreter runs in the sandbox without namespaces here")
    monkeypatch.setattr(sandbox, "_get_launcher", lambda python, uid: ([], False))
    return python


# ---------------------------------------------------------------------------------------------------------------------
# The child's mechanisms, each on its own
# ---------------------------------------------------------------------------------------------------------------------

GUARDS = """
import _posixsubprocess, resource, socket, tempfile
work, outside, outdir = sys.argv[2:5]
os.chdir(work)
sandbox._install_guards(work)
parent = os.getppid()


def in_child(call):
    pid = os.fork()  # not a process-group leader: a real setsid() or setpgid(0, 0) would succeed
    if pid == 0:
        try:
            call()
            os._exit(0)
        except PermissionError:
            os._exit(3)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status == 3:
        raise PermissionError("refused")


def dir_fd_mkdir():
    fd = os.open(outdir, os.O_RDONLY | os.O_DIRECTORY)
    os.mkdir("made_by_dir_fd", dir_fd=fd)


def stream_pair():
    for end in socket.socketpair():
        end.close()


refused = {
    "append_outside": attempt(lambda: open(outside, "a").close()),
    "sibling_with_the_same_prefix": attempt(lambda: open(work + "_sibling", "w").close()),
    "create_flag_only": attempt(lambda: os.close(os.open(os.path.join(outdir, "c"), os.O_RDONLY | os.O_CREAT))),
    "hard_link_to_outside": attempt(lambda: os.link(outside, "hard")),
    "symlink_outside": attempt(lambda: os.symlink("anything", os.path.join(outdir, "sym"))),
    "chmod_outside": attempt(lambda: os.chmod(outside, 0o600)),
    "mkdir_by_dir_fd": attempt(dir_fd_mkdir),
    "posix_spawn": attempt(lambda: os.posix_spawn("/bin/true", ["true"], {})),
    "fork_exec": attempt(lambda: _posixsubprocess.fork_exec()),
    "read_parent_proc": attempt(lambda: open(f"/proc/{parent}/status").close()),
    "kill_parent": attempt(lambda: os.kill(parent, 0)),
    "killpg_parent": attempt(lambda: os.killpg(os.getpgid(parent), 0)),
    "prlimit_parent": attempt(lambda: resource.prlimit(parent, resource.RLIMIT_NOFILE)),
    "pidfd_parent": attempt(lambda: os.close(os.pidfd_open(parent))),
    "memfd": attempt(lambda: os.close(os.memfd_create("x"))),
    "socket": attempt(lambda: socket.socket().close()),
    "datagram_pair": attempt(lambda: [end.close() for end in socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)]),
    "setsid": attempt(lambda: in_child(os.setsid)),
    "setpgid": attempt(lambda: in_child(lambda: os.setpgid(0, 0))),
    "setpgrp": attempt(os.setpgrp),
}
allowed = {
    "write_inside": attempt(lambda: open("inside.txt", "w").close()),
    "chmod_own_directory": attempt(lambda: os.chmod(work, 0o700)),
    "devnull": attempt(lambda: open(os.devnull, "w").close()),
    "stream_pair": attempt(stream_pair),
    "own_limits": attempt(lambda: resource.prlimit(0, resource.RLIMIT_NOFILE)),
    "own_process": attempt(lambda: os.kill(os.getpid(), 0)),
}
print(json.dumps({"refused": refused, "allowed": allowed, "tempdir": tempfile.gettempdir()}))
"""


def test_python_guards_alone_refuse_every_escape_route(tmp_path):
    """Where no kernel mechanism applies, the Python guards alone refuse writes outside the directory (any way of
    naming a path), other programs, other processes, memfd, sockets, setsid and setpgid, and allow the program's own
    work."""
    work, outdir = tmp_path / "work", tmp_path / "outside"
    work.mkdir()
    outdir.mkdir()
    outside = outdir / "victim.txt"
    outside.write_text("original")
    outside.chmod(0o644)
    found = _in_fresh_interpreter(GUARDS, str(work), str(outside), str(outdir))
    assert found["refused"] == {name: "PermissionError" for name in found["refused"]}, found["refused"]
    assert found["allowed"] == {name: "done" for name in found["allowed"]}, found["allowed"]
    assert found["tempdir"] == os.path.realpath(work)
    assert outside.read_text() == "original" and outside.stat().st_mode & 0o777 == 0o644
    assert sorted(os.listdir(outdir)) == ["victim.txt"]
    assert not os.path.exists(str(work) + "_sibling")


SECCOMP = """
import ctypes, errno, resource, threading
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
if not sandbox._install_seccomp():
    print(json.dumps({"installed": False}))
    sys.exit(0)
parent = os.getppid()


def raw(result):
    return "ok" if result != -1 else errno.errorcode[ctypes.get_errno()]


def setsid_in_child():
    pid = os.fork()  # not a process-group leader: only the filter can refuse it
    if pid == 0:
        os._exit(0 if libc.setsid() != -1 else ctypes.get_errno())
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def setpgid_in_child():
    pid = os.fork()  # a new group of its own: only the filter can refuse it
    if pid == 0:
        os._exit(0 if libc.setpgid(0, 0) != -1 else ctypes.get_errno())
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def clone_with(flags):
    pid = libc.syscall(56 if os.uname().machine == "x86_64" else 220, flags | 17, 0, 0, 0, 0)  # | SIGCHLD
    if pid == 0:
        os._exit(0)
    if pid == -1:
        return ctypes.get_errno()
    os.waitpid(pid, 0)
    return 0


pipe_end, _ = os.pipe()
found = {
    "setsid": errno.errorcode.get(setsid_in_child(), "ok"),
    "setpgid": errno.errorcode.get(setpgid_in_child(), "ok"),
    "ptrace": raw(libc.ptrace(3, parent, 0, 0)),  # PTRACE_PEEKUSER of an untraced process: ESRCH if allowed
    "kill_a_group": raw(libc.kill(-987654, 0)),  # no such group: ESRCH if allowed
    "setpriority_own_group": raw(libc.setpriority(1, 0, os.getpriority(os.PRIO_PROCESS, 0))),  # PRIO_PGRP
    "affinity_of_parent": attempt(lambda: os.sched_setaffinity(parent, os.sched_getaffinity(parent))),
    "limits_of_parent": attempt(lambda: resource.prlimit(parent, resource.RLIMIT_NOFILE)),
    "memfd": raw(libc.memfd_create(b"x", 0)),
    "clear_parent_death_signal": raw(libc.prctl(1, 0, 0, 0, 0)),  # PR_SET_PDEATHSIG
    "own_name": raw(libc.prctl(15, b"renamed", 0, 0, 0)),  # PR_SET_NAME: other prctl options stay allowed
    "io_signal_owner": raw(libc.fcntl(pipe_end, 8, os.getpid())),  # F_SETOWN: an I/O signal is a kill by other means
    "io_signal": raw(libc.fcntl(pipe_end, 10, 9)),  # F_SETSIG
    "socket_owner": raw(libc.ioctl(pipe_end, 0x8901, ctypes.byref(ctypes.c_int(os.getpid())))),  # FIOSETOWN
    "own_flags": raw(libc.fcntl(pipe_end, 4, os.O_NONBLOCK)),  # F_SETFL stays allowed (asyncio needs it)
    "new_user_namespace": raw(libc.unshare(0x10000000)),  # CLONE_NEWUSER
    "new_pid_namespace_by_clone": errno.errorcode.get(clone_with(0x20000000), "ok"),  # CLONE_NEWPID
    "clone_parent": errno.errorcode.get(clone_with(0x8000), "ok"),  # CLONE_PARENT: the trainer's child, unreaped
    "plain_clone": errno.errorcode.get(clone_with(0), "ok"),  # what fork is
    "clone3": raw(libc.syscall(435, 0, 0)),  # ENOSYS: the C library falls back to clone
    "threads": attempt(lambda: [thread.start() or thread.join() for thread in [threading.Thread(target=int)]]),
    "own_limits": attempt(lambda: resource.prlimit(0, resource.RLIMIT_NOFILE)),
    "own_priority": raw(libc.setpriority(0, 0, os.getpriority(os.PRIO_PROCESS, 0))),
    "own_process": attempt(lambda: os.kill(os.getpid(), 0)),
}
print(json.dumps({"installed": True, "found": found}))
"""


def test_seccomp_filter_alone_refuses_what_it_lists():
    """The filter refuses setsid, setpgid, clearing the parent-death signal, ptrace, kill of a negative pid,
    setpriority of anything but the caller, affinity and limits of other processes, I/O signal owners and new
    namespaces (EPERM; clone3 ENOSYS), and leaves the caller's own calls alone (threads still start)."""
    with open("/proc/self/status") as f:
        kernel_has_seccomp = any(line.startswith("Seccomp:") for line in f)
    if not kernel_has_seccomp or os.uname().machine not in sandbox._SYSCALLS:
        pytest.skip("this kernel or architecture takes no seccomp filter")
    found = _in_fresh_interpreter(SECCOMP)
    assert found["installed"], "the kernel has seccomp, but the filter was not installed"
    refused = ("setsid", "setpgid", "clear_parent_death_signal", "ptrace", "kill_a_group", "setpriority_own_group",
               "memfd", "io_signal_owner", "io_signal", "socket_owner", "new_user_namespace",
               "new_pid_namespace_by_clone", "clone_parent")
    assert {name: found["found"][name] for name in refused} == dict.fromkeys(refused, "EPERM"), found
    assert found["found"]["affinity_of_parent"] == found["found"]["limits_of_parent"] == "PermissionError", found
    assert found["found"]["clone3"] == "ENOSYS", found
    own = ("own_limits", "own_priority", "own_process", "own_name", "own_flags", "threads", "plain_clone")
    assert [found["found"][name] for name in own] == ["done", "ok", "done", "ok", "ok", "done", "ok"], found
    report = isolation_report()
    assert report["status"] == "ok" and report["seccomp"] is True and report["no_new_privs"] is True, report


LANDLOCK = """
import ctypes, socket
work, outside, port, abstract = sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
kernel_abi = ctypes.CDLL(None, use_errno=True).syscall(444, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
abi = sandbox._install_landlock(work)


def connect(family, address):
    client = socket.socket(family, socket.SOCK_STREAM)
    try:
        client.connect(address)
    finally:
        client.close()


found = {
    "kernel_abi": kernel_abi,
    "abi": abi,
    "write_outside": attempt(lambda: open(outside, "r+").close()),
    "truncate_outside": attempt(lambda: os.truncate(outside, 0)),
    "write_inside": attempt(lambda: open(os.path.join(work, "inside"), "w").close()),
    "tcp": attempt(lambda: connect(socket.AF_INET, ("127.0.0.1", port))),
    "abstract": attempt(lambda: connect(socket.AF_UNIX, "\\0" + abstract)),
    "signal_parent": attempt(lambda: os.kill(os.getppid(), 0)),
}
print(json.dumps(found))
"""


def test_landlock_alone_confines_writes_connections_and_signals(tmp_path):
    """Landlock (as on a host without a mount or network namespace) refuses writing or truncating a file outside the
    directory, TCP connections (ABI >= 4), abstract sockets and signals outside (ABI >= 6)."""
    work = tmp_path / "work"
    work.mkdir()
    outside = tmp_path / "victim.txt"
    outside.write_text("original")
    name = f"trl_sandbox_contract_{secrets.token_hex(4)}"
    servers = [socket.socket(socket.AF_INET, socket.SOCK_STREAM), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)]
    try:
        servers[0].bind(("127.0.0.1", 0))
        servers[1].bind("\0" + name)
        for server in servers:
            server.listen(4)
        port = servers[0].getsockname()[1]
        found = _in_fresh_interpreter(LANDLOCK, str(work), str(outside), str(port), name)
    finally:
        for server in servers:
            server.close()
    abi = found["kernel_abi"]
    if abi < 1:
        pytest.skip("no Landlock on this kernel")
    assert found["abi"] == abi, found  # applied at the kernel's own version
    assert found["write_inside"] == "done"
    assert found["write_outside"] == "PermissionError", found
    expected = {
        "truncate_outside": abi >= 3,
        "tcp": abi >= 4,
        "abstract": abi >= 6,
        "signal_parent": abi >= 6,
    }
    for key, refused in expected.items():
        if refused:
            assert found[key] == "PermissionError", (key, found)
    assert outside.read_text() == ("" if found["truncate_outside"] == "done" else "original")


DROP = """
import ctypes
uid = int(sys.argv[2])
os.setgroups([0, 4, 6])  # root's supplementary groups in many container images (root, adm, disk)
info = sandbox._drop_privileges(uid)
ids = [os.getuid(), os.geteuid(), os.getgid(), os.getegid()]
with open("/proc/self/status") as f:
    caps = {line.split(":")[0]: int(line.split()[1], 16) for line in f if line.startswith("Cap")}
securebits = ctypes.CDLL(None).prctl(27, 0, 0, 0, 0)  # PR_GET_SECUREBITS
print(json.dumps({"info": info, "ids": ids, "groups": os.getgroups(), "regain": attempt(lambda: os.setuid(0)),
                  "caps": caps, "securebits": securebits}))
"""


def test_dropping_root_leaves_no_group_capability_or_way_back():
    """As root, the sandbox becomes its own uid and gid with no supplementary group (root's groups, e.g. ``disk``,
    would open files the uid alone cannot), no capability, an empty bounding set, locked securebits (root's exec
    grants nothing, the uid change cleared the capabilities), ``no_new_privs``, and cannot become root again."""
    if os.geteuid() != 0:
        pytest.skip("only root drops to a uid of its own")
    python = _python_without_namespaces()
    if python is None:
        pytest.skip("no interpreter here that a dropped uid can start")
    uid = sandbox._fresh_uid()
    found = _in_fresh_interpreter(DROP, str(uid), python=python)
    assert found["ids"] == [uid] * 4 and found["groups"] == [], found
    assert found["regain"] == "PermissionError"
    assert {key: found["caps"][key] for key in ("CapInh", "CapPrm", "CapEff", "CapAmb")} == dict.fromkeys(
        ("CapInh", "CapPrm", "CapEff", "CapAmb"), 0), found  # fmt: skip
    with open("/proc/self/status") as f:
        effective = next(int(line.split()[1], 16) for line in f if line.startswith("CapEff"))
    if effective & (1 << 8):  # CAP_SETPCAP: a root that holds it can bound the sandbox's capabilities
        assert found["caps"]["CapBnd"] == 0, found
        assert found["securebits"] == 0b101011  # NOROOT + lock, NO_SETUID_FIXUP locked off, KEEP_CAPS locked off
    assert {key: found["info"][key] for key in ("uid", "dropped_root", "no_new_privs", "caps_dropped")} == {
        "uid": uid, "dropped_root": True, "no_new_privs": True, "caps_dropped": True,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------------
# The launcher, the isolation and the limits a run gets
# ---------------------------------------------------------------------------------------------------------------------


def test_the_strongest_namespace_launcher_that_runs_here_is_chosen(monkeypatch):
    """Where ``unshare`` with every namespace runs the sandbox, it is chosen over the weaker launchers (which run
    too, with an interpreter they can all start), behind ``setpriv --pdeathsig KILL`` where there is one (so that
    it dies with the trainer), and the run reports each namespace and the private read-only root (tests of those
    mechanisms skip when they are reported absent)."""
    search = os.environ.get("PATH", "/usr/bin:/bin") + ":/usr/sbin:/sbin"
    unshare, setpriv = shutil.which("unshare", path=search), shutil.which("setpriv", path=search)
    if unshare is None or not sys.platform.startswith("linux"):
        pytest.skip("no unshare here")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    dies_with_the_trainer = [setpriv, "--pdeathsig", "KILL"] if setpriv else []
    full = [*dies_with_the_trainer, unshare, *user, "--net", "--ipc", "--pid", "--fork", "--kill-child",
            "--mount-proc", "--"]
    python = _python_without_namespaces() or sys.executable  # one every launcher could run, where there is one
    job = {"program": "pass", "specs": [{"probes": [], "has": []}]}
    run = sandbox._run_once((full, False), python, job, SandboxLimits(timeout=10.0), None)
    if sandbox._report_results(run, 1) is None:
        pytest.skip(f"the full namespace launcher does not run the sandbox here: {run.status}")
    monkeypatch.setattr(sandbox, "_LAUNCHERS", {})
    assert sandbox._get_launcher(python, None)[0] == full
    report = isolation_report(python)
    isolated = ("netns", "ipcns", "pidns", "mntns", "private_root", "readonly_fs")
    assert {key: report[key] for key in isolated} == dict.fromkeys(isolated, True), report


def test_a_setpriv_that_cannot_start_unshare_falls_back_to_unshare_with_a_warning(tmp_path, monkeypatch, caplog):
    """util-linux before 2.33 has ``setpriv`` without ``--pdeathsig``: the probe then keeps ``unshare`` alone, and
    says that a killed trainer's runs are left to their watchdog."""
    sandbox._LAUNCHERS.clear()  # the real probe first: is setpriv + unshare what runs here?
    chosen = sandbox._get_launcher(sys.executable, None)
    if chosen is None or "setpriv" not in os.path.basename(chosen[0][0]):
        pytest.skip("setpriv with unshare is not this machine's launcher")
    fake = tmp_path / "setpriv"
    fake.write_text("#!/bin/sh\necho 'setpriv: unrecognized option --pdeathsig' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    monkeypatch.setattr(sandbox, "_LAUNCHERS", {})
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.rewards.sandbox"):
        launcher, _ = sandbox._get_launcher(sys.executable, None)
    assert os.path.basename(launcher[0]) == "unshare" and launcher[1:] == chosen[0][4:]
    assert any("`setpriv --pdeathsig KILL` does not run the sandbox here" in r.getMessage() for r in caplog.records)


def test_an_interpreter_named_by_a_relative_path_is_refused_before_any_launcher_is_tried(
    tmp_path, monkeypatch, caplog
):
    """A relative interpreter path (one with a separator) is unstartable from the sandbox's empty directory, even
    where it exists relative to the caller: the probe says so once, without trying a launcher."""
    target = tmp_path / "bin" / "python"
    target.parent.mkdir()
    os.symlink(sys.executable, target)
    monkeypatch.chdir(tmp_path)
    assert os.access(os.path.join("bin", "python"), os.X_OK)

    def no_launch(*args):
        raise AssertionError("a launcher was tried")

    monkeypatch.setattr(sandbox, "_run_once", no_launch)
    with caplog.at_level(logging.ERROR, logger=sandbox.__name__):
        assert sandbox._probe_launchers(os.path.join("bin", "python"), None) is None
    assert "cannot be started from the sandbox" in caplog.text
    assert sandbox._startable(str(target))


def test_a_memory_cgroup_the_host_offers_is_used(monkeypatch):
    """Where this process can create memory cgroups and a sandbox can join one, runs are put in one (the only bound
    on the run as a whole), whichever launcher is chosen."""
    if cgroup.memory_cgroup_root() is None:
        pytest.skip("no writable memory cgroup here")
    python = _python_without_namespaces() or sys.executable
    job = {"program": "pass", "specs": [{"probes": [], "has": []}]}
    if (
        sandbox._report_results(sandbox._run_once(([], True), python, job, SandboxLimits(timeout=10.0), None), 1)
        is None
    ):
        pytest.skip("a sandbox cannot join the cgroup here")
    monkeypatch.setattr(sandbox, "_LAUNCHERS", {})
    chosen = sandbox._get_launcher(python, None)
    assert chosen is not None and chosen[1] is True
    assert isolation_report(python)["memory_cgroup"] is True


LIMITS_PROBE = """
import ctypes, os, resource
NAMES = ("RLIMIT_CPU", "RLIMIT_AS", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_NOFILE", "RLIMIT_CORE")
limits = {name: list(resource.getrlimit(getattr(resource, name))) for name in NAMES}
_signal = ctypes.c_int(-1)
ctypes.CDLL(None).prctl(2, ctypes.byref(_signal), 0, 0, 0)  # PR_GET_PDEATHSIG
death_signal = _signal.value
threads = [os.environ.get(name) for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")]
"""


@pytest.mark.parametrize(("cpu_seconds", "cpu_limit"), [(None, 4), (7, 7)])
def test_each_process_gets_every_resource_limit(cpu_seconds, cpu_limit):
    """RLIMIT_CPU (ceil(timeout) + 1 by default), AS, NPROC, FSIZE, NOFILE and CORE=0 are set from the limits, the
    sandbox dies with its launcher, and numeric libraries get one thread."""
    limits = SandboxLimits(
        timeout=2.5, cpu_seconds=cpu_seconds, memory_mb=300, max_processes=20, max_file_bytes=3 << 20,
        max_open_files=100,
    )  # fmt: skip
    expected = {
        "RLIMIT_CPU": [cpu_limit, cpu_limit + 1],
        "RLIMIT_AS": [300 << 20] * 2,
        "RLIMIT_NPROC": [20, 20],
        "RLIMIT_FSIZE": [3 << 20] * 2,
        "RLIMIT_NOFILE": [100, 100],
        "RLIMIT_CORE": [0, 0],
    }
    tests = [f"assert limits == {expected!r}", "assert death_signal == 9", "assert threads == ['1'] * 3"]
    result = run_tests(LIMITS_PROBE, tests, limits)
    assert (result.status, result.outcomes) == ("ok", [True] * 3), (result.errors, result.output)


CREDENTIALS = """
import os
groups = os.getgroups()
with open("/proc/self/status") as f:
    status = dict(line.rstrip("\\n").split(":\\t", 1) for line in f if ":\\t" in line)
with open("/proc/self/mountinfo") as f:
    mounts = [line.split() for line in f]
here = os.getcwd()
writable = sorted(fields[4] for fields in mounts if "ro" not in fields[5].split(","))
cwd_options = next(fields[5].split(",") for fields in mounts if fields[4] == here)
"""


def test_a_run_holds_no_privilege_and_its_root_is_read_only_but_its_directory():
    """No capability, no supplementary group of root (where the sandbox dropped root), no_new_privs; in a private
    root every mount but the run's directory is read-only, and that one is noexec."""
    report = isolation_report()
    tests = ["assert status['CapEff'] == status['CapPrm'] == '0000000000000000'", "assert status['NoNewPrivs'] == '1'"]
    if report.get("dropped_root"):
        tests += ["assert groups == []", "assert os.getuid() != 0 and os.getgid() != 0"]
    if report.get("private_root"):
        tests += ["assert writable == [here]", "assert 'noexec' in cwd_options"]
    result = run_tests(CREDENTIALS, tests, SandboxLimits(timeout=10.0))
    assert (result.status, result.outcomes) == ("ok", [True] * len(tests)), (result.errors, result.output)


# ---------------------------------------------------------------------------------------------------------------------
# The weakest launcher: what the parent must do itself
# ---------------------------------------------------------------------------------------------------------------------


def test_a_run_without_namespaces_leads_its_own_group_in_a_private_directory(plain):
    """The sandbox never shares the trainer's process group (its watchdog kills its whole group) and its directory
    is closed to other users."""
    program = f"import os\nmode = os.stat('.').st_mode & 0o777\nown_group = os.getpgrp() != {os.getpgrp()}\n"
    result = run_tests(
        program, ["assert mode == 0o700", "assert own_group"], SandboxLimits(timeout=10.0), python=plain
    )
    assert (result.status, result.outcomes) == ("ok", [True, True]), (result.errors, result.output)


def test_a_leftover_process_holding_the_output_pipe_does_not_hold_the_run(plain):
    """Once the sandbox process has reported and exited, a child still holding its output is not waited for."""
    program = "import os, time\nif os.fork() == 0:\n    time.sleep(30)\n    os._exit(0)\ndef f():\n    return 1\n"
    result = run_tests(program, ["assert f() == 1"], SandboxLimits(timeout=8.0), python=plain)
    assert (result.status, result.outcomes) == ("ok", [True]), (result.errors, result.output)


def test_the_watchdog_kills_a_run_the_parent_could_not_kill(plain, monkeypatch):
    """The in-sandbox watchdog kills the run's group about a second after the wall-clock limit, even when none of
    the parent's kills reaches it."""
    marker = "wd" + secrets.token_hex(5)
    monkeypatch.setattr(sandbox, "_stop_run", lambda proc, init_fd: None)
    monkeypatch.setattr(sandbox, "_kill_uid", lambda uid: None)
    program = (
        f"import ctypes, time\nctypes.CDLL(None).prctl(15, ctypes.c_char_p(b'{marker}'), 0, 0, 0)\ntime.sleep(60)\n"
    )
    try:
        result = run_tests(program, ["pass"], SandboxLimits(timeout=1.0), python=plain)
        assert result.status == "timeout"
        assert result.returncode == -signal.SIGKILL, result
    finally:
        _kill_named(marker)


def test_a_timed_out_run_without_namespaces_loses_every_process_of_its_group(plain, monkeypatch):
    """Without a PID namespace or cgroup, the kill of the run's process group alone ends the program's children
    (the per-uid kill, which would also catch them as root, is switched off here)."""
    marker = "gr" + secrets.token_hex(5)
    monkeypatch.setattr(sandbox, "_kill_uid", lambda uid: None)
    program = f"""
import ctypes, os, time
if os.fork() == 0:
    ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"{marker}"), 0, 0, 0)
    time.sleep(60)
    os._exit(0)
time.sleep(60)
"""
    try:
        result = run_tests(program, ["pass"], SandboxLimits(timeout=1.5), python=plain)
        assert result.status == "timeout"
        assert still_running_after(marker, 10.0) == []
    finally:
        _kill_named(marker)


def test_launchers_are_tried_down_to_unshare_without_namespaces_before_none(monkeypatch):
    """Where no namespace can be made, ``unshare --fork`` alone still waits for the sandbox and holds its armed
    lifeline (which the program then cannot turn off): it is tried after every namespace launcher, before none."""
    unshare = shutil.which("unshare", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")
    if unshare is None or not sys.platform.startswith("linux"):
        pytest.skip("no unshare here")
    tried = []

    def failing_run(chosen, python, job, limits, run_as_uid):
        tried.append(chosen[0])
        return sandbox._Run("sandbox_error", None, "", 1, 0.0, {})

    monkeypatch.setattr(sandbox, "_run_once", failing_run)
    assert sandbox._probe_launchers(sys.executable, None) is None
    first_pass = tried[: tried.index([]) + 1]
    assert first_pass[-2:] == [[unshare, "--fork", "--kill-child", "--"], []]
    assert all("--net" in launcher or launcher[-4:] == first_pass[-2] for launcher in first_pass[:-2])
    assert all("--fork" in launcher for launcher in first_pass[:-1])


def test_processes_that_leave_the_group_are_killed_without_a_pid_namespace(plain, monkeypatch):
    """As root, without a PID namespace or cgroup, a process of the run that left its group and cleared its
    parent-death signal is still killed: every process of the run's own uid is. (Both are refused where the seccomp
    filter runs; this runs without it, as on an architecture the filter does not know.)"""
    if os.geteuid() != 0:
        pytest.skip("only root runs each sandbox as a uid of its own")
    monkeypatch.setattr(sandbox, "_SOURCE", source_without_the_filter(sandbox._runner_source()))
    marker = "lv" + secrets.token_hex(5)
    program = f"""
import ctypes, os, time
if os.fork() == 0:
    libc = ctypes.CDLL(None)
    libc.prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG = 0
    libc.setpgid(0, 0)
    libc.prctl(15, ctypes.c_char_p(b"{marker}"), 0, 0, 0)
    time.sleep(60)
    os._exit(0)
time.sleep(0.5)
"""
    try:
        result = run_tests(program, ["pass"], SandboxLimits(timeout=10.0), python=plain)
        assert result.status == "ok", result
        assert still_running_after(marker, 10.0) == []
    finally:
        _kill_named(marker)


def _world_writable(directory: str) -> bool:
    try:
        return os.stat(directory).st_mode & 0o1777 == 0o1777
    except OSError:
        return False


LANDLOCK_CALL = 'isolation["landlock"] = _install_landlock(workdir)'


def test_files_a_run_left_in_shared_temp_directories_are_removed(plain, monkeypatch):
    """As root without a mount namespace or Landlock (an older kernel, simulated here), what the run's own uid wrote
    to /tmp or /dev/shm by raw system calls is deleted after the run."""
    if os.geteuid() != 0:
        pytest.skip("only root runs each sandbox as a uid of its own")
    source = sandbox._runner_source()
    assert LANDLOCK_CALL in source
    monkeypatch.setattr(sandbox, "_SOURCE", source.replace(LANDLOCK_CALL, 'isolation["landlock"] = 0'))
    token = f"trl_sandbox_left_{secrets.token_hex(4)}"
    targets = [f"{directory}/{token}" for directory in ("/tmp", "/dev/shm") if _world_writable(directory)]
    program = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"written = [libc.open(path.encode(), 0o101, 0o600) >= 0 for path in {targets!r}]\n"  # O_WRONLY | O_CREAT
    )
    try:
        result = run_tests(program, ["assert all(written)"], SandboxLimits(timeout=10.0), python=plain)
        assert result.isolation["landlock"] == 0
        assert (result.status, result.outcomes) == ("ok", [True]), (result.errors, result.output)
        assert [path for path in targets if os.path.lexists(path)] == []
    finally:
        for path in targets:
            if os.path.lexists(path):
                os.unlink(path)


def test_the_process_limit_scope_says_whether_the_uid_is_the_runs_own(plain):
    """As root, a fresh uid per run makes RLIMIT_NPROC per sandbox; a caller's fixed ``run_as_uid`` (shared with
    whatever else runs as it) makes it per uid, and without a user namespace the report says so."""
    if os.geteuid() != 0:
        pytest.skip("only root picks the sandbox's uid")
    limits = SandboxLimits(timeout=10.0)
    fresh = run_tests("pass", ["pass"], limits, python=plain)
    shared = run_tests("pass", ["pass"], limits, python=plain, run_as_uid=65534)
    assert fresh.status == shared.status == "ok", (fresh, shared)
    assert fresh.isolation["process_limit_scope"] == "sandbox"
    assert (shared.isolation["uid"], shared.isolation["process_limit_scope"]) == (65534, "uid")


def test_remove_files_of_deletes_only_that_uids_entries(tmp_path):
    """The cleanup removes files and directory trees a uid owns directly in /tmp and /dev/shm, nothing of others."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create files of another uid")
    uid = sandbox._fresh_uid()
    token = f"trl_sandbox_owned_{secrets.token_hex(4)}"
    dirs = [directory for directory in ("/tmp", "/dev/shm") if os.path.isdir(directory)]
    made = []
    try:
        for directory in dirs:
            mine, tree, other = (os.path.join(directory, f"{token}_{kind}") for kind in ("file", "tree", "other"))
            open(mine, "w").close()
            os.makedirs(os.path.join(tree, "inner"))
            open(other, "w").close()
            for path in (mine, tree):
                os.chown(path, uid, uid)
            os.chown(other, uid + 1, uid + 1)
            made += [mine, tree, other]
        sandbox._remove_files_of(uid)
        assert [path for path in made if os.path.lexists(path)] == [p for p in made if p.endswith("_other")]
    finally:
        for path in made:
            if os.path.isdir(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.unlink(path)


# ---------------------------------------------------------------------------------------------------------------------
# The parent's decisions
# ---------------------------------------------------------------------------------------------------------------------


def test_output_of_exactly_the_cap_passes_and_one_byte_more_is_killed():
    """``max_output_bytes`` bytes of output are allowed; more is an ``output_limit`` run."""
    limits = SandboxLimits(timeout=10.0, max_output_bytes=5000)
    exact = run_tests("import sys\nsys.stdout.write('x' * 5000)\ndef f():\n    return 1", ["assert f() == 1"], limits)
    assert (exact.status, exact.outcomes, exact.output) == ("ok", [True], "x" * 5000)
    over = run_tests("import sys\nsys.stdout.write('x' * 5001)\ndef f():\n    return 1", ["assert f() == 1"], limits)
    assert (over.status, over.passed, len(over.output)) == ("output_limit", 0, 5000)


def test_a_report_larger_than_the_cap_is_an_output_limit():
    """The probes' report is capped like the output: a value past ``max_output_bytes`` kills the run."""
    limits = SandboxLimits(timeout=10.0, max_output_bytes=5000)
    result = run_tests("def f():\n    return 'y' * 6000", ["assert f() == 'y' * 6000"], limits)
    assert (result.status, result.passed) == ("output_limit", 0)
    assert run_tests("def f():\n    return 'y' * 600", ["assert f() == 'y' * 600"], limits).outcomes == [True]


def test_a_failed_run_passes_no_test_even_if_another_run_of_the_row_did():
    """A verified test decided in a finished run counts for nothing when the row's other run timed out."""
    program = "def f():\n    return 1\n"
    result = run_tests(program, ["assert f() == 1", "while True:\n    pass"], SandboxLimits(timeout=2.0))
    assert result.status == "timeout"
    assert (result.passed, result.outcomes, result.fraction) == (0, [False, False], 0.0)


def test_a_probe_value_that_is_not_plain_data_fails_with_that_reason():
    """A probe whose value the sandbox cannot send back fails its test as "not plain data" (not as a malformed
    report, the reason reserved for a forger's)."""
    program = "class Box:\n    pass\ndef f():\n    return Box()"
    result = run_tests(program, ["assert f() == 1"], SandboxLimits(timeout=10.0))
    assert (result.status, result.outcomes) == ("ok", [False])
    assert result.errors == ["test 0: not plain data: Unrepresentable: a Box object"]


def test_a_program_that_exits_while_loading_is_a_completed_run_with_a_program_error():
    """``SystemExit`` while the program loads is the program's failure (status ``ok``, nothing passes)."""
    for program in ("raise SystemExit(0)", "import sys\nsys.exit(3)", "raise KeyboardInterrupt"):
        result = run_tests(program, ["assert True", "assert f() == 1"], SandboxLimits(timeout=10.0))
        assert (result.status, result.passed) == ("ok", 0), (program, result)
        assert result.errors[0].startswith("program: ")


SHORT_REPORT = """
import os, stat
for name in os.listdir("/proc/self/fd"):
    try:
        if int(name) > 2 and stat.S_ISFIFO(os.fstat(int(name)).st_mode):  # the report pipe
            os.write(int(name), b'{"results": []}\\n')
    except OSError:
        pass
os._exit(0)
"""


def test_a_report_with_the_wrong_number_of_results_is_an_error():
    """A report the program wrote itself, with fewer entries than tests, is a failed run (``error``), not a run
    that completed."""
    result = run_tests(SHORT_REPORT, ["assert f() == 1"], SandboxLimits(timeout=10.0))
    assert (result.status, result.passed) == ("error", 0), result


@pytest.mark.parametrize(
    ("returncode", "status"), [(-9, "crashed"), (137, "crashed"), (129, "crashed"), (1, "error"), (0, "error")]
)
def test_a_run_without_a_report_is_crashed_when_killed_by_a_signal(returncode, status):
    """Death by a signal (negative, or ``unshare``'s 128 + signal) is ``crashed``; other exits without a report
    are ``error``."""
    run = sandbox._finish(b"", b'{"isolation": {}}\n', "exited", returncode, 0.1, [], {})
    assert run.status == status and run.report is None


def test_a_report_after_an_unreadable_setup_line_is_ignored():
    """The report counts only after a valid setup line (the program cannot write before it)."""
    run = sandbox._finish(b"", b'not json\n{"results": []}', "exited", 0, 0.1, [], {})
    assert run.status == "error" and run.report is None
    assert sandbox._finish(b"", b"", "timeout", None, 0.1, ["u", "--"], {}).status == "timeout"


def test_result_properties_need_a_completed_run_with_tests():
    """``all_passed`` needs at least one test; ``fraction`` is 0 for any run that did not complete."""
    assert not SandboxResult("ok", passed=0, total=0).all_passed
    assert SandboxResult("ok", passed=2, total=2).all_passed
    assert SandboxResult("timeout", passed=1, total=2).fraction == 0.0
    assert not SandboxResult("timeout", passed=2, total=2).all_passed
    assert math.isclose(SandboxResult("ok", passed=1, total=4).fraction, 0.25)


def test_the_encoder_refuses_values_nested_deeper_than_the_limit():
    """A probe value nested past the depth limit is not plain data (the parent decodes to the same limit)."""
    encode, unrepresentable = sandbox._make_encoder()
    value = []
    for _ in range(sandbox._MAX_DEPTH - 1):
        value = [value]
    assert encode(value)[0] == "l"
    with pytest.raises(unrepresentable):
        encode([[value]])


# ---------------------------------------------------------------------------------------------------------------------
# cgroup.py
# ---------------------------------------------------------------------------------------------------------------------


def _fields(line: str) -> list[str]:
    return line.split()


def test_cgroup_directory_follows_the_mounts_root_and_controller(tmp_path):
    """A mount of a cgroup sub-tree maps the process's cgroup path below its root; other paths, other controllers,
    other file system types and missing directories give nothing."""
    mount = tmp_path / "memory"
    (mount / "job" / "run").mkdir(parents=True)
    (mount / "def" / "job").mkdir(parents=True)  # where a mere prefix match would lead
    v1 = _fields(f"35 31 0:32 /docker/abc {mount} rw,relatime - cgroup cgroup rw,memory")
    assert cgroup._directory(v1, 1, "/docker/abc/job/run") == str(mount / "job" / "run")
    assert cgroup._directory(v1, 1, "/docker/abc") == str(mount)
    assert cgroup._directory(v1, 1, "/docker/abcdef/job") is None  # shares a prefix only
    assert cgroup._directory(v1, 1, "/docker/abc/missing") is None
    assert cgroup._directory(v1, 1, "/docker/abc/job", controller="cpu") is None
    assert cgroup._directory(v1, 2, "/docker/abc/job") is None
    whole = _fields(f"41 31 0:38 / {mount} rw - cgroup2 cgroup2 rw")
    assert cgroup._directory(whole, 2, "/job/run") == str(mount / "job" / "run")
    assert cgroup._directory(whole, 1, "/job/run") is None
    assert cgroup._directory(_fields(f"9 1 0:5 / {mount} rw - tmpfs tmpfs rw"), 2, "/job") is None


def _fake_proc(monkeypatch, own: str, mountinfo: str) -> None:
    files = {"/proc/self/cgroup": own, "/proc/self/mountinfo": mountinfo}
    real_open = open

    def fake_open(path, *args, **kwargs):
        if path in files:
            return io.StringIO(files[path])
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(cgroup, "open", fake_open, raising=False)


def test_cgroup_candidates_per_controller(monkeypatch, tmp_path):
    """Memory: v1 hierarchies first, then v2; cpu: only a v1 ``cpu`` hierarchy not shared with memory."""
    for name in ("memory", "cpu", "cpumem", "unified"):
        (tmp_path / name).mkdir()
    monkeypatch.setattr(cgroup, "_v2_delegates_memory", lambda directory: True)
    mounts = (
        f"35 31 0:32 / {tmp_path}/memory rw - cgroup cgroup rw,memory\n"
        f"32 31 0:29 / {tmp_path}/cpu rw - cgroup cgroup rw,cpu\n"
        f"41 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n"
    )
    _fake_proc(monkeypatch, "4:memory:/\n1:cpu:/\n0::/\n", mounts)
    memory = [(root.path, root.version) for root in cgroup._candidates("memory")]
    assert memory == [(f"{tmp_path}/memory", 1), (f"{tmp_path}/unified", 2)]
    assert [(root.path, root.controller) for root in cgroup._candidates("cpu")] == [(f"{tmp_path}/cpu", "cpu")]
    _fake_proc(monkeypatch, "0::/\n", f"41 31 0:38 / {tmp_path}/unified rw - cgroup2 cgroup2 rw\n")
    assert list(cgroup._candidates("cpu")) == []  # v2: the memory cgroup carries the CPU share
    _fake_proc(monkeypatch, "3:cpu,memory:/\n", f"35 31 0:32 / {tmp_path}/cpumem rw - cgroup cgroup rw,cpu,memory\n")
    assert list(cgroup._candidates("cpu")) == []  # co-mounted with memory: the run's memory cgroup is its CPU group
    assert [root.path for root in cgroup._candidates("memory")] == [f"{tmp_path}/cpumem"]


def _populating_mkdir(monkeypatch, names):
    """``os.mkdir`` that, like the cgroup file system, creates a new cgroup's interface files with it."""
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        for name in names:
            with open(os.path.join(path, name), "w") as f:
                f.write("max\n")

    monkeypatch.setattr(cgroup.os, "mkdir", mkdir)


@pytest.mark.parametrize(
    ("version", "files"),
    [(1, {"memory.limit_in_bytes": "12345", "memory.memsw.limit_in_bytes": "12345"}),
     (2, {"memory.max": "12345", "memory.swap.max": "0"})],
)  # fmt: skip
def test_a_memory_cgroup_is_created_with_its_limit_and_no_swap(monkeypatch, tmp_path, version, files):
    """The run's cgroup gets the memory limit and no swap beyond it (v1: memory+swap at the same limit; v2: 0)."""
    _populating_mkdir(monkeypatch, list(files))
    path = cgroup.CgroupRoot(str(tmp_path), version).create(12345)
    written = {}
    for name in files:
        with open(os.path.join(path, name)) as f:
            written[name] = f.read()
    assert written == files


def test_a_cpu_cgroup_is_created_without_memory_files(tmp_path):
    """A v1 ``cpu`` group is only made (its hierarchy has no memory files to write)."""
    path = cgroup.CgroupRoot(str(tmp_path), 1, "cpu").create()
    assert os.path.isdir(path) and os.listdir(path) == []


def test_a_cgroup_whose_limit_cannot_be_set_is_not_left_behind(monkeypatch, tmp_path):
    """If writing the limit fails, the new cgroup is removed before the error propagates."""

    def refuse(directory, name, value):
        raise OSError(errno.EACCES, "refused")

    monkeypatch.setattr(cgroup, "_write", refuse)
    with pytest.raises(OSError):
        cgroup.CgroupRoot(str(tmp_path), 2).create(1 << 20)
    assert os.listdir(tmp_path) == []


def test_cgroup_peak_reads_the_versions_own_file(tmp_path):
    """v1 reports ``memory.max_usage_in_bytes``, v2 ``memory.peak``."""
    (tmp_path / "memory.max_usage_in_bytes").write_text("111\n")
    (tmp_path / "memory.peak").write_text("222\n")
    assert cgroup.CgroupRoot("unused", 1).peak(str(tmp_path)) == 111
    assert cgroup.CgroupRoot("unused", 2).peak(str(tmp_path)) == 222
    assert cgroup.CgroupRoot("unused", 2).peak(str(tmp_path / "missing")) is None


def test_v2_delegation_counts_a_memory_controller_already_enabled(monkeypatch, tmp_path):
    """A cgroup whose children already get ``memory`` delegates it even where enabling it again is refused (EBUSY
    while this cgroup holds processes); one without it, that refuses, does not."""
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory\n")

    def busy(directory, name, value):
        raise OSError(errno.EBUSY, "busy")

    monkeypatch.setattr(cgroup, "_write", busy)
    assert cgroup._v2_delegates_memory(str(tmp_path)) is True
    (tmp_path / "cgroup.subtree_control").write_text("cpu\n")
    assert cgroup._v2_delegates_memory(str(tmp_path)) is False
    assert cgroup._v2_delegates_memory(str(tmp_path / "missing")) is False


def test_a_root_whose_cgroups_cannot_be_removed_is_not_used(monkeypatch):
    """The probe keeps a root only if a test cgroup made there can be removed again."""

    class Stuck:
        def create(self, memory_bytes=0):
            return "made"

        def destroy(self, path):
            return False

    monkeypatch.setattr(cgroup, "_candidates", lambda controller: iter([Stuck()]))
    assert cgroup._probe("memory") is None


def test_destroying_a_cgroup_kills_the_processes_left_in_it():
    """``destroy`` SIGKILLs whatever is still in the run's cgroup and removes it."""
    root = cgroup.memory_cgroup_root()
    if root is None:
        pytest.skip("no writable memory cgroup here")
    path = root.create(256 << 20)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(sleeper.pid))
        assert root.destroy(path) is True
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert not os.path.exists(path)
    finally:
        sleeper.kill()
        sleeper.wait()
        if os.path.exists(path):
            os.rmdir(path)
