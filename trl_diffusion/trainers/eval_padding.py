"""Which rows of an evaluation batch are real: accelerate pads the last batch of a dataset whose size is not a
multiple of the global batch with samples from its start, which metrics must leave out."""

from __future__ import annotations

from accelerate import Accelerator


def padded_eval_batch(accelerator: Accelerator) -> bool:
    """Whether this is the last batch of a dataset whose size is not a multiple of the global batch (accelerate
    fills it with samples from the start)."""
    state = accelerator.gradient_state
    return bool(state.end_of_dataloader and state.remainder > 0)


def real_eval_rows(accelerator: Accelerator, rows: int) -> int | None:
    """How many of this process's ``rows`` are real samples (None: all). In process order, the first
    ``remainder`` rows of the padded global batch are the real ones."""
    if not padded_eval_batch(accelerator):
        return None
    remainder = accelerator.gradient_state.remainder
    real = min(rows, max(0, remainder - accelerator.process_index * rows))
    return None if real == rows else real
