"""How runs end and what their checkpoints hold.

* The example scripts leave the torch.distributed process group at the end of a run (every process together): a
  process that exits with gloo's threads still up can abort with "terminate called without an active exception"
  after the work is done, and the DDP wrappers go before the group (``leave_process_group``).
* ``save_only_model=True`` TraceRL checkpoints hold the value model's weights but not its optimizer (as transformers
  saves the policy), and resuming from one is refused: transformers documents such checkpoints as not resumable but
  resumes them with a fresh optimizer and scheduler.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from test_cli import load_example
from test_distributed import TWO_CPU_PROCESSES, accelerate_launch
from test_resume_integrity import tracerl

from trl_diffusion.scripts import utils as script_utils
from trl_diffusion.scripts.utils import parse_script_args
from trl_diffusion.value import DiffusionValueModel

ROOT = Path(__file__).resolve().parents[1]
TINY = {
    "sft": ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_eval", "2", "--eval_every", "1",
            "--max_train_samples", "16"],
    "math": ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2", "--num_eval", "2",
             "--eval_every", "1"],
    "code": ["--max_steps", "1", "--per_device_train_batch_size", "2", "--num_generations", "2"],
}
"""Flags for one tiny step of each example on the embedded model."""


@pytest.mark.parametrize("name", sorted(TINY))
def test_examples_end_training_last(monkeypatch, tmp_path, name):
    """Each example calls ``Accelerator.end_training`` (which leaves the process group) once, after it saved the model
    and its curves, and right after ``pause_for_gloo_workers``. In one process (here) there is no group, so the call
    changes nothing for later tests."""
    example = load_example(name)
    seen, calls = [], []
    end_training = Accelerator.end_training

    def recorded(accelerator):
        seen.append(sorted(p.name for p in tmp_path.iterdir()))
        calls.append("end_training")
        end_training(accelerator)

    monkeypatch.setattr(Accelerator, "end_training", recorded)
    monkeypatch.setattr(script_utils, "pause_for_gloo_workers", lambda: calls.append("pause"))
    parsed = parse_script_args(example.make_parser(), ["--output_dir", str(tmp_path), "--use_cpu", "true",
                                                        *TINY[name]])
    example.main(*parsed)
    assert len(seen) == 1
    assert {"model.safetensors", "training_curves.png"} <= set(seen[0])
    assert calls == ["pause", "end_training"]


@pytest.mark.slow
def test_gloo_exit_check_runs(tmp_path):
    """``scripts/gloo_exit_check.py`` (the measurement behind ``pause_for_gloo_workers``) launches its two-process
    runs and reports them; with the pause none hangs."""
    # a run counts as hung after --timeout: 20 s by default, which launching two processes that import torch took
    # on a busy machine (torch 2.6's CUDA build, constraints/oldest.txt: a false "hung"); a real hang never ends
    command = [sys.executable, str(ROOT / "scripts" / "gloo_exit_check.py"), "--runs", "1", "--busy", "0", "--pause",
               "--timeout", "60"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert record == {"torch": torch.__version__, "pause": True, "busy": 0, "runs": 1, "hung": 0}


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


@pytest.mark.slow
def test_leave_process_group_drops_the_ddp_wrappers_first(tmp_path):
    """The examples' last call: after a two-process TraceRL step with a value model (policy and value model wrapped
    in DDP), no DDP wrapper is left while the trainer is still alive, and both processes are out of the group. A DDP
    reducer that outlived the group destroyed it holding the GIL: one process of a two-process CPU run hung at exit
    (seen in CI, with gloo's worker thread waiting for the GIL)."""
    accelerate_launch(TWO_CPU_PROCESSES, ROOT / "tests" / "distributed" / "leave.py", "--out", str(tmp_path),
                      timeout=300)
    for rank in (0, 1):
        facts = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert facts == {"wrappers_before": 2, "wrappers_after": 0, "in_process_group": False}


@pytest.fixture(scope="module")
def only_model(tmp_path_factory) -> dict:
    """Step-1 ``save_only_model=True`` checkpoints of a run without and a run with a value model (mid-cycle:
    ``num_iterations=2``), with the trainers that wrote them."""
    root = tmp_path_factory.mktemp("save_only_model")
    trainers = {}
    for run in ("plain", "value"):
        trainers[run] = tracerl(root / run, 1, value=run == "value", save_only_model=True)
        trainers[run].train()
    return {"root": root, "trainers": trainers}


def test_save_only_model_keeps_the_value_weights_not_its_optimizer(only_model):
    checkpoint = only_model["root"] / "value" / "checkpoint-1"
    assert not (checkpoint / "value_state.pt").exists()  # the value model's optimizer, as transformers' below
    assert not (checkpoint / "optimizer.pt").exists() and not (checkpoint / "scheduler.pt").exists()
    trainer = only_model["trainers"]["value"]
    trained = trainer.accelerator.unwrap_model(trainer.value_model).state_dict()
    saved = DiffusionValueModel.from_pretrained(checkpoint / "value_model").state_dict()
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[k], trained[k]) for k in saved)


@pytest.mark.parametrize("run,opt_out", [("plain", False), ("value", False), ("value", True)],
                         ids=["plain", "value", "value-resume_without_rollout_state"])
def test_resume_from_a_save_only_model_checkpoint_is_refused(only_model, tmp_path, run, opt_out):
    """Refused before any step, whatever ``resume_without_rollout_state`` says (the rollout state is there; the
    optimizer, scheduler and RNG states are not)."""
    checkpoint = only_model["root"] / run / "checkpoint-1"
    trainer = tracerl(tmp_path, 2, value=run == "value", resume_without_rollout_state=opt_out)
    with pytest.raises(ValueError, match="saved with save_only_model=True.*not resumable") as error:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert error.match("save_only_model=False")
    assert trainer.state.global_step == 1
