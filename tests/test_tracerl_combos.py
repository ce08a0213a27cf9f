"""TraceRLTrainer under combinations of options (a pairwise audit): settings TRL reads only at the first rollout
are refused when the config is built, and splitting a rollout into micro-batches leaves the update unchanged with
the options that keep their own normalisers (summed KL, value model)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueModel

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def parity(completions, **kwargs):
    return [float(sum(map(ord, c)) % 2) for c in completions]


def config(tmp_path, **overrides) -> TraceRLConfig:
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=2, logging_steps=1, report_to="none", learning_rate=0.1, block_length=4,
                  denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none")
    values.update(overrides)
    return TraceRLConfig(**values)


@pytest.mark.parametrize("reward_std", ["population", "sample"])
def test_an_unknown_scale_rewards_is_refused_at_construction(tmp_path, reward_std):
    """Both advantage paths (dLLM-RL's population std and TRL's) used to raise only at the first rollout."""
    with pytest.raises(ValueError, match="scale_rewards must be"):
        config(tmp_path, scale_rewards="per_group", reward_std=reward_std)
    assert config(tmp_path, scale_rewards=False, reward_std=reward_std).scale_rewards == "none"


def test_num_iterations_below_one_is_refused_at_construction(tmp_path):
    """num_iterations=0 used to give an empty dataloader: train() returned after 0 steps without a word."""
    with pytest.raises(ValueError, match="num_iterations must be >= 1"):
        config(tmp_path, num_iterations=0)


def test_micro_batch_split_leaves_summed_kl_and_value_updates_unchanged(tmp_path):
    """One micro-batch of 4 or two of 2 accumulated: the same policy and value updates (plain SGD), with the KL
    summed per row against a moving pi_old and a value model training on the same rollout."""
    models = {}
    for name, layout in (("one", dict(per_device_train_batch_size=4)),
                         ("two", dict(per_device_train_batch_size=2, gradient_accumulation_steps=2))):
        policy = tiny_model("sdar").train()
        trainer = TraceRLTrainer(policy, parity, args=config(tmp_path / name, optim="sgd", max_grad_norm=0.0,
                                                             kl_weighting="row_sum", num_iterations=2, beta=0.5,
                                                             **layout),
                                 train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                                 processing_class=build_tokenizer(),
                                 value_model=DiffusionValueModel.from_policy(tiny_model("sdar")))
        initial = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
        trainer.train()
        models[name] = [torch.cat([p.detach().flatten() for p in m.parameters()])
                        for m in (trainer.model, trainer.value_model)]
        assert (models[name][0] - initial).abs().max() > 1e-3
    for one, two in zip(models["one"], models["two"]):
        torch.testing.assert_close(one, two, rtol=0, atol=1e-5)


def test_rollouts_take_one_sequence_per_prompt_whatever_the_policy_config_says(tmp_path):
    """TRL repeats each prompt num_generations times itself; a checkpoint's generation_config.json with
    num_return_sequences > 1 (which generate() honours, as transformers does) must not multiply the rollouts."""
    policy = tiny_model("sdar")
    policy.generation_config.num_return_sequences = 3
    trainer = TraceRLTrainer(policy, parity, args=config(tmp_path, max_steps=1),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer())
    trainer.train()
    assert trainer.state.log_history[0]["num_tokens"] > 0
    assert trainer._rollout_generation_config().num_return_sequences == 1
