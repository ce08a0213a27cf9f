"""``leave_process_group`` after a two-process TraceRL step with a value model: records, per rank, whether any
DistributedDataParallel wrapper is still alive while the trainer is (it must not be: a reducer freed after the group
is destroyed destroys it holding the GIL and can deadlock with gloo's worker thread) and whether the process is still
in the group: ``leave.py --out <folder>``."""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from trl_diffusion.scripts.utils import leave_process_group

_spec = importlib.util.spec_from_file_location("distributed_train", Path(__file__).with_name("train.py"))
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    trainer = train.make_trainer("tracerl", args.out, 2, 1, value=True)
    trainer.train()
    wrapped_before = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    rank = trainer.accelerator.process_index
    leave_process_group(trainer)
    facts = {"wrappers_before": wrapped_before,
             "wrappers_after": sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects()),
             "in_process_group": torch.distributed.is_initialized()}
    (args.out / f"rank{rank}.json").write_text(json.dumps(facts))
