"""The code harnesses against Gen-Verse/dLLM-RL (10b4fd1) ``reward/rl_execute.py``, and programs any grader must run.

The expected rewards come from running dLLM-RL's own ``_check_snippet_many`` / ``worker_stdio`` on the same
completions (only the numbers are kept here).
"""

from __future__ import annotations

import pytest

from trl_diffusion.eval.evaluate import EvalConfig
from trl_diffusion.rewards import make_code_reward, make_official_code_reward, run_tests
from trl_diffusion.rewards.dllm_rl_code import official_stdio_program, stdio_program, stdio_test
from trl_diffusion.rewards.sandbox import SandboxLimits

SUM2 = {"test_method": "stdio", "test_input": ["1 2\n", "3 4\n"], "test_output": ["3\n", "7\n"]}
LINES = {"test_method": "stdio", "test_input": ["2\n1 2\n3 4\n"], "test_output": ["3\n7\n"]}


def _fence(code: str) -> str:
    return f"```python\n{code}\n```"


def _official(row: dict, code: str, **kwargs) -> float | None:
    reward = make_official_code_reward(max_workers=1, **kwargs)
    return reward([_fence(code)], **{k: [v] for k, v in row.items()})[0]


DATACLASS = "from dataclasses import dataclass\n@dataclass\nclass R:\n    w: int\n    h: int\ndef area(w, h):\n" \
            "    r = R(w, h)\n    return r.w * r.h"


@pytest.mark.parametrize("future", ["", "from __future__ import annotations\n"])
def test_a_program_with_a_dataclass_passes(future):
    """Before, the sandbox compiled programs with its own ``from __future__ import annotations`` and ran them in a
    module missing from ``sys.modules``: ``@dataclass`` raised AttributeError and a correct program scored 0."""
    program = future + DATACLASS
    result = run_tests(program, ["assert area(2, 3) == 6"])
    assert result.passed == 1, result.errors
    reward = make_code_reward(max_workers=1)
    assert reward([_fence(program)], tests=[["assert area(2, 3) == 6"]])[0] == 1.0
    row = {"test_method": "function", "prefix": "", "test_list": ["assert area(2, 3) == 6"]}
    assert _official(row, program) == 1.0
    stdio = future + DATACLASS + "\nw, h = map(int, input().split())\nprint(area(w, h))"
    assert run_tests(stdio_program(stdio), [stdio_test("2 3\n", "6\n")]).passed == 1


@pytest.mark.parametrize("program, tests, outcomes, verified", [
    ("def add(a, b):\n    return a + b",
     ["x = add(1, 2)", "assert x == 3", "def helper(v):\n    return add(v, v)", "assert helper(2) == 4",
      "assert add(2, 2) == 5"], [True, True, True, True, False], 0),
    ("stack = []\ndef push(v):\n    stack.append(v)\ndef pop():\n    return stack.pop()",
     ["push(1)", "assert pop() == 1"], [True, True], 0),
    ("items = []\ndef add_item(v):\n    items.append(v)\n    return len(items)\ndef get_items():\n    return items",
     ["assert add_item(7) == 1", "got = get_items()\nassert got == [7]"], [True, True], 1),
    ("def f(x):\n    return x * x", ["import math\nassert f(2) == 4", "r = f(3)\nassert math.isclose(r, 9)"],
     [True, True], 1),
    ("def f(x):\n    return x", ["del f", "assert f(1) == 1"], [True, False], 0),
])
def test_a_rows_tests_run_in_order_in_one_state(program, tests, outcomes, verified):
    """Natively (and in dLLM-RL) a row's tests run in order in one namespace (``ordered=True``, dLLM-RL's grader).
    Tests that cannot be decided outside the sandbox ran in a separate process, so later asserts did not see what
    they did (NameError, IndexError), and they did not see what earlier verified tests did (imports, side effects)."""
    result = run_tests(program, tests, ordered=True)
    assert result.outcomes == outcomes and result.verified == verified, result.errors
    row = {"test_method": "function", "prefix": "", "test_list": tests}
    assert _official(row, program) == float(sum(outcomes))


