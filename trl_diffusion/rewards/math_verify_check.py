"""One math-verify check of a prediction against a gold answer, and a child process that runs it.

math-verify's timeouts use ``signal.alarm``, which only works in a main thread. :class:`MathAccuracyReward` called
from another thread sends each check to a child process (this file run as a script, line protocol of
:class:`~trl_diffusion.rewards.dllm_rl_math.SympyWorker`), where the timeouts work and which is killed if it hangs
anyway. Imports only the standard library and math-verify, so the child starts without loading ``trl_diffusion``.
"""

from __future__ import annotations

import json
import os
import sys

__all__ = ["as_boxed", "boot_command", "extraction_configs", "verify_source"]


def extraction_configs() -> list:
    """Extraction targets for a ``$\\boxed{...}$``-wrapped answer: LaTeX with the box first, then plain expressions."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def as_boxed(answer: str) -> str:
    r"""Wrap a bare answer as ``$\boxed{...}$`` so math-verify parses all of it as a single LaTeX answer."""
    return "$\\boxed{" + answer + "}$"


def verify_source(source: str, gold_parsed: list, parsing_timeout: int | None, verify_timeout: int | None) -> bool:
    """math-verify's verdict on one prediction: ``source`` is an :func:`as_boxed` answer, or raw text to extract the
    answer from. ``False`` when it cannot be parsed, raises or runs out of time."""
    from math_verify import parse, verify
    from math_verify.errors import TimeoutException

    try:
        if source.startswith("$\\boxed{"):
            pred_parsed = parse(source, extraction_config=extraction_configs(), parsing_timeout=parsing_timeout)
        else:
            pred_parsed = parse(source, parsing_timeout=parsing_timeout)
        return bool(pred_parsed) and bool(verify(gold_parsed, pred_parsed, timeout_seconds=verify_timeout))
    except (Exception, TimeoutException):
        return False


def _check(source: str, gold: str, parsing_timeout: int, verify_timeout: int) -> bool:
    from math_verify import parse
    from math_verify.errors import TimeoutException

    try:
        gold_parsed = parse(gold, extraction_config=extraction_configs(), parsing_timeout=parsing_timeout)
    except (Exception, TimeoutException):
        return False
    return bool(gold_parsed) and verify_source(source, gold_parsed, parsing_timeout, verify_timeout)


def _serve() -> None:
    """Child loop: one JSON ``[prediction source, boxed gold]`` per input line, ``1`` / ``0`` per output line."""
    parsing_timeout, verify_timeout = int(sys.argv[-2]), int(sys.argv[-1])
    _check(as_boxed("1"), as_boxed("1"), parsing_timeout, verify_timeout)  # imports off the first check's clock
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        out.write(b"1\n" if _check(*json.loads(line), parsing_timeout, verify_timeout) else b"0\n")
        out.flush()


_BOOT = ("import importlib.util, sys; sys.path.pop(0); spec = importlib.util.spec_from_file_location("
         "'_math_verify_check_child', sys.argv[1]); module = importlib.util.module_from_spec(spec); "
         "spec.loader.exec_module(module); module._serve()")


def boot_command(parsing_timeout: int, verify_timeout: int) -> list[str]:
    """The child's command line (this file loaded by path, so the ``trl_diffusion`` package is not imported)."""
    timeouts = [str(int(parsing_timeout)), str(int(verify_timeout))]
    return [sys.executable, "-c", _BOOT, os.path.abspath(__file__), *timeouts]


if __name__ == "__main__":
    _serve()
