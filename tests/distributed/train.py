"""Tiny SFT and TraceRL runs for the distributed tests.

Run under ``accelerate launch`` (any number of processes, any accelerate config) or import :func:`run` in a
single process. Every process writes ``OUT/<job>/rank<i>.pt`` (its full parameters after training, gathered
when they are sharded) and rank 0 writes ``OUT/<job>/log_history.json`` and ``OUT/<job>/setup.json`` (what
accelerate actually set up). Two CPU processes (gloo; ``--multi_gpu`` selects the torchrun launcher, and on a
machine without GPUs the processes run on the CPU)::

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
        tests/distributed/train.py --out /tmp/run --jobs sft tracerl --per_device_batch 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import TrainerCallback

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.launching import pause_for_gloo_workers
from trl_diffusion.testing import EOS_ID, build_tokenizer, tiny_model, tiny_moe_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

PAIRS = [("What is 1+2?", "3"), ("Say hi", "hi"), ("What is 7-3?", "4"), ("abc", "def"),
         ("What is 2*5?", "10"), ("Name a colour", "red"), ("What is 9-9?", "0"), ("xyz", "uvw")]
PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions: list[str], **kwargs: Any) -> list[float]:
    """A reward that varies inside a group: the number of distinct characters."""
    return [float(len(set(c))) for c in completions]


def distinct_chars_but_abc(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
    """``distinct_chars``, except a constant for the "abc" group, which ``dynamic_group_filtering="all_equal"`` then
    drops: the process holding that group has nothing for the value model to train on."""
    return [1.0 if "abc" in prompt else score for prompt, score in zip(prompts, distinct_chars(completions))]


REWARDS = {"distinct_chars": distinct_chars, "distinct_chars_but_abc": distinct_chars_but_abc}


class StopAfter(TrainerCallback):
    """Stops training after ``step`` optimizer steps (after that step's save), like a killed job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True
        return control


def common_args(out: Path, per_device_batch: int, max_steps: int, seed: int) -> dict[str, Any]:
    """Config fields both trainers share: CPU, fp32, plain SGD at a constant rate (linear in the gradient, so
    runs that should agree do so to rounding), a log entry every step, no checkpoints unless asked."""
    return dict(output_dir=str(out), per_device_train_batch_size=per_device_batch, max_steps=max_steps, seed=seed,
                logging_steps=1, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                gradient_checkpointing=False, save_strategy="no", optim="sgd", max_grad_norm=0.0,
                lr_scheduler_type="constant", dataloader_num_workers=0)


def value_model_for(policy) -> DiffusionValueModel:
    """A value model copied from ``policy`` with a seeded, non-zero head (so that its advantages vary)."""
    value = DiffusionValueModel.from_policy(policy)
    with torch.no_grad():
        weight = value.value_head.weight
        weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(1)))
    return value


def tiny_policy(eos_scale: float = 0.0, moe: bool = False) -> torch.nn.Module:
    """The tiny SDAR (``moe``: SDAR-MoE) in train mode; ``eos_scale`` > 0 makes EOS likely (6 gives completions of
    mixed lengths)."""
    model = (tiny_moe_model("sdar_moe") if moe else tiny_model("sdar")).train()
    if eos_scale:
        with torch.no_grad():
            head = model.lm_head.weight
            head[EOS_ID] = eos_scale * model.model.norm.weight.sign() * head.abs().max()
    return model


