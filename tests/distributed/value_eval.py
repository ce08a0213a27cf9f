"""Evaluate a tiny value model (``DiffusionValueTrainer``, no training) on the first ``--samples`` of a fixed set of
trajectories (counts that need not divide the global eval batch; several counts run one after the other in the same
processes); rank 0 writes the metrics of ``n`` samples to ``OUT/<n>/metrics.json``. Run under ``accelerate launch``
or import :func:`run`."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch
from datasets import Dataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueTrainer

_spec = importlib.util.spec_from_file_location("distributed_train", Path(__file__).with_name("train.py"))
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def trajectories(count: int, seed: int = 5) -> Dataset:
    """Rollouts of 3 to 8 tokens (so processes hold different token counts) with varied rewards."""
    generator = torch.Generator().manual_seed(seed)
    rows = {"prompt": [], "completion_ids": [], "unmask_step": [], "reward": []}
    for i in range(count):
        length = int(torch.randint(3, 9, (1,), generator=generator))
        rows["prompt"].append(["good: add", "bad: sub", "x"][i % 3])
        rows["completion_ids"].append(torch.randint(10, 100, (length,), generator=generator).tolist())
        rows["unmask_step"].append(torch.randperm(length, generator=generator).div(2, rounding_mode="floor").tolist())
        rows["reward"].append(float(torch.randn((), generator=generator)))
    return Dataset.from_dict(rows)


def run(out: Path, per_device_batch: int, samples: int) -> dict:
    value = train.value_model_for(tiny_model("sdar", seed=3))
    args = DiffusionValueConfig(output_dir=str(out), per_device_eval_batch_size=per_device_batch, report_to="none",
                                use_cpu=True, bf16=False, disable_tqdm=True, seed=0, gradient_checkpointing=False)
    trainer = DiffusionValueTrainer(value, args=args, eval_dataset=trajectories(8).select(range(samples)),
                                    processing_class=build_tokenizer())
    metrics = {**trainer.evaluate(), **trainer.state.log_history[-1]}  # the value/* metrics are only logged
    return train.save_metrics(trainer, out, metrics)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per_device_batch", type=int, default=2)
    parser.add_argument("--samples", type=int, nargs="+", default=[5])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for samples in args.samples:
        run(args.out / str(samples), args.per_device_batch, samples)
    train.shut_down()
