"""Scale-out checks on the CPU: two processes (gloo, through ``accelerate launch``) against one, exact resume,
and the accelerate configs under ``examples/accelerate_configs``.

* Two processes with per-device batch b train exactly like one process with batch 2b (same seeds): rollouts are
  seeded per global sample, GRPO groups span both ranks and their advantages use the whole group, trajectories
  stay with their completions, and both ranks end with the same parameters.
* A run stopped after a checkpoint and resumed from it ends where an uninterrupted run ends, with the same
  metric and completion logs (no gaps, no duplicates).
* FSDP2 cannot run on a CPU-only machine with accelerate 1.15 / 1.16 (an FSDP config silently becomes DDP; see
  docs/distributed.md): its test runs only where two GPUs are present. DeepSpeed ZeRO-2/3 do run on the CPU:
  tests/test_deepspeed.py.

The runs themselves live in ``tests/distributed/train.py``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from numerics import DecisionMargins

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "distributed"
CONFIGS = ROOT / "examples" / "accelerate_configs"
TIMING = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos"}
NOISE_FLOOR = {"rollout/sampler_logp_gap": 1e-5, "rollout/sampler_logp_gap_exact": 1e-5}
"""Metrics that are float32 noise around 0 (the gap is ~5e-7 where it must be 0): compared with an absolute floor,
as a relative tolerance on noise is meaningless."""
EOS_SCALE = 6.0  # completions of mixed lengths, so ranks hold different numbers of completion tokens


def _load_helper():
    spec = importlib.util.spec_from_file_location("distributed_train", HELPERS / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load_helper()
SCALE_OUT_JOBS = ["sft", "tracerl", "tracerl_value", "tracerl_masks"]
"""The jobs run on two processes and on one (``train.JOBS`` but ``tracerl_sharded_rollouts``, which differs from
``tracerl`` only under ZeRO-3: tests/test_deepspeed.py)."""


@pytest.fixture(autouse=True)
def one_thread():
    """Two cores are shared by both ranks (and by other jobs): one thread per process avoids oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_launch(launcher: list[str], script: Path, *args: str,
                      timeout: int = 600) -> subprocess.CompletedProcess:
    """``accelerate launch`` with ``launcher`` options on a free port; fails the test with the output tail, returns
    the finished process (its output) otherwise."""
    command = [sys.executable, "-m", "accelerate.commands.launch", *launcher, "--main_process_port",
               str(free_port()), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(command)} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return done


TWO_CPU_PROCESSES = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                     "--dynamo_backend", "no"]


def parameters(folder: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"rank{rank}.pt")


def history(folder: Path) -> list[dict]:
    return json.loads((folder / "log_history.json").read_text())


VALUE_REL = 1e-3
"""The value model's parameters agree to ~1e-4 of its learning rate (Adam's first step is ~lr * sign(grad)), so
metrics computed from its predictions agree to ~1e-4 relative, more where they cancel (``value/explained_variance``
= 1 - Var(R - V) / Var(R) near -4 differed by 1.3e-4 between layouts on an AMD host): across layouts ``value/*``
compares at 1e-3, still far below what mixing up the ranks' trajectories would change."""


def assert_same_metrics(got: list[dict], expected: list[dict], rel: float = 1e-4, skip: frozenset = frozenset(),
                        value_rel: float | None = None):
    """Same log entries, same keys, and every number equal within ``rel`` (``value/*`` within ``value_rel`` if
    given; timings and ``skip`` aside)."""
    assert [e.get("step") for e in got] == [e.get("step") for e in expected]
    for mine, theirs in zip(got, expected):
        keys = set(mine) - TIMING - skip
        assert keys == set(theirs) - TIMING - skip, f"step {mine.get('step')}"
        for key in sorted(keys):
            a, b = mine[key], theirs[key]
            if isinstance(a, float) and isinstance(b, float) and not (math.isnan(a) and math.isnan(b)):
                floor = NOISE_FLOOR.get(key, 1e-6)
                tolerance = value_rel if value_rel is not None and key.startswith("value/") else rel
                assert a == pytest.approx(b, rel=tolerance, abs=floor), f"step {mine.get('step')}: {key}"
            else:
                assert a == b, f"step {mine.get('step')}: {key}"


