"""Math answer accuracy rewards: ours, checked symbolically with math-verify, and dLLM-RL's official one.

The gold answer comes from the dataset row: a bare ``answer`` column ("18", "\\frac{1}{2}"), a GSM8K-style answer
("... #### 18"), or a full ``solution`` text whose last ``\\boxed{}`` holds the answer. The prediction is the last
``\\boxed{}`` of the completion when there is one, otherwise whatever math-verify extracts from the text. Both sides
are normalised to the same ``\\boxed{...}`` form before parsing so equivalent LaTeX compares equal. On top of
math-verify's comparison the prediction must be an answer, not something math-verify can reduce to one: a box read
only in part (``17 \\lor 18``), an operation left to sympy that the gold answer does not use (the question's
``\\dbinom{31}{28}``), arithmetic or an unsimplified expression where the gold is simplified (``99^2+99+1``), an
unknown the gold answer does not have, or a number close to a small gold one only in absolute terms all score 0.0
(the rules and the reasons are in :mod:`~trl_diffusion.rewards.math_verify_check`).

math-verify's timeouts use ``signal.alarm``, which only works in the main thread. Elsewhere (e.g. a trainer that
scores rewards in a worker thread, or an ``async`` wrapper on TRL's event-loop thread) a completion is checked in a
child process, in its main thread with the same timeouts, which is killed if it has not answered in time: a short
answer such as ``\\boxed{9^{9^{9^9}}}`` would otherwise hang the caller for good.

``official_math_reward`` / :class:`OfficialMathReward` reproduce dLLM-RL's reward (``reward/rl_reward.py``,
``reward/math_utils.py``): the last ``\\boxed{}`` only, Hendrycks equivalence, else sympy under a hard 1 s limit
(in a child process), and optionally 0 for a response that reached the length limit.
"""

from __future__ import annotations

import decimal
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy

from .dllm_rl_math import SympyWorker, extract_boxed_answer, is_equiv, repeatness
from .format_reward import completion_to_text, has_box, last_boxed_content, missing_column_error
from .math_verify_check import as_boxed as _as_boxed
from .math_verify_check import boot_command, parse_boxed, verify_source

__all__ = [
    "MathAccuracyReward",
    "OfficialMathReward",
    "extract_gold_answer",
    "gold_text",
    "make_official_math_reward",
    "math_accuracy_reward",
    "official_math_reward",
]

_GSM8K_MARK = "####"


def gold_text(value: Any) -> str:
    """A gold answer field as text: ``str(value)``, except for a finite float (a float column of a parquet / JSON
    file, a numpy float): one Python writes with an exponent (``1e-05``, which math-verify reads with ``e`` as Euler's
    number, so ``0.00001`` scored 0 against it) is written positionally, and a non-integer float64 that needs 15 or
    more significant digits but is exactly a float32 (a float32 column's 1e-05 comes back from ``datasets`` as
    ``9.999999747378752e-06``) with float32's shortest digits (``0.00001``)."""
    text = str(value)
    if not (isinstance(value, float | numpy.floating) and math.isfinite(value)):
        return text  # integers, fractions, decimals and text as they are
    number = value if isinstance(value, numpy.floating) else numpy.float64(value)
    if (number.dtype == numpy.float64 and not float(value).is_integer() and numpy.float32(value) == number
            and len(decimal.Decimal(repr(float(value))).normalize().as_tuple().digits) >= 15):
        return numpy.format_float_positional(numpy.float32(value), trim="-")
    if "e" in text.lower():
        return numpy.format_float_positional(number, trim="-")
    return text


def extract_gold_answer(answer: Any = None, solution: Any = None) -> str | None:
    """Return the bare gold answer of a row (LaTeX without delimiters), or ``None`` if there is none.

    ``answer`` wins over ``solution`` when both are given (MATH-500 has both; ``answer`` is the clean one). Within one
    field: the content of the last ``\\boxed{}`` if present, else the text after the last ``####`` (GSM8K; thousands
    separators dropped), else the whole field, taken as a bare answer (TRL's own ``accuracy_reward`` examples put bare
    answers such as ``"\\frac{1}{3}"`` in the ``solution`` column).
    """
    for field in (answer, solution):
        missing = field is None or (isinstance(field, float) and field != field)  # NaN: a missing value, not "nan"
        text = "" if missing else gold_text(field).strip()
        if not text:
            continue
        boxed = last_boxed_content(text)
        if boxed is not None:
            gold = boxed.strip()
        elif has_box(text):
            continue  # an unclosed box: this field holds no usable answer
        elif _GSM8K_MARK in text:
            gold = text.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")
        else:
            gold = text
        if gold:  # an empty box or nothing after "####" is no answer (the official grader would match \boxed{})
            return gold
    return None


