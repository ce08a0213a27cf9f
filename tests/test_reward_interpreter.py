"""The code rewards' ``python=`` interpreter (resolved and checked when the reward is built), the sandbox's
unstartable-interpreter error (logged once), the asyncio socket pair, and programs the checker cannot parse."""

import logging
import os
import stat
import sys

import pytest

from trl_diffusion.rewards import make_code_reward, make_official_code_reward
from trl_diffusion.rewards.sandbox import SandboxLimits, resolve_python, run_tests
from trl_diffusion.rewards.verdict import program_bindings

LIMITS = SandboxLimits(timeout=20.0, memory_mb=256, max_processes=16, max_output_bytes=100_000)
ADD = "```python\ndef add(a, b):\n    return a + b\n```"


def _script(path, body):
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_bare_name_on_path_and_a_relative_path_resolve_to_the_interpreter(tmp_path, monkeypatch):
    real = os.path.realpath(sys.executable)
    monkeypatch.setenv("PATH", os.path.dirname(real) + os.pathsep + os.environ.get("PATH", ""))
    assert os.path.samefile(resolve_python(os.path.basename(real)), real)
    monkeypatch.chdir(os.path.dirname(os.path.dirname(real)))
    relative = os.path.join(os.path.basename(os.path.dirname(real)), os.path.basename(real))
    assert os.path.samefile(resolve_python(relative), real)
    assert resolve_python(None) is None


def test_a_relative_interpreter_scores_the_program(tmp_path, monkeypatch):
    # The sandbox starts the interpreter from an empty directory: unresolved, a relative path scored 0.0 silently.
    real = os.path.realpath(sys.executable)
    monkeypatch.chdir(os.path.dirname(os.path.dirname(real)))
    relative = os.path.join(os.path.basename(os.path.dirname(real)), os.path.basename(real))
    reward = make_code_reward(timeout=20.0, max_workers=1, python=relative)
    assert os.path.isabs(reward.python)
    assert reward([ADD], tests=[["assert add(2, 3) == 5"]]) == [1.0]
    official = make_official_code_reward(max_workers=1, python=relative)
    assert os.path.isabs(official.python)


@pytest.mark.parametrize("factory", [make_code_reward, make_official_code_reward])
def test_an_interpreter_that_cannot_start_is_refused_when_the_reward_is_built(factory, tmp_path):
    with pytest.raises(ValueError, match="cannot be started"):
        factory(python=str(tmp_path / "no-such-python"))
    not_python = _script(tmp_path / "not-python", "#!/bin/sh\necho hello\n")
    with pytest.raises(ValueError, match="did not run as a Python interpreter"):
        factory(python=not_python)


def test_a_newer_interpreter_is_named_in_a_warning(tmp_path, caplog):
    newer = _script(tmp_path / "python-next", f"#!/bin/sh\necho {sys.executable}\necho {sys.version_info[0]} 99\n")
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.rewards.sandbox"):
        assert resolve_python(newer) == sys.executable
    assert "parsed here with this Python's grammar" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.rewards.sandbox"):
        resolve_python(sys.executable)
    assert caplog.text == ""


def test_an_unstartable_interpreter_in_run_tests_is_logged_once(caplog):
    program, tests = "def f():\n    return 1", ["assert f() == 1"]
    name = "relative/python-that-is-not-there"
    with caplog.at_level(logging.ERROR, logger="trl_diffusion.rewards.sandbox"):
        first = run_tests(program, tests, LIMITS, python=name)
        second = run_tests(program, tests, LIMITS, python=name)
    assert first.status == second.status == "sandbox_error"
    errors = [record for record in caplog.records if "Code sandbox unusable" in record.getMessage()]
    assert len(errors) == 1 and name in errors[0].getMessage()