# ------------------------------------------------------------------------------------ two processes vs one


TWO_PROCESS_VARIANTS = {
    "@filtered": {"eos_scale": 0.0, "max_steps": 8, "reward": "distinct_chars_but_abc", "steps_per_generation": 2,
                  "dynamic_group_filtering": "all_equal", "value_batch_size": 1, "learning_rate": 0.01,
                  "value_learning_rate": 0.01},
    "@budget": {"scoring_token_budget": 30, "gradient_accumulation_steps": 2,
                "accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}}}
"""Two-process runs of the checks below that have no one-process twin in ``runs`` (``tracerl_value@filtered``:
test_value_steps_with_a_process_holding_only_filtered_groups; ``sft@budget``:
test_sft_token_budget_on_two_processes_matches_one_forward), trained in its launch (its start-up is most of a
launch's cost)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The same jobs (``SCALE_OUT_JOBS``: SFT, TraceRL, TraceRL with a value model, TraceRL with random masks), 2 steps
    each: two CPU processes with per-device batch 2, and one process (in this one) with batch 4. The launch also
    trains ``TWO_PROCESS_VARIANTS``."""
    root = tmp_path_factory.mktemp("scale_out")
    overrides = json.dumps({"eos_scale": EOS_SCALE, **TWO_PROCESS_VARIANTS})
    accelerate_launch(TWO_CPU_PROCESSES, HELPERS / "train.py", "--out", str(root / "two"), "--per_device_batch",
                      "2", "--max_steps", "2", "--jobs", *SCALE_OUT_JOBS, "tracerl_value@filtered", "sft@budget",
                      "--overrides", overrides)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with DecisionMargins() as margins:
            for job in SCALE_OUT_JOBS:
                train.run(job, root / "one", 4, 2, eos_scale=EOS_SCALE)
    finally:
        torch.set_num_threads(threads)
    return {"two": root / "two", "one": root / "one", "margin": margins.smallest}


@pytest.mark.slow
@pytest.mark.parametrize("job", SCALE_OUT_JOBS)
def test_both_ranks_end_with_identical_parameters(runs, job):
    setup = json.loads((runs["two"] / job / "setup.json").read_text())
    assert setup["num_processes"] == 2 and setup["distributed_type"] == "DistributedType.MULTI_CPU"
    assert setup["wrapper"] == "DistributedDataParallel"
    rank0, rank1 = parameters(runs["two"] / job, 0), parameters(runs["two"] / job, 1)
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    if job == "tracerl_value":  # the value model is placed like the policy; both scored with recomputed forwards
        assert setup["value_wrapper"] == "DistributedDataParallel" and setup["recompute_scoring_forwards"] is True
        assert any(name.startswith("value.") for name in rank0)


@pytest.mark.slow
@pytest.mark.parametrize("job", ["sft", "tracerl", "tracerl_value", "tracerl_masks"])
def test_two_processes_match_one_process_with_twice_the_batch(runs, job):
    # the two layouts score with float32 probabilities ~1e-6 apart; every sampled draw of the rollouts is at least
    # 2e-5 of probability away from taking another token (~300 draws, so not the 1e-4 of a single generate)
    assert runs["margin"] > 2e-5
    two, one = parameters(runs["two"] / job), parameters(runs["one"] / job)
    initial = train.tiny_policy(0.0 if job == "sft" else EOS_SCALE).state_dict()
    assert two.keys() == one.keys()
    moved = max((one[name] - initial[name]).abs().max().item() for name in initial)
    assert moved > 1e-2  # the comparison below is not trivially true
    for name in two:
        # the value model trains with Adam: its first step is ~lr * sign(grad), so float noise in tiny gradients
        # shows up at ~1e-4 of its learning rate (0.5)
        atol = 1e-3 if name.startswith("value.") else 1e-5
        torch.testing.assert_close(two[name], one[name], atol=atol, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert_same_metrics(history(runs["two"] / job), history(runs["one"] / job), value_rel=VALUE_REL)


def population_z_score(rewards: torch.Tensor) -> torch.Tensor:
    std = rewards.std(correction=0)
    return (rewards - rewards.mean()) / std if std > 0 else torch.zeros_like(rewards)


@pytest.mark.slow
def test_groups_span_ranks_and_advantages_use_the_whole_group(runs):
    """Per-device batch 2 and 4 generations per prompt: every group is split over both ranks. The rewards are
    gathered, so each advantage is (r - group mean) / (group population std) over all four completions."""
    folder = runs["two"] / "tracerl"
    split_matters = False
    for step in (1, 2):
        table = pd.read_parquet(folder / "completions" / f"completions_{step:05d}.parquet")
        assert len(table) == 4 and table["prompt"].nunique() == 1 and (table["step"] == step).all()
        rewards = torch.tensor(table["distinct_chars"].to_numpy())
        expected = population_z_score(rewards)
        torch.testing.assert_close(torch.tensor(table["advantage"].to_numpy()), expected, atol=1e-4, rtol=1e-4)
        local = torch.cat([population_z_score(half) for half in rewards.split(2)])
        split_matters |= not torch.allclose(local, expected, atol=1e-3)
    assert split_matters, "rank-local advantages would have been the same; the check above proves nothing"
    steps = history(folder)[:-1]
    # each trajectory is still attached to its own completion after TRL's gather / shuffle / split, also when
    # the completions (and so their padding) differ in length
    assert all(entry["rollout/sampler_logp_gap"] < 1e-4 for entry in steps)
    assert any(entry["completions/min_length"] < entry["completions/max_length"] for entry in steps)


# ----------------------------------------------------------------------------------------------- resume


def stop_and_resume(root: Path, job: str, stop: int, max_steps: int = 4, **overrides):
    """An uninterrupted run and a run stopped after step ``stop`` (its checkpoint) then resumed; returns the two
    trainers and their folders."""
    settings = dict(save_strategy="steps", save_steps=stop, **overrides)
    full = train.run(job, root / "uninterrupted", 4, max_steps, **settings)
    stopped = train.run(job, root / "resumed", 4, max_steps, stop_after=stop, **settings)
    assert stopped.state.global_step == stop
    checkpoint = root / "resumed" / job / f"checkpoint-{stop}"
    resumed = train.run(job, root / "resumed", 4, max_steps, resume=str(checkpoint), **settings)
    return full, resumed, root / "uninterrupted" / job, root / "resumed" / job


def assert_same_parameters(a: Path, b: Path, atol: float = 1e-6) -> None:
    """Saved parameters equal up to float32 summation-order noise: ``rtol`` 1e-5 scales with each value, ``atol``
    covers values near 0. The tests train at learning rate 0.5, so a missed or repeated step moves weights by
    orders of magnitude more than either."""
    first, second = parameters(a), parameters(b)
    assert first.keys() == second.keys()
    for name in first:
        torch.testing.assert_close(second[name], first[name], atol=atol, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def assert_logged_every_step_once(trainer, max_steps: int) -> None:
    steps = [entry["step"] for entry in trainer.state.log_history if "loss" in entry]
    assert steps == list(range(1, max_steps + 1))


@pytest.mark.slow
def test_tracerl_resume_is_exact(tmp_path):
    """``num_iterations=2`` (a rollout is used for two steps) and a checkpoint at a rollout boundary."""
    full, resumed, a, b = stop_and_resume(tmp_path, "tracerl", stop=2, num_iterations=2)
    assert_same_parameters(a, b)
    assert_logged_every_step_once(resumed, 4)
    # "train_loss" in the closing summary is HF's average over the steps this process ran
    assert_same_metrics(resumed.state.log_history, full.state.log_history, rel=1e-6, skip=frozenset({"train_loss"}))
    names = sorted(p.name for p in (b / "completions").iterdir())
    assert names == sorted(p.name for p in (a / "completions").iterdir())
    assert names == [f"completions_{step:05d}.parquet" for step in range(1, 5)]
    for name in names:
        got, expected = pd.read_parquet(b / "completions" / name), pd.read_parquet(a / "completions" / name)
        pd.testing.assert_frame_equal(got, expected, check_exact=False, rtol=1e-6)


@pytest.mark.slow
def test_tracerl_resume_inside_a_generation_cycle(tmp_path):
    full, resumed, a, b = stop_and_resume(tmp_path, "tracerl", stop=1, num_iterations=2)
    assert_same_parameters(a, b, atol=1e-5)
    assert_same_metrics(resumed.state.log_history, full.state.log_history, skip=frozenset({"train_loss"}))


@pytest.mark.slow
def test_tracerl_resume_with_a_value_model(tmp_path):
    full, resumed, a, b = stop_and_resume(tmp_path, "tracerl_value", stop=2)
    assert_same_parameters(a, b, atol=1e-5)
    assert_same_metrics(resumed.state.log_history, full.state.log_history, skip=frozenset({"train_loss"}))


@pytest.mark.slow
def test_tracerl_resume_with_a_masking_estimator_scores_with_the_same_masks(tmp_path, monkeypatch):
    """The coupled estimator draws its masks from per-row seeds that travel with the rollout: a run resumed inside
    a generation cycle scores every step after the checkpoint with exactly the seeds and masks of the uninterrupted
    run, and ends with the same parameters."""
    from trl_diffusion.trainers import tracerl_trainer

    passes = []  # (seeds, scored tokens) of every scoring pass, in order
    estimate = tracerl_trainer.estimate_logprobs

    def spy(*args, **kwargs):
        out = estimate(*args, **kwargs)
        passes.append((args[6].clone(), out[2].clone()))
        return out

    monkeypatch.setattr(tracerl_trainer, "estimate_logprobs", spy)
    settings = dict(save_strategy="steps", save_steps=1, num_iterations=2, likelihood_estimator="coupled")
    train.run("tracerl", tmp_path / "uninterrupted", 4, 4, **settings)
    uninterrupted = passes[:]
    train.run("tracerl", tmp_path / "resumed", 4, 4, stop_after=1, **settings)
    del passes[:]
    train.run("tracerl", tmp_path / "resumed", 4, 4, resume=str(tmp_path / "resumed" / "tracerl" / "checkpoint-1"),
              **settings)
    resumed = passes[:]
    assert 0 < len(resumed) < len(uninterrupted)
    for (seeds, scored), (seeds_then, scored_then) in zip(resumed, uninterrupted[-len(resumed):]):
        assert torch.equal(seeds, seeds_then) and torch.equal(scored, scored_then)
    assert len({tuple(seeds.tolist()) for seeds, _ in uninterrupted}) > 1  # the seeds change between rollouts
    assert_same_parameters(tmp_path / "uninterrupted" / "tracerl", tmp_path / "resumed" / "tracerl", atol=1e-5)


@pytest.fixture(scope="module")
def sft_resume(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return stop_and_resume(tmp_path_factory.mktemp("sft_resume"), "sft", stop=2)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
def test_sft_resume_is_exact(sft_resume):
    """Same data order and the same per-sample noise (seeded by seed, epoch and sample index)."""
    full, resumed, a, b = sft_resume
    assert_same_parameters(a, b)
    assert_logged_every_step_once(resumed, 4)
    skip = frozenset({"train_loss", "num_tokens"})  # num_tokens: see the next test
    assert_same_metrics(resumed.state.log_history, full.state.log_history, rel=1e-6, skip=skip)


@pytest.mark.slow
def test_sft_resume_keeps_counting_tokens(sft_resume):
    full, resumed, _, _ = sft_resume
    assert_same_metrics(resumed.state.log_history, full.state.log_history, skip=frozenset({"train_loss"}))


@pytest.mark.slow
@pytest.mark.parametrize("job", ["tracerl_value", "sft"])
def test_resume_in_bf16_is_exact(tmp_path, monkeypatch, job):
    """In bfloat16 (bf16 weights, as released checkpoints load, under ``bf16=True`` autocast, TRL's default on a GPU),
    a run resumed from a checkpoint (TraceRL's inside a generation cycle, with a value model) ends where the
    uninterrupted one ended: its saved rollout, value and optimizer state come back at their own precision (a cast
    on the way would move the weights by bf16's rounding step, 2**-8 of their size)."""
    policy = train.tiny_policy
    monkeypatch.setattr(train, "tiny_policy", lambda *args, **kwargs: policy(*args, **kwargs).to(torch.bfloat16))
    cycle = {"num_iterations": 2} if job == "tracerl_value" else {}
    full, resumed, a, b = stop_and_resume(tmp_path, job, stop=1, bf16=True, **cycle)
    assert full.model.dtype == resumed.model.dtype == torch.bfloat16
    assert_same_parameters(a, b)
    assert_same_metrics(resumed.state.log_history, full.state.log_history, rel=1e-6,
                        skip=frozenset({"train_loss", "num_tokens"}))


# --------------------------------------------------------------------------------------- accelerate configs


def test_example_accelerate_configs_say_what_they_are_for():
    from accelerate.commands.config.config_args import load_config_from_file

    expected = {"single_gpu": ("NO", 1), "multi_gpu": ("MULTI_GPU", 1), "deepspeed_zero2": ("DEEPSPEED", 1),
                "deepspeed_zero3": ("DEEPSPEED", 1), "fsdp2": ("FSDP", 1), "multi_node": ("DEEPSPEED", 2)}
    for name, (kind, machines) in expected.items():
        config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))
        assert str(config.distributed_type).endswith(kind) and config.num_machines == machines, name
    assert load_config_from_file(str(CONFIGS / "cpu_two_processes.yaml")).num_processes == 2
    stages = {name: load_config_from_file(str(CONFIGS / f"{name}.yaml")).deepspeed_config["zero_stage"]
              for name in ("deepspeed_zero2", "deepspeed_zero3", "multi_node")}
    assert stages == {"deepspeed_zero2": 2, "deepspeed_zero3": 3, "multi_node": 2}
    assert load_config_from_file(str(CONFIGS / "fsdp2.yaml")).fsdp_config["fsdp_version"] == 2


@pytest.mark.slow
def test_cpu_two_processes_config_starts_two_processes(tmp_path):
    accelerate_launch(["--config_file", str(CONFIGS / "cpu_two_processes.yaml")], HELPERS / "world.py",
                      str(tmp_path), timeout=120)
    worlds = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert [w["num_processes"] for w in worlds] == [2, 2]
    assert {w["backend"] for w in worlds} == {"gloo"}


@pytest.mark.slow
def test_example_on_two_processes_prints_one_result_and_no_ddp_warning(tmp_path):
    """``accelerate launch --num_processes 2 examples/math.py``: the closing JSON result is printed by process 0
    only (every process printed it, and once two copies landed on one line, which no JSON reader parses), and DDP
    does not search for unused parameters: transformers turns the search on when checkpointing is off, and DDP then
    warned on every process at every step that it found none (every parameter takes part)."""
    done = accelerate_launch(TWO_CPU_PROCESSES, ROOT / "examples" / "math.py", "--use_cpu", "true", "--max_steps", "1",
                             "--per_device_train_batch_size", "4", "--num_generations", "4", "--num_eval", "4",
                             "--output_dir", str(tmp_path), timeout=300)
    results = [line for line in done.stdout.splitlines() if '"output_dir"' in line]
    assert len(results) == 1 and json.loads(results[0])["output_dir"] == str(tmp_path)
    assert "find_unused_parameters=True" not in done.stderr
    assert len(list(tmp_path.glob("training_curves.png"))) == 1


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason=(
    "FSDP2 needs accelerator devices (with accelerate 1.15 / 1.16 an FSDP config on the CPU silently runs DDP, "
    "docs/distributed.md); ZeRO-3 on GPUs beside it (on the CPU: tests/test_deepspeed.py)."))
@pytest.mark.parametrize("config", ["deepspeed_zero3", "fsdp2", "fsdp2+budget"])
def test_sharded_config_runs_a_step(tmp_path, config):
    """``fsdp2+budget``: ``scoring_token_budget`` small enough for several forwards per micro-batch (under FSDP
    every process runs as many as the busiest)."""
    if config.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    config, budget = config.split("+")[0], config.endswith("+budget")
    overrides = {"use_cpu": False, **({"scoring_token_budget": 24} if budget else {})}
    launcher = ["--config_file", str(CONFIGS / f"{config}.yaml"), "--num_processes", "2", "--mixed_precision",
                "no"]
    accelerate_launch(launcher, HELPERS / "train.py", "--out", str(tmp_path), "--per_device_batch", "2",
                      "--max_steps", "1", "--jobs", "sft", "tracerl", "--overrides", json.dumps(overrides))
    for job in ("sft", "tracerl"):
        setup = json.loads((tmp_path / job / "setup.json").read_text())
        assert setup["num_processes"] == 2
        assert setup["deepspeed"] if config.startswith("deepspeed") else setup["fsdp"]
        assert math.isfinite(history(tmp_path / job)[0]["loss"])
        rank0, rank1 = parameters(tmp_path / job, 0), parameters(tmp_path / job, 1)
        assert rank0, "no gathered parameters on rank 0"
        initial = train.tiny_policy().state_dict()
        assert any(not torch.equal(rank0[name], initial[name].float()) for name in initial)
        if rank1:  # where the gathered state dict is only materialised on rank 0, rank 1 has none
            assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)


@pytest.mark.slow
def test_value_steps_with_a_process_holding_only_filtered_groups(runs):
    """Two groups per generation batch, one per process, and the "abc" group filtered: in every value step one
    process has nothing to train on. It joins the gradient averaging with a zero loss, so both processes take the
    same steps (no hang) and end with the same value model, which did move. (8 steps, ``TWO_PROCESS_VARIANTS``.)"""
    folder = runs["two"] / "tracerl_value@filtered"
    # its 8 steps (not the launch's 2), the value model trained at each generation of two steps
    assert [entry["step"] for entry in history(folder) if "value/loss" in entry] == [1, 3, 5, 7]
    live = [json.loads((folder / f"value_live_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert any(0 in pair and max(pair) > 0 for pair in zip(*live)), live  # the premise: one process had none
    rank0, rank1 = parameters(folder, 0), parameters(folder, 1)
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    initial = train.value_model_for(train.tiny_policy()).state_dict()
    assert any(not torch.equal(rank0[f"value.{name}"], initial[name]) for name in initial)
    assert all(math.isfinite(entry["value/loss"]) for entry in history(folder) if "value/loss" in entry)


@pytest.mark.slow
def test_sft_token_budget_on_two_processes_matches_one_forward(runs, tmp_path):
    """``scoring_token_budget`` back-propagates each forward of a micro-batch before the next, and the two processes
    may run different numbers of forwards (their batches' widths differ). Under DDP the early ones run without the
    all-reduce (the micro-batch's last backward, or the window's last micro-batch, makes it). With
    ``sync_each_batch`` Trainer opens no ``no_sync`` of its own on any micro-batch (an all-reduce in an early
    backward used to wait for the other process forever): two processes with a budget and gradient accumulation end
    where one process without a budget does. (Without ``sync_each_batch`` ours nests in Trainer's, which DDP
    allows.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train.run("sft", tmp_path / "one", 4, 2, gradient_accumulation_steps=2)
    finally:
        torch.set_num_threads(threads)
    budget = runs["two"] / "sft@budget"  # TWO_PROCESS_VARIANTS
    two, one = parameters(budget, 0), parameters(tmp_path / "one" / "sft")
    assert all(torch.equal(two[name], parameters(budget, 1)[name]) for name in two)
    initial = train.tiny_policy().state_dict()
    assert max((one[name] - initial[name]).abs().max().item() for name in initial) > 1e-2
    for name in one:
        torch.testing.assert_close(two[name], one[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    assert_same_metrics(history(budget), history(tmp_path / "one" / "sft"))
