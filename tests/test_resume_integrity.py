"""A resume either continues exactly or refuses, and a save that fails part-way never leaves a newest checkpoint
that looks complete (``trainer_state.json``) without TraceRL's rollout state.

The exactness of a complete resume itself is checked in ``tests/test_distributed.py``."""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers.trainer_utils import get_last_checkpoint

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import checkpoint_files, sft_trainer, tracerl_trainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer, value_trainer

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def tracerl(out: Path, max_steps: int, value: bool = False, **overrides) -> TraceRLTrainer:
    """A tiny SDAR TraceRL run saving every step; ``num_iterations=2`` so step 1 ends inside a generation cycle."""
    config = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=max_steps, logging_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="steps", save_steps=1, use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, num_iterations=2,
                  dynamic_group_filtering="none")  # rewards beyond [0, 1]
    config.update(overrides)
    model = tiny_model("sdar").train()
    return TraceRLTrainer(model, distinct_chars, args=TraceRLConfig(**config),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer(),
                          value_model=DiffusionValueModel.from_policy(model) if value else None)


def sft(out: Path, max_steps: int, **overrides) -> DiffusionSFTTrainer:
    """A tiny SDAR SFT run saving every step."""
    config = dict(output_dir=str(out), per_device_train_batch_size=2, max_length=32, save_strategy="steps",
                  save_steps=1, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                  gradient_checkpointing=False, max_steps=max_steps)
    data = Dataset.from_list([{"prompt": p, "completion": "ok"} for p in PROMPTS])
    return DiffusionSFTTrainer(tiny_model("sdar").train(), args=DiffusionSFTConfig(**{**config, **overrides}),
                               train_dataset=data, processing_class=build_tokenizer())


TRAJECTORY = dict(prompt="abc", completion_ids=[30, 31, 32, 33], unmask_step=[0, 0, 1, 1], reward=1.0)


