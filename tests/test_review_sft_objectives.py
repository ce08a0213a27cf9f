"""SFT objectives against an independent float64 computation in settings the main tests do not cover: Dream's
shifted logits with `semi_ar` / `complementary`, a labelled first token (plain text), labels in two separate spans
(assistant-only multi-turn: `complementary` only, since `semi_ar` has one span of blocks per row and the trainer
refuses such rows for it, tests/test_sft_multiturn.py), a one-token completion, narrow ratio ranges; and
`trajectory` merging against the collapse rule of dLLM-RL's trace SFT (each block's distinct steps grouped
`shrinkage` at a time) on prompts that do not end on a block edge."""

import math

import pytest
import torch
from datasets import Dataset

from trl_diffusion.testing import EOS_ID, MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.trainers.diffusion_losses import (
    IGNORE_INDEX,
    ScoringBatch,
    build_objective,
    count_loss_tokens,
    diffusion_loss,
    random_masking_objective,
    sample_generators,
    scorable,
)

# (prompt length, label spans as (start, end)) per row; row lengths differ, so rows are right-padded
LAYOUTS = [(0, [(0, 11)]), (5, [(5, 14)]), (3, [(3, 7), (10, 15)]), (7, [(7, 8)]), (2, [(2, 19)])]
ONE_SPAN_LAYOUTS = [layout for layout in LAYOUTS if len(layout[1]) == 1]
"""The rows ``semi_ar`` trains on: one labelled span each (the trainer refuses the others for it)."""


def layouts_for(objective):
    return ONE_SPAN_LAYOUTS if objective == "semi_ar" else LAYOUTS


def make_rows(seed=1, layouts=LAYOUTS):
    generator = torch.Generator().manual_seed(seed)
    lengths = [max(end for _, end in spans) for _, spans in layouts]
    width = max(lengths)
    ids = torch.full((len(layouts), width), EOS_ID)
    labels = torch.full_like(ids, IGNORE_INDEX)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for row, ((_, spans), n) in enumerate(zip(layouts, lengths)):
        ids[row, :n] = torch.randint(10, 100, (n,), generator=generator)
        valid[row, :n] = True
        for start, end in spans:
            labels[row, start:end] = ids[row, start:end]
    return ids, labels, valid


def log_probs(model, seq, exclude_mask=True):
    """float64 log-probs over the vocabulary (without the mask token if ``exclude_mask``); row i predicts token i."""
    logits = model(seq[None]).logits[0].double()
    if model.logits_shift:  # Dream: logits[i - 1] predict token i
        logits = torch.cat([logits[:1], logits[:-1]])
    if exclude_mask:
        logits[:, MASK_ID] = -math.inf
    return logits.log_softmax(-1)


def nll(model, noisy, clean, scored, exclude_mask=True):
    """Sum of -log p(clean[i] | noisy) over scored i: one forward for full attention, one per block otherwise."""
    b = model.block_size or len(clean)
    total = 0.0
    for start in range(0, len(clean), b):
        if not any(scored[start : start + b]):
            continue
        seq = noisy if model.block_size is None else torch.cat([clean[:start], noisy[start : start + b]])
        logp = log_probs(model, seq, exclude_mask)
        for i in range(start, min(start + b, len(clean))):
            if scored[i] and not (model.logits_shift and i == 0):
                total -= logp[i, clean[i]].item()
    return total


