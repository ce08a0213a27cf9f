"""Fixes from an audit of the TraceRL trainer: value steps over surviving groups only, the per-row
``rollout/denoising_steps_per_block`` metric, and ``max_completion_length=None`` refused at construction."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from test_tracerl_official import fixed_rollout, make_trainer, official_config

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer, blocks_generated
from trl_diffusion.value import DiffusionValueModel


def test_value_steps_train_only_on_surviving_groups(tmp_path):
    """The banded reward filters groups 0 and 3 of four: every value optimizer step must have rows to train on
    (a step over filtered responses only has a zero gradient, yet AdamW would still move the weights), the epoch
    takes ceil(training rows / value_batch_size) steps, and the filtered responses never reach the value model."""
    args = official_config(tmp_path, "trado", denoising_steps=2, value_batch_size=4, value_learning_rate=1e-3)
    policy = tiny_model("sdar").train()
    trainer = make_trainer(args, model=policy, value_model=DiffusionValueModel.from_policy(policy))
    grad_norms, trained_prompts = [], []
    step, token_values = trainer.value_optimizer.step, trainer._token_values

    def recording_step(*a, **k):
        grads = [p.grad.float().norm() for p in trainer.value_model.parameters() if p.grad is not None]
        grad_norms.append(float(torch.stack(grads).norm()) if grads else 0.0)
        return step(*a, **k)

    def recording_values(prompt_ids, *rest):
        if torch.is_grad_enabled() and trainer.value_model.training:
            trained_prompts.extend(prompt_ids.tolist())
        return token_values(prompt_ids, *rest)

    planned = []
    value_updates = trainer._value_updates

    def recording_updates(rows, live):
        planned.append((int(rows.sum()), value_updates(rows, live)))
        return planned[-1][1]

    trainer.value_optimizer.step, trainer._token_values = recording_step, recording_values
    trainer._value_updates = recording_updates
    batch = fixed_rollout(trainer)
    kept = batch["kept_rows"].bool()
    assert kept.tolist() == [False] * 4 + [True] * 8 + [False] * 4  # the premise: groups 0 and 3 are filtered
    (rows, steps), = planned
    assert rows == 14 and steps == len(grad_norms) == 4  # ceil(training rows / value_batch_size)
    assert all(norm > 0 for norm in grad_norms), grad_norms
    prompt_ids = batch["prompt_ids"].tolist()
    assert len(trained_prompts) == 8  # each surviving response once, no filtered one
    assert sorted(trained_prompts) == sorted(prompt_ids[i] for i in range(16) if kept[i])


def test_blocks_generated_counts_each_rows_own_blocks():
    steps = torch.tensor([[0, 0, 1, 1, 2, -1, -1, -1],   # blocks 0, 1 (columns 0-1 in block 0, 2-4 in block 1)
                          [0, -1, -1, -1, -1, -1, -1, -1],  # stopped in its first block
                          [0, 1, 1, 2, 3, 3, 4, 4]])
    blocks = torch.tensor([[0, 0, 1, 1, 1, 1, 2, 2]] * 3)  # a prompt ending inside block 0 (2 canvas columns)
    assert blocks_generated(steps, blocks).tolist() == [2, 1, 3]


def test_denoising_steps_per_block_metric_is_per_row(tmp_path):
    """Static decoding with 2 steps per block: the metric is all rows' steps over all rows' own generated blocks.
    Rows stop early (many stop ids), and with a 3-token prompt (block 4) the first generated block is a partial one
    of a single column, decoded in one step; the old metric divided by the longest row's blocks, counted from the
    canvas width (above 2 for the short prompt, below 2 with early stops)."""
    tokenizer = build_tokenizer()
    policy = tiny_model("sdar").train()
    policy.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(c) for c in "aeiouAEIOU 0123456789"]
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=8,
                         max_completion_length=32, report_to="none", block_length=4, denoising_steps=2,
                         remasking_strategy="low_confidence_static", use_cpu=True, seed=0,
                         dynamic_group_filtering="none", disable_tqdm=True)
    for prompt, aligned in (("What is 1+2?", True), ("1+2", False)):
        trainer = TraceRLTrainer(policy, lambda completions, **k: [float(len(c)) for c in completions], args=args,
                                 train_dataset=Dataset.from_dict({"prompt": [prompt]}), processing_class=tokenizer)
        trainer.model.train()
        out = trainer._generate_and_score_completions([{"prompt": prompt}] * 8)
        prompt_length = int(out["prompt_mask"][0].sum())
        assert (prompt_length % 4 == 0) == aligned
        steps = out["unmask_step"]
        total_steps = sum(len(row[row >= 0].unique()) for row in steps)
        total_blocks = sum(len({(prompt_length + c) // 4 for c in (row >= 0).nonzero().squeeze(-1).tolist()})
                           for row in steps)
        lengths = {int((row >= 0).sum()) for row in steps}
        assert len(lengths) > 1  # the premise: rows stopped at different points
        logged = trainer._metrics["train"]["rollout/denoising_steps_per_block"][-1]
        assert logged == pytest.approx(total_steps / total_blocks)
        assert logged == pytest.approx(2.0) if aligned else 1.0 < logged < 2.0


def test_max_completion_length_none_is_refused(tmp_path):
    with pytest.raises(ValueError, match="max_completion_length must be a positive int"):
        TraceRLConfig(output_dir=str(tmp_path), max_completion_length=None, report_to="none", use_cpu=True)



def test_a_rollout_temperature_generate_refuses_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 1e-05"):
        TraceRLConfig(output_dir=str(tmp_path), temperature=1e-9, report_to="none", use_cpu=True)
