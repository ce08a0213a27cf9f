"""Regression tests from a review of the RL side (TraceRLTrainer, its config and estimators)."""

import pytest
import torch
from datasets import Dataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer


def recording_trainer(tmp_path, seen: list, **overrides) -> TraceRLTrainer:
    """A trainer on one repeated prompt whose reward function records every generation batch's completions."""

    def reward(completions, completion_ids, **kwargs):
        seen.append([tuple(ids) for ids in completion_ids])
        return [float(len(set(c))) for c in completions]

    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0,
                  dynamic_group_filtering="none")
    config.update(overrides)
    dataset = Dataset.from_dict({"prompt": ["abc"] * 8})
    return TraceRLTrainer(tiny_model("llada").train(), reward, args=TraceRLConfig(**config), train_dataset=dataset,
                          eval_dataset=dataset, processing_class=build_tokenizer())


def test_generation_batches_of_one_optimizer_step_draw_fresh_samples(tmp_path):
    # gradient_accumulation_steps = 2 x steps_per_generation: two generation batches per optimizer step, which used
    # to share the step's seeds row for row (identical completions for identical prompts)
    seen = []
    recording_trainer(tmp_path, seen, gradient_accumulation_steps=2, steps_per_generation=1).train()
    assert len(seen) == 2
    assert seen[0] != seen[1]


def test_evaluation_batches_draw_fresh_samples(tmp_path):
    seen = []
    trainer = recording_trainer(tmp_path, seen, per_device_eval_batch_size=4)
    trainer.evaluate()  # 8 prompts x 4 generations in batches of 4: all batches at step 0
    batches = len(seen)
    assert batches > 1
    assert len(set(map(tuple, seen))) == batches  # every batch sampled afresh (the prompt is the same)
    trainer.evaluate()  # a second evaluation at the same step samples what the first did
    assert seen[batches:] == seen[:batches]


def test_an_evaluation_samples_the_same_whatever_ran_before_it_at_its_step(tmp_path):
    """The eval rollouts' seeds count the batches of each evaluation from 0: another eval set evaluated before, or an
    evaluation that failed half-way, does not change what an evaluation at the same step samples."""
    seen = []
    trainer = recording_trainer(tmp_path, seen, per_device_eval_batch_size=4)
    trainer.evaluate()
    alone, seen[:] = list(seen), []
    trainer.evaluate(Dataset.from_dict({"prompt": ["xyz"] * 4}))  # another eval set first
    seen.clear()
    trainer.evaluate()
    assert seen == alone
    generate, seen[:] = trainer._generate_single_turn, []

    def fail_in_second_batch(*args, **kwargs):
        if seen:
            raise RuntimeError("reward service down")
        return generate(*args, **kwargs)

    trainer._generate_single_turn = fail_in_second_batch
    with pytest.raises(RuntimeError, match="reward service down"):
        trainer.evaluate()
    trainer._generate_single_turn, seen[:] = generate, []
    trainer.evaluate()  # the retry
    assert seen == alone


def off_policy_mask_calls(tmp_path, estimator: str, masks: int) -> list:
    """The (KL to the reference, kept) of every off-policy-mask call in one first-iteration step on a 0/1 reward."""
    calls = []
    trainer = recording_trainer(tmp_path, [], likelihood_estimator=estimator, masks_per_response=masks,
                                off_policy_mask_threshold=0.05, per_device_train_batch_size=8)
    original = trainer.get_off_policy_mask

    def spy(advantages, per_token_logps, sampling_per_token_logps, mask, off_policy_threshold):
        kept = original(advantages=advantages, per_token_logps=per_token_logps,
                        sampling_per_token_logps=sampling_per_token_logps, mask=mask,
                        off_policy_threshold=off_policy_threshold)
        kl = ((sampling_per_token_logps - per_token_logps.detach()) * mask).sum(1) / mask.sum(1).clamp(min=1)
        calls.append((kl, kept, advantages))
        return kept

    trainer.get_off_policy_mask = spy
    trainer.train()
    return calls


@pytest.mark.parametrize("estimator,masks", [("random_masking", 1), ("mean_field", 1), ("random_masking", 2)])
def test_off_policy_mask_drops_nothing_on_policy(tmp_path, estimator, masks):
    # first iteration, weights unchanged: pi_theta == pi_old, so the off-policy mask must keep every sequence. It
    # used to compare the masking estimates with the sampler's trajectory log-probs (other quantities) and dropped
    # negative-advantage sequences; with several masks it was refused
    calls = off_policy_mask_calls(tmp_path, estimator, masks)
    assert calls
    for kl, kept, advantages in calls:
        assert (advantages < 0).any()  # the mask could drop something
        assert torch.equal(kl, torch.zeros_like(kl))
        assert bool((kept == 1).all())


def filtered_grad_norm(tmp_path, loss_type: str, per_device: int, accumulation: int) -> float:
    """The gradient norm of one optimizer step over one generation batch of 4 responses (2 prompts x 2), one of
    whose groups gets equal rewards and is filtered out."""

    def reward(prompts, completions, **kwargs):
        return [1.0 if p == "abc" else float(len(set(c))) for p, c in zip(prompts, completions)]

    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=per_device,
                         gradient_accumulation_steps=accumulation, generation_batch_size=4, num_generations=2,
                         max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                         max_grad_norm=1e9, block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True,
                         bf16=False, disable_tqdm=True, seed=0, dynamic_group_filtering="all_equal",
                         loss_type=loss_type, step_normalization="sequence", beta=0.0)
    trainer = TraceRLTrainer(tiny_model("llada").train(), reward, args=args, processing_class=build_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": ["abc", "What is 1+2?"]}))
    trainer.train()
    assert trainer.state.log_history[0]["filtered_groups"] == 0.5
    return trainer.state.log_history[0]["grad_norm"]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_row_mean_losses_leave_filtered_rows_out_under_gradient_accumulation(tmp_path, loss_type):
    # the same rollout (same seeds, one generation per optimizer step) in one micro-batch of 4 or four of 1: the
    # gradient must not depend on the split. Filtered rows used to leave only their own micro-batch's row count,
    # so with one row per micro-batch they still counted (half the gradient here)
    whole = filtered_grad_norm(tmp_path / "whole", loss_type, per_device=4, accumulation=1)
    split = filtered_grad_norm(tmp_path / "split", loss_type, per_device=1, accumulation=4)
    assert whole > 0
    assert split == pytest.approx(whole, rel=1e-4)
