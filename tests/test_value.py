"""Diffusion value model: GAE over merged steps, packed state values equal the per-state replay, save/load,
warm-start fitting, TraceRL with a value model for every family, gradient isolation and bad inputs."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32
from transformers import AutoModelForCausalLM, BertConfig

from trl_diffusion.states import (
    attention_mask_from_positions,
    positions_from_padding,
    state_before_step,
    trajectory_groups,
)
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import (
    DiffusionValueConfig,
    DiffusionValueModel,
    DiffusionValueTrainer,
    clipped_value_loss,
    discounted_reverse_cumsum,
    outcome_token_rewards,
    step_gae,
    token_values,
)

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def value_model_for(policy, seed=0):
    """A value model copied from ``policy`` with a random (non-zero) head, so values are informative."""
    value = DiffusionValueModel.from_policy(policy)
    with torch.no_grad():
        value.value_head.weight.copy_(torch.randn(value.value_head.weight.shape,
                                                  generator=torch.Generator().manual_seed(seed)))
    return value


def make_trainer(tmp_path, family="sdar", value_model=None, policy=None, reward=distinct_chars, **overrides):
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                  block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, value_learning_rate=1e-2,
                  dynamic_group_filtering="none")  # distinct_chars rewards lie beyond [0, 1]
    config.update(overrides)
    policy = policy if policy is not None else tiny_model(family).train()
    value_model = value_model if value_model is not None else DiffusionValueModel.from_policy(policy)
    return TraceRLTrainer(policy, reward, args=TraceRLConfig(**config),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer(),
                          value_model=value_model)


# ------------------------------------------------------------------------------------------------ GAE


def test_gae_equals_a_hand_computed_example():
    # one response, three merged steps: tau_0 = {0, 1}, tau_1 = {2}, tau_2 = {3, 4}; token 5 is outside the mask
    groups = torch.tensor([[0, 0, 1, 2, 2, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    values = torch.tensor([[0.2, 0.4, 0.5, 0.6, 1.0, 9.0]])
    rewards = torch.tensor([[0.0, 0.1, 0.0, 1.0, 2.0, 7.0]])
    gamma, lam = 0.9, 0.8
    advantages, returns = step_gae(rewards, values, groups, mask, gamma, lam)
    # step means: r* = (0.05, 0, 1.5), V* = (0.3, 0.5, 0.8)
    big_r = [0.05 + 0.9 * (0 + 0.9 * 1.5), 0.9 * 1.5, 1.5]
    delta = [0.05 - 0.3 + 0.9 * 0.5, 0 - 0.5 + 0.9 * 0.8, 1.5 - 0.8]
    big_a = [0.0, 0.0, delta[2]]
    big_a[1] = delta[1] + 0.72 * big_a[2]
    big_a[0] = delta[0] + 0.72 * big_a[1]
    expected_returns = [0.0 + 0.9 * big_r[1], 0.1 + 0.9 * big_r[1], 0.0 + 0.9 * big_r[2], 1.0, 2.0, 0.0]
    expected_adv = [0.0 - 0.2 + 0.9 * 0.5 + 0.72 * big_a[1], 0.1 - 0.4 + 0.9 * 0.5 + 0.72 * big_a[1],
                    0.0 - 0.5 + 0.9 * 0.8 + 0.72 * big_a[2], 1.0 - 0.6, 2.0 - 1.0, 0.0]
    assert returns[0].tolist() == pytest.approx(expected_returns, abs=1e-6)
    assert advantages[0].tolist() == pytest.approx(expected_adv, abs=1e-6)
    # the step-level recursion is recovered from the token-level one: mean over tau_0 of A_j is A*_0
    assert advantages[0, :2].mean().item() == pytest.approx(big_a[0], abs=1e-6)
    assert returns[0, :2].mean().item() == pytest.approx(big_r[0], abs=1e-6)


def loop_reverse_cumsum(x: torch.Tensor, discount: float) -> torch.Tensor:
    """The recursion as written: one step at a time, float64."""
    out, carry = torch.zeros_like(x, dtype=torch.float64), torch.zeros(x.shape[0], dtype=torch.float64)
    for t in reversed(range(x.shape[1])):
        carry = x[:, t].double() + discount * carry
        out[:, t] = carry
    return out


@pytest.mark.parametrize("discount", [1.0, 0.97, 0.5, 0.0])
@pytest.mark.parametrize("length", [1, 7, 8, 9, 61])
def test_discounted_reverse_cumsum_equals_the_step_by_step_recursion(discount, length):
    """Chunk 8: single, exact-multiple and ragged chunks (the carry crosses chunk boundaries)."""
    x = torch.randn(3, length, generator=torch.Generator().manual_seed(length))
    for chunk in (8, 128):
        assert_close_fp32(discounted_reverse_cumsum(x, discount, chunk=chunk), loop_reverse_cumsum(x, discount))


def test_step_gae_over_many_steps_equals_the_recursion():
    """1,000 merged steps (one token per step, 8 chunks of the scan), gamma and lambda below 1: the token values
    equal the module docstring's recursion run step by step in float64."""
    torch.manual_seed(0)
    steps = 1000
    groups = torch.arange(steps).repeat(2, 1)
    mask = torch.ones(2, steps, dtype=torch.bool)
    mask[1, 700:] = False  # a shorter second row
    values, token_rewards = torch.randn(2, steps), torch.rand(2, steps) * 0.01
    gamma, lam = 0.999, 0.95
    advantages, returns = step_gae(token_rewards, values, groups, mask, gamma, lam)
    r = torch.where(mask, token_rewards, torch.zeros(()))
    v = torch.where(mask, values, torch.zeros(()))
    v_next = torch.cat([v[:, 1:], torch.zeros(2, 1)], dim=1).double()
    expected_returns = loop_reverse_cumsum(r, gamma)
    expected_advantages = loop_reverse_cumsum(r.double() - v.double() + gamma * v_next, gamma * lam)
    assert_close_fp32(returns, expected_returns, mask)
    assert_close_fp32(advantages, expected_advantages, mask)


