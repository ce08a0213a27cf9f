"""Format rewards, plus the small text helpers every reward in this package shares.

TRL hands reward functions either plain strings (standard datasets) or lists of chat messages (conversational
datasets). :func:`completion_to_text` turns both into one string, so every reward here accepts both shapes.
:func:`last_boxed_content` is the single definition of "the final answer in a \\boxed{}" used by the format reward and
the math reward, so the two always agree on what counts as a boxed answer.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

__all__ = [
    "ThinkFormatReward",
    "boxed_format_reward",
    "completion_to_text",
    "has_box",
    "last_boxed_content",
    "think_format_reward",
]

# `\boxed{`, `\boxed {` and the `\fbox{` spelling that some solutions (e.g. AIME write-ups) use.
_BOX_OPEN = re.compile(r"\\(?:boxed|fbox)\s*\{")


def completion_to_text(completion: Any) -> str:
    """Return the text of one completion, whatever shape TRL passed it in.

    Accepts a plain string, a list of chat messages (``[{"role": "assistant", "content": "..."}]``, where content may
    itself be a list of ``{"type": "text", "text": ...}`` parts), or a single message dict. Assistant messages are
    joined; if no message has an assistant role, all messages are joined. Anything else becomes ``""`` so that a
    malformed completion scores as wrong instead of crashing the trainer.
    """
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if not isinstance(completion, (list, tuple)):
        return ""
    messages = [m for m in completion if isinstance(m, dict)]
    assistant = [m for m in messages if m.get("role") == "assistant"]
    return "\n".join(_content_to_text(m.get("content")) for m in (assistant or messages))


def _content_to_text(content: Any) -> str:
    """Flatten a message ``content`` that is either a string or a list of typed parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def has_box(text: str) -> bool:
    """True if ``text`` opens at least one ``\\boxed{`` / ``\\fbox{`` (closed or not)."""
    return _BOX_OPEN.search(text) is not None


def last_boxed_content(text: str) -> str | None:
    """Return the content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``.

    Braces are matched with a counter that skips escaped braces (``\\{``, ``\\}``), so nested LaTeX such as
    ``\\boxed{\\frac{1}{2}}`` or ``\\boxed{\\{1, 2\\}}`` comes back whole. Returns ``None`` when there is no box
    or when the last box is never closed (e.g. a completion truncated mid-answer): an earlier box is deliberately NOT
    used as a fallback, because the last one is the model's final answer.
    """
    matches = list(_BOX_OPEN.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    end = _closing_brace(text, start)
    return None if end is None else text[start:end]


def _closing_brace(text: str, start: int) -> int | None:
    """The index of the brace that closes the group opened just before ``start``, skipping escaped characters
    (``\\{``, ``\\}``); ``None`` if it is never closed."""
    depth = 1
    i = start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


# What prints nothing in a box: LaTeX spacing and empty groups (removed until none is left), and phantoms.
_BLANK_LATEX = re.compile(r"\\[,;:!> ]|~|\\(?:q?quad|enspace|(?:neg)?(?:thin|med|thick)space|space|hfill)(?![a-zA-Z])"
                          r"|\\(?:text|mathrm|mbox|hbox|textbf|mathbf)\s*\{\s*\}|\{\s*\}")
_PHANTOM = re.compile(r"\\[hv]?phantom\s*\{")


def _prints_something(content: str) -> bool:
    """Whether a box's content shows anything: not only spaces, invisible characters (zero-width, format marks),
    LaTeX spacing, phantoms or empty groups (``\\boxed{\\,}``, ``\\boxed{{}}``, ``\\boxed{\\phantom{0}}``)."""
    visible = "".join(ch for ch in content if unicodedata.category(ch)[0] not in "CZ")
    while (phantom := _PHANTOM.search(visible)) is not None:
        end = _closing_brace(visible, phantom.end())
        if end is None:
            break  # an unclosed phantom: what follows it shows
        visible = visible[:phantom.start()] + visible[end + 1:]
    previous = None
    while previous != visible:
        previous, visible = visible, _BLANK_LATEX.sub("", visible)
    return bool(visible)


def boxed_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """1.0 if the completion's last ``\\boxed{...}`` is closed (balanced braces) and shows something, else 0.0.

    Rule chosen: *at least one* box, judged by the last one. Requiring exactly one box would punish a model for
    boxing an intermediate result and then restating the final answer, which is harmless because the math reward
    reads only the last box. A box that prints nothing (spaces, invisible characters, LaTeX spacing, phantoms, empty
    groups) is empty. Extra TRL keyword arguments (dataset columns, ``trainer_state``, ...) are ignored.
    """
    rewards = []
    for completion in completions:
        content = last_boxed_content(completion_to_text(completion))
        rewards.append(1.0 if content is not None and _prints_something(content) else 0.0)
    return rewards


class ThinkFormatReward:
    """Reward ``<think>reasoning</think>answer`` completions: 1.0 if well formed, else 0.0.

    Well formed means: exactly one ``<think>`` and one ``</think>`` (only leading whitespace before ``<think>``),
    non-empty reasoning between them, and a non-empty answer after ``</think>``. With ``prompt_opens_think=True`` the
    chat template already ended the prompt with ``<think>`` (as Qwen3/DeepSeek-R1 templates do), so the completion
    must contain no ``<think>`` and exactly one ``</think>``. A callable class (not a closure) so it pickles.
    """

    def __init__(self, prompt_opens_think: bool = False) -> None:
        self.prompt_opens_think = prompt_opens_think
        self.__name__ = "think_format_reward"

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float]:
        return [self._score(completion_to_text(c)) for c in completions]

    def _score(self, text: str) -> float:
        if text.count("</think>") != 1 or text.count("<think>") != (0 if self.prompt_opens_think else 1):
            return 0.0
        head, answer = text.split("</think>")
        if not self.prompt_opens_think:
            before, _, head = head.partition("<think>")
            if before.strip():
                return 0.0
        return 1.0 if head.strip() and answer.strip() else 0.0


def think_format_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    """Module-level :class:`ThinkFormatReward` with the default settings (completion opens ``<think>`` itself)."""
    return _DEFAULT_THINK(completions, **kwargs)


_DEFAULT_THINK = ThinkFormatReward()


def check_column_lengths(reward_name: str, completions: int, columns: dict[str, Any]) -> None:
    """Raise a ValueError naming the first dataset column (given, not None) whose length is not one value per
    completion: what TRL passes a reward function is one row per completion."""
    for column, values in columns.items():
        if values is not None and len(values) != completions:
            raise ValueError(f"{reward_name}: got {completions} completions but {len(values)} values in the "
                             f"`{column}` column; pass one row per completion.")


_TRL_REWARD_KWARGS = {"prompts", "completion_ids", "trainer_state", "log_metric", "log_extra"}
"""Keyword arguments TRL passes to a reward function that are not dataset columns."""


def missing_column_error(reward_name: str, what: str, columns: str, kwargs: dict, rename: str) -> ValueError:
    """The error for a call that got none of the dataset columns a reward reads ``what`` from: every row would score
    None and the run would train nothing (a row whose column holds None scores None instead). ``kwargs``: the other
    keywords the reward got, less TRL's own; ``rename``: an example fix."""
    given = sorted(set(kwargs) - _TRL_REWARD_KWARGS)
    return ValueError(f"{reward_name} reads the {what} from a {columns} dataset column; none was passed (the other "
                      f"columns: {given}). Rename the column, e.g. {rename}.")