def test_by_default_a_verified_test_stays_verified_after_an_unverified_one():
    """``run_tests``' default keeps every verifiable test verified (decided from its own probe run), so a program
    cannot forge it, at the cost of the two runs not seeing what the other's tests did (``ordered=True`` runs a row
    as natively)."""
    program = "items = []\ndef add_item(v):\n    items.append(v)\n    return len(items)\ndef get(i):\n    return i"
    tests = ["assert add_item(7) == 1", "got = items[:]\nassert got == [7]", "x = get(3)", "assert x == 3",
             "assert get(2) == 2"]
    result = run_tests(program, tests)
    assert result.outcomes == [True, False, True, False, True] and result.verified == 3
    assert run_tests(program, tests, ordered=True).outcomes == [True, True, True, True, True]


CHEAT = r"""
import re, sys
_table = {}
frame = sys._getframe()
while frame is not None:  # the runner's config: every snippet of the run
    config = frame.f_locals.get("config")
    if isinstance(config, dict) and "specs" in config:
        for spec in config["specs"]:
            if isinstance(spec, dict) and "exec" in spec:
                _table.update((int(a), int(b)) for a, b in re.findall(r"\((\d+),\s*(\d+)\)", spec["exec"]))
    frame = frame.f_back
def square(x):
    return _table.get(x, -1)
"""


def test_verified_probes_never_share_a_run_with_unverified_snippets():
    """Unverified snippets may hold expected values: a program that read them from its own run answered the
    verified probes with them (a review of this change found it; 2 of 2 verified tests passed without squaring)."""
    tests = ["assert square(3) == 9", "assert square(12) == 144",
             "for x, y in [(3, 9), (12, 144)]:\n    assert square(x) == y"]
    result = run_tests(CHEAT, tests)
    assert result.verified == 2 and result.outcomes[:2] == [False, False]
    assert run_tests("def square(x):\n    return x * x", tests).outcomes == [True, True, True]


def test_official_function_rows_are_dedented():
    """dLLM-RL execs ``textwrap.dedent(code)``, which blanks a whitespace-only line inside a string literal."""
    row = {"test_method": "function", "prefix": "", "test_list": ["assert f() == 'a\\n\\nb'"]}
    assert _official(row, 'def f():\n    return """a\n    \nb"""') == 1.0  # dLLM-RL: 1
    assert run_tests('def f():\n    return """a\n    \nb"""', ["assert f() == 'a\\n\\nb'"]).passed == 0  # natively


@pytest.mark.parametrize("row, code, official", [
    (SUM2, "a, b = map(int, input('Enter two numbers: ').split())\nprint(a + b)", 2.0),
    (SUM2, "import sys\na, b = map(int, sys.stdin.buffer.read().split())\nprint(a + b)", 0.0),
    (SUM2, "import sys\na, b = map(int, input().split())\nsys.stdout.buffer.write(str(a + b).encode())", 0.0),
    (LINES, "import sys\nn = int(input())\nfor _ in range(n):\n    a, b = map(int, sys.stdin.readline().split())\n"
            "    print(a + b)", 0.0),
    (LINES, "import sys\ninput = sys.stdin.readline\nn = int(input())\nfor _ in range(n):\n"
            "    a, b = map(int, input().split())\n    print(a + b)", 1.0),
    ({"test_method": "stdio", "test_input": ["a\x0cb\n"], "test_output": ["a\x0cb\n"]}, "print(input())", 0.0),
    (SUM2, "a, b = map(int, input().split())\nprint(a + b)\nexit()", 2.0),
])
def test_official_stdio_harness_is_dllm_rls_worker_stdio(row, code, official):
    """dLLM-RL's ``worker_stdio``: a global ``input`` that ignores its prompt and reads the input's ``splitlines()``,
    a separate ``StringIO`` stdin, a ``StringIO`` stdout (no ``.buffer``). Before, the official grader used the real
    text streams: ``input('prompt')`` printed the prompt and scored 0 where dLLM-RL gives full reward."""
    assert _official(row, code) == official