def test_advantages_benchmark_reports_both_implementations():
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "advantages.py"
    run = subprocess.run([sys.executable, str(script), "--lengths", "20", "300", "--rows", "2", "--repeats", "1"],
                         capture_output=True, text=True, check=True)
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["steps"] for r in records] == [20, 300]
    assert all(r["loop_ms"] > 0 and r["scan_ms"] > 0 and r["max_abs_difference"] < 1e-4 for r in records)


def test_gamma_lam_one_gives_reward_minus_value():
    torch.manual_seed(0)
    unmask = torch.randint(-1, 6, (5, 12))
    groups = torch.where(unmask >= 0, unmask, torch.full_like(unmask, -1))
    mask = (groups >= 0) & (torch.rand(5, 12) < 0.8)
    values, reward = torch.randn(5, 12), torch.randn(5)
    token_rewards = outcome_token_rewards(reward, groups, mask)
    advantages, returns = step_gae(token_rewards, values, groups, mask, 1.0, 1.0)
    expected = torch.where(mask, reward[:, None].expand(-1, 12), torch.zeros(()))
    assert_close_fp32(returns, expected)
    assert_close_fp32(advantages, torch.where(mask, expected - values, torch.zeros(())))
    # lam = 0: one-step TD on every token, A_j = r_j - V_j + V*_next
    td, _ = step_gae(token_rewards, values, groups, mask, 1.0, 0.0)
    row = 0
    steps = sorted(set(groups[row][mask[row]].tolist()))
    j = int(mask[row].nonzero()[0])
    following = steps[steps.index(int(groups[row, j])) + 1:]
    v_next = values[row][mask[row] & (groups[row] == following[0])].mean() if following else torch.tensor(0.0)
    assert td[row, j].item() == pytest.approx((token_rewards[row, j] - values[row, j] + v_next).item(), abs=1e-5)


