"""The completions table's ``advantage`` column (``log_completions``) is what the loss uses, as in TRL: a group that
``dynamic_group_filtering`` drops trains nothing, yet its responses were logged with their z-scores (e.g. 0.378 ...
-2.646 for a group with 7 of 8 right, above the accuracy band, at a step whose loss was 0)."""

import pytest
import torch

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_FORMAT, EMBEDDED_MODEL, EMBEDDED_TASK
from trl_diffusion.data import make_problems, to_dataset

SCRIPTED = [1.0] * 7 + [0.0] + [1.0, 0.0] * 4  # group 1: 7/8 right (dropped by the 0.2-0.8 band); group 2: 4/8


def scripted_reward(completions, **kwargs):
    return SCRIPTED[: len(completions)]


@pytest.mark.parametrize("value_model", [None, str(EMBEDDED_MODEL)], ids=["group", "value_model"])
def test_dropped_groups_are_logged_with_advantage_zero(tmp_path, value_model):
    train, _ = make_problems(**EMBEDDED_TASK)
    args = TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                         num_generations=8, per_device_train_batch_size=16, max_completion_length=8,
                         block_length=4, denoising_steps=4, log_completions=True, num_completions_to_print=0,
                         dynamic_group_filtering="accuracy_band", reward_std="population", shuffle_dataset=False)
    trainer = TraceRLTrainer(str(EMBEDDED_MODEL), scripted_reward, args=args, value_model=value_model,
                             train_dataset=to_dataset(train[:8], EMBEDDED_FORMAT))
    trainer.train()
    logged = torch.tensor(list(trainer._logs["advantages"]))
    assert len(logged) == 16
    assert torch.equal(logged[:8], torch.zeros(8))  # dropped: nothing of it trains
    if value_model is None:  # population z-scores of 1, 0, 1, 0, ...: +-1
        torch.testing.assert_close(logged[8:], torch.tensor([1.0, -1.0] * 4))
    else:  # GAE advantages (value model with a zero head: the outcome reward itself), one mean per response
        assert (logged[8:] != 0).all()
        assert (logged[8::2] > 0).all() and (logged[9::2] < 0).all()


def alternating_reward(completions, **kwargs):
    return [float(i % 2) for i in range(len(completions))]


def test_value_model_advantage_is_logged_as_the_mean_over_the_response_own_tokens(tmp_path):
    """A zero value head (``from_policy``) leaves every trained token's GAE advantage at its response's normalised
    reward, +-1 here: the logged per-response mean over the response's own tokens is that reward whatever its length
    (a mean over the padded width logged 5/6 of it for a response 5 of 6 columns long)."""
    train, _ = make_problems(**EMBEDDED_TASK)
    args = TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=1,
                         num_generations=4, per_device_train_batch_size=8, max_completion_length=16, block_length=4,
                         denoising_steps=4, log_completions=True, num_completions_to_print=0, shuffle_dataset=False)
    trainer = TraceRLTrainer(str(EMBEDDED_MODEL), alternating_reward, args=args, value_model=str(EMBEDDED_MODEL),
                             train_dataset=to_dataset(train[:8], EMBEDDED_FORMAT))
    rows = [trainer.train_dataset[i] for i in range(2) for _ in range(4)]
    output = trainer._generate_and_score_completions(rows)
    lengths = (output["completion_mask"] > 0).sum(1)
    assert len(set(lengths.tolist())) > 1 and bool((lengths < output["completion_mask"].shape[1]).any())
    torch.testing.assert_close(torch.tensor(list(trainer._logs["advantages"])), torch.tensor([-1.0, 1.0] * 4))
