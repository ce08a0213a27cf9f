"""dLLM-RL's math answer check (Gen-Verse/dLLM-RL at 10b4fd1, ``reward/math_utils.py``), re-implemented rule for rule,
and a subprocess that runs its sympy comparison under a hard time limit.

The official check of an extracted answer against the ground truth (``is_equal``, math_utils.py 414-419):

1. ``is_equiv``: Hendrycks MATH's string normalisation of both sides (math_utils.py 205-366), then float or string
   equality;
2. otherwise, unless either side is longer than 128 characters and repetitive (``repeatness``, 15-55), sympy's
   ``parse_latex`` + ``evalf`` on both sides, then on both sides after Minerva's ``normalize_final_answer``
   (58-152), and if that cannot be parsed, equality of the normalised strings (``_is_latex_equal``, 161-178);
   with a 1 s timeout that counts as "not equal" (181-192).

This module imports nothing from ``trl_diffusion``: :class:`SympyWorker` runs it as a script in a child process
(step 2 can take unbounded time in sympy or in a regular expression; the child is killed on timeout, so no thread
is left running and no signal is used, which makes it safe in any thread of a trainer).
"""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np

__all__ = ["SympyWorker", "extract_boxed_answer", "is_equiv", "latex_equal", "normalize_final_answer", "repeatness",
           "strip_string"]

NO_ANSWER = None
"""What :func:`extract_boxed_answer` returns without a closed ``\\boxed{`` (dLLM-RL returns a sentinel string that
never equals an answer)."""


# ------------------------------------------------------------------------------------------ answer extraction
def extract_boxed_answer(text: str) -> str | None:
    """The content of the last ``\\boxed{`` in ``text`` (the rollout scripts' ``extract_final_boxed_answer``,
    sample/trado_rl_rollout.py 44-66): braces counted from that opening, escaped or not; ``None`` when there is no
    ``\\boxed{`` or when the last one is never closed (an earlier box is not used)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return NO_ANSWER
    depth = 0
    for i in range(start + len("\\boxed{"), len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            if depth == 0:
                return text[start + len("\\boxed{"):i]
            depth -= 1
    return NO_ANSWER


# ------------------------------------------------------------------------------------------ Hendrycks is_equiv
class _Unnormalisable(Exception):
    """A string the Hendrycks normalisation cannot handle; ``is_equiv`` then compares the raw strings."""


def _units_removed(s: str) -> str:
    r"""Drop a trailing unit written as ``\text{ ...}``; more than one such unit is unnormalisable."""
    if "\\text{ " not in s:
        return s
    parts = s.split("\\text{ ")
    if len(parts) != 2:
        raise _Unnormalisable(s)
    return parts[0]


def _sqrt_braced(s: str) -> str:
    r"""``\sqrt3`` -> ``\sqrt{3}`` (one character); a trailing bare ``\sqrt`` is unnormalisable."""
    head, *tails = s.split("\\sqrt")
    out = [head]
    for tail in tails:
        if not tail:
            raise _Unnormalisable(s)
        out.append("\\sqrt" + (tail if tail[0] == "{" else "{" + tail[0] + "}" + tail[1:]))
    return "".join(out)


def _frac_braced(s: str) -> str:
    r"""``\frac12`` -> ``\frac{1}{2}``, ``\frac1{72}`` -> ``\frac{1}{72}``; a ``\frac`` followed by a single
    character leaves the whole string as it was; a trailing bare ``\frac`` is unnormalisable."""
    head, *tails = s.split("\\frac")
    out = [head]
    for tail in tails:
        if not tail:
            raise _Unnormalisable(s)
        if tail[0] == "{":
            out.append("\\frac" + tail)
        elif len(tail) < 2:
            return s
        elif tail[1] == "{":
            out.append("\\frac{" + tail[0] + "}" + tail[1:])
        else:
            out.append("\\frac{" + tail[0] + "}{" + tail[1] + "}" + tail[2:])
    return "".join(out)


def _slash_as_frac(s: str) -> str:
    r"""``3/4`` (two plain integers, written canonically) -> ``\frac{3}{4}``."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return f"\\frac{{{num}}}{{{den}}}" if s == f"{num}/{den}" else s