def test_clipped_value_loss():
    old, ret = torch.tensor([0.0, 0.0]), torch.tensor([1.0, -1.0])
    values = torch.tensor([0.5, 0.1])
    loss = clipped_value_loss(values, old, ret, 0.2)
    assert loss.tolist() == pytest.approx([0.5 * 0.8**2, 0.5 * 1.1**2])  # clipped (0.2) is worse / unclipped worse
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(values, old, ret, 0.0)


# ------------------------------------------------------------------------------------------------ the model


def rollout(model, prompts=((20, 21, 22, 23, 24, 25, 26), (30, 31, 32), (40, 41, 42, 43, 44)), seed=0):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, mask, max_new_tokens=8, block_length=4, denoising_steps=2, stop_token_ids=[],
                         return_dict_in_generate=True, generator=torch.Generator().manual_seed(seed))
    return ids, mask, out.sequences[:, width:], out.unmask_step[:, width:]


def test_packed_values_equal_per_state_replay(family):
    policy = tiny_model(family, seed=1)
    value = value_model_for(policy).eval()
    ids, mask, completion, steps = rollout(policy)
    sequences = torch.cat([ids, completion], 1)
    valid = torch.cat([mask.bool(), torch.ones_like(completion, dtype=torch.bool)], 1)
    generated = torch.cat([torch.zeros_like(mask, dtype=torch.bool), torch.ones_like(completion, dtype=torch.bool)], 1)
    positions = positions_from_padding(valid)
    attention = attention_mask_from_positions(positions, positions, valid, 4 if value.block_size else None)
    committed = steps >= 0
    for shrinkage in (1, 2):
        packed, groups = token_values(value, ids, mask, completion, steps, shrinkage=shrinkage, block_size=4)
        # slow and obvious: one whole-sequence forward per merged step, read at the token's own position
        full_groups = torch.cat([torch.full_like(ids, -1), groups], 1)
        slow = torch.zeros_like(sequences, dtype=torch.float32)
        with torch.no_grad():
            for g in range(int(groups.max()) + 1):
                state = state_before_step(sequences, full_groups, generated, g, value.mask_token_id)
                out = value(input_ids=state, attention_mask=attention, position_ids=positions).value
                slow = torch.where(full_groups == g, out, slow)
        assert committed.any() and packed[committed].abs().min() > 0
        assert_close_fp32(packed, slow[:, ids.shape[1]:], committed)  # values ~15-20: tolerance scales with them
        assert bool((packed[~committed] == 0).all())


def test_save_load_round_trip_and_policy_initialisation(tmp_path, family):
    policy = tiny_model(family, seed=2)
    value = DiffusionValueModel.from_policy(policy)
    assert bool((value.value_head.weight == 0).all())  # zero-initialised head
    for name, tensor in policy.model.state_dict().items():
        if name in value.model.state_dict():
            assert torch.equal(tensor, value.model.state_dict()[name])
            assert tensor.data_ptr() != value.model.state_dict()[name].data_ptr()  # a copy, not shared
    with torch.no_grad():
        value.value_head.weight.normal_()
    value.save_pretrained(tmp_path / "value")
    loaded = DiffusionValueModel.from_pretrained(tmp_path / "value")
    assert type(loaded.model) is type(value.model)
    x = torch.randint(5, 100, (2, 9))
    assert_close_fp32(loaded(input_ids=x).value, value(input_ids=x).value)
    policy.save_pretrained(tmp_path / "policy")
    from_path = DiffusionValueModel.load(str(tmp_path / "policy"))  # a policy checkpoint: copy its backbone
    assert bool((from_path.value_head.weight == 0).all())
    assert isinstance(DiffusionValueModel.load(str(tmp_path / "value")), DiffusionValueModel)
    with pytest.raises(ValueError, match="does not match .*It holds a policy .*DiffusionValueModel.from_policy"):
        DiffusionValueModel.from_pretrained(tmp_path / "policy")
    with pytest.raises(ValueError, match="does not match .*It holds a value model .*ValueModel.from_pretrained"):
        AutoModelForCausalLM.from_pretrained(tmp_path / "value")


# ------------------------------------------------------------------------------------------------ warm start


