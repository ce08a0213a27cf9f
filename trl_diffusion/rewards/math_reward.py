"""Math answer accuracy reward, checked symbolically with math-verify.

The gold answer comes from the dataset row: a bare ``answer`` column ("18", "\\frac{1}{2}"), a GSM8K-style answer
("... #### 18"), or a full ``solution`` text whose last ``\\boxed{}`` holds the answer. The prediction is the last
``\\boxed{}`` of the completion when there is one, otherwise whatever math-verify extracts from the text. Both sides
are normalised to the same ``\\boxed{...}`` form before parsing so equivalent LaTeX compares equal.

math-verify's timeouts use ``signal.alarm``, which only works in the main thread; elsewhere (e.g. a trainer that
scores rewards in a worker thread) the timeouts are switched off and the answer strings are length-capped instead,
which bounds the worst sympy blow-ups in practice but is not a hard time limit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from .format_reward import completion_to_text, has_box, last_boxed_content

__all__ = ["MathAccuracyReward", "extract_gold_answer", "math_accuracy_reward"]

_GSM8K_MARK = "####"


def extract_gold_answer(answer: Any = None, solution: Any = None) -> str | None:
    """Return the bare gold answer of a row (LaTeX without delimiters), or ``None`` if there is none.

    ``answer`` wins over ``solution`` when both are given (MATH-500 has both; ``answer`` is the clean one). Within one
    field: the content of the last ``\\boxed{}`` if present, else the text after the last ``####`` (GSM8K; thousands
    separators dropped), else the whole field, taken as a bare answer (TRL's own ``accuracy_reward`` examples put bare
    answers such as ``"\\frac{1}{3}"`` in the ``solution`` column).
    """
    for field in (answer, solution):
        text = "" if field is None else str(field).strip()
        if not text:
            continue
        boxed = last_boxed_content(text)
        if boxed is not None:
            return boxed.strip()
        if has_box(text):
            continue  # an unclosed box: this field holds no usable answer
        if _GSM8K_MARK in text:
            return text.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")
        return text
    return None


class MathAccuracyReward:
    """Callable reward: 1.0 if the completion's answer equals the gold answer, 0.0 if not, ``None`` if no gold.

    Args:
        parsing_timeout: seconds allowed for each math-verify parse (main thread only).
        verify_timeout: seconds allowed for each math-verify comparison (main thread only).
        max_answer_chars: answers longer than this score 0.0 without parsing (guards sympy in worker threads).

    Rows are read from the ``answer`` and/or ``solution`` dataset columns TRL passes as keyword lists. A row whose
    gold answer cannot be found or parsed gets ``None``, which TRL treats as NaN and leaves out of the reward.
    A callable class (not a closure) so it pickles for multi-process rollouts.
    """

    def __init__(self, parsing_timeout: int = 5, verify_timeout: int = 5, max_answer_chars: int = 1000) -> None:
        self.parsing_timeout = parsing_timeout
        self.verify_timeout = verify_timeout
        self.max_answer_chars = max_answer_chars
        self.__name__ = "math_accuracy_reward"

    def __call__(
        self,
        completions: list[Any],
        answer: list[Any] | None = None,
        solution: list[Any] | None = None,
        log_extra: Callable[[str, list], None] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        n = len(completions)
        answers = list(answer) if answer is not None else [None] * n
        solutions = list(solution) if solution is not None else [None] * n
        if len(answers) != n or len(solutions) != n:
            raise ValueError(f"math_accuracy_reward: got {n} completions but {len(answers)}/{len(solutions)} golds")
        in_main = threading.current_thread() is threading.main_thread()
        if not in_main:
            for name in ("math_verify.parser", "math_verify.grader"):
                logging.getLogger(name).setLevel(logging.ERROR)
        rewards, golds, preds = [], [], []
        parsed_golds: dict[str | None, list | None] = {}  # GRPO scores several completions per gold answer
        for completion, ans, sol in zip(completions, answers, solutions):
            text = completion_to_text(completion)
            gold = extract_gold_answer(ans, sol)
            pred = last_boxed_content(text)
            if gold not in parsed_golds:
                parsed_golds[gold] = self._parse_gold(gold, in_main)
            rewards.append(self._score(text, parsed_golds[gold], in_main))
            golds.append(gold if gold is not None else "[no gold]")
            preds.append(pred if pred is not None else "[no box]")
        if log_extra is not None:
            log_extra("math_gold", golds)
            log_extra("math_boxed_pred", preds)
        return rewards

    def score(self, text: str, gold: str | None, in_main: bool = True) -> float | None:
        """Score one completion text against one bare gold answer (see the class docstring for the values)."""
        return self._score(text, self._parse_gold(gold, in_main), in_main)

    def _parse_gold(self, gold: str | None, in_main: bool) -> list | None:
        """math-verify parse of a bare gold answer; ``None`` if absent, too long or unparseable."""
        from math_verify import parse
        from math_verify.errors import TimeoutException

        if gold is None or len(gold) > self.max_answer_chars:
            return None
        try:
            parsed = parse(_as_boxed(gold), extraction_config=_configs(), parsing_timeout=self._timeout(in_main))
        except (Exception, TimeoutException):
            return None
        return parsed or None

    def _score(self, text: str, gold_parsed: list | None, in_main: bool) -> float | None:
        """Compare the completion's final answer with an already parsed gold answer."""
        from math_verify import parse, verify
        from math_verify.errors import TimeoutException

        if gold_parsed is None:
            return None
        boxed = last_boxed_content(text)
        timeout = self._timeout(in_main)
        try:
            if boxed is not None:
                if len(boxed) > self.max_answer_chars:
                    return 0.0
                pred_parsed = parse(_as_boxed(boxed), extraction_config=_configs(), parsing_timeout=timeout)
            elif has_box(text):
                return 0.0  # the last box is unclosed: no final answer, and earlier boxes are not answers
            else:
                pred_parsed = parse(text[-self.max_answer_chars * 4 :], parsing_timeout=timeout)
            if not pred_parsed:
                return 0.0
            ok = verify(gold_parsed, pred_parsed, timeout_seconds=self.verify_timeout if in_main else None)
        except (Exception, TimeoutException):
            return 0.0
        return 1.0 if ok else 0.0

    def _timeout(self, in_main: bool) -> int | None:
        """math-verify's signal-based timeout only works in the main thread; elsewhere it must be off."""
        return self.parsing_timeout if in_main else None


def _configs() -> list:
    """Extraction targets for a ``$\\boxed{...}$``-wrapped answer: LaTeX with the box first, then plain expressions."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]


def _as_boxed(answer: str) -> str:
    r"""Wrap a bare answer as ``$\boxed{...}$`` so math-verify parses all of it as a single LaTeX answer."""
    return "$\\boxed{" + answer + "}$"


_DEFAULT = MathAccuracyReward()


def math_accuracy_reward(
    completions: list[Any], answer: list[Any] | None = None, solution: list[Any] | None = None, **kwargs: Any
) -> list[float | None]:
    """Math accuracy with default timeouts; see :class:`MathAccuracyReward` for the full contract."""
    return _DEFAULT(completions, answer=answer, solution=solution, **kwargs)
