"""``reset_optimizer_per_rollout``: dLLM-RL re-creates AdamW at every RL step (a fresh process per step), so every
rollout's first update is AdamW's first step. Checked on the update itself: AdamW's first step moves every
parameter whose gradient is well above ``adam_epsilon`` by exactly the learning rate; a later step with kept moments
does not."""

import os
import subprocess
import sys

import pytest
import torch
from test_distributed import free_port
from test_tracerl_settings import make_trainer
from transformers import TrainerCallback

from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import _check_optimizer_reset

LEARNING_RATE = 1e-3


class ParameterSnapshots(TrainerCallback):
    """Every parameter, flattened, after each optimizer step."""

    def __init__(self, model):
        self.model = model
        self.after_step = []

    def on_step_end(self, args, state, control, **kwargs):
        self.after_step.append(torch.cat([p.detach().flatten().clone() for p in self.model.parameters()]))


def second_update(tmp_path, reset: bool) -> torch.Tensor:
    """The parameter change of the second optimizer step, which follows the second rollout."""
    trainer = make_trainer(tmp_path, max_steps=2, learning_rate=LEARNING_RATE, lr_scheduler_type="constant",
                           weight_decay=0.0, reset_optimizer_per_rollout=reset)
    snapshots = ParameterSnapshots(trainer.model)
    trainer.add_callback(snapshots)
    trainer.train()
    assert len(snapshots.after_step) == 2
    return snapshots.after_step[1] - snapshots.after_step[0]


def share_at_the_learning_rate(update: torch.Tensor) -> float:
    """Of the parameters that moved by more than half the learning rate, the share that moved by it (1% margin)."""
    moved = update.abs()[update.abs() > LEARNING_RATE / 2]
    return float(((moved - LEARNING_RATE).abs() < 0.01 * LEARNING_RATE).float().mean())


def test_every_rollout_starts_a_fresh_adamw(tmp_path):
    fresh = share_at_the_learning_rate(second_update(tmp_path / "reset", reset=True))
    kept = share_at_the_learning_rate(second_update(tmp_path / "kept", reset=False))
    assert fresh > 0.95  # AdamW's first step: lr * g / (|g| + eps) for every parameter
    assert kept < 0.5  # the kept moments mix the first rollout's gradients in


def test_the_value_optimizer_is_reset_too(tmp_path):
    trainer = make_trainer(tmp_path, reset_optimizer_per_rollout=True)
    weight = torch.nn.Parameter(torch.ones(3))
    trainer.value_optimizer = torch.optim.AdamW([weight], lr=0.1)
    weight.grad = torch.ones(3)
    trainer.value_optimizer.step()
    assert trainer.value_optimizer.state
    trainer._reset_optimizer_state()
    assert not trainer.value_optimizer.state


def test_deepspeed_is_refused_and_the_field_is_a_bool(tmp_path):
    """Under DeepSpeed the optimizer state lives in DeepSpeed's partitions (not checked here): refused at
    construction, as is a value that is not a bool. The presets leave it off (their recipes run ZeRO-3)."""
    args = TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                         reset_optimizer_per_rollout=True)
    with pytest.raises(ValueError, match="not supported with DeepSpeed"):
        _check_optimizer_reset(args, deepspeed=True)
    _check_optimizer_reset(args, deepspeed=False)
    assert not TraceRLConfig.from_official("trado", output_dir=str(tmp_path), use_cpu=True, bf16=False,
                                           report_to="none").reset_optimizer_per_rollout
    with pytest.raises(ValueError, match="reset_optimizer_per_rollout"):
        TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                      reset_optimizer_per_rollout="yes")


CONSTRUCT_UNDER_DEEPSPEED = """
import sys
from datasets import Dataset
from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model

for reset in (False, True):
    args = TraceRLConfig(output_dir=sys.argv[1], use_cpu=True, bf16=False, report_to="none", max_completion_length=8,
                         per_device_train_batch_size=4, num_generations=4, block_length=4, denoising_steps=2,
                         reset_optimizer_per_rollout=reset,
                         deepspeed={"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto",
                                    "gradient_accumulation_steps": "auto"})
    try:
        TraceRLTrainer(tiny_model("sdar"), lambda completions, **kwargs: [0.0] * len(completions), args=args,
                       processing_class=build_tokenizer(), train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}))
        print(f"reset={reset}: constructed", flush=True)
    except ValueError as error:
        print(f"reset={reset}: ValueError: {error}", flush=True)
"""


def test_the_trainer_refuses_it_under_deepspeed_at_construction(tmp_path):
    """A real one-process DeepSpeed (ZeRO-2, CPU) construction, in a subprocess so that its process group stays
    out of the suite: the refusal above comes from the trainer itself, and only when the option is on."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is an optional dependency (the deepspeed and dev extras)")
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    done = subprocess.run([sys.executable, "-c", CONSTRUCT_UNDER_DEEPSPEED, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("reset=")]
    assert lines[0] == "reset=False: constructed", done.stdout[-3000:]
    assert lines[1].startswith("reset=True: ValueError: reset_optimizer_per_rollout is not supported with DeepSpeed "
                               "(its optimizer keeps its state in its own partitions)"), done.stdout[-3000:]
    assert len(lines) == 2
