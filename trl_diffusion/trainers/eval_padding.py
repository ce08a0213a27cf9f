"""Evaluation helpers the trainers share: which rows of an evaluation batch are real (accelerate pads the last batch
of a dataset whose size is not a multiple of the global batch with samples from its start, which metrics must leave
out; ``EvaluatedLoader`` names the dataloader evaluated), and TRL's evaluation metrics under ``evaluate()``'s
prefix."""

from __future__ import annotations

import math

from accelerate import Accelerator
from torch.utils.data import DataLoader


class EvaluatedLoader:
    """Trainer mixin (first base): ``_evaluated_loader`` is the dataloader ``evaluation_loop`` iterates while it runs,
    None otherwise; :func:`padded_eval_batch` reads accelerate's state for it only."""

    _evaluated_loader: DataLoader | None = None

    def evaluation_loop(self, dataloader, *args, **kwargs):
        self._evaluated_loader = dataloader
        try:
            return super().evaluation_loop(dataloader, *args, **kwargs)
        finally:
            self._evaluated_loader = None


def padded_eval_batch(accelerator: Accelerator, dataloader: DataLoader | None) -> bool:
    """Whether this is the last batch of ``dataloader`` (the one an evaluation loop iterates; None outside one) and
    its dataset's size is not a multiple of the global batch (accelerate fills it with samples from the start).
    accelerate's state is the dataloader begun last, whichever: a training loop stopped by ``max_steps`` at its last
    batch leaves its own behind, which outside an evaluation loop read as a padded eval batch (half the rows of an
    eval-mode ``compute_loss`` left out)."""
    state = accelerator.gradient_state
    return dataloader is not None and state.active_dataloader is dataloader and \
        bool(state.end_of_dataloader and state.remainder > 0)


def real_eval_rows(accelerator: Accelerator, dataloader: DataLoader | None, rows: int) -> int | None:
    """How many of this process's ``rows`` of a batch of ``dataloader`` are real samples (None: all). In process
    order, the first ``remainder`` rows of the padded global batch are the real ones."""
    if not padded_eval_batch(accelerator, dataloader):
        return None
    remainder = accelerator.gradient_state.remainder
    real = min(rows, max(0, remainder - accelerator.process_index * rows))
    return None if real == rows else real


def prefixed_eval_metrics(store: dict[str, list[float]], prefix: str) -> dict[str, float]:
    """TRL's evaluation metrics (a trainer's ``_metrics["eval"]``) named as ``evaluate(metric_key_prefix=prefix)``
    names its own: TRL's ``log`` names them ``eval_*`` whatever the prefix, so two named eval sets shared one name and
    ``predict()``'s were averaged into the next evaluation's. Each is the mean of its values, NaN left out as GRPO's
    ``log`` leaves it out (NaN when nothing is left: transformers reads the metrics as numbers, a None failed in its
    plateau scheduler and best-checkpoint comparison)."""
    means = {}
    for name, values in store.items():
        valid = [value for value in values if not math.isnan(value)]
        means[f"{prefix}_{name}"] = sum(valid) / len(valid) if valid else math.nan
    return means