class MathAccuracyReward:
    """Callable reward: 1.0 if the completion's answer equals the gold answer, 0.0 if not, ``None`` if no gold.

    Args:
        parsing_timeout: seconds allowed for each math-verify parse (main thread only).
        verify_timeout: seconds allowed for each math-verify comparison (main thread only).
        max_answer_chars: answers longer than this score 0.0 without parsing.
        answer_rules: require an answer written as an answer (the rules of
            :mod:`~trl_diffusion.rewards.math_verify_check`: no operation left to sympy that the gold answer does not
            use, a written number for a numeric gold answer, no unknowns the gold answer lacks, at most one operation
            longer than it, four significant digits for a small one), so that a policy cannot score by copying the
            question's expression into the box. ``False``: math-verify's own comparison (a box is still read
            whole), for numbers comparable with other math-verify evaluations.

    Rows are read from the ``answer`` and/or ``solution`` dataset columns TRL passes as keyword lists. A row whose
    gold answer cannot be found or parsed gets ``None``, which TRL treats as NaN and leaves out of the reward; a
    call with neither column (a dataset whose gold column has another name) is a ``ValueError``. Called outside the
    main thread, each completion is checked in a child process (see the module docstring; ``close()`` stops it). A
    callable class (not a closure) so it pickles for multi-process rollouts.
    """

    def __init__(self, parsing_timeout: int = 5, verify_timeout: int = 5, max_answer_chars: int = 1000,
                 answer_rules: bool = True) -> None:
        self.parsing_timeout = parsing_timeout
        self.answer_rules = answer_rules
        self.verify_timeout = verify_timeout
        self.max_answer_chars = max_answer_chars
        self.__name__ = "math_accuracy_reward"
        self.worker: SympyWorker | None = None  # the child process that checks completions off the main thread

    def __call__(
        self,
        completions: list[Any],
        answer: list[Any] | None = None,
        solution: list[Any] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        n = len(completions)
        if answer is None and solution is None:
            raise missing_column_error(self.__name__, "gold answer", "'answer' or 'solution'", kwargs,
                                           "dataset.rename_column('ground_truth', 'answer')")
        answers = list(answer) if answer is not None else [None] * n
        solutions = list(solution) if solution is not None else [None] * n
        if len(answers) != n or len(solutions) != n:
            raise ValueError(f"math_accuracy_reward: got {n} completions but {len(answers)}/{len(solutions)} golds")
        in_main = threading.current_thread() is threading.main_thread()
        if not in_main:
            _quiet_disabled_timeout_warning()
        rewards, golds, preds = [], [], []
        parsed_golds: dict[str | None, list | None] = {}  # GRPO scores several completions per gold answer
        for completion, ans, sol in zip(completions, answers, solutions):
            text = completion_to_text(completion)
            gold = extract_gold_answer(ans, sol)
            pred = last_boxed_content(text)
            if gold not in parsed_golds:
                parsed_golds[gold] = self._parse_gold(gold, in_main)
            rewards.append(self._score(text, gold, parsed_golds[gold], in_main))
            golds.append(gold if gold is not None else "[no gold]")
            preds.append(pred if pred is not None else "[no box]")
        if log_extra is not None:
            log_extra("math_gold", golds)
            log_extra("math_boxed_pred", preds)
        return rewards

    def score(self, text: str, gold: str | None, in_main: bool = True) -> float | None:
        """Score one completion text against one bare gold answer (see the class docstring for the values)."""
        return self._score(text, gold, self._parse_gold(gold, in_main), in_main)

    def close(self) -> None:
        """Stop the child process used off the main thread (a later call starts a new one)."""
        if self.worker is not None:
            self.worker.close()

    def _parse_gold(self, gold: str | None, in_main: bool) -> list | None:
        """math-verify parse of a bare gold answer; ``None`` if absent, too long or unparseable."""
        from math_verify.errors import TimeoutException

        if gold is None or len(gold) > self.max_answer_chars:
            return None
        try:
            parsed = parse_boxed(_as_boxed(gold), self._timeout(in_main))
        except (Exception, TimeoutException):
            return None
        return parsed or None

    def _score(self, text: str, gold: str | None, gold_parsed: list | None, in_main: bool) -> float | None:
        """Compare the completion's final answer with the gold answer (``gold_parsed``: its math-verify parse)."""
        if gold_parsed is None:
            return None
        boxed = last_boxed_content(text)
        if boxed is not None:
            if len(boxed) > self.max_answer_chars:
                return 0.0
            if _without_final_period(boxed).strip() == gold.strip():
                return 1.0  # the gold answer as written: no parse, no comparison (a power tower's timed out)
            source = _as_boxed(_without_final_period(boxed))
        elif has_box(text):
            return 0.0  # the last box is unclosed: no final answer, and earlier boxes are not answers
        else:
            source = text[-self.max_answer_chars * 4 :]
        if not in_main:
            return 1.0 if self._child().compare(source, gold) else 0.0
        verdict = verify_source(source, gold_parsed, self.parsing_timeout, self.verify_timeout, gold,
                                self.answer_rules)
        return 1.0 if verdict else 0.0

    def _child(self) -> SympyWorker:
        """The child process checking completions in its main thread; killed past the timeouts plus a margin."""
        if self.worker is None:
            # both parses, the prediction's checks, the gold's tolerance, the comparison, the pipe
            limit = 2 * self.parsing_timeout + 3 * self.verify_timeout + 2
            self.worker = SympyWorker(timeout=limit, command=boot_command(self.parsing_timeout, self.verify_timeout,
                                                                         self.answer_rules))
        return self.worker

    def _timeout(self, in_main: bool) -> int | None:
        """math-verify's signal-based timeout only works in the main thread; elsewhere it must be off."""
        return self.parsing_timeout if in_main else None


class _DisabledTimeoutFilter(logging.Filter):
    """Drops math-verify's warning that its timeout is off: off the main thread the gold answer is parsed without
    one on purpose (signals only work in the main thread; predictions go to the worker process, which has one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


def _quiet_disabled_timeout_warning() -> None:
    """Add ``_DisabledTimeoutFilter`` to math-verify's loggers once; every other record and the loggers' levels stay
    as the user set them (the levels used to be raised to ERROR for the rest of the process)."""
    for name in ("math_verify.parser", "math_verify.grader"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DisabledTimeoutFilter) for f in logger.filters):
            logger.addFilter(_DisabledTimeoutFilter())


def _without_final_period(answer: str) -> str:
    r"""A boxed answer without the sentence's full stop written inside the box (``\boxed{104.}``, as in some AIME
    solutions): math-verify reads ``104.`` and ``\frac{1}{2}.`` as no answer; a trailing period changes no value."""
    stripped = answer.rstrip()
    return stripped[:-1].rstrip() if stripped.endswith(".") and not stripped.endswith("..") else answer


_DEFAULT = MathAccuracyReward()


def math_accuracy_reward(
    completions: list[Any], answer: list[Any] | None = None, solution: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """Math accuracy with default timeouts; see :class:`MathAccuracyReward` for the full contract."""
    return _DEFAULT(completions, answer=answer, solution=solution, **kwargs)


class OfficialMathReward:
    """dLLM-RL's math reward (Gen-Verse/dLLM-RL ``reward/rl_reward.py``): 1.0 if the completion's answer equals the
    gold answer by the official rules, 0.0 if not, ``None`` if the row has no gold answer.

    * The answer is the content of the completion's last ``\\boxed{`` (``sample/*_rl_rollout.py``); none, or an
      unclosed last box, scores 0.0.
    * Equal means (``math_utils.is_equal``, 414-419): Hendrycks ``is_equiv``; otherwise, unless either side is over
      128 characters and repetitive, sympy's comparison (:func:`~trl_diffusion.rewards.dllm_rl_math.latex_equal`)
      within ``timeout`` seconds, run in a child process that is killed when time runs out.
    * ``max_tokens``: a completion of at least ``max_tokens - length_margin`` tokens scores 0.0 (``rl_reward.py``
      99-103, with ``max_token`` and margin 5); the length is ``len(completion_ids[i])``, which TRL passes to reward
      functions. ``None`` switches this off, unless a call passes ``max_completion_length`` (the run's token limit;
      ``examples/math.py`` binds it to every reward function that takes it), which then plays its part.

    The gold answer is the row's ``ground_truth_answer`` (dLLM-RL's column) or ``answer``, else ``solution``, read
    as by :func:`extract_gold_answer` (a call with none of these columns is a ``ValueError``). Picklable; the child
    process starts at the first sympy comparison and stops with ``close()``, at garbage collection or at exit.
    """

    def __init__(self, max_tokens: int | None = None, length_margin: int = 5, timeout: float = 1.0,
                 name: str = "official_math_reward") -> None:
        if max_tokens is not None and max_tokens <= length_margin:
            raise ValueError(f"max_tokens must exceed length_margin ({length_margin}), got {max_tokens}.")
        if length_margin < 0:
            raise ValueError(f"length_margin must be >= 0, got {length_margin}.")
        self.max_tokens, self.length_margin = max_tokens, length_margin
        self.worker = SympyWorker(timeout=timeout)
        self.__name__ = name

    def __call__(
        self,
        completions: list[Any],
        completion_ids: list[list[int]] | None = None,
        ground_truth_answer: list[Any] | None = None,
        answer: list[Any] | None = None,
        solution: list[Any] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        max_completion_length: int | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        n = len(completions)
        max_tokens = self.max_tokens if self.max_tokens is not None else max_completion_length
        if max_tokens is not None and max_tokens <= self.length_margin:
            raise ValueError(f"{self.__name__}: max_completion_length must exceed length_margin "
                             f"({self.length_margin}), got {max_tokens}.")
        answers = ground_truth_answer if ground_truth_answer is not None else answer
        if answers is None and solution is None:
            raise missing_column_error(self.__name__, "gold answer", "'ground_truth_answer', 'answer' or 'solution'",
                                           kwargs, "dataset.rename_column('ground_truth', 'answer')")
        answers = list(answers) if answers is not None else [None] * n
        solutions = list(solution) if solution is not None else [None] * n
        if len(answers) != n or len(solutions) != n:
            raise ValueError(f"{self.__name__}: got {n} completions but {len(answers)}/{len(solutions)} golds")
        if max_tokens is not None and (completion_ids is None or len(completion_ids) != n):
            raise ValueError(f"{self.__name__}: a token limit is set, so it needs `completion_ids` (one list of token "
                             "ids per completion; TRL's trainers pass them).")
        rewards, golds, preds = [], [], []
        for i, (completion, ans, sol) in enumerate(zip(completions, answers, solutions)):
            gold = extract_gold_answer(ans, sol)
            pred = extract_boxed_answer(completion_to_text(completion))
            truncated = max_tokens is not None and len(completion_ids[i]) >= max_tokens - self.length_margin
            if gold is None:
                rewards.append(None)
            elif pred is None or truncated:
                rewards.append(0.0)
            else:
                rewards.append(1.0 if self.equal(pred, gold) else 0.0)
            golds.append(gold if gold is not None else "[no gold]")
            preds.append("[truncated]" if truncated else pred if pred is not None else "[no box]")
        if log_extra is not None:
            log_extra("official_math_gold", golds)
            log_extra("official_math_pred", preds)
        return rewards

    def equal(self, prediction: str, gold: str) -> bool:
        """dLLM-RL's ``is_equal(prediction, gold)`` (legacy mode, the one its reward uses)."""
        if is_equiv(prediction, gold):
            return True
        if any(len(text) > 128 and repeatness(text) for text in (prediction, gold)):
            return False
        return self.worker.compare(prediction, gold)

    def close(self) -> None:
        """Stop the sympy child process (a later call starts a new one)."""
        self.worker.close()


