"""Likelihood estimators: packed trajectory scoring equals the sampler and the naive per-step replay; shrinkage;
deterministic masks; gradients only through committed completion tokens."""

import numpy as np
import pytest
import torch
from numerics import assert_close_fp32

from trl_diffusion.estimators import (
    ESTIMATORS,
    EstimatorSettings,
    draw_masks,
    estimate_logprobs,
    likelihood,
    replay_logprobs,
    step_groups,
)
from trl_diffusion.states import (
    attention_mask_from_positions,
    completion_blocks,
    positions_from_padding,
    state_before_step,
)
from trl_diffusion.testing import MASK_ID, tiny_model

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]


def rollout(model, temperature=1.0, seed=0, **kw):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    args = dict(max_new_tokens=12, block_length=4, denoising_steps=2, temperature=temperature, stop_token_ids=[],
                return_dict_in_generate=True, generator=torch.Generator().manual_seed(seed))
    args.update(kw)
    out = model.generate(ids, mask, **args)
    return ids, mask, out.sequences[:, width:], out.unmask_step[:, width:], out.token_logprobs[:, width:]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trajectory_estimate_equals_sampler_logprobs(family, temperature):
    model = tiny_model(family)
    ids, mask, completion, steps, sampler = rollout(model, temperature, remasking_strategy="low_confidence_dynamic",
                                                    confidence_threshold=0.2)
    settings = EstimatorSettings(block_size=4, temperature=temperature)
    logps, _, scored = estimate_logprobs(model, ids, mask, completion, steps, settings)
    assert bool(scored.equal(steps >= 0))
    assert_close_fp32(logps, sampler, scored)  # the ratio new / old is exactly 1 up to float32 rounding
    assert bool((logps[~scored] == 0).all())


@pytest.mark.parametrize("budget", [None, 64])
def test_packed_scoring_equals_naive_per_step_loop(family, budget):
    model = tiny_model(family, seed=3)
    ids, mask, completion, steps, _ = rollout(model, seed=5)
    packed, _, scored = estimate_logprobs(model, ids, mask, completion, steps,
                                          EstimatorSettings(block_size=4, token_budget=budget))
    sequences, full_steps = torch.cat([ids, completion], 1), torch.cat([torch.full_like(ids, -1), steps], 1)
    naive = replay_logprobs(model, sequences, mask, full_steps, block_length=4)[:, ids.shape[1]:]
    assert_close_fp32(packed, naive, scored)


