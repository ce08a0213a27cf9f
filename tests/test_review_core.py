"""Review of the core math (states, packed scoring, value model, GAE): edge cases the other tests leave out."""

import warnings

import pytest
import torch
from datasets import Dataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueModel, step_gae


def test_gae_with_no_participating_token_is_zero():
    """A batch in which no token takes part (every group filtered out, or nothing committed) has zero advantages
    and returns; before the fix ``step_means`` indexed a table of width 0 and raised."""
    groups = torch.tensor([[0, 1, 2, -1], [0, 0, 1, 1]])
    values = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    for mask in (torch.zeros(2, 4, dtype=torch.bool), torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]]).bool()):
        advantages, returns = step_gae(torch.ones(2, 4), values, groups, mask, 0.9, 0.8)
        assert advantages.shape == returns.shape == (2, 4)
        assert bool((advantages == 0).all()) and bool((returns == 0).all())


def test_tracerl_with_a_value_model_when_every_group_is_filtered(tmp_path):
    """A constant reward under the default accuracy-band filter drops every group of the batch (common early in
    training: every answer wrong); with a value model the step still runs and trains nothing."""

    def constant(completions, **kwargs):
        return [1.0] * len(completions)

    policy = tiny_model("sdar").train()
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", block_length=4,
                         denoising_steps=2, save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, bf16=False,
                         dynamic_group_filtering="accuracy_band")
    trainer = TraceRLTrainer(policy, constant, args=args, train_dataset=Dataset.from_dict({"prompt": ["abc", "xy"]}),
                             processing_class=build_tokenizer(), value_model=DiffusionValueModel.from_policy(policy))
    before = {n: p.detach().clone() for n, p in trainer.value_model.named_parameters()}
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["filtered_groups"] == 1.0 and logs["grad_norm"] == 0.0
    assert all(torch.equal(before[n], p) for n, p in trainer.value_model.named_parameters())


def test_training_block_size_not_a_multiple_of_block_length_warns():
    """Scores of such a layout are not the sampler's log-probs (packed vs replay differ by up to ~4 nats)."""
    settings = dict(output_dir="unused", use_cpu=True, bf16=False, block_length=4)
    with pytest.warns(UserWarning, match="not a multiple of block_length"):
        TraceRLConfig(training_block_size=6, **settings)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        TraceRLConfig(training_block_size=8, **settings)