def value_run(out: Path, max_steps: int, **overrides) -> DiffusionValueTrainer:
    """A tiny SDAR value-model fit saving every step (rewards 1 and 0, so the logged statistics vary)."""
    rows = [TRAJECTORY, {**TRAJECTORY, "reward": 0.0, "completion_ids": [40, 41], "unmask_step": [0, 1]}] * 2
    config = dict(output_dir=str(out), per_device_train_batch_size=2, save_strategy="steps", save_steps=1,
                  report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, max_steps=max_steps)
    return DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")),
                                 args=DiffusionValueConfig(**{**config, **overrides}),
                                 train_dataset=Dataset.from_list(rows), processing_class=build_tokenizer())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Step-1 checkpoints of a run without and a run with a value model (each copied before a test edits it)."""
    root = tmp_path_factory.mktemp("resume")
    tracerl(root / "plain", 1).train()
    tracerl(root / "value", 1, value=True).train()
    return root


def copy_checkpoint(checkpoints: Path, run: str, tmp_path: Path) -> Path:
    target = tmp_path / run / "checkpoint-1"
    shutil.copytree(checkpoints / run / "checkpoint-1", target)
    return target


def test_checkpoints_hold_the_rollout_state(checkpoints):
    """What the refusal below guards: the buffer of the cycle in progress (step 1 of 2) and the value state."""
    saved = torch.load(checkpoints / "plain" / "checkpoint-1" / "rollout_buffer_0.pt", weights_only=True)
    assert saved["buffer"] is not None and saved["step"] == 1
    assert saved["layout"] == {"num_processes": 1, "per_device_train_batch_size": 4}
    assert (checkpoints / "value" / "checkpoint-1" / "value_model").is_dir()
    assert (checkpoints / "value" / "checkpoint-1" / "value_state.pt").is_file()


def test_resume_without_rollout_buffer_is_refused(checkpoints, tmp_path):
    checkpoint = copy_checkpoint(checkpoints, "plain", tmp_path)
    (checkpoint / "rollout_buffer_0.pt").unlink()
    trainer = tracerl(tmp_path / "plain", 2)
    with pytest.raises(ValueError, match="rollout_buffer_0.pt is missing") as error:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert error.match("resume_without_rollout_state=True")
    assert trainer.state.global_step == 1  # refused before any step ran


def test_opt_out_resumes_without_the_rollout_buffer(checkpoints, tmp_path, caplog):
    checkpoint = copy_checkpoint(checkpoints, "plain", tmp_path)
    (checkpoint / "rollout_buffer_0.pt").unlink()
    trainer = tracerl(tmp_path / "plain", 2, resume_without_rollout_state=True)
    with caplog.at_level(logging.WARNING, logger=tracerl_trainer.__name__):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == 2
    assert "rollout_buffer_0.pt is missing" in caplog.text and "Resuming anyway" in caplog.text


def test_buffer_saved_with_another_batch_layout_is_refused(checkpoints, tmp_path):
    """Rollout seeds and buffers are per process: another process count or per-device batch cannot continue it."""
    checkpoint = copy_checkpoint(checkpoints, "plain", tmp_path)
    saved = torch.load(checkpoint / "rollout_buffer_0.pt", weights_only=True)
    saved["layout"]["num_processes"] = 2
    torch.save(saved, checkpoint / "rollout_buffer_0.pt")
    with pytest.raises(ValueError, match="saved with .'num_processes': 2"):
        tracerl(tmp_path / "plain", 2).train(resume_from_checkpoint=str(checkpoint))


def test_buffer_without_the_row_scale_of_a_row_mean_loss_is_refused(tmp_path):
    """A rollout buffer saved before ``kept_row_scale`` existed cannot continue a ``grpo`` run (its loss reads it)."""
    tracerl(tmp_path / "grpo", 1, loss_type="grpo").train()
    path = tmp_path / "grpo" / "checkpoint-1" / "rollout_buffer_0.pt"
    saved = torch.load(path, weights_only=True)
    for batch in saved["buffer"]:
        del batch["kept_row_scale"]
    torch.save(saved, path)
    with pytest.raises(ValueError, match="lacks the kept_row_scale"):
        tracerl(tmp_path / "grpo", 2, loss_type="grpo").train(resume_from_checkpoint=str(path.parent))


@pytest.mark.parametrize("missing", ["value_state.pt", "value_model"])
def test_resume_without_value_state_is_refused(checkpoints, tmp_path, missing):
    checkpoint = copy_checkpoint(checkpoints, "value", tmp_path)
    path = checkpoint / missing
    shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(ValueError, match=f"{missing}/? is missing"):
        tracerl(tmp_path / "value", 2, value=True).train(resume_from_checkpoint=str(checkpoint))


def test_value_checkpoint_resumed_without_a_value_model_is_refused(checkpoints, tmp_path):
    checkpoint = copy_checkpoint(checkpoints, "value", tmp_path)
    with pytest.raises(ValueError, match="holds a value model"):
        tracerl(tmp_path / "value", 2).train(resume_from_checkpoint=str(checkpoint))


def complete(folder: Path) -> list[str]:
    """The checkpoints transformers can resume from (those with ``trainer_state.json``), oldest first."""
    found = [p for p in folder.glob("checkpoint-*") if (p / "trainer_state.json").exists()]
    return [p.name for p in sorted(found, key=lambda p: int(p.name.split("-")[1]))]


def failing_save(monkeypatch, marker: str, step: int, trainer) -> None:
    """Make writes (``torch.save``, ``json.dump``) of files whose name starts with ``marker`` fail at ``step``: a crash
    between the writes of one checkpoint."""
    save, dump = torch.save, json.dump

    def fail_if_marked(target) -> None:
        if Path(str(getattr(target, "name", target))).name.startswith(marker) and trainer.state.global_step == step:
            raise OSError(f"disk full while writing {marker}")

    def torch_save(obj, f, *args, **kwargs):
        fail_if_marked(f)
        return save(obj, f, *args, **kwargs)

    def json_dump(obj, fp, *args, **kwargs):
        fail_if_marked(fp)
        return dump(obj, fp, *args, **kwargs)

    monkeypatch.setattr(torch, "save", torch_save)
    monkeypatch.setattr(json, "dump", json_dump)


def test_failed_rollout_state_write_leaves_the_last_complete_checkpoint(tmp_path, monkeypatch):
    """``save_total_limit=1``: transformers deletes older checkpoints after marking the new one complete, so our
    files must be written before that."""
    out = tmp_path / "run"
    trainer = tracerl(out, 2, save_total_limit=1)
    failing_save(monkeypatch, "rollout_buffer", 2, trainer)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert complete(out) == ["checkpoint-1"]
    assert (out / "checkpoint-1" / "rollout_buffer_0.pt").exists()
    # transformers' "latest checkpoint" is the incomplete folder, and it refuses it rather than resuming from it
    # (no model files yet: "Can't find a valid checkpoint"; model files but no state file: FileNotFoundError)
    assert Path(get_last_checkpoint(str(out))).name == "checkpoint-2"
    monkeypatch.undo()
    with pytest.raises((ValueError, FileNotFoundError), match="checkpoint-2"):
        tracerl(out, 2).train(resume_from_checkpoint=True)
    resumed = tracerl(out, 2)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-1"))
    assert resumed.state.global_step == 2


def test_failed_write_into_an_old_checkpoint_folder_does_not_look_complete(tmp_path, monkeypatch):
    """A folder being rewritten (an earlier run's ``checkpoint-1`` in the same output_dir) loses its old state file
    before anything else is written."""
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-1" / "trainer_state.json").write_text("{}")
    trainer = tracerl(tmp_path, 1)
    failing_save(monkeypatch, "rollout_buffer", 1, trainer)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert complete(tmp_path) == []


def test_failed_token_count_write_leaves_the_last_complete_sft_checkpoint(tmp_path, monkeypatch):
    config = DiffusionSFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, max_length=32,
                                save_strategy="steps", save_steps=1, save_total_limit=1, report_to="none",
                                use_cpu=True, bf16=False, disable_tqdm=True, gradient_checkpointing=False)
    data = Dataset.from_list([{"prompt": p, "completion": "ok"} for p in PROMPTS])
    trainer = DiffusionSFTTrainer(tiny_model("sdar").train(), args=config, train_dataset=data,
                                  processing_class=build_tokenizer())
    failing_save(monkeypatch, "token_count", 2, trainer)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert complete(tmp_path) == ["checkpoint-1"]
    assert (tmp_path / "checkpoint-1" / "token_count.json").exists()


def test_sft_resume_without_token_count_warns(tmp_path, caplog):
    """The token counter is a logged metric only (training itself resumes exactly), so its absence warns."""
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=32, save_strategy="steps",
                  save_steps=1, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                  gradient_checkpointing=False)
    data = Dataset.from_list([{"prompt": p, "completion": "ok"} for p in PROMPTS])

    def sft(max_steps):
        return DiffusionSFTTrainer(tiny_model("sdar").train(), args=DiffusionSFTConfig(**config, max_steps=max_steps),
                                   train_dataset=data, processing_class=build_tokenizer())

    sft(1).train()
    (tmp_path / "checkpoint-1" / "token_count.json").unlink()
    with caplog.at_level(logging.WARNING, logger=sft_trainer.__name__):
        sft(2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert "token_count.json is missing" in caplog.text


def test_sft_resume_from_a_save_only_model_checkpoint_is_refused(tmp_path):
    """transformers resumed it silently with a fresh optimizer and a restarted learning-rate schedule (the warmup
    again): refused before any step, as TraceRL refuses it."""
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=32, save_strategy="steps",
                  save_steps=1, report_to="none", use_cpu=True, bf16=False, disable_tqdm=True,
                  gradient_checkpointing=False, save_only_model=True)
    data = Dataset.from_list([{"prompt": p, "completion": "ok"} for p in PROMPTS])

    def sft(max_steps):
        return DiffusionSFTTrainer(tiny_model("sdar").train(), args=DiffusionSFTConfig(**config, max_steps=max_steps),
                                   train_dataset=data, processing_class=build_tokenizer())

    sft(1).train()
    assert not (tmp_path / "checkpoint-1" / "optimizer.pt").exists()
    trainer = sft(2)
    with pytest.raises(ValueError, match="saved with save_only_model=True.*not resumable"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert trainer.state.global_step == 1


def first_pass_warnings(make_trainer, tmp_path: Path, caplog, stop: int, steps: tuple[int, ...]) -> list[bool]:
    """Train ``make_trainer(callbacks)`` on a stream until step ``stop`` (saving every step), then resume a new
    trainer from each of ``steps``: whether each resume warned that its checkpoint is past the first pass."""
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= stop

    make_trainer([StopAfter()]).train()
    warned = []
    for step in steps:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=checkpoint_files.__name__):
            make_trainer(None).train(resume_from_checkpoint=str(tmp_path / f"checkpoint-{step}"))
        warned.append("within its first pass only" in caplog.text)
    return warned


def test_sft_resume_of_a_stream_past_its_first_pass_warns(tmp_path, caplog):
    """transformers skips an IterableDataset's trained batches within its first pass only: a checkpoint saved in a
    later pass resumed at the start of a pass (batches repeated, noise of another pass) without a word."""
    config = DiffusionSFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_length=32, max_steps=6,
                                save_strategy="steps", save_steps=1, report_to="none", use_cpu=True, bf16=False,
                                disable_tqdm=True, gradient_checkpointing=False)
    data = Dataset.from_list([{"prompt": p, "completion": "ok"} for p in PROMPTS * 2]).to_iterable_dataset()

    def sft(callbacks):
        return DiffusionSFTTrainer(tiny_model("sdar").train(), args=config, train_dataset=data,
                                   processing_class=build_tokenizer(), callbacks=callbacks)

    # 4 batches a pass: checkpoint-5 is in the second pass, checkpoint-3 in the first
    assert first_pass_warnings(sft, tmp_path, caplog, stop=5, steps=(3, 5)) == [False, True]


def test_value_resume_of_a_stream_past_its_first_pass_warns(tmp_path, caplog):
    """The value trainer resumed such a checkpoint without a word too (SFT's warning only): resumed from step 3 of
    a 2-batch stream, steps 4-6 trained other batches than an uninterrupted run's."""
    config = DiffusionValueConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=6,
                                  save_strategy="steps", save_steps=1, report_to="none", use_cpu=True, bf16=False,
                                  disable_tqdm=True)
    rows = [{**TRAJECTORY, "reward": float(index)} for index in range(4)]
    data = Dataset.from_list(rows).to_iterable_dataset()

    def value(callbacks):
        return DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")), args=config,
                                     train_dataset=data, processing_class=build_tokenizer(), callbacks=callbacks)

    # 2 batches a pass: checkpoint-3 is in the second pass, checkpoint-1 in the first
    assert first_pass_warnings(value, tmp_path, caplog, stop=3, steps=(1, 3)) == [False, True]


