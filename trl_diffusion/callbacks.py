"""Training callbacks and training-curve plots shared by the examples and scripts."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast
from transformers import TrainerCallback

from .data.arithmetic import ArithmeticProblem, evaluate_accuracy

HELD_OUT_KEY = "eval/held_out_accuracy"


def held_out_curve(log_history: list[dict]) -> list[tuple[int, float]]:
    """The ``(step, accuracy)`` points that ``HeldOutAccuracyCallback`` logged, in order: the whole run's curve,
    including the part before a resume (``log_history`` is restored from the checkpoint)."""
    return [(entry["step"], round(entry[HELD_OUT_KEY], 4)) for entry in log_history if HELD_OUT_KEY in entry]


class HeldOutAccuracyCallback(TrainerCallback):
    """Greedy held-out accuracy on arithmetic problems when training starts, every ``every`` optimizer steps and
    when it ends, appended to ``state.log_history`` as ``eval/held_out_accuracy`` (read by ``held_out_curve`` and
    ``save_training_curves``; a callback has no ``Trainer.log``, so ``report_to`` integrations do not receive it),
    printed as JSON by the main process and kept in ``curve`` (this process's measurements). A resumed run does not
    measure again at the step it resumes from when the checkpoint's history already has the starting point, so its
    logged curve is the uninterrupted run's. Every process measures (the model must be whole on each: not under
    ZeRO-3 / FSDP)."""

    def __init__(self, model, tokenizer, problems: list[ArithmeticProblem], every: int, **generate_kwargs):
        self.model, self.tokenizer, self.problems, self.every = model, tokenizer, problems, every
        self.generate_kwargs = generate_kwargs
        self.curve: list[tuple[int, float]] = []

    def measure(self, step: int, announce: bool = True) -> float:
        accuracy = evaluate_accuracy(self.model, self.tokenizer, self.problems, **self.generate_kwargs)
        self.curve.append((step, round(accuracy, 4)))
        if announce:
            print(json.dumps({"step": step, "held_out_accuracy": round(accuracy, 4)}), flush=True)
        return accuracy

    def _record(self, state) -> None:
        accuracy = self.measure(state.global_step, announce=state.is_world_process_zero)
        state.log_history.append({"step": state.global_step, HELD_OUT_KEY: accuracy})

    def on_train_begin(self, args, state, control, **kwargs):
        if not held_out_curve(state.log_history):  # a fresh run, or a checkpoint made without this callback
            self._record(state)

    def on_step_end(self, args, state, control, **kwargs):
        if self.every and state.global_step % self.every == 0:
            self._record(state)

    def on_train_end(self, args, state, control, **kwargs):
        if held_out_curve(state.log_history)[-1][0] != state.global_step:
            self._record(state)


class TimeBudgetCallback(TrainerCallback):
    """Stop training once ``seconds`` of training have passed, and anneal by wall time: over the last
    ``decay_fraction`` of the budget the learning rate falls linearly from ``args.learning_rate`` to 0
    (warmup-stable-decay keyed on time, so a time-boxed run ends annealed however fast the machine is). Meant for a
    constant schedule after warmup; checked after every optimizer step. With several processes the time is process
    0's, so every process anneals and stops at the same step."""

    def __init__(self, seconds: float, decay_fraction: float = 0.0, clock=time.perf_counter) -> None:
        if not seconds > 0 or not 0.0 <= decay_fraction <= 1.0:  # NaN fails both comparisons: never stopped
            raise ValueError(f"need seconds > 0 and 0 <= decay_fraction <= 1, got {seconds} and {decay_fraction}.")
        self.seconds, self.decay_fraction, self.clock = seconds, decay_fraction, clock
        self.start = clock()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = self.clock()

    def elapsed(self) -> float:
        """Seconds since training began, by process 0's clock: by their own clocks processes would stop at different
        steps (the others then wait forever in the next collective) and step with different learning rates."""
        seconds = self.clock() - self.start
        world = PartialState()
        if world.num_processes > 1:
            seconds = broadcast(torch.tensor([seconds], dtype=torch.float64, device=world.device)).item()
        return seconds

    def on_step_end(self, args, state, control, optimizer=None, lr_scheduler=None, **kwargs):
        remaining = self.seconds - self.elapsed()
        if remaining <= 0:
            control.should_training_stop = True
        elif remaining < self.decay_fraction * self.seconds:
            lr = args.learning_rate * remaining / (self.decay_fraction * self.seconds)
            if lr_scheduler is not None:  # the schedule's factor (1 after warmup) now multiplies the decayed lr
                lr_scheduler.base_lrs = [lr] * len(lr_scheduler.base_lrs)
            for group in optimizer.param_groups:
                group["lr"] = lr
        return control


def save_training_curves(log_history: list[dict], path: str | Path, keys: list[str], title: str = "") -> Path | None:
    """One PNG with a panel per logged key (e.g. reward, held-out accuracy, tokens per step) against the step.
    Keys that were never logged are skipped; returns the path, or None when nothing was logged. The plotted numbers
    are stored in the PNG's ``Curves`` text chunk (JSON ``{key: [[step, value], ...]}``), so they can be read back
    from the figure alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {k: [(h["step"], h[k]) for h in log_history if k in h and "step" in h] for k in keys}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, axes = plt.subplots(1, len(series), figsize=(4 * len(series), 3.2), squeeze=False)
    for ax, (key, points) in zip(axes[0], series.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, marker="o", markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, metadata={"Curves": json.dumps(series)})
    plt.close(fig)
    return path