_HENDRYCKS_DELETIONS = ("\\!",)
_HENDRYCKS_STEPS: tuple[tuple[str, str], ...] = (
    ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"), ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""),
    ("^\\circ", ""), ("\\$", ""), ("$", ""), (",", ""),
)


def strip_string(s: str) -> str:
    """Hendrycks MATH's answer normalisation (math_utils.py 277-346): line breaks, ``\\!``, ``\\left``/``\\right``,
    degrees, dollars, commas, a trailing ``\\text{ unit}``, ``\\%``, leading zeros of decimals, a short ``x =``
    prefix, spaces; ``\\sqrt3``, ``\\frac12``, ``0.5`` and ``a/b`` rewritten as braced ``\\sqrt`` / ``\\frac``.
    Raises ``_Unnormalisable`` where the original raises."""
    s = s.replace("\n", "")
    for old in _HENDRYCKS_DELETIONS:
        s = s.replace(old, "")
    for old, new in _HENDRYCKS_STEPS:
        s = s.replace(old, new)
    s = _units_removed(s)
    s = s.replace("\\%", "").replace("\\%", "")  # twice, as the original; a bare "%" stays
    s = s.replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _sqrt_braced(s).replace(" ", "")
    s = _frac_braced(s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def is_equiv(a: str | None, b: str | None) -> bool:
    """Hendrycks equivalence (math_utils.py 349-366): both normalised, then equal as floats, else as strings; if a
    side cannot be normalised, the raw strings must be equal. ``None`` equals only ``None``."""
    if a is None or b is None:
        return a is None and b is None
    try:
        na, nb = strip_string(a), strip_string(b)
    except (_Unnormalisable, IndexError):
        return a == b
    try:
        return float(na) == float(nb)
    except ValueError:
        return na == nb


# ------------------------------------------------------------------------------------------ Minerva normalisation
_MINERVA_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
)
_MINERVA_DELETIONS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots", "sue",
    "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
    "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
    "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
    "\\dots",
)
_MINERVA_PATTERNS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep the first $...$ span
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)


