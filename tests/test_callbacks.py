"""Callbacks: the wall-clock budget stops training and anneals the learning rate linearly over its last part;
the training-curve PNG holds the numbers it plots."""

import json
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from transformers import TrainerControl, TrainerState
from transformers.optimization import get_constant_schedule_with_warmup

from trl_diffusion.callbacks import TimeBudgetCallback, save_training_curves


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_budget_decays_the_learning_rate_then_stops():
    clock = FakeClock()
    callback = TimeBudgetCallback(100.0, decay_fraction=0.25, clock=clock)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1e-3)
    scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=0)
    args, state = SimpleNamespace(learning_rate=1e-3), TrainerState()
    callback.on_train_begin(args, state, TrainerControl())
    seen = []
    for now in (10.0, 74.0, 80.0, 90.0, 99.0, 100.5):
        clock.now = now
        control = callback.on_step_end(args, state, TrainerControl(), optimizer=optimizer, lr_scheduler=scheduler)
        seen.append((optimizer.param_groups[0]["lr"], control.should_training_stop))
        scheduler.step()  # the trainer steps the schedule; the decayed lr must survive it
        assert optimizer.param_groups[0]["lr"] == pytest.approx(seen[-1][0])
    lrs, stops = zip(*seen)
    assert lrs[:2] == pytest.approx((1e-3, 1e-3))  # before the last quarter: untouched
    assert lrs[2:5] == pytest.approx((0.8e-3, 0.4e-3, 0.04e-3))  # linear to 0 over the last 25 s
    assert stops == (False,) * 5 + (True,)


def test_time_budget_errors():
    with pytest.raises(ValueError, match="decay_fraction"):
        TimeBudgetCallback(10.0, decay_fraction=1.5)
    with pytest.raises(ValueError, match="seconds"):
        TimeBudgetCallback(0.0)
    with pytest.raises(ValueError, match="seconds"):  # NaN passed `seconds <= 0` and never stopped training
        TimeBudgetCallback(float("nan"))


def test_training_curves_png_holds_the_logged_numbers(tmp_path):
    """One panel per key that was logged (400 px wide each), and the PNG's ``Curves`` chunk holds exactly the
    (step, value) pairs of the log; a key never logged gets no panel; nothing logged, no file."""
    history = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": 1.25, "reward": 0.5}, {"step": 3, "reward": 0.75},
               {"loss": 9.0}]  # no step: not a point of any curve
    path = save_training_curves(history, tmp_path / "curves.png", ["loss", "reward", "never_logged"])
    image = Image.open(path)
    assert image.size == (2 * 400, 320)
    assert json.loads(image.text["Curves"]) == {"loss": [[1, 2.5], [2, 1.25]], "reward": [[2, 0.5], [3, 0.75]]}
    pixels = torch.frombuffer(bytearray(image.convert("L").tobytes()), dtype=torch.uint8).view(320, 800)
    assert all((pixels[40:280, left + 60:left + 380] < 128).any() for left in (0, 400))  # a curve in each panel
    assert save_training_curves(history, tmp_path / "none.png", ["never_logged"]) is None
    assert not (tmp_path / "none.png").exists()
