"""Packed scoring against an obvious per-row, per-merged-step loop, on configurations the other estimator tests do
not sweep (batches of prompts that straddle blocks, blocks of 1-8, uneven step counts, stop tokens, shrinkage,
tiny token budgets, training blocks larger than the rollout's). Cases come from a randomized differential fuzz.

Regression: with ``training_block_size`` larger than the rollout's block (SDAR 4 -> 8), the right padding of a
batch's shorter canvases fell inside a row's last training block and was shown as mask tokens, so a response's
log-probs depended on the other responses of its batch (and differed from scoring it alone)."""

import pytest
import torch
from numerics import assert_close_fp32
from test_estimators import slow_step_groups

from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs
from trl_diffusion.generation.sampling import sampling_logits
from trl_diffusion.states import CanvasLayout
from trl_diffusion.testing import EOS_ID, MASK_ID, tiny_model


def rollout(family, model_seed, prompts, gen_seeds, **kwargs):
    model = tiny_model(family, seed=model_seed)
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, mask, return_dict_in_generate=True,
                         generator=[torch.Generator().manual_seed(s) for s in gen_seeds], **kwargs)
    return model, ids, mask, out.sequences[:, width:], out.unmask_step[:, width:], out.token_logprobs[:, width:]


@torch.no_grad()
def naive_row(model, prompt, completion, steps, shrinkage, block, temperature):
    """One row alone, unpadded: for every merged group, the explicit state before it and one plain forward under
    block-causal (``block``) or full attention. A block model's row ends at its last committed token."""
    committed = [j for j, s in enumerate(steps) if s >= 0]
    n = committed[-1] + 1 if block is not None else len(steps)
    blocks = None if block is None else torch.tensor([[(len(prompt) + j) // block for j in range(n)]])
    groups = slow_step_groups(torch.tensor([steps[:n]]), shrinkage, blocks)[0].tolist()
    length = len(prompt) + n
    positions = torch.arange(length)[None]
    if block is None:
        attention = torch.ones(1, 1, length, length, dtype=torch.bool)
    else:
        attention = (positions[0, None, :] // block <= positions[0, :, None] // block)[None, None]
    out = torch.zeros(len(steps))
    for g in range(max(groups) + 1):
        state = list(prompt) + [completion[j] if 0 <= groups[j] < g else MASK_ID for j in range(n)]
        logits = model(input_ids=torch.tensor([state]), attention_mask=attention, position_ids=positions).logits[0]
        if model.logits_shift:
            logits = torch.cat([logits[:1], logits[:-1]])
        log_dist = sampling_logits(logits, temperature, mask_token_id=MASK_ID).log_softmax(-1)
        for j in range(n):
            if groups[j] == g:
                out[j] = log_dist[len(prompt) + j, completion[j]]
    return out


CASES = {  # name: (family, model seed, prompts, generation seeds, generate kwargs, training block, shrinkage, budget)
    "sdar_block3_straddling_prompts_stop": (
        "sdar", 0, [[44, 84, 33], [43, 40, 64, 95, 104, 82, 34], [26, 78]], [1, 2, 3],
        dict(max_new_tokens=10, block_length=3, denoising_steps=2, remasking_strategy="low_confidence_dynamic",
             confidence_threshold=0.2, stop_token_ids=[16, 67, 34, 102, 7, 94, 39, 71, 57, 65], temperature=0.7),
        3, 2, 8),
    "sdar_block8_steps3_budget1": (
        "sdar", 1, [[87, 110, 62, 50, 116, 54, 59, 78, 9], [8]], [4, 5],
        dict(max_new_tokens=13, block_length=8, denoising_steps=3, remasking_strategy="low_confidence_static"),
        8, 5, 1),
    "llada_block3_shrink3_budget1": (
        "llada", 1, [[70, 67, 56, 122, 105], [30, 31]], [6, 7],
        dict(max_new_tokens=9, block_length=3, denoising_steps=2, remasking_strategy="low_confidence_dynamic",
             confidence_threshold=0.2), None, 3, 1),
    "dream_block3_four_rows_stop": (
        "dream", 0, [[64, 109, 67, 110, 40, 88, 108, 25], [9, 71, 67], [10], [58, 115, 22, 82]], [8, 9, 10, 11],
        dict(max_new_tokens=11, block_length=3, denoising_steps=2, remasking_strategy="entropy",
             stop_token_ids=[63, 27, 92], temperature=0.7), None, 2, 20),
    # the regression: rollout blocks of 4, training blocks of 8, canvases of different lengths in one batch
    "sdar_training_block_8_of_4": (
        "sdar", 0, [[44, 84, 33], [43, 40, 64, 95, 104, 82, 34, 60, 88, 12], [26, 78, 22, 44, 27, 31],
                    [118, 67, 61, 68, 57, 54, 25]], [130385, 229004, 624628, 806293],
        dict(max_new_tokens=13, block_length=4, denoising_steps=3, remasking_strategy="low_confidence_dynamic",
             confidence_threshold=0.05), 8, 3, 1),
    "sdar_training_block_4_of_2_stop": (
        "sdar", 1, [[117], [98, 35, 20, 99, 38, 78, 87, 82], [6, 39, 65, 59, 115, 89, 47, 108]],
        [779128, 556848, 718324],
        dict(max_new_tokens=6, block_length=2, denoising_steps=2, remasking_strategy="low_confidence_dynamic",
             confidence_threshold=0.5, stop_token_ids=[11, 72, 54, 118, 60, 71, 25, 110, 124, 100], top_k=30),
        4, 2, 8),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_packed_scoring_equals_the_obvious_per_row_loop(name):
    family, model_seed, prompts, gen_seeds, kwargs, training_block, shrinkage, budget = CASES[name]
    model, ids, mask, completion, steps, sampler = rollout(family, model_seed, prompts, gen_seeds, **kwargs)
    committed = steps >= 0
    temperature = kwargs.get("temperature", 1.0)
    block = training_block if model.block_size is not None else None
    settings = dict(block_size=block, temperature=temperature)
    if block is None or block == kwargs["block_length"]:  # the sampler's own states: its log-probs, exactly
        logps, entropies, _ = estimate_logprobs(model, ids, mask, completion, steps,
                                                EstimatorSettings(**settings, token_budget=budget),
                                                compute_entropy=True)
        assert_close_fp32(logps, sampler, committed)
        assert bool(torch.isfinite(entropies[committed]).all())
    packed, _, _ = estimate_logprobs(model, ids, mask, completion, steps,
                                     EstimatorSettings(**settings, shrinkage=shrinkage, token_budget=budget))
    unbudgeted, _, _ = estimate_logprobs(model, ids, mask, completion, steps,
                                         EstimatorSettings(**settings, shrinkage=shrinkage))
    assert_close_fp32(packed, unbudgeted, committed)
    layout = CanvasLayout([len(p) for p in prompts], kwargs["max_new_tokens"], kwargs["block_length"],
                          model.block_size is not None)
    for row, prompt in enumerate(prompts):
        if not bool(committed[row].any()):
            continue
        n = layout.gen_end[row] - layout.gen_start[row]
        expected = naive_row(model, prompt, completion[row].tolist(), steps[row, :n].tolist(), shrinkage, block,
                             temperature)
        assert_close_fp32(packed[row, :n], expected, committed[row, :n])
        alone, _, _ = estimate_logprobs(model, torch.tensor([prompt]), torch.ones(1, len(prompt), dtype=torch.long),
                                        completion[row:row + 1, :n], steps[row:row + 1, :n],
                                        EstimatorSettings(**settings, shrinkage=shrinkage, token_budget=budget))
        assert_close_fp32(packed[row, :n], alone[0], committed[row, :n])
