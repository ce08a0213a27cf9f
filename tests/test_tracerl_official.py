"""TraceRL as published (dLLM-RL, arXiv 2509.06949), option by option.

Each official objective, filter and value setting is compared on fixed rollouts with a slow transcription of the
official formula written out in this file (rows built from the raw trajectory with Python loops, the loss summed
token by token), not with the trainer's own helpers. The per-token log-probs of the transcriptions come from the
slow per-step replay (``replay_logprobs``), not from the trainer's packed scorer."""

import math

import pytest
import torch
from datasets import Dataset

from trl_diffusion.estimators import replay_logprobs
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_objective import kept_groups, population_advantages, step_weights
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueModel, step_gae

STOP_CHARACTERS = "aeiouAEIOU 0123456789"
PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]
CORRECT_IN_GROUP = {"What is 1+2?": 0, "Say hi": 1, "abc": 2, "What is 7-3?": 4}  # accuracies 0, 1/4, 1/2, 1


def banded_reward(prompts, completions, **kwargs):
    """0/1 "correctness" with group accuracies 0, 0.25, 0.5 and 1 (groups of 4 consecutive completions)."""
    return [float(i % 4 < CORRECT_IN_GROUP[p]) for i, p in enumerate(prompts)]


def base_config(tmp_path, **overrides) -> dict:
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=16, num_generations=4,
                  max_completion_length=16, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                  block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False)
    config.update(overrides)
    return config


def official_config(tmp_path, name, **overrides) -> TraceRLConfig:
    """``TraceRLConfig.from_official(name)`` shrunk to the tiny models (sizes only; the objective is untouched)."""
    sizes = dict(base_config(tmp_path), generation_batch_size=None, gradient_accumulation_steps=1, top_k=0,
                 top_p=1.0, learning_rate=1e-2)
    sizes.update(overrides)
    return TraceRLConfig.from_official(name, **sizes)


def make_trainer(args, family="sdar", reward=banded_reward, prompts=PROMPTS, value_model=None, model=None):
    tokenizer = build_tokenizer()
    policy = model if model is not None else tiny_model(family).train()
    # stop at several characters, so completions end at different points inside their blocks
    policy.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(c) for c in STOP_CHARACTERS]
    return TraceRLTrainer(policy, reward, args=args, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tokenizer, value_model=value_model)


def fixed_rollout(trainer, prompts=PROMPTS) -> dict:
    """One generation batch as the trainer buffers it (rewards, advantages, weights, trajectories)."""
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = [{"prompt": p} for p in prompts for _ in range(trainer.num_generations)]
    return trainer._generate_and_score_completions(batch)


def trained_tokens(trainer, batch) -> torch.Tensor:
    """``[B, C]`` the tokens dLLM-RL trains: the response up to and including its first stop token (the text the
    official code re-tokenizes), committed by the sampler; nothing after it."""
    canvas, steps = batch["canvas_ids"], batch["unmask_step"]
    width = batch["completion_ids"].shape[1]
    stops = torch.tensor(trainer.eos_token_ids)
    trained = torch.zeros(canvas.shape[0], width, dtype=torch.bool)
    for b in range(canvas.shape[0]):
        for j in range(min(width, canvas.shape[1])):
            if steps[b, j] < 0:
                break
            trained[b, j] = True
            if canvas[b, j] in stops:
                break
    return trained


def official_advantages_and_kept(rewards: list[float], group: int, low=0.2, high=0.8):
    """reward/rl_reward.py: z-score with the population std (0 when it is 0); drop groups whose accuracy is
    < low or > high."""
    advantages, kept = [], []
    for start in range(0, len(rewards), group):
        chunk = rewards[start : start + group]
        mean = sum(chunk) / len(chunk)
        std = (sum((x - mean) ** 2 for x in chunk) / len(chunk)) ** 0.5
        advantages += [0.0 if std == 0 else (x - mean) / std for x in chunk]
        accuracy = sum(chunk) / len(chunk)
        kept += [low <= accuracy <= high] * len(chunk)
    return advantages, kept


