"""Multi-process evaluation metrics that must not depend on how the batch is split over processes (two CPU processes
over gloo against one process with twice the per-device batch), for combinations the scale-out tests of
``test_distributed.py`` do not evaluate: the value trainer's evaluation on an eval set that does not fill the last
global batch, and TraceRL's evaluation loss."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from test_distributed import HELPERS, TWO_CPU_PROCESSES, accelerate_launch


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HELPERS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


value_eval = _load("value_eval")
tracerl_eval = _load("tracerl_eval")


def in_one_process(run, *args, **kwargs):
    """``run`` in this process with one thread, as each of the two launched processes runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


VALUE_EVAL = ("eval_value/mean", "eval_value/explained_variance")


@pytest.fixture(scope="module")
def value_eval_on_two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("value_eval_two")
    accelerate_launch(TWO_CPU_PROCESSES, HELPERS / "value_eval.py", "--out", str(out), "--per_device_batch", "2",
                      "--samples", "5", "7", timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("samples", [5, 7])
def test_value_eval_metrics_ignore_the_padding_of_the_last_batch(tmp_path, samples, value_eval_on_two_processes):
    """5 or 7 trajectories, global eval batch 4: accelerate fills each process's last batch with rows from the start
    (5: process 1 holds only such rows and process 0 one; 7: process 1 one). ``value/mean`` and
    ``value/explained_variance`` are over every real trained token once, as one process with batch 4 computes them
    (the repeated rows were counted again)."""
    one = in_one_process(value_eval.run, tmp_path / "one", 4, samples)
    two = json.loads((value_eval_on_two_processes / str(samples) / "metrics.json").read_text())
    for name in VALUE_EVAL:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name


TRACERL_EVAL = ("eval_loss", "eval_reward", "eval_rollout/tokens_per_step")


@pytest.fixture(scope="module")
def tracerl_eval_on_two_processes(tmp_path_factory) -> tuple[Path, dict[int, str]]:
    """One two-process launch evaluating 4 and then 5 prompts (a launch's start-up is most of its cost): the folder
    of their metrics and each evaluation's output (stdout and stderr), by number of prompts."""
    out = tmp_path_factory.mktemp("tracerl_eval_two")
    done = accelerate_launch(TWO_CPU_PROCESSES, HELPERS / "tracerl_eval.py", "--out", str(out),
                             "--per_device_batch", "4", "--prompts", "4", "5", timeout=300)
    stdout, stderr = (stream.split(tracerl_eval.SEPARATOR) for stream in (done.stdout, done.stderr))
    # [4 prompts' output, between the two processes' separators, 5 prompts' output, between, after]
    assert len(stdout) == len(stderr) == 5, done.stdout[-2000:] + done.stderr[-2000:]
    assert not "".join(stdout[1::2] + stderr[1::2]).strip()
    return out, {4: stdout[0] + stderr[0], 5: stdout[2] + stderr[2]}


@pytest.mark.slow
def test_tracerl_eval_loss_counts_every_process(tmp_path, tracerl_eval_on_two_processes):
    """4 prompts x 4 generations = 16 rows, global eval batch 8, so no batch is padded. The evaluation loss is the
    mean over both eval batches of both processes, as one process with batch 8 computes it (accelerate counted the
    last batch's remainder over the 4 prompts, so ``gather_for_metrics`` kept process 0's loss only)."""
    out, output = tracerl_eval_on_two_processes
    one = in_one_process(tracerl_eval.run, tmp_path / "one", 8, 4)
    two = json.loads((out / "4" / "metrics.json").read_text())
    assert abs(one["eval_loss"]) > 1e-3  # not trivially equal
    for name in TRACERL_EVAL:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-7), name
    assert "rows of padding" not in output[4]


@pytest.mark.slow
def test_tracerl_eval_says_when_accelerate_pads_the_last_batch(tracerl_eval_on_two_processes):
    """5 prompts x 4 generations = 20 rows in global eval batches of 8: accelerate fills the last batch with the
    first prompt's 4 rows again, which GRPO generates, scores and counts in every eval metric (eval_reward 3.583
    where one process gives 3.542). The trainer says so, once."""
    _, output = tracerl_eval_on_two_processes
    assert output[5].count("rows of padding") == 1 and "the last eval batch holds 4 rows of padding" in output[5]


def test_tracerl_eval_loss_weighs_every_eval_batch_fully(tmp_path, monkeypatch):
    """One process, 4 prompts x 4 generations in eval batches of 8 rows: ``eval_loss`` is the mean of the two batch
    losses (the last batch was cut to 4 of its 8 rows' losses, the remainder of 4 prompts over 8 rows)."""
    from trl_diffusion.trainers import tracerl_trainer

    losses = []
    step = tracerl_trainer.TraceRLTrainer.prediction_step

    def spy(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        losses.append(out[0].item())
        return out

    monkeypatch.setattr(tracerl_trainer.TraceRLTrainer, "prediction_step", spy)
    metrics = in_one_process(tracerl_eval.run, tmp_path, 8, 4)
    assert len(losses) == 2 and abs(losses[0] - losses[1]) > 1e-3
    assert metrics["eval_loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)
