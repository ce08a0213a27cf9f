"""The one wording of the refusals of inputs that hold the mask token.

A prompt or a committed token equal to the mask id cannot be told from a masked position, so the sampler, the
three trainers and eval each refuse it where they first see it; these helpers keep how they name the token and
the rows the same everywhere, and the remedy for conversational prompts (SFT, whose rows carry their own
``chat_template_kwargs`` column, words it for that column).
"""

from __future__ import annotations

from collections.abc import Sequence

SANITIZE_CONTROL_TOKENS = (
    "chat_template_kwargs={'sanitize_control_tokens': True} (transformers then encodes the control tokens written in "
    "messages as text)"
)
"""The remedy for conversational text holding the mask token's string."""


def mask_token_name(mask_id: int, mask_token: str | None = None) -> str:
    """``the mask token '<|MASK|>' (id 3)``; without the string (a sampler sees ids only) ``the mask token (id 3)``."""
    string = f" {mask_token!r}" if mask_token else ""
    return f"the mask token{string} (id {mask_id})"


def first_few(items: Sequence, limit: int = 5) -> str:
    """The first ``limit`` items joined by commas, with ``, ...`` when there are more."""
    return ", ".join(map(str, items[:limit])) + (", ..." if len(items) > limit else "")
