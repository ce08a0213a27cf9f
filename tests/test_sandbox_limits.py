"""Limits that must hold for the sandbox as a whole, not per process: memory across forked children, memory that
no per-process limit counts (memfd, shared memory, tmpfs files), and host sockets.

Each test skips where the machine lacks the mechanism it relies on (``isolation_report()`` says which are active;
``docs/rewards.md`` states the bound that holds instead). Limits are kept small (64-128 MiB) so the tests are cheap.
"""

import os
import secrets
import shutil
import socket
import tempfile

import pytest
from processes import REWARDS_WITHOUT_MODELS

from trl_diffusion.rewards.sandbox import SandboxLimits, isolation_report, run_tests


@pytest.fixture(scope="module")
def isolation():
    report = isolation_report()
    assert report["status"] == "ok", report
    return report


def _needs(isolation, *keys):
    missing = [k for k in keys if not isolation.get(k)]
    if missing:
        pytest.skip(f"not available on this machine: {missing} (see docs/rewards.md for the bound that holds)")


FORKED_HOLDERS = """
import os, select, time
r, w = os.pipe()
kids = []
for i in range({n}):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        block = b"\\x01" * ({mb} << 20)  # written, so every page is resident
        os.write(w, bytes([i]))
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
os.close(w)
reported, dead = set(), set()

def reap():
    for i, pid in enumerate(kids):
        if i not in dead and os.waitpid(pid, os.WNOHANG) != (0, 0):
            dead.add(i)

deadline = time.monotonic() + 5
while len(reported | dead) < {n} and time.monotonic() < deadline:  # each child holds its block or was killed
    if select.select([r], [], [], 0.05)[0]:
        reported.update(os.read(r, 64))
    reap()
time.sleep(0.3)
reap()
held = len(reported - dead)  # children holding their block at the same time
print("held", held, "of", {n})
for pid in kids:
    try:
        os.kill(pid, 9)
    except OSError:
        pass
"""


def test_forked_children_together_cannot_exceed_the_memory_limit(isolation):
    """Five children of 40 MiB each under memory_mb=128: RLIMIT_AS allows each one, the cgroup not all five."""
    _needs(isolation, "memory_cgroup")
    limits = SandboxLimits(timeout=8.0, memory_mb=128, max_processes=16)
    result = run_tests(FORKED_HOLDERS.format(n=5, mb=40), ["assert held * 40 < 128"], limits)
    assert (result.status, result.outcomes) == ("ok", [True]), (result.errors, result.output)
    assert result.isolation["memory_peak_bytes"] <= 128 << 20
    # Control: the same program within the limit keeps all five (so the children did not fail for another reason).
    result = run_tests(FORKED_HOLDERS.format(n=5, mb=8), ["assert held == 5"], limits)
    assert (result.status, result.outcomes) == ("ok", [True]), (result.errors, result.output)


FILL = """
import ctypes, os, select, time
libc = ctypes.CDLL(None, use_errno=True)

def fill(make):
    '''Make 8 MiB objects with ``make`` in a child until it is refused or killed; return MiB held at most.'''
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        keep = []
        try:
            for _ in range(32):
                keep.append(make())
                os.write(w, b"8")
        except OSError:
            pass
        os._exit(0)
    os.close(w)
    total = 0
    while True:
        data = os.read(r, 64)
        if not data:
            break
        total += 8 * len(data)
    os.waitpid(pid, 0)
    return total

def memfd_python():
    fd = os.memfd_create("x")
    os.write(fd, b"x" * (8 << 20))
    return fd

def memfd_raw():
    fd = libc.memfd_create(b"x", 0)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "memfd_create")
    os.write(fd, b"x" * (8 << 20))
    return fd

def sysv_shm():
    shmid = libc.shmget({key}, 8 << 20, 0o1600)  # IPC_CREAT | 0600, left behind on purpose
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    libc.shmat.restype = ctypes.c_void_p
    addr = libc.shmat(shmid, None, 0)
    ctypes.memset(addr, 1, 8 << 20)
    return shmid

def tmpfs_file(counter=[0]):
    counter[0] += 1
    path = "/dev/shm/{token}" if {use_dev_shm} else f"f{{counter[0]}}"
    fd = libc.open(f"{{path}}_{{counter[0]}}".encode(), 0o102, 0o600)  # O_RDWR | O_CREAT, bypassing the guards
    if fd < 0:
        raise OSError(ctypes.get_errno(), "open")
    os.write(fd, b"x" * (8 << 20))
    return fd

held = {{name: fill(fn) for name, fn in [("memfd", memfd_python), ("memfd_raw", memfd_raw), ("sysv", sysv_shm),
                                         ("dev_shm", tmpfs_file)]}}
print("held MiB", held)
"""