def normalize_final_answer(s: str) -> str:
    """Minerva's final-answer normalisation (arXiv 2206.14858, math_utils.py 118-152): fixed substitutions, unit
    words removed, the first ``$...$`` span and the insides of ``\\text{}``, ``\\textbf{}``, ``\\overline{}``,
    ``\\boxed{}`` kept, shorthand ``\\frac``/``\\sqrt`` braced, dollars dropped, ``100,000`` -> ``100000``."""
    for old, new in _MINERVA_REPLACEMENTS:
        s = s.replace(old, new)
    for old in _MINERVA_DELETIONS:
        s = s.replace(old, "")
    for pattern, replacement in _MINERVA_PATTERNS:
        s = pattern.sub(replacement, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s


# ------------------------------------------------------------------------------------------ repetition guard
def _dense_ranks(primary: np.ndarray, secondary: np.ndarray) -> np.ndarray:
    """The rank of every ``(primary, secondary)`` pair among the distinct pairs, in sorted order (ties share one)."""
    order = np.lexsort((secondary, primary))
    first, second = primary[order], secondary[order]
    starts_a_group = np.ones(len(order), dtype=bool)
    starts_a_group[1:] = (first[1:] != first[:-1]) | (second[1:] != second[:-1])
    ranks = np.empty(len(order), dtype=np.int64)
    ranks[order] = np.cumsum(starts_a_group) - 1
    return ranks


def suffix_ranks(codes: list[int]) -> list[int]:
    """Every suffix's dense rank by its first ``span`` characters (a shorter suffix first), where ``span`` is the
    first power of two >= ``len(codes) - 1``: prefix doubling, one numpy sort per round."""
    n = len(codes)
    rank, span = _dense_ranks(np.array(codes, dtype=np.int64), np.zeros(n, dtype=np.int64)), 1
    while span < n - 1:
        following = np.full(n, -1, dtype=np.int64)  # the rank ``span`` characters on; -1 past the end
        following[: n - span] = rank[span:]
        rank, span = _dense_ranks(rank, following), span * 2
    return rank.tolist()


def repeatness(s: str) -> bool:
    """dLLM-RL's repetition test (math_utils.py 15-55): the summed longest-common-prefix of adjacent suffixes, over
    n(n+1)/2, exceeds 0.2. Suffixes are ranked by prefix doubling that stops once the compared prefix length
    reaches n - 1, so suffixes still tied at that length share a rank, exactly as in the original. The doubling
    rounds are numpy sorts (a Python sort of tuples per round took 0.5 s on 32,000 characters)."""
    codes = [ord(c) for c in s]
    n = len(codes)
    if n <= 1:
        return False
    rank = suffix_ranks(codes)
    suffix_at = [0] * n  # suffix of each rank (with ties, the last one wins; unused ranks point at 0)
    for start, r in enumerate(rank):
        suffix_at[r] = start
    prefix_of_rank, common = [0] * n, 0
    for start in range(n):  # Kasai's scan, carrying the common length from one suffix to the next
        if rank[start] == n - 1:
            common = 0
            continue
        other = suffix_at[rank[start] + 1]
        while start + common < n and other + common < n and codes[start + common] == codes[other + common]:
            common += 1
        prefix_of_rank[rank[start]] = common
        common = max(common - 1, 0)
    return sum(prefix_of_rank) * 2 / (n * (n + 1)) > 0.2


# ------------------------------------------------------------------------------------------ sympy comparison
def _sympy_parse(text: str):
    from sympy.parsing.latex import parse_latex

    return parse_latex(text)


def latex_equal(a: str, b: str, parse: Callable | None = None) -> bool:
    """dLLM-RL's ``_is_latex_equal`` (math_utils.py 161-178): parse both with sympy's ``parse_latex`` (``parse``)
    and compare structurally or by ``evalf``; on any failure or inequality, the same on Minerva-normalised strings;
    if those cannot be parsed, equality of the normalised strings. ``parse_latex`` needs antlr4 4.11; without it
    every parse fails and the result is the normalised-string equality."""
    parse = parse or _sympy_parse
    try:
        expr_a = parse(a)
        value_a = expr_a.evalf()
        expr_b = parse(b)
        value_b = expr_b.evalf()
        if expr_a == expr_b or value_a == value_b:
            return True
    except Exception:  # noqa: BLE001 - any failure falls through to the normalised strings, as in the original
        pass
    norm_a, norm_b = normalize_final_answer(a), normalize_final_answer(b)
    try:
        expr_a = parse(norm_a)
        value_a = expr_a.evalf()
        expr_b = parse(norm_b)
        value_b = expr_b.evalf()
        return bool(expr_a == expr_b or value_a == value_b)
    except Exception:  # noqa: BLE001
        return norm_a == norm_b


def _serve() -> None:
    """Worker loop: one JSON ``[a, b]`` per input line, ``1`` / ``0`` (``latex_equal``) per output line."""
    latex_equal("\\frac{1}{2}", "x")  # sympy imports lazily at the first parse: not on a comparison's clock
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        a, b = json.loads(line)
        try:
            equal = latex_equal(a, b)
        except Exception:  # noqa: BLE001 - a comparison that crashes is "not equal"
            equal = False
        out.write(b"1\n" if equal else b"0\n")
        out.flush()


def boot_source(module_name: str) -> str:
    """Source for ``python -c`` that loads the file named by ``sys.argv[1]`` by path as ``module_name`` (so the
    ``trl_diffusion`` package is not imported) and runs its ``_serve()`` loop.

    A thread ends the child once its parent is gone (its parent pid changes): a comparison can run long, and a
    trainer killed by SIGTERM or SIGKILL cannot stop it (the child would spin on until the comparison ended)."""
    return (
        "import importlib.util, os, sys, threading, time; sys.path.pop(0); parent = os.getppid()\n"
        "def watch():\n"
        "    while os.getppid() == parent:\n"
        "        time.sleep(1.0)\n"
        "    os._exit(1)\n"
        "threading.Thread(target=watch, daemon=True).start()\n"
        f"spec = importlib.util.spec_from_file_location({module_name!r}, sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module); module._serve()\n"
    )


class SympyWorker:
    """:func:`latex_equal` in a child process, under a hard per-comparison time limit.

    The child starts on first use (it imports sympy and runs one comparison before it answers, so the first real
    comparison is not slowed by imports; allow a few seconds) and is reused. A comparison that has
    not answered after ``timeout`` seconds counts as "not equal": the child is killed and waited for, and the next
    comparison starts a fresh one. Nothing runs in a thread and no signal is used, so it is safe in any thread;
    ``close()`` (also run at garbage collection and at exit) stops the child. POSIX only. Thread-safe (one
    comparison at a time). ``command`` replaces the child's command line (it must speak the same line protocol).
    """

    def __init__(self, timeout: float = 1.0, startup_timeout: float = 120.0, command: list[str] | None = None):
        if not timeout > 0 or not startup_timeout > 0:
            raise ValueError(f"timeout and startup_timeout must be > 0, got {timeout} and {startup_timeout}.")
        self.timeout, self.startup_timeout = timeout, startup_timeout
        boot = [sys.executable, "-c", boot_source("_dllm_rl_math_worker"), os.path.abspath(__file__)]
        self.command = command or boot
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._buffer = b""
        self._finalizer = None
        self.timeouts = 0  # comparisons that ran out of time (each killed a child)

    def compare(self, a: str, b: str) -> bool:
        """``latex_equal(a, b)``, or False if it takes longer than ``timeout``."""
        with self._lock:
            try:
                process = self._started()
                try:
                    process.stdin.write(json.dumps([a, b]).encode() + b"\n")
                    process.stdin.flush()
                except (BrokenPipeError, OSError):  # the child died (e.g. killed for memory): not equal, start afresh
                    self._stop()
                    return False
                answer = self._read_line(self.timeout)
            except BaseException:  # interrupted (KeyboardInterrupt): its answer would be read as the next request's
                self._stop()
                raise
            if answer is None:
                self.timeouts += 1
                self._stop()
                return False
            return answer == b"1"

    @property
    def pid(self) -> int | None:
        """The running child's process id (None before the first comparison or after a timeout)."""
        return None if self._process is None else self._process.pid

    def close(self) -> None:
        """Stop the child (a later comparison starts a new one)."""
        with self._lock:
            self._stop()

    def _started(self) -> subprocess.Popen:
        if self._process is not None and self._process.poll() is None:
            return self._process
        if os.name != "posix":
            raise NotImplementedError("SympyWorker needs a POSIX system (it waits on pipes with select).")
        self._stop()
        self._process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, bufsize=0, start_new_session=True)
        self._finalizer = weakref.finalize(self, _kill, self._process)
        if self._read_line(self.startup_timeout) != b"ready":
            self._stop()
            raise RuntimeError(f"the sympy worker ({' '.join(self.command[:2])} ...) did not start within "
                               f"{self.startup_timeout} s.")
        return self._process

    def _read_line(self, timeout: float) -> bytes | None:
        """One line from the child, or None at timeout or if the child is gone."""
        deadline = time.monotonic() + timeout
        fd = self._process.stdout.fileno()
        while b"\n" not in self._buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the child
        self._process, self._finalizer, self._buffer = None, None, b""

    def __getstate__(self) -> dict:  # picklable (TRL may send reward functions to worker processes)
        return {"timeout": self.timeout, "startup_timeout": self.startup_timeout, "command": self.command,
                "timeouts": self.timeouts}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["timeout"], state["startup_timeout"], state["command"])
        self.timeouts = state["timeouts"]


def _kill(process: subprocess.Popen) -> None:
    """Kill and reap a child, closing its pipes."""
    if process.poll() is None:
        process.kill()
    process.wait()
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()


if __name__ == "__main__":
    _serve()