def slow_step_groups(unmask_step, shrinkage, blocks=None):
    """The obvious per-row loop: rank each block's distinct steps, merge ``shrinkage`` of them, number the merged
    groups by their first step (ties: lower block first)."""
    groups = torch.full_like(unmask_step, -1)
    for row in range(unmask_step.shape[0]):
        keys = {}  # (block, merged rank) -> first step
        lookup = {}
        for col in range(unmask_step.shape[1]):
            step = int(unmask_step[row, col])
            if step < 0:
                continue
            block = int(blocks[row, col]) if blocks is not None else 0
            same_block = [c for c in range(unmask_step.shape[1]) if blocks is None or int(blocks[row, c]) == block]
            distinct = sorted({int(unmask_step[row, c]) for c in same_block if unmask_step[row, c] >= 0})
            key = (block, distinct.index(step) // shrinkage)
            keys[key] = min(keys.get(key, step), step)
            lookup[col] = key
        order = sorted(keys, key=lambda k: (keys[k], k))
        for col, key in lookup.items():
            groups[row, col] = order.index(key)
    return groups


def test_step_groups_equal_the_slow_loop_on_random_trajectories():
    g = torch.Generator().manual_seed(0)
    for trial in range(150):
        rows, cols = int(torch.randint(1, 4, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))
        steps = torch.randint(-1, 10, (rows, cols), generator=g)
        blocks = [None, torch.randint(0, 4, (rows, cols), generator=g)][trial % 2]
        shrinkage = int(torch.randint(1, 4, (1,), generator=g))
        assert torch.equal(step_groups(steps, shrinkage, blocks), slow_step_groups(steps, shrinkage, blocks))


def test_step_groups_merge_as_specified():
    steps = torch.tensor([[0, 0, 1, 2, 3, 3, 4, 5, -1]])
    assert step_groups(steps, 1).tolist() == [[0, 0, 1, 2, 3, 3, 4, 5, -1]]
    assert step_groups(steps, 2).tolist() == [[0, 0, 0, 1, 1, 1, 2, 2, -1]]
    assert step_groups(steps, 4).tolist() == [[0, 0, 0, 0, 0, 0, 1, 1, -1]]
    # within blocks (block models): a group never spans two blocks
    blocks = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    assert step_groups(steps, 4, blocks).tolist() == [[0, 0, 0, 0, 1, 1, 1, 1, -1]]
    # with gaps in the step numbers (a row that waited), distinct steps are what is merged
    assert step_groups(torch.tensor([[0, 5, 5, 9]]), 2).tolist() == [[0, 0, 0, 1]]


def test_shrinkage_scores_each_merged_group_from_the_state_before_it(family):
    model = tiny_model(family, seed=2)
    ids, mask, completion, steps, _ = rollout(model, seed=1, denoising_steps=4)
    shrink = 2
    logps, _, _ = estimate_logprobs(model, ids, mask, completion, steps,
                                    EstimatorSettings(block_size=4, shrinkage=shrink))
    blocks = None
    if model.block_size is not None:  # completion positions -> SDAR blocks from absolute position 0
        lengths = mask.sum(1, keepdim=True)
        blocks = (lengths + torch.arange(completion.shape[1])) // 4
    groups = step_groups(steps, shrink, blocks)
    sequences = torch.cat([ids, completion], 1)
    full_groups = torch.cat([torch.full_like(ids, -1), groups], 1)
    generated = torch.cat([torch.zeros_like(ids, dtype=torch.bool), torch.ones_like(completion, dtype=torch.bool)], 1)
    # naive: for each group, one forward of the whole sequence in the state before it
    valid = torch.cat([mask.bool(), torch.ones_like(completion, dtype=torch.bool)], 1)
    pos = positions_from_padding(valid)
    attn = attention_mask_from_positions(pos, pos, valid, 4 if model.block_size else None)
    expected = torch.zeros_like(logps)
    with torch.no_grad():
        for g in range(int(groups.max()) + 1):
            state = state_before_step(sequences, full_groups, generated, g, MASK_ID)
            logits = model.align_logits(model(state, attention_mask=attn, position_ids=pos).logits)
            logits[..., MASK_ID] = float("-inf")
            lp = logits.log_softmax(-1).gather(-1, sequences[..., None]).squeeze(-1)[:, ids.shape[1]:]
            expected = torch.where(groups == g, lp, expected)
    assert_close_fp32(logps, expected, steps >= 0)
    assert int(groups.max()) + 1 < int(step_groups(steps, 1, blocks).max()) + 1  # fewer states than steps


def test_masks_are_deterministic_per_seed():
    model = tiny_model("llada")
    ids, mask, completion, steps, _ = rollout(model)
    for name in ("random_masking", "coupled", "mean_field"):
        settings = EstimatorSettings(name=name)
        a = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds=torch.tensor([1, 2, 3]))
        b = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds=torch.tensor([1, 2, 3]))
        c = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds=torch.tensor([7, 8, 9]))
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
        assert not torch.equal(a[0], c[0])