def _sysv_keys():
    with open("/proc/sysvipc/shm") as f:
        return {int(line.split()[0]) for line in list(f)[1:]}


def test_memfd_and_shared_memory_are_bounded(isolation):
    """memfd, SysV shared memory and /dev/shm files (each 8 MiB, up to 256 MiB) are refused or stay within the
    sandbox's memory, and nothing survives the run on the host."""
    cgroup = isolation.get("memory_cgroup")
    if not (isolation.get("seccomp") or cgroup) or not (isolation.get("private_root") or isolation.get("landlock")):
        pytest.skip("no kernel mechanism bounds this here (see docs/rewards.md for the bound that holds)")
    key, token = secrets.randbelow(1 << 30) + 1, f"trl_sandbox_test_{secrets.token_hex(4)}"
    limits = SandboxLimits(timeout=15.0, memory_mb=128, max_file_bytes=16 << 20, max_disk_bytes=512 << 20)
    program = FILL.format(key=key, token=token, use_dev_shm=True)
    tests = [f"assert held[{kind!r}] <= 128" for kind in ("memfd", "memfd_raw", "sysv", "dev_shm")]
    result = run_tests(program, tests, limits)
    assert (result.status, result.outcomes) == ("ok", [True] * 4), (result.errors, result.output)
    if isolation.get("seccomp"):  # refused outright
        assert "'memfd': 0, 'memfd_raw': 0, 'sysv': 0" in result.output, result.output
    if not isolation.get("private_root") and isolation.get("landlock"):  # no writes to the host's /dev/shm
        assert "'dev_shm': 0" in result.output, result.output
    # with a private root /dev/shm is the run's own directory: bounded above, removed with it
    assert key not in _sysv_keys()
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(token)]


def test_files_in_the_sandbox_directory_count_against_its_memory(isolation):
    """A 512 MiB working tmpfs under memory_mb=128: the cgroup, not the tmpfs size, is the bound."""
    _needs(isolation, "memory_cgroup", "private_root")
    key, token = secrets.randbelow(1 << 30) + 1, "unused"
    limits = SandboxLimits(timeout=15.0, memory_mb=128, max_file_bytes=16 << 20, max_disk_bytes=512 << 20)
    program = FILL.format(key=key, token=token, use_dev_shm=False)
    result = run_tests(program, ["assert held['dev_shm'] <= 128"], limits)
    assert (result.status, result.outcomes) == ("ok", [True]), (result.errors, result.output)
    assert result.isolation["memory_peak_bytes"] <= 128 << 20


RAW_ACCESS = """
import ctypes, struct
libc = ctypes.CDLL(None, use_errno=True)

def connect_unix(path):
    fd = libc.socket(1, 1, 0)  # AF_UNIX, SOCK_STREAM: raw calls, bypassing the Python guards
    addr = struct.pack("H108s", 1, path)
    return libc.connect(fd, addr, len(addr))

def connect_tcp(port):
    fd = libc.socket(2, 1, 0)
    addr = struct.pack("=H", 2) + struct.pack("!H4s8x", port, bytes([127, 0, 0, 1]))
    return libc.connect(fd, addr, len(addr))

by_path = connect_unix({path!r})
abstract = connect_unix({abstract!r})
tcp = connect_tcp({port})
written = libc.open({target!r}, 0o101, 0o644)  # O_WRONLY | O_CREAT
import os
visible = os.path.exists({directory!r})
"""


