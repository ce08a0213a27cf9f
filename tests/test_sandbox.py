"""Hostile-program tests for the code sandbox: every one must be contained, bounded in time, and score 0.

Tests that need a kernel mechanism (network namespace, read-only mount view) skip where the machine cannot provide
it; the Python-level guards and the resource limits are tested everywhere.
"""

import os
import shutil
import socket
import tempfile
import time

import pytest

from trl_diffusion.rewards.sandbox import SandboxLimits, isolation_report, run_tests

SMALL = SandboxLimits(timeout=20.0, memory_mb=256, max_processes=16, max_output_bytes=100_000)
KILLED_WITHIN = 60.0
"""Seconds within which a run the sandbox must kill has returned: a generous bound of "it was killed" (the status
says why), never a speed check, so a loaded machine cannot fail it."""


@pytest.fixture(scope="module")
def isolation():
    report = isolation_report()
    assert report["status"] == "ok", report
    print("sandbox isolation on this machine:", report)
    return report


def sandbox_pids():
    """Pids of live processes running the sandbox child (their command line carries its source)."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"def _child_main" in f.read():
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def assert_no_leftovers(timeout=30.0):
    """No sandbox process alive at some moment within ``timeout``: one empty look, not two in a row (the suite's
    other worker starts sandboxes of its own, which a second look could catch starting)."""
    deadline = time.monotonic() + timeout
    while (left := sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert left == []


@pytest.fixture
def open_dir():
    """A world-writable directory outside the sandbox (so only the sandbox, not permissions, can stop writes)."""
    path = tempfile.mkdtemp(prefix="sandbox_target_")
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_correct_and_wrong_programs(isolation):
    result = run_tests("def f(x):\n    return x * 2\nprint('hello')", ["assert f(2) == 4", "assert f(3) == 7"])
    assert (result.status, result.passed, result.total) == ("ok", 1, 2)
    assert result.output == "hello\n" and "AssertionError" in result.errors[0]
    assert result.fraction == 0.5 and not result.all_passed
    assert run_tests("x = ", ["assert True"]).passed == 0  # syntax error: nothing passes


def test_infinite_loop_is_killed():
    start = time.monotonic()
    result = run_tests("while True:\n    pass", ["assert True"], SandboxLimits(timeout=1.0))
    assert result.status == "timeout" and result.fraction == 0.0
    assert time.monotonic() - start < KILLED_WITHIN
    assert_no_leftovers()


def test_process_limit_stops_forking():
    """The program forks sleeping children until fork fails; RLIMIT_NPROC must make it fail, then all are killed."""
    program = (
        "import os, time\nblocked = False\nfor _ in range(200):\n    try:\n        pid = os.fork()\n"
        "    except OSError:\n        blocked = True\n        break\n    if pid == 0:\n        time.sleep(60)\n"
        "        os._exit(0)\n"
    )
    result = run_tests(program, ["assert blocked"], SMALL)
    assert (result.status, result.passed) == ("ok", 1), result
    assert_no_leftovers()


def test_fork_bomb_is_contained():
    program = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    start = time.monotonic()
    result = run_tests(program, ["assert True"], SandboxLimits(timeout=1.5, max_processes=16))
    assert result.status in ("timeout", "crashed") and result.fraction == 0.0
    assert time.monotonic() - start < KILLED_WITHIN
    assert_no_leftovers()


def test_concurrent_fork_bomb_does_not_starve_other_runs(isolation):
    """With a per-sandbox process limit, a fork bomb next door must not stop another program's threads."""
    if isolation.get("process_limit_scope") != "sandbox":
        pytest.skip("process limit is shared per uid here (non-root without user namespaces)")
    from concurrent.futures import ThreadPoolExecutor

    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    threads = "import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\nok = True\n"
    limits = SandboxLimits(timeout=2.0, max_processes=16)
    with ThreadPoolExecutor(2) as pool:
        bombing = pool.submit(run_tests, bomb, ["pass"], limits)
        time.sleep(0.3)
        # its own generous timeout: a loaded machine may start it slowly, the fork bomb must not stop it
        assert run_tests(threads, ["assert ok"], SandboxLimits(timeout=30.0, max_processes=16)).passed == 1
        assert bombing.result().fraction == 0.0
    assert_no_leftovers()