def slow_masked_logprobs(model, ids, mask, completion, hidden, block_size=4, prompt_hidden=None):
    """log p(token | sequence with the ``hidden`` completion tokens masked) at every hidden position, from whole
    -sequence forwards under the model's own attention: full attention, one forward per row; block-causal, one
    forward per (row, block), the block's hidden tokens scored given clean earlier blocks."""
    prompt = ids if prompt_hidden is None else ids.masked_fill(prompt_hidden & mask.bool(), MASK_ID)
    valid = torch.cat([mask.bool(), torch.ones_like(completion, dtype=torch.bool)], 1)
    positions = positions_from_padding(valid)
    block = block_size if model.block_size is not None else None
    attention = attention_mask_from_positions(positions, positions, valid, block)
    blocks = completion_blocks(mask, completion.shape[1], block)
    if blocks is None:
        blocks = torch.zeros_like(completion)
    out = torch.zeros(completion.shape)
    with torch.no_grad():
        for b in range(int(blocks.max()) + 1):
            here = hidden & (blocks == b)
            if not here.any():
                continue
            state = torch.cat([prompt, completion.masked_fill(hidden & (blocks >= b), MASK_ID)], 1)
            logits = model.align_logits(model(state, attention_mask=attention, position_ids=positions).logits)
            logits[..., MASK_ID] = float("-inf")
            lp = logits.log_softmax(-1)[:, ids.shape[1]:].gather(-1, completion[..., None]).squeeze(-1)
            out = torch.where(here, lp, out)
    return out


class ScoredMasks:
    """Records the completion tokens each scoring pass of an estimator masks and scores (its ``scored``
    argument, or every committed token when it scores them all)."""

    def __init__(self, monkeypatch):
        self.masks = []
        original = likelihood.build_scoring_chunks

        def spy(prompt_ids, prompt_mask, completion_ids, groups, *args, **kwargs):
            scored = kwargs.get("scored", args[4] if len(args) > 4 else None)
            self.masks.append((groups >= 0) if scored is None else scored.clone())
            return original(prompt_ids, prompt_mask, completion_ids, groups, *args, **kwargs)

        monkeypatch.setattr(likelihood, "build_scoring_chunks", spy)


SEEDS = torch.tensor([11, 12, 13])


def test_random_masking_equals_a_slow_per_state_computation(family, monkeypatch):
    model = tiny_model(family, seed=4)
    ids, mask, completion, steps, _ = rollout(model, seed=2)
    settings = EstimatorSettings(name="random_masking", block_size=4)
    spy = ScoredMasks(monkeypatch)
    logps, _, scored = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds=SEEDS)
    hidden = draw_masks(settings, steps >= 0, SEEDS, ids.shape[1])["masked"]
    assert len(spy.masks) == 1 and torch.equal(spy.masks[0], hidden) and torch.equal(scored, hidden)
    assert 0.2 < hidden.float().mean() < 0.8  # a real mix of visible and masked tokens
    assert_close_fp32(logps, slow_masked_logprobs(model, ids, mask, completion, hidden), scored)
    assert bool((logps[~scored] == 0).all())


def test_mean_field_equals_a_slow_computation_with_the_prompt_noise(family):
    model = tiny_model(family, seed=4)
    ids, mask, completion, steps, _ = rollout(model, seed=2)
    settings = EstimatorSettings(name="mean_field", block_size=4, prompt_mask_prob=0.3)
    logps, _, scored = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds=SEEDS)
    noise = draw_masks(settings, steps >= 0, SEEDS, ids.shape[1])["prompt_noise"]
    assert (noise & mask.bool()).any()
    expected = slow_masked_logprobs(model, ids, mask, completion, steps >= 0, prompt_hidden=noise)
    assert_close_fp32(logps, expected, scored)
    without_noise = slow_masked_logprobs(model, ids, mask, completion, steps >= 0)
    assert (logps - without_noise)[scored].abs().max() > 1e-3  # the prompt noise is really applied


def test_coupled_equals_a_slow_two_forward_computation(family, monkeypatch):
    """DiffuCoder's coupled estimate: (log p(o | all masked) + w log p(o | its half masked)) / 2, w = 1/t for
    the first mask and 1/(1-t) for its complement; every committed token is scored once in the pair."""
    model = tiny_model(family, seed=4)
    ids, mask, completion, steps, _ = rollout(model, seed=2)
    committed = steps >= 0
    settings = EstimatorSettings(name="coupled", block_size=4)
    spy = ScoredMasks(monkeypatch)
    logps, _, scored = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds=SEEDS)
    full, first, second = spy.masks  # the estimator's own passes: everything, the mask, the other mask
    assert torch.equal(full, committed) and torch.equal(scored, committed)
    assert not (first & second).any() and torch.equal(first | second, committed)  # complementary
    draws = draw_masks(settings, committed, SEEDS, ids.shape[1])
    assert torch.equal(first, draws["masked"]) and first.any() and second.any()
    t = draws["t"][:, None]
    assert bool(((t >= 0.2) & (t <= 0.8)).all())
    slow = {name: slow_masked_logprobs(model, ids, mask, completion, hidden)
            for name, hidden in (("full", full), ("first", first), ("second", second))}
    expected = 0.5 * (slow["full"] + torch.where(first, slow["first"] / t, slow["second"] / (1 - t)))
    assert_close_fp32(logps, expected, committed)