@pytest.fixture
def host_endpoints():
    """A socket file and a writable target in a world-writable host directory, an abstract socket, a TCP port."""
    directory = tempfile.mkdtemp(prefix="trl_sandbox_host_")
    os.chmod(directory, 0o777)
    path = os.path.join(directory, "s")
    name = f"\0trl_sandbox_test_{secrets.token_hex(4)}"
    servers = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(2)]
    servers.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
    try:
        servers[0].bind(path)
        os.chmod(path, 0o777)
        servers[1].bind(name)
        servers[2].bind(("127.0.0.1", 0))
        for server in servers:
            server.listen(4)
            server.settimeout(0.3)
        yield {"directory": directory, "path": path, "abstract": name, "port": servers[2].getsockname()[1],
               "target": os.path.join(directory, "written"), "servers": servers}  # fmt: skip
    finally:
        for server in servers:
            server.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_host_sockets_files_and_ports_are_unreachable(isolation, host_endpoints):
    """Raw system calls (no Python guard) cannot reach a host socket file, an abstract socket or a TCP port, nor
    create a file in a world-writable host directory, wherever a kernel mechanism covers that route."""
    e = host_endpoints
    landlock = isolation.get("landlock", 0)
    covered = {
        "by_path": isolation.get("private_root"),
        "abstract": isolation.get("netns") or landlock >= 6,
        "tcp": isolation.get("netns") or landlock >= 4,
        "written": isolation.get("readonly_fs") or landlock >= 1,
        "visible": isolation.get("private_root"),
    }
    if not any(covered.values()):
        pytest.skip("no kernel mechanism covers these routes here (see docs/rewards.md)")
    program = RAW_ACCESS.format(
        path=e["path"].encode(), abstract=e["abstract"].encode(), port=e["port"], target=e["target"].encode(),
        directory=e["directory"],
    )  # fmt: skip
    checks = {"by_path": "assert by_path == -1", "abstract": "assert abstract == -1", "tcp": "assert tcp == -1",
              "written": "assert written == -1", "visible": "assert not visible"}  # fmt: skip
    names = [name for name, ok in covered.items() if ok]
    result = run_tests(program, [checks[name] for name in names], SandboxLimits(timeout=5.0))
    assert (result.status, result.outcomes) == ("ok", [True] * len(names)), (names, result.errors, result.output)
    assert not os.path.exists(e["target"])
    servers = dict(zip(("by_path", "abstract", "tcp"), e["servers"]))
    for name in names:
        if name in servers:
            with pytest.raises(socket.timeout):
                servers[name].accept()[0].close()
    # Control: the same connections from this process reach all three servers.
    for family, target in ((socket.AF_UNIX, e["path"]), (socket.AF_UNIX, e["abstract"]),
                           (socket.AF_INET, ("127.0.0.1", e["port"]))):  # fmt: skip
        client = socket.socket(family, socket.SOCK_STREAM)
        client.connect(target)
        client.close()