def test_default_stdio_harness_keeps_real_streams():
    """The default harness is a real text stdin/stdout: bytes I/O works, and a prompt is printed (as on a judge)."""
    tests = [stdio_test("1 2\n", "3\n")]
    assert run_tests(stdio_program("import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))"),
                     tests).passed == 1
    assert run_tests(official_stdio_program("import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))"),
                     tests).passed == 0
    assert run_tests(stdio_program("print(sum(map(int, input('? ').split())))"), tests).passed == 0


FAST_IO = """import os, sys
class Reader:  # the fast-I/O templates of judge solutions: raw reads and writes on the streams' descriptors
    def __init__(self, stream):
        self.fd = stream.fileno()
    def read(self):
        return os.read(self.fd, max(os.fstat(self.fd).st_size, 8192)).decode()
data = Reader(sys.stdin).read().split()
os.write(sys.stdout.fileno(), (str(int(data[0]) + int(data[1])) + "\\n").encode())
"""
DESCRIPTOR_PROGRAMS = {
    "fast_io": FAST_IO,
    "open_0": "a, b = map(int, open(0).read().split())\nprint(a + b)",
    "os_write_1": "import os\na, b = map(int, input().split())\nos.write(1, f'{a + b}\\n'.encode())",
    "dunder_stdout": "import sys\na, b = map(int, input().split())\nsys.__stdout__.write(f'{a + b}\\n')",
    "closes_stdout": "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.stdout.close()",
    "unflushed_wrapper": "import io, sys\nsys.stdout = io.TextIOWrapper(open(1, 'wb', closefd=False))\n"
                         "a, b = map(int, input().split())\nprint(a + b)",
    # a file on descriptor 1 flushed only when the interpreter finalizes it
    "unflushed_open_1": "out = open(1, 'w')\na, b = map(int, input().split())\nout.write(f'{a + b}\\n')",
    # the previous case's `open(0)` (kept alive by the cycle a `def` makes) must not be closed during this case
    "collected_open_0": "import gc\ngc.collect()\ninput = open(0).readline\ndef solve():\n"
                        "    a, b = map(int, input().split())\n    print(a + b)\nsolve()",
    "atexit_print": "import atexit\na, b = map(int, input().split())\natexit.register(lambda: print(a + b))",
    # an interpreter's exit stops a pool's idle workers; the next case starts a new pool
    "thread_pool_in_a_global": "from concurrent.futures import ThreadPoolExecutor\npool = ThreadPoolExecutor(2)\n"
                               "a, b = map(int, input().split())\nprint(pool.submit(lambda: a + b).result())",
    # finalizers run with the globals intact, print() writing descriptor 1, in every case
    "finalizer_prints_a_global": "class W:\n    def __del__(self):\n        print(total)\n"
                                 "total = sum(map(int, input().split()))\nw = W()",
    "weakref_finalize": "import weakref\nclass K:\n    pass\nkeep = K()\na, b = map(int, input().split())\n"
                        "weakref.finalize(keep, print, a + b)",
    # a file kept inside an object, flushed by nobody but the exiting interpreter
    "file_in_an_object": "class Out:\n    def __init__(self):\n        self.f = open(1, 'w')\nout = Out()\n"
                         "a, b = map(int, input().split())\nout.f.write(f'{a + b}\\n')",
    # each case configures logging afresh (case 1's handler wrote to its own, closed, stdout)
    "logging_to_stdout": "import logging, sys\nlogging.basicConfig(stream=sys.stdout, format='%(message)s', "
                         "level=logging.INFO)\na, b = map(int, input().split())\nlogging.info(a + b)",
}