def test_value_loss_falls_when_the_return_is_predictable_from_the_prompt(tmp_path):
    tokenizer = build_tokenizer()
    generator = torch.Generator().manual_seed(0)
    rows = {"prompt": [], "completion_ids": [], "unmask_step": [], "reward": []}
    for i in range(64):
        good = i % 2 == 0
        rows["prompt"].append("good: add" if good else "bad: sub")
        rows["completion_ids"].append(torch.randint(10, 100, (8,), generator=generator).tolist())
        rows["unmask_step"].append(torch.randperm(8, generator=generator).div(2, rounding_mode="floor").tolist())
        rows["reward"].append(1.0 if good else -1.0)
    value = DiffusionValueModel.from_policy(tiny_model("llada", seed=3))
    args = DiffusionValueConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=12,
                                learning_rate=1e-2, logging_steps=2, report_to="none", save_strategy="no",
                                use_cpu=True, bf16=False, gradient_checkpointing=False, disable_tqdm=True, seed=0,
                                shrinkage=2)
    trainer = DiffusionValueTrainer(value, args=args, train_dataset=Dataset.from_dict(rows),
                                    processing_class=tokenizer)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[0] > 0.3  # zero head: 0.5 * 1^2 on every token
    assert losses[-1] < 0.25 * losses[0]
    assert trainer.state.log_history[-2]["value/explained_variance"] > 0.5
    metrics = trainer.evaluate(Dataset.from_dict(rows).select(range(16)))
    assert metrics["eval_loss"] < 0.25 * losses[0]


def test_value_dataset_errors(tmp_path):
    value = DiffusionValueModel.from_policy(tiny_model("sdar"))
    args = DiffusionValueConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    missing = Dataset.from_dict({"prompt": ["a"], "completion_ids": [[5]], "reward": [1.0]})
    with pytest.raises(ValueError, match="unmask_step"):
        DiffusionValueTrainer(value, args=args, processing_class=build_tokenizer(), train_dataset=missing)
    bad = Dataset.from_dict({"prompt_ids": [[5]], "completion_ids": [[5, 6]], "unmask_step": [[0]], "reward": [1.0]})
    with pytest.raises(ValueError, match="same length"):
        DiffusionValueTrainer(value, args=args, processing_class=build_tokenizer(), train_dataset=bad)


# ------------------------------------------------------------------------------------------------ TraceRL


def test_tracerl_step_with_a_value_model(tmp_path, family):
    trainer = make_trainer(tmp_path, family)
    before = {n: p.detach().clone() for n, p in trainer.value_model.named_parameters()}
    policy_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and math.isfinite(logs["value/loss"])
    assert logs["value/mean"] == 0.0  # from_policy's zero head: the advantages were computed before it trained
    assert any(not torch.equal(before[n], p) for n, p in trainer.value_model.named_parameters())
    assert any(not torch.equal(policy_before[n], p) for n, p in trainer.model.named_parameters())


def test_advantages_come_from_the_value_model_before_its_update_and_gradients_stay_apart(tmp_path):
    trainer = make_trainer(tmp_path, "sdar", value_train_every=2)
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(4)][:4]
    output = trainer._generate_and_score_completions(inputs)
    advantages = output["advantages"]
    assert advantages.dim() == 2 and not advantages.requires_grad
    # zero head before the update: every trained token's advantage is its row's normalised reward (R - 0)
    trained = output["completion_mask"] > 0
    scalar = torch.tensor(list(trainer._logs["advantages"]))  # GRPO's own (B,) advantages, as logged
    assert trained.any(1).all()
    assert torch.allclose(advantages[trained], scalar[:, None].expand_as(advantages)[trained])
    assert bool((advantages[~trained] == 0).all())
    assert trainer.accelerator.unwrap_model(trainer.value_model).value_head.weight.abs().sum() > 0  # then it trained
    assert all(p.grad is None for p in trainer.model.parameters())  # the value loss reached no policy weight
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    loss = trainer.compute_loss(trainer.model, output)
    loss.backward()
    assert any(p.grad is not None for p in trainer.model.parameters())
    assert all(p.grad is None for p in trainer.value_model.parameters())  # the policy loss reached no value weight
    trainer._generate_and_score_completions(inputs)  # value_train_every=2: the second batch does not train it
    assert len(trainer._metrics["train"]["value/loss"]) == 1