def make_trainer(trainer: str, out: Path, per_device_batch: int, max_steps: int, seed: int = 0,
                 stop_after: int | None = None, value: bool = False, eos_scale: float = 0.0,
                 reward: str = "distinct_chars", moe: bool = False, value_path: bool = False, **overrides: Any):
    """A tiny SDAR trainer (``sft`` or ``tracerl``, with a value model if ``value``, passed as the path of its saved
    copy if ``value_path``); ``eos_scale`` and ``reward`` (a name in ``REWARDS``) apply to TraceRL only;
    ``overrides`` go to the config."""
    config = common_args(out, per_device_batch, max_steps, seed)
    callbacks = [StopAfter(stop_after)] if stop_after else None
    model = tiny_policy(eos_scale if trainer == "tracerl" else 0.0, moe)
    if trainer == "sft":
        config.update(learning_rate=0.5, max_length=32)
        config.update(overrides)
        data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in PAIRS])
        return DiffusionSFTTrainer(model, args=DiffusionSFTConfig(**config), train_dataset=data,
                                   processing_class=build_tokenizer(), callbacks=callbacks)
    config.update(learning_rate=0.5, num_generations=4, max_completion_length=8, block_length=4, denoising_steps=2,
                  log_completions=True, num_completions_to_print=0, value_learning_rate=0.5,
                  dynamic_group_filtering="none")  # distinct_chars rewards lie beyond [0, 1]
    config.update(overrides)
    data = Dataset.from_dict({"prompt": PROMPTS})
    args = TraceRLConfig(**config)
    value_model = value_model_for(model) if value else None
    if value_model is not None and value_path:
        value_model = saved(value_model, out / "value_init")
    return TraceRLTrainer(model, REWARDS[reward], args=args, train_dataset=data, processing_class=build_tokenizer(),
                          callbacks=callbacks, value_model=value_model)


def saved(model, folder: Path) -> str:
    """``model`` saved to ``folder`` by the main process (``save_pretrained`` writes nothing elsewhere), once every
    process may read it."""
    model.save_pretrained(folder)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return str(folder)


def value_trainer(out: Path, per_device_batch: int, max_steps: int, seed: int = 0, **overrides: Any):
    """``DiffusionValueTrainer`` of a value model copied from the tiny SDAR and given as a path (loaded as
    transformers loads it: partitioned under ZeRO-3), on 8 seeded trajectories, one row per scoring forward with
    the forwards recomputed in the backward pass."""
    generator = torch.Generator().manual_seed(0)
    rows = {"prompt": ["good: add", "bad: sub"] * 4, "reward": [1.0, -1.0] * 4,
            "completion_ids": [torch.randint(10, 100, (8,), generator=generator).tolist() for _ in range(8)],
            "unmask_step": [torch.randperm(8, generator=generator).div(2, rounding_mode="floor").tolist()
                            for _ in range(8)]}
    config = common_args(out, per_device_batch, max_steps, seed)
    config.update(learning_rate=0.01, scoring_token_budget=1, recompute_scoring_forwards=True, **overrides)
    args = DiffusionValueConfig(**config)
    path = saved(value_model_for(tiny_policy()), out / "value_init")
    return DiffusionValueTrainer(path, args=args, train_dataset=Dataset.from_dict(rows),
                                 processing_class=build_tokenizer())


def full_state_dict(trainer) -> dict[str, torch.Tensor]:
    """Every parameter of the trained model on this process (gathered under ZeRO-3 / FSDP), and the value
    model's under ``value.``."""
    accelerator = trainer.accelerator
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        state = accelerator.get_state_dict(trainer.model_wrapped)  # collective: every rank calls it
    else:
        state = accelerator.unwrap_model(trainer.model).state_dict()
    state = {name: tensor.detach().float().cpu().clone() for name, tensor in (state or {}).items()}
    if getattr(trainer, "value_model", None) is not None:
        value = accelerator.unwrap_model(trainer.value_model).state_dict()
        state.update({f"value.{name}": tensor.detach().float().cpu().clone() for name, tensor in value.items()})
    return state


JOBS = {"sft": ("sft", False), "tracerl": ("tracerl", False), "tracerl_value": ("tracerl", True),
        "tracerl_masks": ("tracerl", False), "tracerl_sharded_rollouts": ("tracerl", False),
        "tracerl_moe": ("tracerl", False), "tracerl_resume": ("tracerl", True), "value": ("value", False)}
