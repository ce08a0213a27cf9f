"""transformers' choice of the best checkpoint (``metric_for_best_model``), told where an evaluation cannot be it.

An evaluation whose ``metric_for_best_model`` is NaN never compares better than another, and one whose value is
None (TraceRL's reward when no reward function scored a completion) made transformers fail with a TypeError
comparing it: the three trainers pass their metrics through :func:`usable_best_metric` first.
"""

from __future__ import annotations

import math

from transformers import TrainingArguments
from transformers.utils import logging

logger = logging.get_logger(__name__)


def usable_best_metric(metrics: dict, metric_for_best_model: str | None, step: int, why: str) -> dict:
    """``metrics`` for transformers' ``_determine_best_metric``: a ``metric_for_best_model`` value of None made NaN,
    and a warning (``why``: the likely cause) when it is NaN: this evaluation cannot be chosen as the best (if none
    can, ``best_model_checkpoint`` stays None and ``load_best_model_at_end`` loads nothing), which transformers
    does silently."""
    if metric_for_best_model is None:
        return metrics
    key = metric_for_best_model if metric_for_best_model.startswith("eval_") else f"eval_{metric_for_best_model}"
    if key in metrics and metrics[key] is None:
        metrics = {**metrics, key: math.nan}
    value = metrics.get(key)
    if isinstance(value, float) and math.isnan(value):
        logger.warning(f"metric_for_best_model {key!r} is NaN at step {step}: {why}. A NaN is never better than "
                       "another value, so this evaluation cannot be chosen as the best checkpoint (if none can, "
                       "best_model_checkpoint stays None and load_best_model_at_end loads nothing). Choose another "
                       "metric_for_best_model (e.g. 'eval_loss') or evaluate on rows that give it a value.")
    return metrics


def check_best_metric_names_a_set(eval_dataset, args: TrainingArguments) -> None:
    """Refuse, when the trainer is built, a ``metric_for_best_model`` that no evaluation of a dict of eval datasets
    logs: transformers logs each set's metrics as ``eval_<name>_<metric>``, and failed with a KeyError only at the
    first evaluation, after the training steps before it (``load_best_model_at_end`` sets ``"loss"`` by default).
    Without an ``eval_strategy`` training never looks the metric up."""
    metric_for_best_model = args.metric_for_best_model
    if not isinstance(eval_dataset, dict) or not eval_dataset or metric_for_best_model is None or \
            args.eval_strategy == "no":
        return
    metric = metric_for_best_model.removeprefix("eval_")
    if not any(metric.startswith(f"{name}_") for name in eval_dataset):
        first = next(iter(eval_dataset))
        raise ValueError(f"metric_for_best_model={metric_for_best_model!r} is logged by no evaluation: with a dict of "
                         f"eval datasets ({', '.join(map(repr, eval_dataset))}) each set's metrics are named "
                         f"eval_<set>_<metric>; name the set that chooses the best checkpoint, e.g. "
                         f"metric_for_best_model='{first}_{metric}'.")