def reference(model, objective, ids, labels, valid, eps, weighting, block_length, exclude_mask=True):
    """The loss from the definitions, row by row, drawing each sample's numbers as documented: the ratios, then
    one uniform per real token."""
    total = 0.0
    for row, generator in enumerate(sample_generators(list(range(len(ids))), 0, 0)):
        n = int(valid[row].sum())
        x = ids[row, :n]
        completion = (labels[row, :n] != IGNORE_INDEX).tolist()
        span = [i for i in range(n) if completion[i]]
        if objective == "semi_ar":  # one span of blocks from the end of the prompt
            assert span == list(range(span[0], span[-1] + 1)), "semi_ar rows have one labelled span"
        n_ratios = (span[-1] - span[0]) // block_length + 1 if objective == "semi_ar" else 1
        ratios = torch.rand(n_ratios, generator=generator)
        uniforms = torch.rand(n, generator=generator)
        cases = []  # (hidden, scored, ratio): one per noisy row
        if objective == "complementary":
            t = eps + (1 - 2 * eps) * ratios[0]
            first = [completion[i] and bool(uniforms[i] < t) for i in range(n)]
            second = [completion[i] and not first[i] for i in range(n)]
            cases = [(first, first, 2 * float(t)), (second, second, 2 * (1 - float(t)))]
        else:  # semi_ar: block b masked with its own ratio, later completion tokens hidden, earlier ones clean
            for b in range(n_ratios):
                t = eps + (1 - eps) * ratios[b]
                lo, hi = span[0] + b * block_length, span[0] + (b + 1) * block_length
                scored = [completion[i] and lo <= i < hi and bool(uniforms[i] < t) for i in range(n)]
                hidden = [scored[i] or (completion[i] and hi <= i <= span[-1]) for i in range(n)]
                cases.append((hidden, scored, float(t)))
        for hidden, scored, ratio in cases:
            weight = 1 / ratio if weighting == "elbo" else 1.0
            total += weight * nll(model, x.masked_fill(torch.tensor(hidden), MASK_ID), x, scored, exclude_mask)
    return total / int(count_loss_tokens(labels, model.logits_shift))


def loss_of(model, objective, ids, labels, valid, excluded=MASK_ID, **kwargs):
    batch = build_objective(objective, ids, labels, valid, sample_generators(list(range(len(ids))), 0, 0),
                            mask_token_id=MASK_ID, block_size=model.block_size, **kwargs)
    shift = model.logits_shift
    return diffusion_loss(model, batch, count_loss_tokens(labels, shift), shift, excluded)[0].item()


@pytest.mark.parametrize("family,objective", [("dream", "semi_ar"), ("dream", "complementary"),
                                              ("llada", "semi_ar"), ("sdar", "complementary")])
@pytest.mark.parametrize("eps,weighting", [(1e-3, "elbo"), (0.45, "none")])
def test_objective_equals_the_definition_in_unusual_rows(family, objective, eps, weighting):
    model = tiny_model(family).double()
    ids, labels, valid = make_rows(layouts=layouts_for(objective))
    got = loss_of(model, objective, ids, labels, valid, eps=eps, weighting=weighting, semi_ar_block_length=3)
    want = reference(model, objective, ids, labels, valid, eps, weighting, 3)
    assert got == pytest.approx(want, rel=1e-5)  # the scorer works in float32


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_whole_vocabulary_loss_equals_the_released_cross_entropy(family):
    """exclude_mask_token_from_softmax=False (no excluded id): the released SFT losses' softmax, mask included."""
    model = tiny_model(family).double()
    ids, labels, valid = make_rows(layouts=ONE_SPAN_LAYOUTS)
    got = loss_of(model, "semi_ar", ids, labels, valid, excluded=None, eps=1e-3, weighting="elbo",
                  semi_ar_block_length=3)
    assert got == pytest.approx(reference(model, "semi_ar", ids, labels, valid, 1e-3, "elbo", 3, False), rel=1e-5)
    assert got != pytest.approx(reference(model, "semi_ar", ids, labels, valid, 1e-3, "elbo", 3), rel=1e-5)


def test_the_trainer_passes_exclude_mask_token_from_softmax_on(tmp_path):
    tokenizer = build_tokenizer()
    data = Dataset.from_list([{"prompt": "What is 12+7?\n", "completion": "\\boxed{19}"}] * 2)
    losses = {}
    for exclude in (True, False):
        args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=64,
                                  per_device_train_batch_size=2, exclude_mask_token_from_softmax=exclude)
        trainer = DiffusionSFTTrainer(tiny_model("llada"), args=args, train_dataset=data, processing_class=tokenizer)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
        losses[exclude] = trainer.compute_loss(trainer.model, batch).item()
    mask_share = losses[False] - losses[True]  # -log(1 - p(mask)) per scored token, averaged: small, positive
    assert 0 < mask_share < 0.1 * losses[True]