@pytest.mark.parametrize("name", sorted(DESCRIPTOR_PROGRAMS))
def test_default_stdio_harness_gives_programs_descriptors_0_and_1(name):
    """On a judge a program's descriptors 0 and 1 are its input and output. Before, the default harness only swapped
    the ``sys.stdin`` / ``sys.stdout`` objects: ``open(0).read()``, ``os.write(1, ...)``, the fast-I/O templates over
    ``fileno()`` and closing ``sys.stdout`` failed every case of a correct program. dLLM-RL's harness swaps objects
    only, so there (the official grader) they score 0."""
    code = DESCRIPTOR_PROGRAMS[name]
    tests = [stdio_test("1 2\n", "3\n"), stdio_test("30 4\n", "34\n")]
    assert run_tests(stdio_program(code), tests).passed == 2
    if name in ("open_0", "os_write_1", "fast_io"):
        assert run_tests(official_stdio_program(code), tests).passed == 0


def test_default_stdio_harness_restores_the_streams_between_cases():
    """Each case reads only its own input and prints only its own output, whatever the previous case left open."""
    code = ("import sys, os\nprint(sum(map(int, sys.stdin.read().split())))\nsys.stdout.flush()\n"
            "sys.stdin.close()\nos.close(0)\nos.close(1)")
    tests = [stdio_test("1 2\n", "3\n"), stdio_test("5\n", "5\n"), stdio_test("", "0\n")]
    assert run_tests(stdio_program(code), tests).passed == 3
    flood = run_tests(stdio_program("while True:\n    print('y' * 4096)"), [stdio_test("", "y")])
    assert flood.passed == 0 and flood.status in ("ok", "output_limit")


def test_a_cases_globals_do_not_outlive_it():
    """Globals kept alive past their case (here by a daemon thread's function) are cleared, as a fresh process per
    case would drop them: they held earlier cases' memory (a judge-passing program hit MemoryError) and files."""
    code = ("import gc, threading, time\n"
            "alive = sum(1 for o in gc.get_objects() if isinstance(o, dict) and o.get('case_tag') == 'x')\n"
            "case_tag = 'x'\ndef spin():\n    while True:\n        time.sleep(1)\n"
            "threading.Thread(target=spin, daemon=True).start()\ninput()\nprint(alive)")
    assert run_tests(stdio_program(code), [stdio_test(f"{i}\n", "0") for i in range(3)]).passed == 3


def test_default_stdio_harness_reads_input_as_a_posix_stdin():
    """No newline translation (``"\\r\\n"`` keeps its ``"\\r"``, as ``sys.stdin`` on Linux), and an input too large for
    the sandbox's files fails the case with an error naming the limit, never a cut-short input."""
    assert run_tests(stdio_program("print(len(input()))"), [stdio_test("abc\r\n", "4")]).passed == 1
    code = "import sys\nprint(len(sys.stdin.read()))"
    result = run_tests(stdio_program(code), [stdio_test("x" * 3_000_000, "3000000")],
                       SandboxLimits(max_file_bytes=1_000_000))
    assert result.passed == 0 and "does not fit the sandbox's max_file_bytes" in " ".join(result.errors)


def test_the_output_cap_can_be_raised_for_large_stdio_outputs():
    """A run's stdio cases share its report, capped at ``max_output_bytes`` (1 MB): 8 cases of ~150 kB fail a correct
    program until the cap is raised (eval: ``--code_max_output_bytes``; dLLM-RL has no cap)."""
    code = "n = int(input())\nprint('x' * n)"
    tests = [stdio_test(f"{150_000 + i}\n", "x" * (150_000 + i)) for i in range(8)]
    assert run_tests(stdio_program(code), tests).status == "output_limit"
    assert run_tests(stdio_program(code), tests, SandboxLimits(max_output_bytes=1_400_000)).passed == 8
    big = {"test_method": "stdio", "test_input": ["1300000\n"], "test_output": ["x" * 1_300_000]}
    assert _official(big, code) == 0.0
    assert _official(big, code, max_output_bytes=1_400_000) == 1.0
    limits = SandboxLimits(max_output_bytes=1000)
    assert run_tests("print('y' * 5000)", ["pass"], limits).status == "output_limit"


