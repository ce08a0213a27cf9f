"""Review round 3, what the trainers hand to the user: saved outputs, checkpoints, model cards, callbacks."""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

CPU = dict(report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no")


def quick_start(card: str) -> str:
    return re.search(r"## Quick start\n\n```python\n(.*?)```", card, re.S).group(1)


def run_fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing of trl_diffusion imported unless the code imports it)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def length_reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


@pytest.mark.slow  # a fresh interpreter
def test_tracerl_card_quick_start_runs_and_samples_as_the_rollouts(tmp_path):
    """TRL's quick start (a bare transformers pipeline) failed on every diffusion checkpoint: the model type is only
    known after `import trl_diffusion`. The card's code now runs as written, with the rollout sampler settings."""
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, block_length=4, denoising_steps=2, temperature=0.7, top_k=5,
                         gradient_checkpointing=False, **CPU)
    trainer = TraceRLTrainer(tiny_model("sdar"), length_reward, args=args, processing_class=build_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 4}))
    trainer.save_model()
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    code = quick_start(card)
    comment = " ".join(line[2:] for line in code.splitlines() if line.startswith("# "))  # generation_config.json's
    assert ("max_new_tokens=8, block_length=4, denoising_steps=2, remasking_strategy='low_confidence_dynamic', "
            "confidence_threshold=0.9, temperature=0.7, top_k=5, top_p=1.0, use_cache=True") in comment
    assert "- trl_diffusion: " in card and "2509.06949" in card
    run_fresh(code.replace('device_map="auto"', 'device_map="cpu"'))


@pytest.mark.slow  # a fresh interpreter
def test_value_card_quick_start_loads_the_value_model(tmp_path):
    """A value model's card offered a text-generation pipeline, which cannot load it; it now loads it as a value
    model, and the loaded weights are the trained ones."""
    value = DiffusionValueModel.from_policy(tiny_model("llada", seed=3))
    with torch.no_grad():
        value.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    rows = {"prompt": ["ab"], "completion_ids": [[5, 6]], "unmask_step": [[0, 1]], "reward": [1.0]}
    trainer = DiffusionValueTrainer(value, args=DiffusionValueConfig(output_dir=str(tmp_path), **CPU),
                                    train_dataset=Dataset.from_dict(rows), processing_class=build_tokenizer())
    trainer.save_model()
    trainer.create_model_card(model_name="tiny-value")
    code = quick_start((tmp_path / "README.md").read_text())
    assert "pipeline" not in code
    head = value.value_head.weight.flatten()[:3].tolist()
    out = run_fresh(code + "print(value_model.value_head.weight.flatten()[:3].tolist())\n")
    assert [float(x) for x in out.strip().strip("[]").split(",")] == head


def test_sft_card_quick_start_registers_the_models(tmp_path):
    args = DiffusionSFTConfig(output_dir=str(tmp_path), **CPU)
    trainer = DiffusionSFTTrainer(tiny_model("dream"), args=args, processing_class=build_tokenizer(),
                                  train_dataset=Dataset.from_dict({"prompt": ["1+2="], "completion": ["3"]}))
    trainer.create_model_card(model_name="tiny")
    code = quick_start((tmp_path / "README.md").read_text())
    assert code.index("import trl_diffusion") < code.index("from transformers import pipeline")
    assert "max_new_tokens=128, return_full_text=False" in code


TIME_BUDGET_WORKER = '''
import json, sys, torch
from accelerate import PartialState
from transformers import TrainerControl, TrainerState
from trl_diffusion.callbacks import TimeBudgetCallback
from trl_diffusion.launching import pause_for_gloo_workers
world = PartialState(cpu=True)
offset = 3.0 * world.process_index  # the processes' clocks disagree by 3 s
clock = [0.0]
callback = TimeBudgetCallback(100.0, decay_fraction=0.5, clock=lambda: clock[0] + offset)
callback.on_train_begin(None, TrainerState(), TrainerControl())
optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
seen = []
for now in (10.0, 60.0, 98.0, 99.0, 101.0):
    clock[0] = now + (5.0 if world.process_index else 0.0)  # and they reach a step at different times
    control = callback.on_step_end(type("A", (), {"learning_rate": 1.0}), TrainerState(), TrainerControl(),
                                   optimizer=optimizer)
    seen.append([optimizer.param_groups[0]["lr"], control.should_training_stop])
open(sys.argv[1] + f"/rank{world.process_index}.json", "w").write(json.dumps(seen))
world.wait_for_everyone()
pause_for_gloo_workers()  # torch 2.6 could hang in the next line otherwise
world.destroy_process_group()  # leave gloo together: exiting with its threads up can abort the process
'''