def test_asyncio_runs_and_other_sockets_stay_refused():
    program = (
        "import asyncio, os, socket\n"
        "async def double(x):\n    await asyncio.sleep(0)\n    return 2 * x\n"
        "def f(x):\n    return asyncio.run(double(x))\n"
        "def refused(make):\n    try:\n        make()\n    except PermissionError:\n        return True\n"
        "    return False\n"
        "def wrap_any_descriptor():\n    r, w = os.pipe()\n    return socket.socket(fileno=r)\n"
    )
    tests = [
        "assert f(21) == 42",
        "assert refused(lambda: socket.socketpair(socket.AF_INET))",
        "assert refused(lambda: socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM))",  # could sendto() any path
        "a, b = socket.socketpair(None)\nb.sendall(b'x')\nassert a.recv(1) == b'x'",
        "assert refused(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))",
        "assert refused(wrap_any_descriptor)",
        "a, b = socket.socketpair()\nassert refused(lambda: socket.socket(fileno=a.fileno()))",
    ]
    result = run_tests(program, tests, LIMITS)
    assert (result.status, result.outcomes) == ("ok", [True] * len(tests)), result


def test_a_program_the_checker_cannot_parse_counts_as_redefining_every_builtin():
    # Syntax this interpreter cannot parse (a newer Python's, or an error): a check made outside the sandbox
    # must not evaluate the real builtin in place of one the program may define.
    assert "sorted" in program_bindings("def sorted(xs):\n    return xs\nx = (\n")
    assert program_bindings("def sorted(xs):\n    return xs\n") == frozenset({"sorted"})
    result = run_tests("def sorted(xs):\n    return xs\ndef f(xs):\n    return [1, 3]\nx = (\n",
                       ["assert f([3, 1]) == sorted([3, 1])"], LIMITS)  # fmt: skip
    assert result.outcomes == [False]


def test_a_process_that_fills_its_output_pipe_exits_while_it_is_drained():
    # after an output-limited run the pipe is full and unshare's last message blocked it: the 2 s wait ran out
    import subprocess

    from trl_diffusion.rewards.sandbox import _exits_draining

    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdout.write('x' * 1_000_000)"],
                            stdout=subprocess.PIPE)
    try:
        assert _exits_draining(proc, 120.0) and proc.returncode == 0
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_transient_error_while_probing_is_not_cached_as_a_weaker_launcher(monkeypatch):
    # an OSError (EAGAIN from a momentary fork limit) moved the probe on to a weaker launcher, cached for the run
    import errno

    from trl_diffusion.rewards import sandbox

    monkeypatch.setattr(sandbox, "_LAUNCHERS", {})
    real, failures = sandbox._run_once, [1]

    def flaky(*args, **kwargs):
        if failures:
            failures.pop()
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        return real(*args, **kwargs)

    monkeypatch.setattr(sandbox, "_run_once", flaky)
    program, tests = "def f():\n    return 1", ["assert f() == 1"]
    assert run_tests(program, tests, LIMITS).status == "sandbox_error"  # that call only
    assert not sandbox._LAUNCHERS
    monkeypatch.setattr(sandbox, "_run_once", real)
    assert run_tests(program, tests, LIMITS).outcomes == [True]  # probed afresh


def test_run_tests_takes_the_interpreter_as_a_path_or_bytes():
    from pathlib import Path

    for python in (Path(sys.executable), os.fsencode(sys.executable)):
        assert run_tests("def f():\n    return 1", ["assert f() == 1"], LIMITS, python=python).outcomes == [True]


def test_draining_a_process_whose_output_pipe_is_closed_just_waits():
    import subprocess

    from trl_diffusion.rewards.sandbox import _exits_draining

    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE)
    proc.stdout.close()
    assert _exits_draining(proc, 120.0) and proc.returncode == 0


def test_the_sandbox_source_fits_one_command_line_argument():
    # the child gets sandbox.py as its `-c` argument: Linux refuses one over MAX_ARG_STRLEN (128 KiB), and every
    # launch would fail. Move the source to stdin or a file before this is near.
    from trl_diffusion.rewards.sandbox import _runner_source

    assert len(_runner_source().encode()) < 120_000
