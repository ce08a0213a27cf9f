"""TraceRLTrainer beyond the loss: checkpoints, resume, saved folders, inherited TRL fields (second audit)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_trainer import REFERENCE_STATE_NAME

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def tracerl(out: Path, max_steps: int, **overrides) -> TraceRLTrainer:
    config = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=max_steps, logging_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="steps", save_steps=1, use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none", lr_scheduler_type="constant")
    config.update(overrides)
    return TraceRLTrainer(tiny_model("sdar").train(), distinct_chars, args=TraceRLConfig(**config),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer())


SYNCED = dict(kl_reference="reference_model", sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5,
              beta=0.5)


def test_resume_restores_the_synced_reference_model(tmp_path):
    """sync_ref_model mixes the policy into the reference at every sync step; a resumed run used to rebuild the
    reference from the initial policy, so its KL (and parameters) left the uninterrupted run's after the resume."""
    full = tracerl(tmp_path / "full", 3, **SYNCED)
    full.train()
    tracerl(tmp_path / "stopped", 2, **SYNCED).train()
    checkpoint = tmp_path / "stopped" / "checkpoint-2"
    assert (checkpoint / REFERENCE_STATE_NAME).exists()
    resumed = tracerl(tmp_path / "resumed", 3, **SYNCED)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for ours, theirs in zip(full.ref_model.parameters(), resumed.ref_model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    for ours, theirs in zip(full.model.parameters(), resumed.model.parameters()):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    kl = [h["kl"] for h in full.state.log_history if "kl" in h]
    assert [h["kl"] for h in resumed.state.log_history if "kl" in h][-1] == kl[-1]


def test_resume_without_the_synced_reference_is_refused(tmp_path):
    tracerl(tmp_path / "stopped", 1, **SYNCED).train()
    checkpoint = tmp_path / "stopped" / "checkpoint-1"
    (checkpoint / REFERENCE_STATE_NAME).unlink()
    with pytest.raises(ValueError, match=REFERENCE_STATE_NAME):
        tracerl(tmp_path / "resumed", 2, **SYNCED).train(resume_from_checkpoint=str(checkpoint))


def test_no_reference_copy_without_sync(tmp_path):
    tracerl(tmp_path / "run", 1, kl_reference="reference_model", beta=0.5).train()
    assert not (tmp_path / "run" / "checkpoint-1" / REFERENCE_STATE_NAME).exists()


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_an_approximate_cache_on_a_block_model_is_refused_at_construction(tmp_path, cache):
    """generate() refused it only at the first rollout, after the trainer (and a value model) had been built."""
    with pytest.raises(ValueError, match="rollout_cache"):
        tracerl(tmp_path, 1, rollout_cache=cache, save_strategy="no")


def test_only_a_writing_process_copies_the_synced_reference(tmp_path, monkeypatch):
    """Under DDP every process used to copy the whole reference model to the CPU at each checkpoint, though only the
    main process writes it (a full host-memory copy per process, thrown away). A process that does not save only
    joins the (ZeRO-3) gathering."""
    trainer = tracerl(tmp_path / "run", 1, **SYNCED)
    copies, reference_parameters = [], trainer._reference_parameters

    def recording(*args, **kwargs):
        copies.append(reference_parameters(*args, **kwargs))
        return copies[-1]

    trainer._reference_parameters = recording
    monkeypatch.setattr(TraceRLConfig, "should_save", property(lambda self: False))  # as on a DDP rank > 0
    trainer.train()
    assert copies == [None]
    assert not (tmp_path / "run" / "checkpoint-1" / REFERENCE_STATE_NAME).exists()