JOB_CONFIG = {"tracerl_value": {"scoring_token_budget": 1, "recompute_scoring_forwards": True},
              "tracerl_masks": {"likelihood_estimator": "random_masking", "masks_per_response": 2},
              "tracerl_sharded_rollouts": {"ds3_gather_for_generation": False}, "tracerl_moe": {"moe": True},
              "tracerl_resume": {"save_strategy": "steps", "save_steps": 1, "num_iterations": 2, "beta": 0.5,
                                 "kl_reference": "reference_model", "sync_ref_model": True, "ref_model_sync_steps": 1,
                                 "ref_model_mixup_alpha": 0.5, "learning_rate": 0.01, "value_learning_rate": 0.01,
                                 "value_path": True}}
"""Config fields of a job (before ``overrides``): TraceRL with a value model also covers recomputed scoring
forwards under DDP (one row per forward, each run again in the backward pass, for the policy and the value model);
``tracerl_masks`` dLLM-RL's random-masking baseline, whose masks must not depend on the process layout;
``tracerl_sharded_rollouts`` decodes from ZeRO-3's sharded weights (plain TraceRL elsewhere); ``tracerl_moe`` trains
the tiny SDAR-MoE; ``tracerl_resume`` saves every step what a resume needs (rollout buffer inside a generation cycle,
value model, the reference model as ``sync_ref_model`` mixes it; a small learning rate, as its KL weight is large),
its value model given as a path; ``value`` trains a value model alone (``value_trainer``)."""


def record_value_live_responses(trainer) -> list[int]:
    """The number of this process's responses the value model trains on, per value epoch (filled as it trains)."""
    counts, plan = [], trainer._value_updates

    def recording(rows, live):
        counts.append(live)
        return plan(rows, live)

    trainer._value_updates = recording
    return counts


def record_rollout_forwards(trainer) -> list[int]:
    """The forwards of each of this process's rollouts (filled as it trains; TraceRL logs the largest over the
    processes)."""
    counts, log = [], trainer._log_rollout_stats

    def recording(mode):
        counts.append(int(trainer._rollout_stats[4]))
        return log(mode)

    trainer._log_rollout_stats = recording
    return counts