def trajectory_reference(model, ids, labels, valid, unmask_step, shrinkage):
    """dLLM-RL's trace rounds: per block (whole response for full attention), the distinct steps grouped
    `shrinkage` at a time; each group is scored from the state hiding its own and every later group."""
    b = model.block_size
    total = 0.0
    for row in range(len(ids)):
        n = int(valid[row].sum())
        x, steps = ids[row, :n], unmask_step[row, :n].tolist()
        completion = (labels[row, :n] != IGNORE_INDEX).tolist()
        group = [None] * n
        for key in {i // b if b else 0 for i in range(n) if completion[i]}:
            members = [i for i in range(n) if completion[i] and (i // b if b else 0) == key]
            distinct = sorted({steps[i] for i in members})
            for i in members:  # a group is named by its last step, as dLLM-RL's collapse names it
                rank = distinct.index(steps[i])
                group[i] = distinct[min((rank // shrinkage + 1) * shrinkage, len(distinct)) - 1]
        for g in sorted({v for v in group if v is not None}):
            hidden = [bool(completion[i]) and group[i] >= g for i in range(n)]
            total += nll(model, x.masked_fill(torch.tensor(hidden), MASK_ID), x, [group[i] == g for i in range(n)])
    return total / int(count_loss_tokens(labels, model.logits_shift))


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
@pytest.mark.parametrize("shrinkage", [1, 2, 3])
def test_trajectory_equals_the_trace_rounds(family, shrinkage):
    model = tiny_model(family).double()
    generator = torch.Generator().manual_seed(3)
    rows = [(5, 9), (2, 7), (7, 1), (0, 6)]  # (prompt, completion): prompts end inside blocks of 4
    width = max(p + c for p, c in rows)
    ids = torch.full((len(rows), width), EOS_ID)
    labels = torch.full_like(ids, IGNORE_INDEX)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    unmask_step = torch.full_like(ids, -1)
    for row, (p, c) in enumerate(rows):
        ids[row, : p + c] = torch.randint(10, 100, (p + c,), generator=generator)
        labels[row, p : p + c] = ids[row, p : p + c]
        valid[row, : p + c] = True
        step = 0  # global steps, increasing across blocks, several tokens per step (as the sampler records them)
        for i in range(p, p + c):
            step += int(i != p and i % 4 == 0) + int(torch.rand(1, generator=generator) < 0.5)
            unmask_step[row, i] = step
    batch = build_objective("trajectory", ids, labels, valid, [], mask_token_id=MASK_ID,
                            block_size=model.block_size, unmask_step=unmask_step, shrinkage=shrinkage)
    shift = model.logits_shift
    got = diffusion_loss(model, batch, count_loss_tokens(labels, shift), shift, MASK_ID)[0].item()
    assert got == pytest.approx(trajectory_reference(model, ids, labels, valid, unmask_step, shrinkage), rel=1e-5)


def test_the_elbo_weight_is_one_over_t_even_for_tiny_t():
    """``eps`` = ``high`` = 1e-3 draws t = 1e-3 for every sample: each masked token weighs 1/t = 1000, uncapped."""
    ids = torch.arange(20000).remainder(90)[None] + 10
    batch = random_masking_objective(ids, ids.clone(), torch.ones_like(ids, dtype=torch.bool), MASK_ID,
                                     sample_generators([0], 0, 0), eps=1e-3, high=1e-3)
    weights = batch.weights[batch.targets != IGNORE_INDEX]
    assert weights.numel() > 0
    torch.testing.assert_close(weights, torch.full_like(weights, 1000.0))


def test_shifted_logits_count_and_score_no_first_column_and_no_document_start():
    """Dream's shifted logits predict column i from column i - 1: column 0, and the first token of every packed
    document, are never scored, and ``count_loss_tokens`` (the normaliser) leaves them out the same way."""
    labels = torch.tensor([[5, 6, 7], [8, 9, IGNORE_INDEX]])
    rows = ScoringBatch(labels, torch.arange(3).expand(2, 3), None, labels, (labels != IGNORE_INDEX).float())
    assert int(count_loss_tokens(labels, logits_shift=True)) == int(scorable(rows, True).sum()) == 3
    assert int(count_loss_tokens(labels, logits_shift=False)) == 5
    targets = torch.tensor([[5, 6, 7, 8, 9]])
    packed = ScoringBatch(targets, torch.tensor([[0, 1, 2, 0, 1]]), None, targets, torch.ones(1, 5))
    assert scorable(packed, True).tolist() == [[False, True, True, False, True]]
    assert scorable(packed, False).all()
