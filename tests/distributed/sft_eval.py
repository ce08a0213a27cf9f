"""Evaluate the tiny SFT model on the first ``--samples`` pairs (a count that need not divide the global eval
batch; several counts run one after the other in the same processes); rank 0 writes the metrics of ``n`` samples to
``OUT/<n>/metrics.json``. Run under ``accelerate launch`` or import :func:`run`."""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

import torch
from datasets import Dataset

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.testing import build_tokenizer

_spec = importlib.util.spec_from_file_location("distributed_train", Path(__file__).with_name("train.py"))
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def run(out: Path, per_device_batch: int, samples: int) -> dict:
    config = train.common_args(out, per_device_batch, 1, 0)
    config.update(learning_rate=0.5, max_length=32, per_device_eval_batch_size=per_device_batch)
    pairs = [{"prompt": p, "completion": c} for p, c in train.PAIRS]
    trainer = DiffusionSFTTrainer(train.tiny_policy(), args=DiffusionSFTConfig(**config),
                                  train_dataset=Dataset.from_list(pairs),
                                  eval_dataset=Dataset.from_list(pairs[:samples]), processing_class=build_tokenizer())
    return train.save_metrics(trainer, out, trainer.evaluate())


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