def test_memory_limit():
    program = (
        "try:\n    block = bytearray(2 * 1024**3)\n    limited = False\nexcept MemoryError:\n    limited = True\n"
    )
    assert run_tests(program, ["assert limited"], SMALL).passed == 1
    hog = "data = []\nwhile True:\n    data.append(bytearray(10**7))"
    result = run_tests(hog, ["assert True"], SMALL)
    assert result.fraction == 0.0 and result.status in ("ok", "crashed")


def test_huge_output_is_capped():
    start = time.monotonic()
    result = run_tests("while True:\n    print('x' * 10**6)", ["assert True"], SMALL)
    assert result.status == "output_limit" and len(result.output) <= SMALL.max_output_bytes
    # A single 1 GB line: the memory limit or the output cap stops it.
    result = run_tests("while True:\n    print('x' * 10**9)", ["assert True"], SMALL)
    assert result.fraction == 0.0 and len(result.output) <= SMALL.max_output_bytes
    assert time.monotonic() - start < 2 * KILLED_WITHIN
    assert_no_leftovers()


def test_runs_in_fresh_directory_that_is_deleted():
    result = run_tests("import os\nprint(os.getcwd())\nopen('scratch.txt', 'w').write('ok')", ["pass"])
    cwd = result.output.strip()
    assert result.passed == 1 and os.path.basename(cwd).startswith("trl_diffusion_run_")
    assert not os.path.exists(cwd)


def test_writes_outside_directory_are_blocked(open_dir):
    target = os.path.join(open_dir, "escaped")
    victim = os.path.join(open_dir, "victim")
    with open(victim, "w") as f:
        f.write("original")
    os.chmod(victim, 0o666)
    attempts = [
        f"open({target + '1'!r}, 'w').write('x')",
        f"os.close(os.open({target + '2'!r}, os.O_WRONLY | os.O_CREAT))",
        f"pathlib.Path({target + '3'!r}).write_text('x')",
        f"open('local', 'w').write('x'); shutil.copy('local', {target + '4'!r})",
        f"open('local5', 'w').write('x'); os.rename('local5', {target + '5'!r})",
        f"os.symlink({target + '6'!r}, 'link'); open('link', 'w').write('x')",
        f"io.FileIO({target + '7'!r}, 'w').write(b'x')",
        f"os.mkdir({target + '8'!r})",
        f"os.link({victim!r}, 'hardlink'); open('hardlink', 'w').write('changed')",
        f"open({victim!r}, 'a').write('changed')",
        f"os.chmod({victim!r}, 0o600)",
    ]
    program = "import io, os, pathlib, shutil\nwritten = 0\n" + "".join(
        f"try:\n    {a}\n    written += 1\nexcept OSError:\n    pass\n" for a in attempts
    )
    result = run_tests(program, ["assert written == 0"])
    assert os.listdir(open_dir) == ["victim"]
    with open(victim) as f:
        assert f.read() == "original"
    assert os.stat(victim).st_mode & 0o777 == 0o666
    assert (result.status, result.passed) == ("ok", 1), result


def test_raw_syscall_writes_blocked_by_readonly_view(isolation, open_dir):
    """Bypassing the Python guards with ctypes must still fail when the kernel read-only view is active."""
    if not isolation.get("readonly_fs"):
        pytest.skip("no private mount namespace here: only the Python-level write guard applies")
    target = os.path.join(open_dir, "raw").encode()
    program = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.open({target!r}, 0o101, 0o644)\n"
    assert run_tests(program, ["assert fd == -1"]).passed == 1
    assert os.listdir(open_dir) == []


def test_disk_usage_is_bounded(isolation):
    """Many files under the per-file limit: the sandbox directory is a size-limited tmpfs where available."""
    if not isolation.get("readonly_fs"):
        pytest.skip("no private mount namespace here: only RLIMIT_FSIZE (per file) applies")
    program = (
        "written = 0\ntry:\n    for i in range(40):\n        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'x' * 4 * 1024 * 1024)\n        written += 4\nexcept OSError:\n    pass\n"
    )
    limits = SandboxLimits(max_disk_bytes=32 * 1024 * 1024)
    assert run_tests(program, ["assert written < 40"], limits).passed == 1


def test_environment_is_empty(monkeypatch):
    secret = "trl-diffusion-secret-value-42"
    monkeypatch.setenv("TRL_DIFFUSION_TEST_SECRET", secret)
    program = (
        "import os\nprint(dict(os.environ))\nfor pid in os.listdir('/proc'):\n    if pid.isdigit():\n"
        "        try:\n            print(open(f'/proc/{pid}/environ', 'rb').read())\n        except OSError:\n"
        "            pass\n"
        "keys = set(os.environ) - {'PATH', 'LC_CTYPE', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS',\n"
        "                          'MALLOC_ARENA_MAX'}\n"
    )
    result = run_tests(program, ["assert not keys"])
    assert (result.status, result.passed) == ("ok", 1), result
    assert secret not in result.output


