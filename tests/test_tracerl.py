"""TraceRLTrainer: a full training step for every family and estimator, LoRA, the reference model, the sampler
log-prob gap, group filtering and bad inputs."""

import math

import peft
import pytest
import torch
from datasets import Dataset

from trl_diffusion.estimators import ESTIMATORS
from trl_diffusion.testing import EOS_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer, mask_seed, step_weights

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def make_trainer(tmp_path, family="sdar", reward=distinct_chars, model=None, prompts=PROMPTS, **overrides):
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                  block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none")  # rewards beyond [0, 1]
    peft_config = overrides.pop("peft_config", None)
    config.update(overrides)
    model = model if model is not None else tiny_model(family).train()
    dataset = Dataset.from_dict({"prompt": prompts})
    return TraceRLTrainer(model, reward, args=TraceRLConfig(**config), train_dataset=dataset,
                          processing_class=build_tokenizer(), peft_config=peft_config)


def changed_parameters(before, model):
    return [n for n, p in model.named_parameters() if n in before and not torch.equal(before[n], p.detach())]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_training_step_for_every_family_and_estimator(tmp_path, family, estimator):
    trainer = make_trainer(tmp_path, family, likelihood_estimator=estimator, num_iterations=2, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"])
    assert logs["rollout/tokens_per_step"] >= 1.0
    assert changed_parameters(before, trainer.model)
    if estimator == "trajectory":
        assert logs["rollout/sampler_logp_gap"] < 1e-4  # first iteration, same weights: ratio exactly 1


def test_lora(tmp_path):
    trainer = make_trainer(tmp_path, "llada", peft_config=peft.LoraConfig(r=4, lora_alpha=8), beta=0.04,
                           kl_reference="reference_model")  # the base model (adapters off) is the reference
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert not changed_parameters(base, trainer.model)  # only adapters move
    assert changed_parameters(adapters, trainer.model)
    assert math.isfinite(trainer.state.log_history[0]["kl"])


def test_reference_model_is_a_frozen_copy(tmp_path):
    trainer = make_trainer(tmp_path, "dream", beta=0.1, max_steps=2, num_iterations=1, kl_reference="reference_model")
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    assert not changed_parameters(initial, trainer.ref_model)
    assert changed_parameters(initial, trainer.model)
    assert trainer.state.log_history[1]["kl"] > 0  # the policy moved away from the frozen copy


def test_mask_seeds_are_stable_and_distinct():
    assert mask_seed(0, 3, 5) == mask_seed(0, 3, 5)
    assert len({mask_seed(0, step, i) for step in range(4) for i in range(16)}) == 64


def test_step_weights_normalise_each_merged_step():
    weights = step_weights(torch.tensor([[0, 0, 1, 2, 2, 2, -1]]))
    assert weights.tolist()[0][:6] == pytest.approx([0.5, 0.5, 1.0, 1 / 3, 1 / 3, 1 / 3])
    assert weights[0, 6] == 0 and weights.sum().item() == pytest.approx(3.0)  # one unit per step


def test_equal_rewards_give_zero_advantage_and_filtering(tmp_path):
    trainer = make_trainer(tmp_path, "sdar", reward=lambda completions, **kw: [1.0] * len(completions),
                           dynamic_group_filtering=True)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["loss"] == 0.0 and logs["filtered_groups"] == 1.0


def test_group_filtering_drops_the_equal_group_from_the_loss(tmp_path):
    """One group with equal rewards, one without: filtering logs half the groups dropped and takes the dropped
    group's tokens out of the normaliser, so the same rollouts move the weights further (plain SGD, no clipping)
    than without filtering, where the zero-advantage tokens still count."""

    def half_constant(prompts, completions, **kwargs):
        return [1.0 if p.startswith("What") else float(i % 4) for i, p in enumerate(prompts)]

    deltas = {}
    for filtering in (False, True):
        trainer = make_trainer(tmp_path, "sdar", reward=half_constant, prompts=["What is 1+2?", "abc"],
                               per_device_train_batch_size=8, dynamic_group_filtering=filtering, optim="sgd",
                               max_grad_norm=0.0, loss_type="dapo")
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        deltas[filtering] = torch.cat([(p.detach() - before[n]).flatten()
                                       for n, p in trainer.model.named_parameters()]).norm()
        if filtering:
            assert trainer.state.log_history[0]["filtered_groups"] == 0.5
    assert deltas[False] > 0
    assert deltas[True] > 1.2 * deltas[False]


def test_reward_that_raises_names_the_function(tmp_path):
    def broken_reward(completions, **kwargs):
        raise KeyError("solution")

    trainer = make_trainer(tmp_path, reward=broken_reward)
    with pytest.raises(RuntimeError, match="broken_reward"):
        trainer.train()


def test_nan_rewards_follow_trl_none_handling(tmp_path):
    def sometimes_nan(completions, **kwargs):
        return [float("nan") if i % 2 else float(len(c)) for i, c in enumerate(completions)]

    trainer = make_trainer(tmp_path, reward=[sometimes_nan, distinct_chars])
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_empty_completions(tmp_path):
    model = tiny_model("sdar").train()
    with torch.no_grad():
        model.lm_head.weight[EOS_ID] = 10 * model.model.norm.weight.sign() * model.lm_head.weight.abs().max()
    trainer = make_trainer(tmp_path, model=model)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_model_without_mask_token_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="mask token"):
        make_trainer(tmp_path, model=tiny_model("sdar", mask_token_id=None))


def test_config_errors():
    with pytest.raises(ValueError, match="likelihood_estimator"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, likelihood_estimator="elbo")
    with pytest.raises(ValueError, match="temperature"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, temperature=0.0)
    with pytest.raises(ValueError, match="denoising_steps"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, block_length=4, denoising_steps=8)
