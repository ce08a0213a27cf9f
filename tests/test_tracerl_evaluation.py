"""Evaluation inside TraceRL training: it leaves the training run as it was (the eval loader drew from torch's
global generator, which TRL's shuffle of each generation batch reads, so evaluating changed the later steps), refuses
an eval batch of partial groups before its rollouts, and the best checkpoint's metric is checked: one no evaluation
of a dict of eval sets logs is refused when the trainer is built, a None reward is warned about and never the best
(transformers failed comparing it)."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from test_tracerl_dataset_sizes import PROMPTS, config, distinct_chars

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer


def run(tmp_path, eval_dataset=None, reward=distinct_chars, **overrides):
    torch.manual_seed(0)
    trainer = TraceRLTrainer(tiny_model("sdar").train(), reward, args=config(tmp_path, **overrides),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=eval_dataset,
                             processing_class=build_tokenizer())
    trainer.train()
    return trainer


def test_evaluating_during_training_does_not_change_the_training_run(tmp_path):
    steps = dict(max_steps=3, per_device_train_batch_size=2, steps_per_generation=2, num_generations_eval=2)
    plain = run(tmp_path / "plain", **steps)
    evaluated = run(tmp_path / "eval", Dataset.from_dict({"prompt": PROMPTS[:2]}), eval_strategy="steps",
                    eval_steps=1, **steps)
    assert any("eval_reward" in log for log in evaluated.state.log_history)
    for (name, a), (_, b) in zip(plain.model.named_parameters(), evaluated.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_an_eval_batch_of_partial_groups_is_refused_before_its_rollouts(tmp_path):
    trainer = run(tmp_path, max_steps=1, per_device_eval_batch_size=3, num_generations_eval=2)
    trainer.model.forward = None  # a rollout would fail with a TypeError
    with pytest.raises(ValueError, match=r"global eval batch size \(3 x 1 process\(es\)\) must be divisible by "
                                         r"num_generations_eval \(2\)"):
        trainer.evaluate(Dataset.from_dict({"prompt": PROMPTS[:2]}))


def test_a_best_metric_no_eval_set_logs_is_refused_at_construction(tmp_path):
    sets = {"a": Dataset.from_dict({"prompt": PROMPTS[:2]}), "b": Dataset.from_dict({"prompt": PROMPTS[2:]})}
    with pytest.raises(ValueError, match=r"metric_for_best_model='reward' is logged by no evaluation.*'a_reward'"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path, metric_for_best_model="reward",
                                                                       eval_strategy="steps"),
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=sets,
                       processing_class=build_tokenizer())
    TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path, metric_for_best_model="a_reward"),
                   train_dataset=Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=sets,
                   processing_class=build_tokenizer())


@pytest.mark.parametrize("scheduler", ["linear", "reduce_lr_on_plateau"])
def test_an_evaluation_without_any_reward_is_never_the_best_and_is_warned_about(tmp_path, caplog, scheduler):
    def training_prompts_only(completions, prompts, **kwargs):  # TRL's None: the function does not score the row
        return [float(len(set(c))) if p in PROMPTS else None for c, p in zip(completions, prompts)]

    with caplog.at_level(logging.WARNING, logger="trl_diffusion.best_metric"):
        trainer = run(tmp_path, Dataset.from_dict({"prompt": ["never scored"]}), training_prompts_only, max_steps=1,
                      eval_strategy="steps", eval_steps=1, metric_for_best_model="reward",
                      lr_scheduler_type=scheduler)  # eval_reward was None: TypeErrors in both places
    assert trainer.state.best_global_step is None
    assert any("'eval_reward' is NaN at step 1" in r.getMessage() for r in caplog.records)