def new_logprobs(trainer, batch, groups=None) -> torch.Tensor:
    """``[B, C]`` log-prob of every completion token given its state, with gradients, by the slow replay, at the
    configured scoring temperature and with the mask token in the softmax or not (the official presets: raw logits,
    mask token included, as dLLM-RL's trainers)."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    sequences = torch.cat([batch["prompt_ids"], batch["canvas_ids"]], dim=1)
    pad = torch.full_like(batch["prompt_ids"], -1)
    steps = torch.cat([pad, batch["unmask_step"] if groups is None else groups], dim=1)
    args = trainer.args
    temperature = args.temperature if args.scoring_temperature is None else args.scoring_temperature
    logps = replay_logprobs(model, sequences, batch["prompt_mask"], steps, args.block_length, temperature,
                            exclude_mask_token=args.exclude_mask_token_from_softmax)
    return logps[:, batch["prompt_ids"].shape[1]:][:, : batch["completion_ids"].shape[1]]


def perturbed_old(new: torch.Tensor, scale: float, seed: int = 0) -> torch.Tensor:
    noise = torch.randn(new.shape, generator=torch.Generator().manual_seed(seed)) * scale
    return new.detach() + noise


def trado_rows(trained: torch.Tensor, steps: torch.Tensor, prompt_lengths: list[int], block: int):
    """train/rl_trado.py one_round_vectorized: row r of a response holds, in every block, the tokens of the
    block's r-th smallest step (blocks aligned as the sampler aligns them: absolute position // block)."""
    rows = []
    for b in range(trained.shape[0]):
        remaining = {j for j in range(trained.shape[1]) if trained[b, j]}
        while remaining:
            row = set()
            for blk in {(prompt_lengths[b] + j) // block for j in remaining}:
                members = [j for j in remaining if (prompt_lengths[b] + j) // block == blk]
                first = min(int(steps[b, j]) for j in members)
                row |= {j for j in members if int(steps[b, j]) == first}
            rows.append((b, sorted(row)))
            remaining -= row
    return rows


def collapse_k_unique(values: list[int], k: int) -> list[int]:
    """dLLM-RL's shrinkage: k consecutive distinct step values map to the last of them."""
    unique = sorted(set(values))
    mapping = {v: unique[min((i // k + 1) * k - 1, len(unique) - 1)] for i, v in enumerate(unique)}
    return [mapping[v] for v in values]


def step_rows(trained, steps, prompt_lengths, block, shrinkage):
    """The paper's steps tau(t) as rows: train/rl_dream.py / rl_llada.py (whole response, after shrinkage over all
    the canvas's committed tokens), or per block for a block model (``block``)."""
    rows = []
    for b in range(trained.shape[0]):
        committed = [j for j in range(steps.shape[1]) if steps[b, j] >= 0]
        keys = {}
        for blk in sorted({(prompt_lengths[b] + j) // block if block else 0 for j in committed}):
            members = [j for j in committed if ((prompt_lengths[b] + j) // block if block else 0) == blk]
            merged = collapse_k_unique([int(steps[b, j]) for j in members], shrinkage)
            keys.update({j: (m, blk) for j, m in zip(members, merged)})
        for key in sorted(set(keys.values())):
            row = [j for j, k in keys.items() if k == key and j < trained.shape[1] and trained[b, j]]
            if row:  # rows without a trained token are dropped (p_mask.any())
                rows.append((b, row))
    return rows


def ppo_term(new, old, advantage, eps, log_ratio_clip=None):
    x = new - old
    if log_ratio_clip is not None:
        x = x.clamp(-log_ratio_clip, log_ratio_clip)
    ratio = torch.exp(x)
    return -torch.minimum(ratio * advantage, ratio.clamp(1 - eps, 1 + eps) * advantage)


def prompt_lengths(batch) -> list[int]:
    return batch["prompt_mask"].sum(1).tolist()


def gradients(model) -> torch.Tensor:
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_loss_and_gradient(trainer, batch, official_loss_fn):
    """The trainer's loss on ``batch`` and the transcription's: equal values and equal parameter gradients."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.zero_grad(set_to_none=True)
    ours = trainer._compute_loss(trainer.model, batch)
    ours.backward()
    our_grads = gradients(model)
    theirs = official_loss_fn()
    theirs.backward()
    their_grads = gradients(model)
    assert ours.abs().item() > 1e-4  # not trivially equal
    torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(our_grads, their_grads, rtol=1e-3, atol=1e-4 * their_grads.abs().max().item())


# ------------------------------------------------------------------------------------------------ the crash


def test_gae_ignores_group_ids_outside_the_mask():
    """Tokens outside the mask (canvas after EOS, filtered rows) may carry larger group ids than any token inside
    it; they must neither index the step table nor receive an advantage."""
    groups = torch.tensor([[0, 1, 2, 7, 7], [0, 0, 5, 6, -1]])
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [0.5, 0.25, 1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 1.0, 9.0, 9.0, 9.0], [2.0, 2.0, 9.0, 9.0, 9.0]])
    advantages, returns = step_gae(rewards, values, groups, mask)
    # gamma = lam = 1: every masked token's return is the sum of its row's step-mean rewards from its step on
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0, 0, 0], [2.0, 2.0, 0, 0, 0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.9, 0.8, 0, 0, 0], [1.5, 1.75, 0, 0, 0]]))


def test_value_model_with_group_filtering_and_early_stops(tmp_path):
    """The reported crash: a value model, group filtering, and several stop ids so that rows stop at different
    points inside their blocks (canvas tokens after the stop carry larger step ids than any trained token)."""

    def reward(prompts, completions, **kwargs):  # the "abc" group is all-equal and is filtered
        return [1.0 if p == "abc" else float(i % 2) for i, p in enumerate(prompts)]

    args = TraceRLConfig(**base_config(tmp_path, per_device_train_batch_size=8, seed=1,
                                       dynamic_group_filtering="all_equal"))
    policy = tiny_model("sdar").train()
    trainer = make_trainer(args, reward=reward, prompts=["What is 1+2?", "abc"],
                           value_model=DiffusionValueModel.from_policy(policy), model=policy)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["filtered_groups"] == 0.5
    assert logs["completions/min_length"] < logs["completions/max_length"]


# ------------------------------------------------------------------------------------------------ objectives


def merged_steps(batch, shrinkage: int) -> torch.Tensor:
    """``[B, canvas]`` each committed token's merged step (dLLM-RL's collapse_k_unique over the response)."""
    steps = batch["unmask_step"]
    merged = torch.full_like(steps, -1)
    for b in range(steps.shape[0]):
        cols = [j for j in range(steps.shape[1]) if steps[b, j] >= 0]
        for j, value in zip(cols, collapse_k_unique([int(steps[b, j]) for j in cols], shrinkage)):
            merged[b, j] = value
    return merged


def official_rows_loss(trainer, batch, rows, advantages, weight, beta=0.0, log_ratio_clip=None, groups=None,
                       kl_summed=False):
    """sum over rows of weight(row) * sum over the row's tokens of (PPO term + beta * k3 to pi_old), / rows; with
    ``kl_summed`` (rl_dream.py 624-631) the k3 terms are summed without the row's weight."""
    new = new_logprobs(trainer, batch, groups)
    old = batch["old_per_token_logps"]
    x = new - old
    terms = ppo_term(new, old, advantages[:, None], 0.2, log_ratio_clip)
    kl = torch.exp((-x).clamp(-10.0, 10.0)) - 1.0 + x  # rl_trado.py: linear term unclamped
    total = torch.zeros(())
    for b, cols in rows:
        if kl_summed:
            total = total + weight(b, cols) * terms[b, cols].sum() + beta * kl[b, cols].sum()
        else:
            total = total + weight(b, cols) * (terms[b, cols] + beta * kl[b, cols]).sum()
    return total / len(rows)


def rollout_with_official_advantages(trainer):
    batch = fixed_rollout(trainer)
    rewards = banded_reward([p for p in PROMPTS for _ in range(4)], [""] * 16)
    advantages, kept = official_advantages_and_kept(rewards, 4)
    torch.testing.assert_close(batch["advantages"], torch.tensor(advantages))
    assert batch["kept_rows"].bool().tolist() == kept
    trained = trained_tokens(trainer, batch) & torch.tensor(kept)[:, None]
    batch["old_per_token_logps"] = perturbed_old(new_logprobs(trainer, batch), 0.5)
    return batch, torch.tensor(advantages), trained


def test_trado_objective_equals_dllm_rl(tmp_path):
    """from_official('trado'): rl_trado.py's loss -- rows = the r-th step of every block, each row's token sum
    / L1 (the longest trained response), / rows; k3 against pi_old with beta 0.01; ratio from a clamped log-ratio;
    on the groups that pass the 0.2-0.8 accuracy band, with population-std advantages."""
    trainer = make_trainer(official_config(tmp_path, "trado", denoising_steps=2, max_completion_length=24))
    assert trainer.ref_model is None  # the KL target is pi_old: no reference model
    batch, advantages, trained = rollout_with_official_advantages(trainer)
    rows = trado_rows(trained, batch["unmask_step"], prompt_lengths(batch), 4)
    assert any(len({(prompt_lengths(batch)[b] + j) // 4 for j in cols}) > 1 for b, cols in rows)  # stacked blocks
    longest = trained.sum(1).max().item()
    assert longest < trainer.args.max_completion_length  # L1 is the longest response, not the limit

    def official():
        return official_rows_loss(trainer, batch, rows, advantages, lambda b, cols: 1.0 / longest, beta=0.01,
                                  log_ratio_clip=10.0)

    assert_same_loss_and_gradient(trainer, batch, official)
    # log-ratios beyond the clamp: the policy term is exp(clamp(x)) with no gradient through clamped tokens
    batch["old_per_token_logps"] = perturbed_old(batch["old_per_token_logps"], 12.0, seed=1)
    assert (batch["old_per_token_logps"] - new_logprobs(trainer, batch)).abs()[trained].max() > 10
    trainer.beta = 0.0  # the official KL's linear term is not clamped (documented); compare the policy term

    def official_clamped():
        return official_rows_loss(trainer, batch, rows, advantages, lambda b, cols: 1.0 / longest,
                                  log_ratio_clip=10.0)

    assert_same_loss_and_gradient(trainer, batch, official_clamped)


@pytest.mark.parametrize("family", ["dream", pytest.param("llada", marks=pytest.mark.slow)])
def test_dream_and_llada_objective_equals_dllm_rl(tmp_path, family):
    """from_official('dream' / 'llada'): rl_dream.py / rl_llada.py's loss -- one row per merged step over the
    whole response (shrinkage over every committed canvas token), each row's mean over its trained tokens plus beta
    times its k3 sum (kl_weighting='row_sum'), / rows; raw logits (temperature 1, the rollout's 0.8 aside) with the
    mask token in the softmax."""
    trainer = make_trainer(official_config(tmp_path, family, block_length=8, denoising_steps=8, shrinkage=2),
                           family=family)
    assert trainer.args.temperature == 0.8 and trainer.args.beta == 0.01
    batch, advantages, trained = rollout_with_official_advantages(trainer)
    groups = merged_steps(batch, 2)
    rows = step_rows(trained, groups, prompt_lengths(batch), None, 1)
    assert any(len(cols) > 1 for _, cols in rows)

    def official():
        return official_rows_loss(trainer, batch, rows, advantages, lambda b, cols: 1.0 / len(cols), beta=0.01,
                                  groups=groups, kl_summed=True)

    assert_same_loss_and_gradient(trainer, batch, official)


def test_default_objective_is_the_paper_formula(tmp_path):
    """TraceRLConfig's defaults: sum over steps of (1/|tau(t)|) sum over tau(t), / the number of steps (constant
    row count); |tau(t)| counts only trained tokens (not canvas tokens after the stop); the k3 KL to pi_old with
    beta 0.01 weighted like the policy term; the accuracy band; population-std advantages."""
    trainer = make_trainer(TraceRLConfig(**base_config(tmp_path)))
    batch, advantages, trained = rollout_with_official_advantages(trainer)
    rows = step_rows(trained, batch["unmask_step"], prompt_lengths(batch), 4, 1)
    committed = batch["unmask_step"][:, : trained.shape[1]] >= 0
    shared = [(b, cols) for b, cols in rows if any(
        committed[b, j] and not trained[b, j] and batch["unmask_step"][b, j] == batch["unmask_step"][b, cols[0]]
        and (prompt_lengths(batch)[b] + j) // 4 == (prompt_lengths(batch)[b] + cols[0]) // 4
        for j in range(trained.shape[1]))]
    assert shared  # some step commits tokens both before and after a stop: |tau(t)| must count the first only

    def official():
        return official_rows_loss(trainer, batch, rows, advantages, lambda b, cols: 1.0 / len(cols), beta=0.01)

    assert_same_loss_and_gradient(trainer, batch, official)


def test_step_weights_count_only_trained_tokens():
    groups = torch.tensor([[0, 0, 1, 1, 1, 2, -1]])
    trained = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    assert step_weights(groups, trained).tolist()[0] == pytest.approx([0.5, 0.5, 0.5, 0.5, 0, 0, 0])
    assert step_weights(groups).tolist()[0] == pytest.approx([0.5, 0.5, 1 / 3, 1 / 3, 1 / 3, 1.0, 0])


@pytest.mark.parametrize("loss_type", ["grpo", pytest.param("dr_grpo", marks=pytest.mark.slow)])
def test_filtered_rows_leave_grpo_and_dr_grpo_denominators(tmp_path, loss_type):
    """TRL's grpo (per-sequence mean, then mean over rows) and dr_grpo (sum / (rows x max_completion_length))
    count only the rows of groups that survive the filter."""
    trainer = make_trainer(TraceRLConfig(**base_config(tmp_path, loss_type=loss_type, step_normalization="sequence",
                                                       beta=0.0)))
    batch, advantages, trained = rollout_with_official_advantages(trainer)
    kept = [b for b in range(16) if trained[b].any()]
    assert 0 < len(kept) < 16

    def official():
        new, old = new_logprobs(trainer, batch), batch["old_per_token_logps"]
        terms = ppo_term(new, old, advantages[:, None], 0.2)
        length = trainer.args.max_completion_length
        per_row = [terms[b, trained[b]].sum() / (trained[b].sum() if loss_type == "grpo" else length) for b in kept]
        return torch.stack(per_row).mean()

    assert_same_loss_and_gradient(trainer, batch, official)


# ------------------------------------------------------------------------------------------------ filter, advantages


def test_group_filter_band_and_population_advantages_equal_the_official_ones():
    generator = torch.Generator().manual_seed(0)
    rewards = (torch.rand(10 * 16, generator=generator) < torch.rand(10, generator=generator).repeat_interleave(16))
    rewards = rewards.float()
    rewards[:16] = 1.0  # an all-correct group: std 0
    advantages, kept = official_advantages_and_kept(rewards.tolist(), 16)
    torch.testing.assert_close(population_advantages(rewards, 16, "group"), torch.tensor(advantages))
    assert kept_groups(rewards, 16, "accuracy_band", 0.2, 0.8).tolist() == kept
    assert 0 < sum(kept) < len(kept)
    # boundaries are kept, as `proportion > 0.8 or proportion < 0.2` drops only outside them
    edge = torch.tensor([1.0] + [0.0] * 4 + [1.0] * 4 + [0.0])
    assert kept_groups(edge, 5, "accuracy_band", 0.2, 0.8).tolist() == [True] * 10
    equal = kept_groups(torch.tensor([1.0, 1.0, 0.0, 1.0]), 2, "all_equal", 0.2, 0.8)
    assert equal.tolist() == [False, False, True, True]


def test_accuracy_band_needs_rewards_in_the_unit_interval(tmp_path):
    def lengths(completions, **kwargs):
        return [float(len(c)) + 2.0 for c in completions]

    trainer = make_trainer(TraceRLConfig(**base_config(tmp_path)), reward=lengths)
    with pytest.raises(ValueError, match="dynamic_group_filtering"):
        trainer.train()


# ------------------------------------------------------------------------------------------------ updates per rollout


@pytest.mark.slow
def test_one_epoch_of_minibatches_against_a_fixed_old_policy(tmp_path):
    """steps_per_generation = 4 x gradient_accumulation_steps: four optimizer steps on one rollout, all against
    the same pi_old -- the first with ratio 1 and zero KL, the later ones with the ratio moved, clipping active and
    the KL to pi_old positive."""
    args = TraceRLConfig(**base_config(tmp_path, per_device_train_batch_size=4, steps_per_generation=4,
                                       max_steps=4, learning_rate=5e-2))
    trainer = make_trainer(args)
    generations = []
    original = trainer._generate_and_score_completions

    def counting(inputs):
        output = original(inputs)
        generations.append("old_per_token_logps" in output)
        return output

    trainer._generate_and_score_completions = counting
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert generations == [True]  # one rollout, with pi_old's log-probs stored
    assert logs[0]["kl"] == 0.0 and logs[0]["clip_ratio/region_mean"] == 0.0
    assert logs[-1]["kl"] > 0.0
    assert max(entry["clip_ratio/region_mean"] for entry in logs[1:]) > 0.0


def test_without_stored_old_logprobs_the_kl_target_is_the_current_policy(tmp_path):
    """One optimizer step per rollout: TRL stores no old log-probs (pi_old is the current policy), so the ratio is
    1 and the k3 KL to pi_old is exactly 0."""
    trainer = make_trainer(TraceRLConfig(**base_config(tmp_path)))
    batch = fixed_rollout(trainer)
    assert "old_per_token_logps" not in batch and "ref_per_token_logps" not in batch
    trainer._compute_loss(trainer.model, batch)
    assert trainer._metrics["train"]["kl"][-1] == 0.0


def test_reference_model_kl_is_a_named_option(tmp_path):
    trainer = make_trainer(TraceRLConfig(**base_config(tmp_path, kl_reference="reference_model", beta=0.1)))
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    batch = fixed_rollout(trainer)
    assert "ref_per_token_logps" in batch


# ------------------------------------------------------------------------------------------------ value model


def counted(method) -> tuple:
    """``method`` wrapped to record its calls, and the list of calls."""
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return method(*args, **kwargs)

    return wrapper, calls


@pytest.mark.parametrize("value_batch_size", [8, 10**6])
def test_value_model_trains_one_epoch_over_the_surviving_rows(tmp_path, value_batch_size):
    """ceil(rows / value_batch_size) value steps per rollout, on the rows of the groups that pass the band only;
    the loss is dLLM-RL's: each row's 0.5 max((V - R)^2, (V_clip - R)^2) token sum / L1, / rows."""
    args = official_config(tmp_path, "trado", denoising_steps=2, value_batch_size=value_batch_size,
                           value_learning_rate=1e-3)
    policy = tiny_model("sdar").train()
    value = DiffusionValueModel.from_policy(policy)  # zero head: V = 0, so the first step's loss is 0.5 R^2
    trainer = make_trainer(args, model=policy, value_model=value)
    trainer.value_optimizer.step, steps = counted(trainer.value_optimizer.step)
    batch = fixed_rollout(trainer)
    rewards = banded_reward([p for p in PROMPTS for _ in range(4)], [""] * 16)
    advantages, kept = official_advantages_and_kept(rewards, 4)
    trained = trained_tokens(trainer, batch) & torch.tensor(kept)[:, None]
    rows = trado_rows(trained, batch["unmask_step"], prompt_lengths(batch), 4)
    assert len(steps) == math.ceil(len(rows) / value_batch_size)
    if value_batch_size == 8:
        assert len(steps) > 1
    else:  # one step from V = 0: gamma = lam = 1, so every trained token's return is its advantage
        longest = trained.sum(1).max().item()
        expected = sum(0.5 * advantages[b] ** 2 * len(cols) / longest for b, cols in rows) / len(rows)
        assert trainer._metrics["train"]["value/loss"][-1] == pytest.approx(expected, rel=1e-4)


# ------------------------------------------------------------------------------------------------ presets, errors


def test_official_trado_settings_are_rl_trado_yaml():
    """configs/rl_trado.yaml + rl_trado_with_value.yaml (dLLM-RL 10b4fd1), restated by hand."""
    args = TraceRLConfig.from_official("trado", num_processes=8, output_dir="x", use_cpu=True)
    expected = dict(num_generations=16, generation_batch_size=1024, max_completion_length=2000, block_length=4,
                    denoising_steps=4, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.9,
                    temperature=1.0, top_k=0, top_p=1.0, shrinkage=1, training_block_size=4, epsilon=0.2, beta=0.01,
                    kl_reference="old_policy", use_bias_correction_kl=False, log_ratio_clip=10.0,
                    step_normalization="max_length", loss_type="tracerl", learning_rate=1e-6,
                    lr_scheduler_type="constant", warmup_steps=0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
                    weight_decay=0.0, max_grad_norm=1.0, dynamic_group_filtering="accuracy_band",
                    group_accuracy_low=0.2, group_accuracy_high=0.8, reward_std="population", gamma=1.0, lam=1.0,
                    cliprange_value=0.2, value_learning_rate=5e-6, value_batch_size=256, value_train_every=1)
    assert {k: getattr(args, k) for k in expected} == expected
    # 8 processes x 1 response x 8 accumulation = 64 responses (~256 rows of ~4 merged steps) per optimizer step
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 8)
    assert args.generation_batch_size // (1 * 8 * 8) == 16  # optimizer steps per rollout on 8 processes
    with pytest.raises(ValueError, match="processes"):
        TraceRLConfig.from_official("trado", num_processes=3, output_dir="x", use_cpu=True)
    with pytest.raises(ValueError, match="official"):
        TraceRLConfig.from_official("sdar-8b", output_dir="x", use_cpu=True)


def test_official_dream_and_llada_settings():
    dream = TraceRLConfig.from_official("dream", output_dir="x", use_cpu=True)
    llada = TraceRLConfig.from_official("llada", output_dir="x", use_cpu=True)
    assert (dream.temperature, dream.top_p, dream.top_k, dream.max_completion_length) == (0.8, 0.9, 50, 1024)
    assert (llada.temperature, llada.max_completion_length) == (0.8, 512)
    for args in (dream, llada):
        assert (args.block_length, args.denoising_steps, args.shrinkage) == (32, 32, 8)
        assert (args.step_normalization, args.loss_type, args.log_ratio_clip) == ("step", "tracerl", None)
        assert args.generation_batch_size == 32 * 8 and args.num_generations == 8


def test_config_errors_name_the_field():
    def config(**fields):
        return TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, **fields)

    assert config(dynamic_group_filtering=True).dynamic_group_filtering == "all_equal"
    assert config(dynamic_group_filtering=False).dynamic_group_filtering == "none"
    for fields, field in [({"dynamic_group_filtering": "band"}, "dynamic_group_filtering"),
                          ({"group_accuracy_low": 0.9}, "group_accuracy_low"),
                          ({"step_normalization": "tokens"}, "step_normalization"),
                          ({"step_normalization": "sequence"}, "step_normalization"),
                          ({"importance_sampling_level": "sequence"}, "importance_sampling_level"),
                          ({"kl_reference": "initial"}, "kl_reference"),
                          ({"sync_ref_model": True}, "sync_ref_model"),
                          ({"log_ratio_clip": 0.0}, "log_ratio_clip"),
                          ({"reward_std": "unbiased"}, "reward_std"),
                          ({"multi_objective_aggregation": "normalize_then_sum"}, "reward_std"),
                          ({"value_batch_size": 0}, "value_batch_size")]:
        with pytest.raises(ValueError, match=field):
            config(**fields)


@pytest.mark.slow
def test_a_frozen_reference_of_an_in_memory_policy_can_be_synced(tmp_path):
    """kl_reference='reference_model' with sync_ref_model (DiffuCoder's recipe): the trainer's own frozen copy gets
    TRL's sync callback (TRL itself refuses to sync a reference it did not build)."""
    from trl.trainer.callbacks import SyncRefModelCallback

    args = TraceRLConfig(**base_config(tmp_path, kl_reference="reference_model", sync_ref_model=True,
                                       ref_model_sync_steps=1, ref_model_mixup_alpha=1.0, max_steps=2,
                                       dynamic_group_filtering="none"))
    trainer = make_trainer(args)
    assert any(isinstance(c, SyncRefModelCallback) for c in trainer.callback_handler.callbacks)
    trainer.train()
    for ours, reference in zip(trainer.model.parameters(), trainer.ref_model.parameters()):
        torch.testing.assert_close(reference, ours)  # alpha 1: the reference is the policy after every step


def test_token_metrics_are_means_under_max_length_weights(tmp_path):
    """``step_normalization="max_length"`` weighs every token 1/L_max; TRL's token metrics divide by
    max(sum of the weights, 1), so a micro-batch with fewer trained tokens than L_max logged its mean entropy times
    tokens / L_max (the TraDo preset, one response per micro-batch: about a sixth of the mean). The same rollouts
    weighted 1 per token (``sequence``) log the plain means; at the first step, before any update, the two must log
    the same entropy."""
    logged = []
    for normalization in ("max_length", "sequence"):
        args = official_config(tmp_path / normalization, "trado", per_device_train_batch_size=1,
                               gradient_accumulation_steps=16, step_normalization=normalization,
                               loss_type="dapo" if normalization == "sequence" else "tracerl")  # tracerl needs rows
        trainer = make_trainer(args)
        trainer.train()
        logged.append(trainer.state.log_history[0]["entropy"])
    assert logged[0] == pytest.approx(logged[1], rel=1e-5)


@pytest.mark.parametrize("normalization", ["step", "max_length"])
def test_dapo_divides_by_the_token_weights_as_bnpo_does(tmp_path, normalization):
    """TRL's ``dapo`` and ``bnpo`` are the same loss over one micro-batch on one process: sum(w l) / sum(w). With
    TraceRL's token weights dapo divided by the token count instead (x 40/64 with 'step' weights here, x 1/L_max
    with 'max_length')."""
    losses = {}
    for loss_type in ("dapo", "bnpo"):
        args = TraceRLConfig(**base_config(tmp_path / loss_type, loss_type=loss_type, step_normalization=normalization,
                                           dynamic_group_filtering="none", beta=0.0))
        trainer = make_trainer(args)
        batch = fixed_rollout(trainer)
        if loss_type == "dapo":
            assert batch["num_items_in_batch"].item() == pytest.approx(batch["completion_mask"].sum().item())
            assert batch["num_items_in_batch"] < (batch["completion_mask"] > 0).sum()  # weights, not tokens
        losses[loss_type] = trainer._compute_loss(trainer.model, batch).item()
    assert abs(losses["dapo"]) > 1e-3
    assert losses["dapo"] == pytest.approx(losses["bnpo"], rel=1e-5)


def test_token_metrics_of_a_micro_batch_without_trained_tokens_are_left_out_of_the_log(tmp_path):
    """Group filtering can leave a micro-batch with no trained token; TRL's masked mean then logs 0, which its log
    averaged in (the logged entropy about the true one times the kept fraction). Such entries are NaN, which TRL's
    log skips."""
    args = TraceRLConfig(**base_config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=16,
                                       dynamic_group_filtering="accuracy_band"))
    trainer = make_trainer(args)
    seen, compute_loss = [], trainer._compute_loss

    def recording(model, inputs):
        loss = compute_loss(model, inputs)
        seen.append((trainer._metrics["train"]["entropy"][-1], trainer._metrics["train"]["kl"][-1],
                     int(inputs["kept_rows"].sum())))
        return loss

    trainer._compute_loss = recording
    trainer.train()
    empty = [(entropy, kl) for entropy, kl, kept in seen if kept == 0]
    trained = [entropy for entropy, _, kept in seen if kept > 0]
    assert len(seen) == 16 and len(empty) == 8  # two of the four groups are outside the accuracy band
    assert all(math.isnan(entropy) and math.isnan(kl) for entropy, kl in empty)
    assert trainer.state.log_history[0]["entropy"] == pytest.approx(sum(trained) / len(trained), rel=1e-6)


def test_sequence_level_clip_ratios_are_means_over_the_kept_rows(tmp_path):
    """importance_sampling_level="sequence": TRL's clip ratios are means over every row of the micro-batch, and a
    filtered row (ratio 1, never clipped) only added to the count: a micro-batch with one of its two rows kept logged
    0.5 for a clipped kept row, one with none kept logged 0. Now 1.0 and NaN."""
    args = TraceRLConfig(**base_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=8,
                                       steps_per_generation=8, dynamic_group_filtering="accuracy_band",
                                       importance_sampling_level="sequence", loss_type="grpo", num_iterations=2,
                                       max_steps=2, epsilon=0.001, learning_rate=0.5))
    trainer = make_trainer(args)
    seen, compute_loss = [], trainer._compute_loss

    def recording(model, inputs):
        loss = compute_loss(model, inputs)
        metrics = trainer._metrics["train"]
        seen.append((metrics["clip_ratio/region_mean"][-1], int(inputs["kept_rows"].sum()),
                     metrics["clip_ratio/low_mean"][-1], metrics["clip_ratio/low_min"][-1],
                     metrics["clip_ratio/high_mean"][-1], metrics["clip_ratio/high_max"][-1]))
        return loss

    trainer._compute_loss = recording
    trainer.train()
    second = seen[8:]  # the second iteration over the rollout: ratios differ from 1
    assert all(math.isnan(value) and math.isnan(low_min) and math.isnan(high_max)
               for value, kept, _, low_min, _, high_max in second if kept == 0)
    partial = [entry for entry in second if entry[1] == 1]
    assert partial and {entry[0] for entry in partial} <= {0.0, 1.0} and 1.0 in {entry[0] for entry in partial}
    # one kept row of two: the least / greatest clip indicator is that row's (a filtered row's 0 was the minimum)
    assert all(entry[3] == entry[2] and entry[5] == entry[4] for entry in partial)  # low_min, high_max
    assert 1.0 in {entry[3] for entry in partial}