@pytest.mark.parametrize("family", ["sdar", "dream"])  # block-causal, and full attention with shifted logits
def test_logged_value_statistics_and_advantages_equal_a_hand_computation(tmp_path, family):
    """With a non-zero head: the token advantages are R - V (gamma = lam = 1) and the logged mean value and
    explained variance 1 - Var(R - V) / Var(R) are those of the value model before its update, recomputed here
    in float64 over the trained tokens."""
    policy = tiny_model(family).train()
    value = value_model_for(policy, seed=3)
    before = copy.deepcopy(value).eval()
    trainer = make_trainer(tmp_path, family, value_model=value, policy=policy)
    value_advantages, normalised = trainer._value_advantages, []

    def record_reward(output, *args):  # GRPO's normalised reward R, which the GAE advantages replace
        normalised.append(output["advantages"].clone())
        return value_advantages(output, *args)

    trainer._value_advantages = record_reward
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    trained = output["completion_mask"] > 0
    with torch.no_grad():
        values, _ = token_values(before, output["prompt_ids"], output["prompt_mask"], output["canvas_ids"],
                                 output["unmask_step"], shrinkage=1, block_size=4)
    values = values[:, : trained.shape[1]]
    reward = normalised[0][:, None].expand_as(values)
    assert_close_fp32(output["advantages"], reward - values, trained)
    # the completions table's advantage: each response's mean over its trained tokens, what the loss uses
    mean = (output["advantages"] * trained).sum(1) / trained.sum(1).clamp(min=1)
    assert_close_fp32(torch.tensor(list(trainer._logs["advantages"])), mean)
    v, r = values[trained].double(), reward[trained].double()
    explained = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    assert abs(explained) > 0.1 and v.abs().max() > 1  # neither statistic is trivially 0
    metrics = trainer._metrics["train"]
    assert metrics["value/explained_variance"][-1] == pytest.approx(explained.item(), rel=1e-4)
    assert metrics["value/mean"][-1] == pytest.approx(v.mean().item(), rel=1e-4)


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_value_optimizer_groups_weight_decay_as_the_policy_optimizer(tmp_path, family):
    # one AdamW group at weight_decay pulled the value model's norm weights and biases towards 0; the policy's
    # optimizer (transformers' Trainer) leaves them out of weight decay
    trainer = make_trainer(tmp_path, family, weight_decay=0.1)
    trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.value_model.named_parameters()}

    def decay_of(optimizer, model):
        lookup = {id(p): n for n, p in model.named_parameters()}
        return {lookup[id(p)]: group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}

    value_decay = decay_of(trainer.value_optimizer, trainer.value_model)
    policy_decay = {name: decay for name, decay in decay_of(trainer.optimizer, trainer.model).items()
                    if not name.startswith(("lm_head", "model.transformer.ff_out"))}  # the value model has a head
    assert len(value_decay) == len(names)
    assert {name: decay for name, decay in value_decay.items() if not name.startswith("value_head")} == policy_decay
    assert value_decay["value_head.weight"] == 0.1
    assert {decay for name, decay in value_decay.items() if "norm" in name} == {0.0}


def test_value_model_must_match_the_policy(tmp_path):
    policy = tiny_model("sdar").train()
    with pytest.raises(ValueError, match="mask_token_id"):
        make_trainer(tmp_path, policy=policy, value_model=DiffusionValueModel.from_policy(
            tiny_model("sdar", mask_token_id=4)))
    with pytest.raises(ValueError, match="embedding has 64 rows, fewer than the policy.s"):
        make_trainer(tmp_path, policy=policy, value_model=DiffusionValueModel.from_policy(
            tiny_model("sdar", vocab_size=64)))
    with pytest.raises(ValueError, match="attention"):
        make_trainer(tmp_path, policy=policy, value_model=DiffusionValueModel.from_policy(tiny_model("llada")))
    with pytest.raises(TypeError, match="DiffusionValueModel"):
        make_trainer(tmp_path, policy=policy, value_model=tiny_model("sdar"))


