"""DeepSpeed ZeRO-2 and ZeRO-3 on the CPU: two processes (gloo) with the shipped accelerate configs train exactly as
two DDP processes do (same parameters to float32 rounding, same logged metrics).

What runs under ZeRO-3 here: the policy's weights sharded over the processes (checked on every parameter), SFT,
TraceRL with its rollouts on weights gathered once (``ds3_gather_for_generation=True``, TRL's default) and on
sharded weights (``False``), scoring forwards recomputed in the backward pass (``recompute_scoring_forwards``:
ZeRO-3 gathers each module's weights again in that module's own hooks), processes decoding different numbers of
steps (both run as many forwards: with gathered weights too, DeepSpeed's start-of-forward hook, which TRL's
``remove_hooks`` leaves in place, is a collective until its trace is recorded again after every rollout; a run
without ``synced_gpus`` hung here), the value model beside it with packed scoring split into one row per forward
(processes agree on the number of forwards), ``DiffusionValueTrainer`` (its value model loaded partitioned and trained
by DeepSpeed's engine), a mixture-of-experts policy (SDAR-MoE, whose experts run in every
training forward), and the 16-bit weights gathered on rank 0 (``zero3_save_16bit_model``). The runs live in
``tests/distributed/train.py``.

Checked with DeepSpeed 0.19.8 under accelerate 1.15 and 1.16 (the shipped configs as they are: the runs' own
``use_cpu=True`` puts them on the CPU, and DeepSpeed's CPU accelerator talks over gloo).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_distributed import (
    CONFIGS,
    EOS_SCALE,
    HELPERS,
    TWO_CPU_PROCESSES,
    VALUE_REL,
    accelerate_launch,
    assert_same_metrics,
    history,
    parameters,
)

pytestmark = pytest.mark.slow
pytest.importorskip("deepspeed", reason="DeepSpeed is an optional dependency (the deepspeed and dev extras)")

JOBS = ["sft", "tracerl", "tracerl_value", "tracerl_sharded_rollouts", "tracerl_moe", "tracerl_resume", "value"]
OVERRIDES = {"eos_scale": EOS_SCALE, "tracerl.max_completion_length": 16, "tracerl.num_generations": 2,
             "tracerl.kl_reference": "reference_model", "sft.scoring_token_budget": 24,
             "sft.recompute_scoring_forwards": True}
"""Completions of mixed lengths, and each process holding one prompt's group: the processes decode different
numbers of steps. The KL against a frozen reference model (prepared by DeepSpeed, sharded under ZeRO-3). The value
job recomputes its scoring forwards in the backward pass (``recompute_scoring_forwards``, policy and value model),
and SFT splits each micro-batch into forwards of at most 24 tokens, recomputed in its one backward."""


def launch(root: Path, launcher: list[str], jobs: list[str]) -> Path:
    accelerate_launch(launcher, HELPERS / "train.py", "--out", str(root), "--per_device_batch", "2",
                      "--max_steps", "2", "--jobs", *jobs, "--overrides", json.dumps(OVERRIDES))
    return root


def deepspeed_launcher(config: str) -> list[str]:
    """The shipped config with two processes and no mixed precision (the runs' ``use_cpu=True`` puts them on the
    CPU; accelerate's ``--cpu`` would start one process without DeepSpeed)."""
    return ["--config_file", str(CONFIGS / f"{config}.yaml"), "--num_processes", "2", "--mixed_precision", "no"]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> Path:
    """The DDP runs the DeepSpeed ones are compared with (``reference_job``)."""
    return launch(tmp_path_factory.mktemp("ddp"), TWO_CPU_PROCESSES, sorted({reference_job(job) for job in JOBS}))


def assert_same_parameters(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal up to float32 summation order (ZeRO reduce-scatters the gradients where DDP all-reduces buckets), which
    two SGD steps at learning rate 0.5 amplify: up to 1.4e-5 on a norm weight of about 1 here, against changes of
    order 0.1 that a wrong gradient scale or a mixed-up rollout would make. The value model compares at 1e-3 as in
    test_distributed.py (``VALUE_REL``)."""
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        atol = 1e-3 if name.startswith("value.") else 1e-4
        torch.testing.assert_close(got[name], tensor, atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def reference_job(job: str) -> str:
    """The DDP run a job is compared with (``ds3_gather_for_generation`` means nothing without ZeRO-3)."""
    return "tracerl" if job == "tracerl_sharded_rollouts" else job


@pytest.fixture(scope="module")
def zero3(tmp_path_factory) -> Path:
    return launch(tmp_path_factory.mktemp("zero3"), deepspeed_launcher("deepspeed_zero3"), JOBS)


def test_zero3_trains_as_ddp(zero3, ddp):
    runs = zero3
    for job in JOBS:
        setup = json.loads((runs / job / "setup.json").read_text())
        assert setup["zero_stage"] == 3 and setup["sharded"] and setup["wrapper"] == "DeepSpeedEngine", job
        assert setup["recompute_scoring_forwards"] == (job in ("sft", "tracerl_value", "value")), job
        expected = ddp / reference_job(job)
        assert_same_metrics(history(runs / job), history(expected), rel=1e-4, skip=frozenset({"train_loss"}),
                            value_rel=VALUE_REL)
        assert_same_parameters(parameters(runs / job), parameters(expected))
        # the policy's gathered state dict is materialised on rank 0 only; the value model is replicated
        rank0, rank1 = parameters(runs / job), parameters(runs / job, 1)
        assert rank1.keys() == {name for name in rank0 if name.startswith("value.")}, job
        assert all(torch.equal(rank1[name], rank0[name]) for name in rank1), job
    for job in ("tracerl", "tracerl_value", "tracerl_sharded_rollouts", "tracerl_moe", "tracerl_resume"):
        setup = json.loads((runs / job / "setup.json").read_text())
        assert setup["ref_wrapper"] == "DeepSpeedEngine", job
        assert setup["model"] == ("SDARMoeForCausalLM" if job == "tracerl_moe" else "SDARForCausalLM"), job
        assert setup["rollout_graphs"] == "off", job  # their forwards are collectives: decoded eagerly
    # the premise: the processes decoded different numbers of forwards in some rollout, which would leave one waiting
    # in a collective the other never enters, had generate() not run as many forwards on both (synced_gpus)
    forwards = [json.loads((runs / "tracerl" / f"rollout_forwards_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert forwards[0] != forwards[1], forwards
    # decoding from gathered and from sharded weights, the same rollouts (TraceRL logs the busiest process's count)
    busiest = [entry["rollout/forward_passes"] for entry in history(runs / "tracerl_sharded_rollouts")
               if "rollout/forward_passes" in entry]
    assert busiest == [max(pair) for pair in zip(*forwards)]


def test_zero3_resumes_exactly(zero3, tmp_path):
    """Resumed from its step-1 checkpoint (inside a generation cycle: ``num_iterations=2``; the value model; the
    reference model as ``sync_ref_model`` mixed it, sharded), the run ends where the uninterrupted one ended."""
    checkpoint = zero3 / "tracerl_resume" / "checkpoint-1"
    assert (checkpoint / "ref_model_state.pt").is_file() and (checkpoint / "value_state.pt").is_file()
    accelerate_launch(deepspeed_launcher("deepspeed_zero3"), HELPERS / "train.py", "--out", str(tmp_path),
                      "--per_device_batch", "2", "--max_steps", "2", "--jobs", "tracerl_resume", "--overrides",
                      json.dumps(OVERRIDES), "--resume", str(checkpoint))
    resumed, uninterrupted = tmp_path / "tracerl_resume", zero3 / "tracerl_resume"
    assert [e["step"] for e in history(resumed) if "loss" in e] == [1, 2]  # step 1's from the checkpoint
    assert_same_metrics(history(resumed), history(uninterrupted), rel=1e-6, skip=frozenset({"train_loss"}))
    assert_same_parameters(parameters(resumed), parameters(uninterrupted))


def test_zero2_trains_as_ddp(tmp_path, ddp):
    jobs = ["sft", "tracerl", "tracerl_value"]
    runs = launch(tmp_path, deepspeed_launcher("deepspeed_zero2"), jobs)
    for job in jobs:
        setup = json.loads((runs / job / "setup.json").read_text())
        assert setup["zero_stage"] == 2 and not setup["sharded"], job
        assert job == "sft" or setup["ref_wrapper"] == "DeepSpeedEngine"
        assert setup["recompute_scoring_forwards"] == (job in ("sft", "tracerl_value")), job
        assert_same_metrics(history(runs / job), history(ddp / job), rel=1e-4, skip=frozenset({"train_loss"}),
                            value_rel=VALUE_REL)
        assert_same_parameters(parameters(runs / job), parameters(ddp / job))
        assert_same_parameters(parameters(runs / job, 1), parameters(ddp / job))