def test_eval_config_checks_code_max_output_bytes():
    assert EvalConfig(dataset_name="gsm8k", code_max_output_bytes=5).code_max_output_bytes == 5
    with pytest.raises(ValueError, match="code_max_output_bytes must be >= 1"):
        EvalConfig(dataset_name="gsm8k", code_max_output_bytes=0)


def test_builtins_are_seen_as_dllm_rl_and_python_show_them():
    """dLLM-RL's ``exec`` gives programs the builtins' dict (``__builtins__['len']`` works); a script run as
    ``__main__`` sees the module. The official harness and function rows follow dLLM-RL, the default stdio harness
    a script."""
    tests = [stdio_test("\n", "2\n")]
    as_dict, as_module = "print(__builtins__['len']([1, 2]))", "print(__builtins__.len([1, 2]))"
    assert run_tests(official_stdio_program(as_dict), tests).passed == 1
    assert run_tests(official_stdio_program(as_module), tests).passed == 0
    assert run_tests(stdio_program(as_module), tests).passed == 1
    row = {"test_method": "function", "prefix": "", "test_list": ["assert f() == 2"]}
    assert _official(row, "def f():\n    return __builtins__['len']([1, 2])") == 1.0


def test_a_forged_report_is_capped_in_all():
    """A program can write its own report; its size is capped at ``max_output_bytes`` in all. A per-test cap (tried
    and reverted) let ~40 MB of ``[],`` through, which the parent parsed into ~1 GiB of lists."""
    program = r"""
import os, sys
frame = sys._getframe()
while frame is not None and not isinstance(frame.f_locals.get("config"), dict):
    frame = frame.f_back
fd = frame.f_locals["config"]["report_fd"]
head = b'{"results": [' + b",".join([b'{"has": [], "values": []}'] * 4) + b'], "x": ['
os.write(fd, head)
for _ in range(4):
    os.write(fd, b"[]," * 100_000)
os.write(fd, b'[]]}')
os._exit(0)
"""
    result = run_tests(program, [f"assert f({i}) == {i}" for i in range(4)])
    assert result.status == "output_limit" and result.passed == 0


def test_a_stdio_program_runs_as_a_script():
    """The default harness ran a stdio program in a plain dict: pickling its classes failed and a dataclass
    ``ClassVar`` under postponed annotations became a field, unlike ``python program.py``."""
    program = ("from __future__ import annotations\nimport pickle\nfrom dataclasses import dataclass, fields\n"
               "from typing import ClassVar\n@dataclass\nclass P:\n    x: int\n    k: ClassVar[int] = 0\n"
               "n = int(input())\nprint(pickle.loads(pickle.dumps(P(n))).x, len(fields(P)))")
    assert run_tests(stdio_program(program), [stdio_test("5\n", "5 1\n")]).passed == 1


def test_a_stdio_program_whose_main_runs_in_a_thread():
    """``threading.Thread(target=main).start()`` without a join (a competitive-programming idiom for a larger stack):
    a script's interpreter waits for the thread; the harness returned before it printed (and its output could land
    in the next case's)."""
    program = ("import threading, time\ndef main():\n    n = int(input())\n    time.sleep(0.2)\n    print(n * 2)\n"
               "threading.stack_size(1 << 24)\nthreading.Thread(target=main).start()")
    tests = [stdio_test("21\n", "42\n"), stdio_test("5\n", "10\n")]
    assert run_tests(stdio_program(program), tests).passed == 2


def test_ordered_rows_run_a_test_the_program_shadows_after_an_unverified_one():
    """With ``ordered=True`` a test after the first unverified one runs in the sandbox anyway, so one that uses a
    builtin the program redefines (refused from the probe run) runs there, as natively."""
    program = "def sorted(xs):\n    return list(__import__('builtins').sorted(xs))\ndef f(xs):\n    return sorted(xs)"
    tests = ["x = f([3, 1])", "assert f([3, 1]) == sorted([3, 1])"]
    assert run_tests(program, tests, ordered=True).outcomes == [True, True]