def test_config_errors():
    with pytest.raises(ValueError, match="cliprange_value"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, cliprange_value=0.0)
    with pytest.raises(ValueError, match="cliprange_value"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, cliprange_value=-0.1)
    with pytest.raises(ValueError, match="gamma"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, lam=1.5)
    with pytest.raises(ValueError, match="value_train_every"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, value_train_every=0)
    with pytest.raises(ValueError, match="model_type"):
        DiffusionValueModel(BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=8))


def test_value_update_after_an_interrupted_one_equals_a_fresh_trainers(tmp_path):
    """An exception between the value model's micro-batches (OOM, Ctrl-C) leaves their gradients behind and the
    model in train mode: the next update (a retried or resumed train() on the same trainer) starts from zero
    gradients, as a fresh trainer's does, and the value model is back in eval mode after the failure."""
    inputs = [{"prompt": p} for p in PROMPTS for _ in range(4)][:4]
    settings = dict(per_device_train_batch_size=2, steps_per_generation=2, value_batch_size=10**6)  # 1 step, 2 pieces

    def trainer(path):
        policy = tiny_model("sdar").train()
        return make_trainer(path, policy=policy, value_model=value_model_for(policy), **settings)

    fresh = trainer(tmp_path / "fresh")
    fresh._generate_and_score_completions(inputs)
    interrupted = trainer(tmp_path / "interrupted")
    token_values, calls = interrupted._token_values, []

    def failing(*args, **kwargs):
        if torch.is_grad_enabled():  # the value model's training forwards
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
        return token_values(*args, **kwargs)

    interrupted._token_values = failing
    with pytest.raises(KeyboardInterrupt):
        interrupted._generate_and_score_completions(inputs)
    assert not interrupted.value_model.training
    interrupted._token_values = token_values
    interrupted._generate_and_score_completions(inputs)
    expected = dict(fresh.value_model.named_parameters())
    for name, param in interrupted.value_model.named_parameters():
        torch.testing.assert_close(param, expected[name], msg=name)


def test_token_values_take_the_training_block_size_given():
    """``token_values(block_size=...)`` (TraceRL's ``training_block_size``) groups the steps by THAT block, not the
    model's (4 here): its groups are ``trajectory_groups`` at the given size, and so differ from the model's."""
    value = DiffusionValueModel.from_policy(tiny_model("sdar", seed=1)).eval()
    with torch.no_grad():
        value.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    assert value.block_size == 4
    prompt = torch.arange(5, 13)[None]
    prompt_mask = torch.ones_like(prompt)
    canvas, steps = torch.arange(20, 28)[None], torch.arange(8)[None]
    groups = {}
    for block_size in (4, 8):
        with torch.no_grad():
            _, groups[block_size] = token_values(value, prompt, prompt_mask, canvas, steps, shrinkage=3,
                                                 block_size=block_size)
        assert torch.equal(groups[block_size], trajectory_groups(steps, prompt_mask, 3, block_size))
    assert not torch.equal(groups[4], groups[8])


def test_a_token_committed_at_step_0_counts_as_committed():
    """``unmask_step`` numbers the steps from 0: a row whose last committed token was committed at step 0 is shown
    through that token. Taking only steps > 0 as committed hid it, and its (committed) token got no value."""
    value = value_model_for(tiny_model("sdar", seed=1), seed=2).eval()
    assert value.block_size == 4
    prompt = torch.arange(5, 13)[None]
    canvas = torch.arange(20, 28)[None]
    steps = torch.tensor([[1, 0, 1, 0, -1, -1, -1, -1]])  # one block, its last column committed at step 0
    with torch.no_grad():
        values, _ = token_values(value, prompt, torch.ones_like(prompt), canvas, steps)
        alone, _ = token_values(value, prompt, torch.ones_like(prompt), canvas[:, :4], steps[:, :4])
    assert bool((values[:, :4] != 0).all()) and bool((values[:, 4:] == 0).all())
    assert_close_fp32(values[:, :4], alone)