def test_private_root_shows_no_host_directories(isolation):
    """Only system and interpreter directories exist; /tmp holds the sandbox's own directory and nothing else but
    the path down to the interpreter when that lives under /tmp (a virtualenv in a checkout there, as in CI)."""
    _needs(isolation, "private_root")
    program = (
        "import os, sys\nroot = sorted(os.listdir('/'))\n"
        "interpreter = [os.path.abspath(p) + '/' for p in (sys.prefix, sys.base_prefix, *sys.path) if p]\n"
        "others = [e for e in os.listdir('/tmp') if e != os.path.basename(os.getcwd())]\n"
        "only_ours = all(any(p.startswith(f'/tmp/{e}/') for p in interpreter) for e in others)\n"
        "home = [p for p in ('/home', '/root/.ssh', '/run', '/var', '/sys') if os.path.exists(p)]\n"
        "shm = os.path.realpath('/dev/shm') == os.getcwd()\n"
    )
    tests = ["assert only_ours", "assert home == []", "assert 'usr' in root and 'proc' in root", "assert shm"]
    result = run_tests(program, tests, SandboxLimits(timeout=5.0))
    assert (result.status, result.outcomes) == ("ok", [True] * 4), (result.errors, result.output)


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"timeout": float("inf")}, "timeout must be finite and > 0"),
        ({"timeout": 0}, "timeout must be finite and > 0"),
        ({"timeout": float("nan")}, "timeout must be finite and > 0"),
        ({"timeout": "3"}, "timeout must be a number"),
        ({"timeout": True}, "timeout must be a number"),
        ({"cpu_seconds": 0}, "cpu_seconds must be an int >= 1"),
        ({"memory_mb": 0}, "memory_mb must be an int >= 1"),
        ({"max_processes": -1}, "max_processes must be an int >= 1"),
        ({"max_output_bytes": 1.5}, "max_output_bytes must be an int >= 1"),
        ({"max_file_bytes": True}, "max_file_bytes must be an int >= 1"),
        ({"max_disk_bytes": 0}, "max_disk_bytes must be an int >= 1"),
        ({"max_open_files": "256"}, "max_open_files must be an int >= 1"),
    ],
)
def test_limits_no_run_could_pass_under_are_refused_when_built(limits, message):
    """Before, memory_mb=0 or max_output_bytes=0 failed every program (reward 0 for all) and timeout=inf raised
    OverflowError inside a run; now the limits are refused when built, naming the field."""
    with pytest.raises(ValueError, match=message):
        SandboxLimits(**limits)


def test_reward_and_eval_settings_reach_the_limit_checks():
    """The code reward and the dLLM-RL code reward build their limits at construction, so a bad setting fails there."""
    from trl_diffusion.rewards import make_code_reward, make_official_code_reward

    with pytest.raises(ValueError, match="timeout must be finite"):
        make_code_reward(timeout=float("inf"))
    with pytest.raises(ValueError, match="memory_mb must be an int >= 1"):
        make_official_code_reward(memory_mb=0)
    assert SandboxLimits(timeout=2, cpu_seconds=3).timeout == 2  # ints are fine for the seconds


@pytest.mark.parametrize("time_limit", [0, -1, float("inf"), "nan", True])
def test_official_code_rows_time_limit_is_checked_before_a_run(time_limit):
    """A dataset row's test_time_limit that no run could use is an error naming the column, not a sandbox error."""
    from trl_diffusion.rewards.dllm_rl_code import run_official

    with pytest.raises(ValueError, match="test_time_limit must be a finite number of seconds > 0"):
        run_official("print(1)", ["assert True"], stdio=False, time_limit=time_limit)


CPU_GROUPS = """
import ctypes, os
def cpu_group():  # the line of /proc/self/cgroup that decides this process's CPU share
    with open("/proc/self/cgroup") as f:
        lines = [line.strip() for line in f]
    return next((l for l in lines if "cpu" in l.split(":")[1].split(",")), lines[-1])
r, w = os.pipe()
for _ in range(3):
    if os.fork() == 0:
        if os.fork() == 0:  # a grandchild too
            os.write(w, (cpu_group() + "\\n").encode())
            os._exit(0)
        os.wait()
        os.write(w, (cpu_group() + "\\n").encode())
        os._exit(0)
for _ in range(3):
    os.wait()
os.close(w)
groups = set(os.read(r, 65536).decode().split()) | {cpu_group()}
try:
    os.setsid()
    session = "new session"
except PermissionError:
    session = "refused"
libc = ctypes.CDLL(None, use_errno=True)
raw_session = "refused" if libc.setsid() == -1 else "new session"
print(sorted(groups), session, raw_session)
"""