def _listening_socket():
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.3)
    return server


def _assert_no_connection(server):
    with pytest.raises(socket.timeout):
        server.accept()[0].close()


def test_sockets_are_blocked():
    server = _listening_socket()
    port = server.getsockname()[1]
    program = (
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n    connected = True\n"
        "except OSError:\n    connected = False\n"
    )
    try:
        result = run_tests(program, ["assert connected"])
        assert (result.status, result.passed) == ("ok", 0)
        _assert_no_connection(server)
    finally:
        server.close()


def test_raw_syscall_network_blocked_by_namespace(isolation):
    if not isolation.get("netns"):
        pytest.skip("no network namespace here: only the Python-level socket guard applies")
    server = _listening_socket()
    port = server.getsockname()[1]
    program = (
        "import ctypes, socket, struct\nlibc = ctypes.CDLL(None, use_errno=True)\nfd = libc.socket(2, 1, 0)\n"
        f"addr = struct.pack('!HH4s8x', 2, {port}, bytes([127, 0, 0, 1]))\n"
        "addr = addr[1::-1] + addr[2:]  # sa_family is host byte order\n"
        "rc = libc.connect(fd, addr, len(addr))\n"
    )
    try:
        assert run_tests(program, ["assert rc == 0"]).passed == 0
        _assert_no_connection(server)
    finally:
        server.close()


def test_cannot_start_other_programs():
    program = (
        "import os, subprocess\nresults = []\nfor fn in (lambda: subprocess.run(['true']), lambda: os.system('true'),"
        " lambda: os.execv('/bin/true', ['true'])):\n    try:\n        fn()\n        results.append('ran')\n"
        "    except OSError:\n        results.append('blocked')\n"
    )
    assert run_tests(program, ["assert results == ['blocked'] * 3"]).passed == 1


def test_bad_inputs_never_raise():
    assert run_tests(None, ["assert True"]).passed == 0
    assert run_tests("x = 1", [None]).passed == 0


def test_program_cannot_forge_the_report():
    """Patching builtins.exec (so tests never run) or json.dumps (to fake the report) must not produce a pass."""
    skip_tests = "import builtins\nbuiltins.exec = lambda *args, **kwargs: None\nbuiltins.compile = lambda *a, **k: 0"
    assert run_tests(skip_tests, ["assert False"]).passed == 0
    fake_dumps = "import json\njson.dumps = lambda *a, **k: '{\"passed\": 1}'"
    assert run_tests(fake_dumps, ["assert False"]).passed == 0


def test_a_folder_a_pth_file_adds_to_the_import_path_stays_outside(isolation, tmp_path):
    """An editable install of the user's own project (hatchling, poetry, pdm, uv, setuptools' src layout) writes a
    ``.pth`` file naming the project's folder; every import-path entry used to be bound into the private root, so a
    program could read the project's data (the expected values of verified tests) and its ``.env``."""
    if not isolation.get("private_root"):
        pytest.skip("no private root here: the program sees the user's readable files anyway (docs/rewards.md)")
    import venv

    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / ".env").write_text("HF_TOKEN=hf_secret\n")
    (project / "mine.py").write_text("VALUE = 1\n")
    for path in (tmp_path, project, project / "data"):
        path.chmod(0o755)  # readable by the sandbox's uid, so only the private root keeps it out
    (project / ".env").chmod(0o644)
    env = tmp_path / "venv"
    venv.create(env, with_pip=False, symlinks=True)
    python = str(env / "bin" / "python")
    site = next((env / "lib").glob("python3*/site-packages"))
    (site / "_project.pth").write_text(f"{project}\n")
    spy = (f"import os, sys\non_path = {str(project)!r} in sys.path\nseen = os.path.exists({str(project)!r})\n"
           "try:\n    import mine\n    imported = True\nexcept ImportError:\n    imported = False\n")
    result = run_tests(spy, ["assert on_path and not seen and not imported"], SandboxLimits(timeout=10.0),
                       python=python)
    assert (result.status, result.outcomes) == ("ok", [True]), (result.errors, result.output)
    assert run_tests("import json", ["pass"], python=python).status == "ok"  # its standard library is there