def make_official_math_reward(max_tokens: int | None = None, length_margin: int = 5,
                              timeout: float = 1.0) -> OfficialMathReward:
    """dLLM-RL's math reward with its length rule: pass the rollout's token limit (dLLM-RL's ``max_token``, e.g. 2000
    for TraDo; TRL's ``max_completion_length``) as ``max_tokens``; see :class:`OfficialMathReward`."""
    return OfficialMathReward(max_tokens=max_tokens, length_margin=length_margin, timeout=timeout)


_OFFICIAL = OfficialMathReward()


def official_math_reward(
    completions: list[Any],
    ground_truth_answer: list[Any] | None = None,
    answer: list[Any] | None = None,
    solution: list[Any] | None = None,
    max_completion_length: int | None = None,
    **kwargs: Any,
) -> list[float | None]:
    """dLLM-RL's math reward; see :class:`OfficialMathReward`. Its length rule (a completion of at least
    ``max_completion_length - 5`` tokens scores 0.0) applies when ``max_completion_length`` is given:
    ``examples/math.py`` (and so every recipe) binds the run's value; in your own script pass it with
    ``functools.partial`` or use :func:`make_official_math_reward`."""
    return _OFFICIAL(completions, ground_truth_answer=ground_truth_answer, answer=answer, solution=solution,
                     max_completion_length=max_completion_length, **kwargs)