# ------------------------------------------------------------------------------------------- two processes

TRAIN = Path(__file__).resolve().parent / "distributed" / "train.py"


def launch_two(out: Path, max_steps: int, resume: Path | None = None, **overrides) -> subprocess.CompletedProcess:
    """``tests/distributed/train.py`` (TraceRL, per-device batch 2) in two CPU processes over gloo."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               str(port), str(TRAIN), "--out", str(out), "--jobs", "tracerl", "--per_device_batch", "2",
               "--max_steps", str(max_steps), "--overrides",
               json.dumps({"save_strategy": "steps", "save_steps": 1, "num_iterations": 2, **overrides})]
    if resume is not None:
        command += ["--resume", str(resume)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    # generous bound: a process waiting for one that raised would hang until gloo's 30-minute timeout
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def logged_steps(out: Path) -> list[int]:
    history = json.loads((out / "tracerl" / "log_history.json").read_text())
    return [entry["step"] for entry in history if "loss" in entry]


@pytest.mark.slow
def test_two_processes_resume_refuse_and_opt_out_together(tmp_path):
    """With only rank 1's buffer missing both processes stop with the refusal (none waits for the other), and with
    the opt-out both generate the cycle again (rank 0 dropping its buffer too, or it would skip the collectives of
    rank 1's generation) and finish. (A complete two-process checkpoint resuming exactly: tests/test_deepspeed.py,
    under ZeRO-3.)"""
    def succeeded(done: subprocess.CompletedProcess) -> bool:
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        return True

    assert succeeded(launch_two(tmp_path, 1))
    checkpoint = tmp_path / "tracerl" / "checkpoint-1"
    assert (checkpoint / "rollout_buffer_0.pt").is_file()
    (checkpoint / "rollout_buffer_1.pt").unlink()
    refused = launch_two(tmp_path, 2, resume=checkpoint)
    output = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "rollout_buffer_1.pt is missing" in output, output[-3000:]
    assert "another process's rollout state is incomplete" in output, output[-3000:]
    assert succeeded(launch_two(tmp_path, 2, resume=checkpoint, resume_without_rollout_state=True))
    assert logged_steps(tmp_path) == [1, 2]


def test_a_value_optimizer_saved_with_one_parameter_group_is_refused_clearly(checkpoints, tmp_path):
    """Checkpoints from before the value optimizer took the policy's weight-decay groups hold one group: PyTorch's
    bare 'different number of parameter groups' aborted the resume; the error names the file and the cause."""
    checkpoint = copy_checkpoint(checkpoints, "value", tmp_path)
    state = torch.load(checkpoint / "value_state.pt", weights_only=True)
    groups = state["optimizer"]["param_groups"]
    state["optimizer"]["param_groups"] = [{**groups[0], "params": [p for g in groups for p in g["params"]]}]
    torch.save(state, checkpoint / "value_state.pt")
    with pytest.raises(ValueError, match=r"value_state.pt holds a value optimizer with 1 parameter group\(s\)"):
        tracerl(tmp_path / "value", 2, value=True).train(resume_from_checkpoint=str(checkpoint))


def _train_logs(trainer) -> list[dict]:
    """The training log entries, less transformers' own running ``loss`` (its window sum is not in checkpoints) and
    wall-clock times."""
    return [{k: v for k, v in entry.items() if k != "loss" and "time" not in k} for entry in trainer.state.log_history
            if "loss" in entry]


@pytest.mark.parametrize("trainer_kind", ["tracerl", "sft", "value"])
def test_a_checkpoint_between_two_logs_keeps_the_window_in_progress(tmp_path, trainer_kind):
    """logging_steps=2, save_steps=1: resuming from checkpoint-1 dropped step 1's metrics from the step-2 log
    (TraceRL's reward 3.583 for 4.375, value/loss 6.80 for 28.48; the value trainer's value/mean 0.469 for
    0.2346); the window in progress is saved with the checkpoint."""
    settings = dict(logging_steps=2, lr_scheduler_type="constant")
    if trainer_kind == "tracerl":
        def run(out, steps):
            return tracerl(out, steps, num_iterations=1, **settings)
    else:
        def run(out, steps):
            return (sft if trainer_kind == "sft" else value_run)(out, steps, learning_rate=1e-2, **settings)
    whole = run(tmp_path / "whole", 2)
    whole.train()
    run(tmp_path / "cut", 1).train()
    resumed = run(tmp_path / "cut", 2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-1"))
    expected, got = _train_logs(whole), _train_logs(resumed)
    assert len(expected) == len(got) == 1
    assert got[0].keys() == expected[0].keys()
    for key, value in expected[0].items():
        assert got[0][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


# ------------------------------------------------------------------------------- what a checkpoint folder holds


@pytest.mark.parametrize("name", ["rollout_buffer_0.pt", "value_state.pt"])
def test_a_crafted_checkpoint_file_runs_no_code_on_resume(checkpoints, tmp_path, name):
    """The rollout buffer and the value state were unpickled with ``weights_only=False``: a crafted file ran code
    on ``train(resume_from_checkpoint=...)``. They load as tensors and plain containers only, as transformers loads
    its checkpoint files."""
    checkpoint = copy_checkpoint(checkpoints, "value", tmp_path)
    marker = tmp_path / "code_ran"

    class Crafted:
        def __reduce__(self):
            return os.makedirs, (str(marker),)

    saved = torch.load(checkpoint / name, weights_only=True)
    torch.save({**saved, "crafted": Crafted()}, checkpoint / name)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        tracerl(tmp_path / "value", 2, value=True).train(resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()


def test_a_rewritten_tracerl_checkpoint_holds_only_this_runs_files(tmp_path):
    """An earlier run in the same output_dir (value model, sync_ref_model, two processes) left its value model,
    reference and rollout buffers in checkpoint-1: a new run rewriting it without them could not resume ("holds a
    value model") and ``load_best_model_at_end`` loaded the earlier run's reference. They are removed first."""
    synced = dict(beta=0.1, sync_ref_model=True, ref_model_sync_steps=1, kl_reference="reference_model")
    tracerl(tmp_path, 1, value=True, **synced).train()
    checkpoint = tmp_path / "checkpoint-1"
    shutil.copy(checkpoint / "rollout_buffer_0.pt", checkpoint / "rollout_buffer_1.pt")
    assert {"value_model", "value_state.pt", "ref_model_state.pt"} <= {p.name for p in checkpoint.iterdir()}
    tracerl(tmp_path, 1).train()
    ours = {p.name for p in checkpoint.iterdir()} & {"value_model", "value_state.pt", "ref_model_state.pt",
                                                     "rollout_buffer_0.pt", "rollout_buffer_1.pt"}
    assert ours == {"rollout_buffer_0.pt"}
    resumed = tracerl(tmp_path, 2)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2


@pytest.mark.parametrize("trainer_kind", ["sft", "value"])
def test_a_failed_rewrite_of_an_sft_or_value_checkpoint_does_not_look_complete(tmp_path, monkeypatch,
                                                                               trainer_kind):
    """An earlier run's checkpoint-1 kept its ``trainer_state.json`` while a new run rewrote the folder: a save that
    failed part-way (here at the optimizer) left a complete-looking checkpoint mixing the two runs, which
    ``resume_from_checkpoint=True`` resumed. As in TraceRL, the old state file is removed before anything is
    written."""
    run = sft if trainer_kind == "sft" else value_run
    run(tmp_path, 1).train()
    trainer = run(tmp_path, 1)
    failing_save(monkeypatch, "optimizer", 1, trainer)
    with pytest.raises(OSError, match="disk full"):
        trainer.train()
    assert complete(tmp_path) == []


def test_value_resume_from_a_save_only_model_checkpoint_is_refused(tmp_path):
    """The value trainer resumed it silently with a fresh optimizer and the learning-rate warmup again; refused
    before any step, as SFT and TraceRL refuse it."""
    value_run(tmp_path, 1, save_only_model=True).train()
    trainer = value_run(tmp_path, 2, save_only_model=True)
    with pytest.raises(ValueError, match="saved with save_only_model=True.*not resumable"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert trainer.state.global_step == 1


def test_value_resume_without_its_statistics_warns(tmp_path, caplog):
    """The logging window's statistics are a metric only (training itself resumes exactly), so their absence (a
    checkpoint from an older trl_diffusion) warns."""
    value_run(tmp_path, 1).train()
    (tmp_path / "checkpoint-1" / "value_stats.json").unlink()
    with caplog.at_level(logging.WARNING, logger=value_trainer.__name__):
        value_run(tmp_path, 2).train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert "value_stats.json is missing" in caplog.text


def test_value_checkpoints_write_the_model_card(tmp_path):
    """TRL's trainers write the model card into output_dir at each checkpoint; the value trainer wrote none."""
    value_run(tmp_path, 1).train()
    card = (tmp_path / "README.md").read_text()
    assert "DiffusionValueModel.from_pretrained" in card and "trl_diffusion:" in card