@pytest.mark.slow  # two processes
def test_time_budget_stops_every_process_at_the_same_step(tmp_path):
    """Each process read its own clock: one stopped while the other ran another step (a hang in its next
    collective under DDP), and they stepped with different learning rates. Process 0's clock now decides."""
    root = Path(__file__).resolve().parents[1]
    script = tmp_path / "worker.py"
    script.write_text(TIME_BUDGET_WORKER)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(root / "examples" / "accelerate_configs" / "cpu_two_processes.yaml"), "--main_process_port",
               str(port), str(script), str(tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=root)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1))
    assert rank0 == rank1
    assert [stop for _, stop in rank0] == [False, False, False, False, True]
    assert [lr for lr, _ in rank0[:4]] == pytest.approx([1.0, 0.8, 0.04, 0.02])


def test_held_out_accuracy_logs_the_starting_point_once(capsys):
    """The accuracy measured when training begins (the "before" point) was kept in ``curve`` only, so the training
    curve read from ``log_history`` started at the first ``every`` step. It is now logged, once per step (a resume
    at a step already logged adds no second point), and only the main process prints it. A resumed run does not
    measure at the step it resumes from when the checkpoint's history has the starting point (it added a point the
    uninterrupted run does not have, and the examples reported it as the accuracy "before" training)."""
    from transformers import TrainerControl, TrainerState

    from trl_diffusion.callbacks import HELD_OUT_KEY, HeldOutAccuracyCallback, held_out_curve
    from trl_diffusion.data import make_problems

    problems = make_problems(num_train=1, num_test=3, seed=0)[1]
    callback = HeldOutAccuracyCallback(tiny_model("sdar"), build_tokenizer(), problems, every=2, max_new_tokens=4)
    state, control = TrainerState(), TrainerControl()
    callback.on_train_begin(None, state, control)
    for step in (1, 2, 3):
        state.global_step = step
        callback.on_step_end(None, state, control)
    callback.on_train_end(None, state, control)
    assert [entry["step"] for entry in state.log_history if HELD_OUT_KEY in entry] == [0, 2, 3]
    assert [step for step, _ in callback.curve] == [0, 2, 3]
    assert len(capsys.readouterr().out.splitlines()) == 3
    assert held_out_curve(state.log_history) == callback.curve
    resumed = HeldOutAccuracyCallback(callback.model, callback.tokenizer, problems, every=2, max_new_tokens=4)
    state.log_history = state.log_history[:2]  # the checkpoint saved at step 2
    state.global_step = 2
    resumed.on_train_begin(None, state, control)
    assert resumed.curve == [] and capsys.readouterr().out == ""
    state.is_world_process_zero = False  # another process: measures and logs, does not print
    for step in (3, 4):
        state.global_step = step
        resumed.on_step_end(None, state, control)
    resumed.on_train_end(None, state, control)
    assert [step for step, _ in held_out_curve(state.log_history)] == [0, 2, 4]
    assert capsys.readouterr().out == ""
    without = HeldOutAccuracyCallback(callback.model, callback.tokenizer, problems, every=2, max_new_tokens=4)
    state.log_history = [{"step": 4, "loss": 1.0}]  # a checkpoint made without the callback: measured at the start
    without.on_train_begin(None, state, control)
    assert [step for step, _ in held_out_curve(state.log_history)] == [4] == [step for step, _ in without.curve]