def test_a_run_shares_one_cpu_group_and_cannot_start_new_sessions(isolation):
    """A red-team program forked 29 busy processes, each in a new session (a scheduler autogroup of its own), then
    answered correctly just before its deadline: three correct programs scored beside it timed out (0.0). Every
    process of a run is now in the run's CPU group (one share per run: with the kernel's autogroups switched off the
    same attack without setsid also starved them before, and no longer does), and setsid is refused."""
    _needs(isolation, "cpu_cgroup", "seccomp")
    result = run_tests(CPU_GROUPS, ["assert len(groups) == 1 and session == raw_session == 'refused'"],
                       SandboxLimits(timeout=8.0, max_processes=16))
    assert (result.status, result.outcomes) == ("ok", [True]), (result.errors, result.output)
    assert "trl_sandbox_" in result.output, result.output


SUBREAPER_RUNS = REWARDS_WITHOUT_MODELS + r"""
import ctypes, os, sys, time
from trl_diffusion.rewards.sandbox import SandboxLimits, run_tests
assert ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER: orphans come to us
for _ in range(4):
    result = run_tests("while True:\n    pass", ["pass"], SandboxLimits(timeout=1.0, memory_mb=256))
    assert result.status == "timeout", result
time.sleep(1.0)  # anything orphaned has been re-parented by now
zombies = []
for entry in os.listdir("/proc"):
    try:
        with open(f"/proc/{entry}/stat", "rb") as f:
            fields = f.read().rpartition(b")")[2].split()
    except (OSError, ValueError):
        continue
    if fields[0] == b"Z" and int(fields[1]) == os.getpid():
        zombies.append(int(entry))
print("ZOMBIES", len(zombies))
"""


def test_a_trainer_running_as_pid_1_is_left_no_zombie_per_timed_out_run(isolation):
    # A trainer as a container's PID 1 (or a subreaper) inherits orphans and never reaps them: when unshare was
    # killed together with the namespace's init, every timed-out run left that init to it as a zombie.
    _needs(isolation, "pidns")
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SUBREAPER_RUNS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ZOMBIES 0" in done.stdout, done.stdout


def test_multiprocessing_locks_and_queues_work_in_the_private_root(isolation):
    # the private root had no /dev/shm: every SemLock (Pool, Queue, even multiprocessing.pool.ThreadPool) failed
    _needs(isolation, "private_root")
    program = (
        "import multiprocessing as mp\nfrom multiprocessing.pool import ThreadPool\n"
        "def square(x):\n    return x * x\n"
        "def with_processes():\n    with mp.Pool(2) as pool:\n        return pool.map(square, range(4))\n"
        "def with_threads():\n    with ThreadPool(3) as pool:\n        return pool.map(square, range(4))\n"
        "def through_a_queue():\n    q = mp.Queue()\n    q.put([0, 1, 4, 9])\n"
        "    return q.get()\n"
    )
    names = ("with_processes", "with_threads", "through_a_queue")
    tests = [f"x = {name}()\nassert x == [0, 1, 4, 9]" for name in names]
    result = run_tests(program, tests, SandboxLimits(timeout=30.0, memory_mb=512, max_processes=16))
    assert result.outcomes == [True] * 3, result


def test_28_threads_alive_at_once_fit_the_address_space_limit(isolation):
    # each thread's malloc arena reserved 64 MiB of RLIMIT_AS: about 21-27 threads exhausted 1 GiB and a
    # ThreadPoolExecutor of that size could not start its threads (MALLOC_ARENA_MAX caps the arenas)
    _needs(isolation, "pidns")
    if isolation.get("process_limit_scope") != "sandbox":
        pytest.skip("the process limit is shared with this user's other processes here")
    program = (
        "import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
        "barrier = threading.Barrier(28)\n"
        "def work(x):\n    barrier.wait()\n    return [i * x for i in range(1000)][-1]\n"
        "def f():\n    with ThreadPoolExecutor(max_workers=28) as pool:\n"
        "        return sum(pool.map(work, range(28)))\n"
    )
    result = run_tests(program, ["x = f()\nassert x == 999 * 378"], SandboxLimits(timeout=30.0, memory_mb=1024))
    assert result.outcomes == [True], result