def overrides_for(trainer: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The ``overrides`` of a run that apply to ``trainer``: those named ``"<trainer>.<field>"`` (e.g.
    ``"tracerl.num_generations"``, the prefix dropped) and, for the policy trainers (``sft``, ``tracerl``), the
    unprefixed ones."""
    shared = trainer != "value"
    return {name.split(".", 1)[-1]: setting for name, setting in overrides.items()
            if name.startswith(f"{trainer}.") or (shared and "." not in name)}


def run(job: str, out: Path, per_device_batch: int, max_steps: int, resume: str | None = None,
        folder_name: str | None = None, **overrides: Any):
    """Train one of ``JOBS`` and write this process's parameters (and, on rank 0, the log history) under
    ``out/job`` (``out/folder_name`` if given)."""
    trainer, value = JOBS[job]
    folder = Path(out) / (folder_name or job)
    if trainer == "value":
        built = value_trainer(folder, per_device_batch, max_steps, **overrides_for(trainer, overrides))
    else:
        built = make_trainer(trainer, folder, per_device_batch, max_steps, value=value,
                             **{**JOB_CONFIG.get(job, {}), **overrides_for(trainer, overrides)})
    live_responses = record_value_live_responses(built) if value else []
    rollout_forwards = record_rollout_forwards(built) if trainer == "tracerl" else []
    built.train(resume_from_checkpoint=resume)
    state = full_state_dict(built)
    rank = built.accelerator.process_index
    if value:
        (folder / f"value_live_rank{rank}.json").write_text(json.dumps(live_responses))
    if rollout_forwards:
        (folder / f"rollout_forwards_rank{rank}.json").write_text(json.dumps(rollout_forwards))
    torch.save(state, folder / f"rank{rank}.pt")
    if rank == 0:
        (folder / "log_history.json").write_text(json.dumps(built.state.log_history))
        setup = {"num_processes": built.accelerator.num_processes,
                 "distributed_type": str(built.accelerator.distributed_type),
                 "fsdp": built.is_fsdp_enabled, "deepspeed": built.is_deepspeed_enabled,
                 "wrapper": type(built.model_wrapped).__name__, "model": type(built.model).__name__,
                 "value_wrapper": type(getattr(built, "value_model", None)).__name__,
                 "recompute_scoring_forwards": getattr(built.args, "recompute_scoring_forwards", None),
                 **deepspeed_setup(built)}
        (folder / "setup.json").write_text(json.dumps(setup))
    built.accelerator.wait_for_everyone()
    return built


def deepspeed_setup(trainer) -> dict[str, Any]:
    """Under DeepSpeed: its ZeRO stage, whether this process holds only a shard of the policy's weights, the
    rollouts' ``cuda_graphs`` and the reference model's wrapper (TraceRL)."""
    if not trainer.is_deepspeed_enabled:
        return {}
    parameters = list(trainer.accelerator.unwrap_model(trainer.model_wrapped).parameters())
    return {"zero_stage": trainer.accelerator.state.deepspeed_plugin.zero_stage,
            "sharded": all(hasattr(p, "ds_tensor") and p.ds_tensor.numel() < p.ds_numel for p in parameters),
            "rollout_graphs": getattr(trainer, "_rollout_graphs", None),
            "ref_wrapper": type(getattr(trainer, "ref_model", None)).__name__}


def without_deepspeed_shm_op() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory all-reduce the first time it starts on a machine (about
    50 s on two cores); these tiny runs communicate through gloo instead (what DeepSpeed does where it cannot build
    the op)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def save_metrics(trainer, out, metrics: dict) -> dict:
    """Rank 0 writes ``metrics`` to ``OUT/metrics.json``; returns them."""
    if trainer.accelerator.is_main_process:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "metrics.json").write_text(json.dumps(metrics))
    return metrics


def shut_down() -> None:
    """Leave the process group together: a process that exits while gloo's threads are still up can abort with
    "terminate called without an active exception" (seen once in CI after an otherwise finished run)."""
    if torch.distributed.is_initialized():
        gc.collect()  # a DDP reducer freed after the group is destroyed can deadlock (leave_process_group)
        torch.distributed.barrier()
        pause_for_gloo_workers()
        torch.distributed.destroy_process_group()


def variant(name: str, overrides: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A ``--jobs`` entry ``<job>`` or ``<job>@<variant>``: the job of ``JOBS`` and its overrides, those of the run
    updated with the variant's own (the ``"@<variant>"`` entry of ``overrides``; its ``max_steps`` replaces
    ``--max_steps``). Variants let several settings of one job share a launch, whose start-up is most of its cost on
    a CPU."""
    job, _, tag = name.partition("@")
    if job not in JOBS or (tag and f"@{tag}" not in overrides):
        raise SystemExit(f"unknown job {name!r}: use one of {sorted(JOBS)}, as <job>@<variant> with an "
                         "'@<variant>' entry in --overrides")
    shared = {key: setting for key, setting in overrides.items() if not key.startswith("@")}
    return job, {**shared, **overrides[f"@{tag}"]} if tag else shared


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jobs", nargs="+", default=["sft", "tracerl"],
                        help=f"of {sorted(JOBS)}, each as <job> or <job>@<variant> (see variant)")
    parser.add_argument("--per_device_batch", type=int, default=2)
    parser.add_argument("--max_steps", type=int, default=2)
    parser.add_argument("--overrides", type=json.loads, default={},
                        help="config fields and eos_scale, as JSON (see overrides_for), and a variant's own under "
                             "'@<variant>'")
    parser.add_argument("--resume", default=None, help="checkpoint to resume from")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    without_deepspeed_shm_op()
    jobs = {name: variant(name, args.overrides) for name in args.jobs}  # every name checked before training
    for name, (job, overrides) in jobs.items():
        steps = overrides.pop("max_steps", args.max_steps)  # a variant may train longer
        run(job, args.out, args.per_device_batch, steps, resume=args.resume, folder_name=name, **overrides)
    shut_down()


if __name__ == "__main__":
    main()
