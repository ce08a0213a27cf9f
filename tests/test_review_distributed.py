"""Multi-process metrics that must not depend on how the batch is split over processes (two CPU processes over
gloo against one process with twice the per-device batch)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from test_distributed import TWO_CPU_PROCESSES, accelerate_launch, history, train

GAP_METRICS = ("rollout/sampler_logp_gap", "rollout/sampler_logp_gap_exact")


SETTINGS = {"gap": dict(eos_scale=7.0, seed=2, shrinkage=2, step_normalization="sequence", loss_type="dapo"),
            "rollout": dict(eos_scale=5.0, seed=1, denoising_steps=4, confidence_threshold=0.2)}
"""The TraceRL settings of each check, trained for one step on two processes in one launch (``two_processes``)."""


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    """One TraceRL step of each of ``SETTINGS`` on 2 processes x 2 rows, in one launch (its start-up is most of its
    cost): ``OUT/tracerl@<name>``."""
    out = tmp_path_factory.mktemp("two")
    variants = {f"@{name}": settings for name, settings in SETTINGS.items()}
    accelerate_launch(TWO_CPU_PROCESSES, train.__file__, "--out", str(out), "--per_device_batch", "2",
                      "--max_steps", "1", "--jobs", *(f"tracerl@{name}" for name in SETTINGS), "--overrides",
                      json.dumps(variants), timeout=300)
    return out


def first_logs_two_and_one(two_processes: Path, tmp_path: Path, name: str) -> tuple[dict, dict]:
    """The first logged step of one TraceRL step with ``SETTINGS[name]`` on 2 processes x 2 rows and on 1 process x
    4 rows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.run("tracerl", tmp_path / "one", 4, 1, **SETTINGS[name])
    finally:
        torch.set_num_threads(threads)
    return history(two_processes / f"tracerl@{name}")[0], history(tmp_path / "one" / "tracerl")[0]


@pytest.mark.slow
def test_sampler_logp_gap_is_pooled_over_processes(two_processes, tmp_path):
    """The gap is a mean over every process's committed tokens, not a mean of per-process means: with merged steps
    (shrinkage 2, a gap far from 0) and completions of different lengths (so the processes hold different token
    counts) it equals the one-process value."""
    two, one = first_logs_two_and_one(two_processes, tmp_path, "gap")
    assert one["completions/min_length"] < one["completions/max_length"]  # unequal token counts per process
    assert one["rollout/sampler_logp_gap"] > 0.1  # far from float noise: a mean of means differs at ~1e-3
    for name in GAP_METRICS:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-7), name


ROLLOUT_METRICS = ("rollout/tokens_per_step", "rollout/forward_passes", "rollout/denoising_steps_per_block")


@pytest.mark.slow
def test_rollout_metrics_cover_every_process(two_processes, tmp_path):
    """Dynamic decoding (a low confidence threshold) commits a varying number of tokens per step, so the processes'
    rows differ: the sampler metrics describe all of them, as one process sampling the whole batch does (they were
    process 0's own)."""
    two, one = first_logs_two_and_one(two_processes, tmp_path, "rollout")
    assert one["rollout/tokens_per_step"] not in (1.0, 2.0)  # rows commit different numbers of tokens per step
    for name in ROLLOUT_METRICS:
        assert two[name] == pytest.approx(one[name], rel=1e-5), name


SFT_EVAL = ("eval_entropy", "eval_mean_token_accuracy", "eval_scored_tokens")


SFT_EVAL_SCRIPT = Path(train.__file__).with_name("sft_eval.py")


@pytest.fixture(scope="module")
def sft_eval_on_two_processes(tmp_path_factory) -> Path:
    """One two-process launch evaluating 5 and then 7 samples (a launch's start-up is most of its cost)."""
    out = tmp_path_factory.mktemp("sft_eval_two")
    accelerate_launch(TWO_CPU_PROCESSES, SFT_EVAL_SCRIPT, "--out", str(out), "--per_device_batch", "2",
                      "--samples", "5", "7", timeout=300)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("samples", [5, 7])
def test_sft_eval_metrics_ignore_the_padding_of_the_last_batch(tmp_path, samples, sft_eval_on_two_processes):
    """5 or 7 eval samples, global eval batch 4: accelerate pads each process's last batch with samples from the
    start (5: process 1 holds only padding; 7: half of it). The token metrics count every real sample once, as one
    process with batch 4 does (``gather_for_metrics`` of per-process sums kept process 0's sum, padding included)."""
    spec = importlib.util.spec_from_file_location("sft_eval", SFT_EVAL_SCRIPT)
    sft_eval = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sft_eval)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = sft_eval.run(tmp_path / "one", 4, samples)
    finally:
        torch.set_num_threads(threads)
    two = json.loads((sft_eval_on_two_processes / str(samples) / "metrics.json").read_text())
    for name in SFT_EVAL:
        assert two[name] == pytest.approx(one[name], rel=1e-5, abs=1e-6), name
