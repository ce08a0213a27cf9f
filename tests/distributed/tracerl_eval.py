"""Evaluate the tiny TraceRL policy (no training) on the first ``n`` prompts for each ``n`` of ``--prompts``, with
``num_generations=4`` and a per-device eval batch of ``--per_device_batch`` rows; rank 0 writes the metrics to
``OUT/<n>/metrics.json``. After each evaluation the processes wait for each other, each prints ``SEPARATOR`` to
stdout and stderr, and they wait again: between two pairs of separators is one evaluation's output. Run under
``accelerate launch`` or import :func:`run`."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

import torch
from datasets import Dataset

_spec = importlib.util.spec_from_file_location("distributed_train", Path(__file__).with_name("train.py"))
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

SEPARATOR = "=== evaluated ==="
EVAL_PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?", "xyz", "Name a colour"]


def run(out: Path, per_device_batch: int, prompts: int, eos_scale: float = 6.0) -> dict:
    trainer = train.make_trainer("tracerl", Path(out), per_device_batch, 1, eos_scale=eos_scale,
                                 per_device_eval_batch_size=per_device_batch, log_completions=False)
    return train.save_metrics(trainer, out, trainer.evaluate(Dataset.from_dict({"prompt": EVAL_PROMPTS[:prompts]})))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per_device_batch", type=int, default=4)
    parser.add_argument("--prompts", type=int, nargs="+", default=[4])
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    for prompts in args.prompts:
        run(args.out / str(prompts), args.per_device_batch, prompts)
        sys.stdout.flush()
        sys.stderr.flush()
        torch.distributed.barrier()  # every process has written this evaluation's output ...
        print(SEPARATOR, flush=True)
        print(SEPARATOR, file=sys.stderr, flush=True)
        torch.distributed.barrier()  # ... and its separators, before any starts the next
    train.shut_down()
