"""How runs end and what their checkpoints hold.

* The example scripts leave the torch.distributed process group at the end of a run (every process together): a
  process that exits with gloo's threads still up can abort with "terminate called without an active exception"
  after the work is done.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate import Accelerator
from test_cli import load_example

from trl_diffusion.cli import parse_script_args

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "sft": ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_eval", "2", "--eval_every", "1"],
    "math": ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2", "--num_eval", "2",
             "--eval_every", "1"],
    "code": ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2"],
}
"""Flags for one tiny step of each example on the embedded model."""


@pytest.mark.parametrize("name", sorted(TINY))
def test_examples_end_training_last(monkeypatch, tmp_path, name):
    """Each example calls ``Accelerator.end_training`` (which leaves the process group) once, after it saved the model
    and its curves. In one process (here) there is no group, so the call changes nothing for later tests."""
    example = load_example(name)
    seen = []
    end_training = Accelerator.end_training

    def recorded(accelerator):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        end_training(accelerator)

    monkeypatch.setattr(Accelerator, "end_training", recorded)
    parsed = parse_script_args(example.make_parser(), ["--output_dir", str(tmp_path), "--use_cpu", "true",
                                                        *TINY[name]])
    example.main(*parsed)
    assert len(seen) == 1
    assert {"model.safetensors", "training_curves.png"} <= set(seen[0])


@pytest.mark.slow
def test_example_in_two_processes_leaves_the_group_and_exits_cleanly(tmp_path):
    """``accelerate launch`` of an example in two CPU processes (gloo): both processes finish the run out of the
    process group and the launch exits with status 0."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), str(ROOT / "tests" / "distributed" / "run_example.py"), str(tmp_path),
               str(ROOT / "examples" / "sft.py"), "--output_dir", str(tmp_path / "run"), "--use_cpu", "true",
               *TINY["sft"]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert (tmp_path / "run" / "model.safetensors").is_file()
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"in_process_group": False}