@pytest.mark.parametrize("name", ESTIMATORS)
def test_gradient_only_through_committed_completion_tokens(family, name):
    model = tiny_model(family).train()
    ids, mask, completion, steps, _ = rollout(model, max_new_tokens=8)
    steps = steps.clone()
    steps[0, -3:] = -1  # never committed
    logps, _, scored = estimate_logprobs(model, ids, mask, completion, steps, EstimatorSettings(name=name),
                                         seeds=torch.tensor([1, 2, 3]))
    assert not bool(scored[0, -3:].any())
    assert bool((logps[~scored] == 0).all())
    weight = model.get_input_embeddings().weight
    untouched = torch.autograd.grad(logps[~scored].sum(), weight, allow_unused=True, retain_graph=True)[0]
    assert untouched is None or bool((untouched == 0).all())
    (logps * scored).sum().backward()
    assert weight.grad.abs().sum() > 0


def test_unknown_estimator_is_an_error():
    with pytest.raises(ValueError, match="unknown likelihood_estimator"):
        EstimatorSettings(name="nope").validate()


@pytest.mark.parametrize("field,value,message", [
    ("shrinkage", 1.5, "shrinkage must be an integer >= 1"),
    ("token_budget", 0, "token_budget must be None or an integer >= 1"),
    ("block_size", 0, "block_size must be None or an integer >= 1"),  # was read as "the model's"
    ("temperature", -1.0, "temperature must be 0 .scored at 1. or a finite number >= 1e-05"),  # all-NaN log-probs
    ("temperature", float("nan"), "temperature must be 0 .scored at 1. or a finite number >= 1e-05"),
    ("temperature", 1e-40, "temperature must be 0 .scored at 1. or a finite number >= 1e-05"),  # NaN log-probs
    ("top_k", -3, "top_k must be None or an integer >= 0"),
    ("top_p", 0.0, r"top_p must be None or in \(0, 1\]"),  # every log-prob -inf
    ("top_p", 1.5, r"top_p must be None or in \(0, 1\]"),
    ("prompt_mask_prob", 1.5, r"prompt_mask_prob must lie in \[0, 1\]"),
    ("attention_backend", "bogus", "attention_backend must be one of"),
])
def test_estimator_settings_refuse_values_no_estimator_can_use(field, value, message):
    with pytest.raises(ValueError, match=message):
        EstimatorSettings(**{field: value})
    EstimatorSettings(temperature=0.0, top_k=0, top_p=1.0, prompt_mask_prob=0.0, token_budget=1, block_size=4)


@pytest.mark.parametrize("field,value", [
    ("temperature", np.float32(0.7)), ("temperature", 1), ("temperature", -1.0), ("temperature", True),
    ("temperature", float("inf")), ("top_k", np.int64(5)), ("top_k", 2.5), ("top_k", True), ("top_k", -1),
    ("top_p", np.float64(0.9)), ("top_p", 0.0), ("top_p", True),
])
def test_the_estimators_accept_exactly_the_sampling_values_generate_accepts(field, value):
    # one rule (sampling.check_sampling_filters): generate() took numpy integers / floats the estimator refused
    from trl_diffusion.generation.sampler import SamplingSettings

    def accepted(make):
        try:
            make()
        except ValueError:
            return False
        return True

    sampled = accepted(lambda: SamplingSettings(8, 4, 4, **{field: value}).validate())
    assert accepted(lambda: EstimatorSettings(**{field: value})) == sampled
