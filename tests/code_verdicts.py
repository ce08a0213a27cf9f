"""Test helpers for the code reward's verdicts: a program as a completion, a sandbox run whose every test must be
decided outside the sandbox, and the verdicts the same tests get natively (the way the unverified mode runs them).

Used by ``tests/test_leetcode_verified.py`` and ``tests/test_leetcode_structures.py``, which compare the two.
"""

from __future__ import annotations

import json
import subprocess
import sys

from trl_diffusion.rewards import run_tests
from trl_diffusion.rewards.sandbox import SandboxLimits, SandboxResult

NATIVE = """
import json, sys
job = json.load(sys.stdin)
namespace = {"__name__": "solution"}
exec(job["program"], namespace)
outcomes = []
for test in job["tests"]:
    try:
        exec(test, namespace)
        outcomes.append(True)
    except BaseException:
        outcomes.append(False)
with open(sys.argv[1], "w") as f:
    json.dump(outcomes, f)
"""


def fenced(program: str) -> str:
    """``program`` as a completion: one fenced Python block."""
    return f"```python\n{program}\n```"


def run_verified(program: str, tests: list[str], limits: SandboxLimits) -> SandboxResult:
    """``run_tests(program, tests, limits)``, asserting that every test was decided outside the sandbox."""
    result = run_tests(program, tests, limits)
    assert result.verified == result.total == len(tests), result  # decided outside the sandbox
    return result


def native_outcomes(program: str, tests: list[str], tmp_path) -> list[bool]:
    """Each test's verdict run natively, as the unverified mode runs it (the program's namespace, in order), in a
    separate plain process (some programs patch builtins)."""
    out = tmp_path / "native.json"
    subprocess.run(
        [sys.executable, "-c", NATIVE, str(out)],
        input=json.dumps({"program": program, "tests": tests}),
        text=True,
        capture_output=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.read_text())
