"""Diffusion SFT: every objective against a slow, obvious computation; prompt / padding handling; the trainer
end to end (formats, overfitting, LoRA, gradient accumulation) and its errors."""

import math

import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32
from trl import SFTConfig

from trl_diffusion.models import LLaDAModelLM, SDARForCausalLM
from trl_diffusion.states import block_index, noisy_clean_layout, positions_from_padding, step_groups
from trl_diffusion.testing import EOS_ID, MASK_ID, build_tokenizer, tiny_llada_config, tiny_model, tiny_sdar_config
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.trainers.diffusion_losses import (
    IGNORE_INDEX,
    ScoringBatch,
    build_objective,
    count_loss_tokens,
    diffusion_loss,
    draw_noise,
    mask_ratio,
    sample_generators,
    score_tokens,
    trajectory_state_rows,
)
from trl_diffusion.trainers.sft_trainer import DiffusionDataCollator

TOKENIZER = build_tokenizer()
PAIRS = [("What is 12+7?\n", "\\boxed{19}"), ("Hi!\n", "\\boxed{-3}"), ("What is 5-5?\n", "\\boxed{0}=zero")]
EPS = 1e-3


def encode(text):
    return TOKENIZER.encode(text, add_special_tokens=False)


def make_batch(pairs=PAIRS, extra_pad=0):
    """Right-padded ``input_ids``, ``labels`` (-100 on the prompt and padding) and the padding mask."""
    rows = [(encode(p), encode(c) + [EOS_ID]) for p, c in pairs]
    width = max(len(p) + len(c) for p, c in rows) + extra_pad
    ids = torch.full((len(rows), width), EOS_ID)
    labels = torch.full((len(rows), width), IGNORE_INDEX)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        labels[i, len(p) : n] = torch.tensor(c)
        valid[i, :n] = True
    return ids, labels, valid


def gens(n, seed=0, epoch=0):
    return sample_generators(list(range(n)), seed, epoch)


def fast_loss(model, objective, ids, labels, valid, **kw):
    batch = build_objective(objective, ids, labels, valid, kw.pop("generators", gens(len(ids))),
                            mask_token_id=MASK_ID, block_size=model.block_size, **kw)
    shift = model.logits_shift
    return diffusion_loss(model, batch, count_loss_tokens(labels, shift), shift, MASK_ID)[0], batch


def row_mask(generator, valid_row, labels_row, n_ratios=1, high=1.0):
    ratios, uniforms = draw_noise(generator, n_ratios, valid_row)
    ratios = mask_ratio(ratios, EPS, high)
    return ratios, uniforms, labels_row != IGNORE_INDEX


def logp_full_attention(model, noisy, clean, scored):
    """log p(clean[i] | noisy) at scored positions, one plain forward (the model's own full attention)."""
    logits = model.align_logits(model(noisy[None]).logits)[0].float()
    logits = logits.index_fill(-1, torch.tensor([MASK_ID]), float("-inf")).log_softmax(-1)
    if model.logits_shift:
        scored = scored.clone()
        scored[0] = False
    return sum(logits[i, clean[i]] for i in torch.nonzero(scored).flatten().tolist())


def logp_block_causal(model, noisy, clean, scored):
    """Per block: forward [clean earlier blocks | noisy block] (the model's own block-causal mask) and score."""
    b = model.block_size
    total = 0.0
    for start in range(0, len(clean), b):
        if not scored[start : start + b].any():
            continue
        seq = torch.cat([clean[:start], noisy[start : start + b]])
        logits = model(seq[None]).logits[0].float()
        logits = logits.index_fill(-1, torch.tensor([MASK_ID]), float("-inf")).log_softmax(-1)
        for i in torch.nonzero(scored[start : start + b]).flatten().tolist():
            total = total + logits[start + i, clean[start + i]]
    return total


# ---------------------------------------------------------------------------------------------- objectives


@pytest.mark.parametrize("weighting", ["elbo", "none"])
def test_block_objective_equals_per_block_forwards(weighting):
    model = tiny_model("sdar")
    ids, labels, valid = make_batch()
    loss, _ = fast_loss(model, "block", ids, labels, valid, weighting=weighting)
    total = 0.0
    for row, g in enumerate(gens(len(ids))):
        n = int(valid[row].sum())
        (t,), u, completion = row_mask(g, valid[row], labels[row])
        masked = (completion & (u < t))[:n]
        noisy = ids[row, :n].masked_fill(masked, MASK_ID)
        weight = 1 / t if weighting == "elbo" else 1.0
        total = total - weight * logp_block_causal(model, noisy, ids[row, :n], masked)
    torch.testing.assert_close(loss, total / (labels != IGNORE_INDEX).sum(), atol=1e-5, rtol=1e-5)


def test_block_layout_leaves_out_unscored_noisy_blocks_exactly():
    """The noisy copy holds, per row, only the blocks with a masked token (left padding included); loss and
    gradients equal scoring with the whole noisy copy."""
    model = tiny_model("sdar")
    ids, labels, valid = make_batch(PAIRS * 2)
    shift = (~valid).sum(-1)  # move every row's padding to the left
    ids, labels, valid = (torch.stack([x[r].roll(int(shift[r])) for r in range(len(x))]) for x in (ids, labels, valid))
    generators = [torch.Generator().manual_seed(s) for s in (0, 1, 2, 3, 4, 6)]  # some rows leave blocks unmasked
    batch = build_objective("block", ids, labels, valid, generators, mask_token_id=MASK_ID, block_size=4)
    loss = diffusion_loss(model, batch, count_loss_tokens(labels), False, MASK_ID)[0]
    loss.backward()
    compact_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    draws = [row_mask(torch.Generator().manual_seed(s), valid[r], labels[r]) for r, s in enumerate((0, 1, 2, 3, 4, 6))]
    masked = torch.stack([completion & (u < t) for (t,), u, completion in draws])
    ratio = torch.stack([t for (t,), _, _ in draws])
    positions = positions_from_padding(valid)
    blocks = positions // 4
    width = ids.shape[1]
    gaps = 0  # completion blocks after a row's first masked block with nothing masked in them
    for row in range(len(ids)):  # the built noisy tokens: exactly the real tokens of the row's masked blocks
        masked_blocks = set(blocks[row][masked[row]].tolist())
        expected = sum(int(blocks[row, c]) in masked_blocks and bool(valid[row, c]) for c in range(width))
        assert int(batch.layout.valid[row, : batch.input_ids.shape[1] - width].sum()) == expected
        if masked_blocks:
            gaps += len(set(range(min(masked_blocks), int(blocks[row].max()) + 1)) - masked_blocks)
    assert gaps > 0
    full_ids, full_pos, full_layout = noisy_clean_layout(ids.masked_fill(masked, MASK_ID), ids, positions, valid, 4)
    targets = torch.where(masked, ids, IGNORE_INDEX)
    weights = masked.float() / ratio[:, None]
    ignore = torch.full_like(targets, IGNORE_INDEX)
    full = ScoringBatch(full_ids, full_pos, full_layout, torch.cat([targets, ignore], -1),
                        torch.cat([weights, weights * 0], -1))
    expected_loss = diffusion_loss(model, full, count_loss_tokens(labels), False, MASK_ID)[0]
    expected_loss.backward()
    assert_close_fp32(loss, expected_loss)
    for name, p in model.named_parameters():
        assert_close_fp32(compact_grads[name], p.grad)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_random_masking_equals_per_sample_forwards(family):
    model = tiny_model(family)
    ids, labels, valid = make_batch()
    loss, _ = fast_loss(model, "random_masking", ids, labels, valid)
    total = 0.0
    for row, g in enumerate(gens(len(ids))):
        n = int(valid[row].sum())
        (t,), u, completion = row_mask(g, valid[row], labels[row])
        masked = (completion & (u < t))[:n]
        total = total - logp_full_attention(model, ids[row, :n].masked_fill(masked, MASK_ID), ids[row, :n], masked) / t
    n_items = (labels[:, 1:] if model.logits_shift else labels).ne(IGNORE_INDEX).sum()
    torch.testing.assert_close(loss, total / n_items, atol=1e-5, rtol=1e-5)


def test_semi_ar_equals_per_block_rows():
    model = tiny_model("llada")
    ids, labels, valid = make_batch()
    block_length = 3
    loss, batch = fast_loss(model, "semi_ar", ids, labels, valid, semi_ar_block_length=block_length)
    total, rows = 0.0, 0
    for row, g in enumerate(gens(len(ids))):
        n = int(valid[row].sum())
        completion = (labels[row] != IGNORE_INDEX)[:n]
        start = int(completion.nonzero()[0])
        n_blocks = -(-(n - start) // block_length)
        ratios, u = draw_noise(g, n_blocks, valid[row])
        ratios = mask_ratio(ratios, EPS)
        for b in range(n_blocks):
            lo, hi = start + b * block_length, start + (b + 1) * block_length
            noisy, masked = ids[row, :n].clone(), torch.zeros(n, dtype=torch.bool)
            for i in range(lo, n):
                if i < hi and u[i] < ratios[b]:
                    masked[i] = True
                if i >= hi or masked[i]:
                    noisy[i] = MASK_ID
            total = total - logp_full_attention(model, noisy, ids[row, :n], masked) / ratios[b]
            rows += 1
    assert batch.input_ids.shape[0] == rows
    torch.testing.assert_close(loss, total / (labels != IGNORE_INDEX).sum(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_complementary_scores_each_token_once_and_equals_reference(family):
    model = tiny_model(family)
    ids, labels, valid = make_batch()
    loss, batch = fast_loss(model, "complementary", ids, labels, valid)
    width = ids.shape[1]
    n_scorable = batch.targets.shape[1] - width if model.block_size else width  # [x_t | x_0]: the noisy part
    scored = batch.targets[:, :n_scorable] != IGNORE_INDEX
    # back to columns through the position ids (rows are right-padded: a token's position is its column)
    hits = torch.zeros(len(scored), width, dtype=torch.long).scatter_add_(1, batch.position_ids[:, :n_scorable],
                                                                        scored.long())
    completion = labels != IGNORE_INDEX
    assert torch.equal(hits.view(len(ids), 2, width).sum(1), completion.long())  # each token once per pair
    logp = logp_block_causal if model.block_size else logp_full_attention
    total = 0.0
    for row, g in enumerate(gens(len(ids))):
        n = int(valid[row].sum())
        (t,), u, completion = row_mask(g, valid[row], labels[row], high=1 - EPS)
        first = (completion & (u < t))[:n]
        second = completion[:n] & ~first
        for masked, ratio in ((first, t), (second, 1 - t)):
            noisy = ids[row, :n].masked_fill(masked, MASK_ID)
            total = total - logp(model, noisy, ids[row, :n], masked) / (2 * ratio)
    torch.testing.assert_close(loss, total / (labels != IGNORE_INDEX).sum(), atol=1e-5, rtol=1e-5)


def test_trajectory_reproduces_the_samplers_logprobs(family):
    """Re-scoring a fresh rollout on the states it visited gives back the sampler's own log-probs exactly."""
    model = tiny_model(family)
    prompts = [encode("What is 1+2?"), encode("Hey")]
    width = max(map(len, prompts))
    prompt_ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(prompt_ids, prompt_mask, max_new_tokens=8, block_length=4, denoising_steps=2,
                         temperature=1.0, stop_token_ids=[], return_dict_in_generate=True,
                         generator=torch.Generator().manual_seed(0))
    committed = out.unmask_step >= 0
    valid = committed.clone()
    valid[:, :width] = prompt_mask.bool()
    labels = torch.where(committed, out.sequences, IGNORE_INDEX)
    steps = step_groups(out.unmask_step, 1)
    states = trajectory_state_rows(out.sequences, committed, valid, steps, MASK_ID, model.block_size)
    assert states.input_ids.shape[0] == int(out.denoising_steps.sum())  # one row per visited state
    scores = score_tokens(model, states, model.logits_shift, MASK_ID)
    rows = torch.repeat_interleave(torch.arange(len(prompts)), out.denoising_steps)
    rescored = torch.zeros_like(out.token_logprobs).index_add_(0, rows, scores.log_probs.detach())
    assert int(scores.scored.sum()) == int(committed.sum())  # every committed token scored once
    assert_close_fp32(rescored, out.token_logprobs, committed)
    # the objective: for SDAR TraceRL's packed layout, one row per sample (clean sequence + a block copy per step)
    batch = build_objective("trajectory", out.sequences, labels, valid, [], mask_token_id=MASK_ID,
                            block_size=model.block_size, unmask_step=out.unmask_step)
    packed = scores if model.block_size is None else score_tokens(model, batch, model.logits_shift, MASK_ID)
    assert batch.input_ids.shape[0] == (len(prompts) if model.block_size else int(out.denoising_steps.sum()))
    assert int(packed.scored.sum()) == int(committed.sum())
    per_sample = packed.log_probs.sum(-1) if model.block_size else rescored.sum(-1)
    assert_close_fp32(per_sample, (out.token_logprobs * committed).sum(-1))


@pytest.mark.parametrize("shrinkage", [1, 2])
def test_packed_trajectory_equals_one_row_per_state(shrinkage):
    """SDAR's trajectory objective scores every token under the same state as the per-state rows: the same loss and
    gradient, from a packed row per sample instead of a whole row per step (rows right-padded as SFT collates).
    Steps out of block order (no block sampler's) keep the per-state rows, exact for any steps."""
    model = tiny_model("sdar").train()
    ids, labels, valid = make_batch()
    completion = labels != IGNORE_INDEX
    blocks = block_index(positions_from_padding(valid), 4)
    draw = torch.Generator().manual_seed(0)
    within = torch.randint(0, 3, ids.shape, generator=draw)  # blocks one after another, 1-3 steps each
    steps = torch.where(completion, blocks * 3 + within, -1)
    batch = build_objective("trajectory", ids, labels, valid, [], mask_token_id=MASK_ID, block_size=4,
                            unmask_step=steps, shrinkage=shrinkage)
    reference = trajectory_state_rows(ids, completion, valid, step_groups(steps, shrinkage, blocks), MASK_ID, 4)
    assert batch.input_ids.shape[0] == len(ids) < reference.input_ids.shape[0]
    # steps a block sampler never takes (a block still open after a later one started): one row per state
    shuffled = torch.where(completion, torch.randint(0, 6, ids.shape, generator=draw), -1)
    unordered = build_objective("trajectory", ids, labels, valid, [], mask_token_id=MASK_ID, block_size=4,
                                unmask_step=shuffled, shrinkage=shrinkage)
    expected = trajectory_state_rows(ids, completion, valid, step_groups(shuffled, shrinkage, blocks), MASK_ID, 4)
    assert torch.equal(unordered.input_ids, expected.input_ids)
    losses, gradients = [], []
    for scoring in (batch, reference):
        model.zero_grad()
        loss = diffusion_loss(model, scoring, int(completion.sum()), False, MASK_ID)[0]
        loss.backward()
        losses.append(loss)
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert_close_fp32(losses[0], losses[1])
    assert_close_fp32(gradients[0], gradients[1])


def test_trajectory_rows_are_the_states_before_each_step():
    ids = torch.tensor([[50, 51, 60, 61, 62, 63]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 60, 61, 62, 63]])
    steps = torch.tensor([[-1, -1, 1, 0, 2, 1]])
    batch = build_objective("trajectory", ids, labels, torch.ones_like(ids).bool(), [], mask_token_id=MASK_ID,
                            block_size=None, unmask_step=steps, shrinkage=1)
    m = MASK_ID
    assert batch.input_ids.tolist() == [[50, 51, m, m, m, m], [50, 51, m, 61, m, m], [50, 51, 60, 61, m, 63]]
    assert (batch.targets != IGNORE_INDEX).tolist() == [[0, 0, 0, 1, 0, 0], [0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 1, 0]]
    merged = build_objective("trajectory", ids, labels, torch.ones_like(ids).bool(), [], mask_token_id=MASK_ID,
                             block_size=None, unmask_step=steps, shrinkage=2)
    assert merged.input_ids.tolist() == [[50, 51, m, m, m, m], [50, 51, 60, 61, m, 63]]


def test_trajectory_shrinkage_merges_within_blocks_for_block_models():
    """Block models merge steps inside a block only (as TraceRL scores them); full attention merges globally."""
    ids = torch.tensor([[50, 51, 60, 61, 62, 63]])
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 60, 61, 62, 63]])
    steps = torch.tensor([[-1, -1, 0, 0, 1, 2]])  # block 1 (cols 2-3) at step 0; block 2 at steps 1 and 2
    m = MASK_ID

    def states(block_size):
        valid = torch.ones_like(ids).bool()
        blocks = block_index(positions_from_padding(valid), block_size) if block_size else None
        groups = step_groups(steps, 2, blocks)
        rows = trajectory_state_rows(ids, labels != IGNORE_INDEX, valid, groups, MASK_ID, block_size)
        return rows.input_ids.tolist()

    assert states(2) == [[50, 51, m, m, m, m], [50, 51, 60, 61, m, m]]
    assert states(None) == [[50, 51, m, m, m, m], [50, 51, 60, 61, 62, m]]


@pytest.mark.parametrize("objective,family", [("block", "sdar"), ("random_masking", "llada"), ("semi_ar", "dream"),
                                              ("complementary", "llada"), ("complementary", "sdar")])
def test_prompt_and_padding_are_never_masked_or_scored(objective, family):
    model = tiny_model(family)
    ids, labels, valid = make_batch(extra_pad=3)
    batch = build_objective(objective, ids, labels, valid, gens(len(ids)), mask_token_id=MASK_ID,
                            block_size=model.block_size, semi_ar_block_length=4)
    width = ids.shape[1]
    layout = model.block_size is not None  # [x_t | x_0]: the noisy copy holds the blocks with a masked token
    n_noisy = batch.input_ids.shape[1] - width if layout else width
    assert not layout or n_noisy < width  # prompt-only blocks need no noisy copy
    for r in range(batch.input_ids.shape[0]):
        noisy, targets, weights = batch.input_ids[r, :n_noisy], batch.targets[r, :n_noisy], batch.weights[r, :n_noisy]
        if layout:  # the built noisy tokens, and their columns (rows are right-padded: position = column)
            built = batch.layout.valid[r, :n_noisy]
            noisy, targets, weights = noisy[built], targets[built], weights[built]
            cols = batch.position_ids[r, :n_noisy][built]
            source = next(i for i in range(len(ids)) if torch.equal(batch.input_ids[r, n_noisy:], ids[i]))
        else:  # the sample this row comes from: the one it agrees with off the masked positions
            cols = torch.arange(width)
            source = next(i for i in range(len(ids)) if torch.equal(noisy[noisy != MASK_ID], ids[i][noisy != MASK_ID]))
        hidden = noisy == MASK_ID
        assert torch.equal(noisy[~hidden], ids[source, cols][~hidden])
        not_completion = labels[source, cols] == IGNORE_INDEX
        assert not (hidden & not_completion).any(), "a prompt or padding position was masked"
        assert (targets[not_completion] == IGNORE_INDEX).all() and (weights[not_completion] == 0).all()
        if layout:  # the clean copy is context only
            assert (batch.targets[r, n_noisy:] == IGNORE_INDEX).all()
    # padding keys are hidden from every real query
    if batch.layout is not None:
        mask = batch.layout.dense()[0, 0]
        real_queries = valid[0].nonzero().flatten() + (n_noisy if layout else 0)
        pad_keys = (~valid[0]).nonzero().flatten() + (n_noisy if layout else 0)
        assert not mask[real_queries][:, pad_keys].any()


def test_padding_does_not_change_the_loss_and_eos_padding_is_trained():
    model = tiny_model("llada")
    loss, _ = fast_loss(model, "random_masking", *make_batch())
    padded, _ = fast_loss(model, "random_masking", *make_batch(extra_pad=5))
    assert_close_fp32(padded, loss)  # padding changes the kernels' shapes, so not bit-identical

    examples = [{"input_ids": encode(p) + encode(c), "labels": [IGNORE_INDEX] * len(encode(p)) + encode(c),
                 "sample_index": i} for i, (p, c) in enumerate(PAIRS)]
    base = DiffusionDataCollatorBase()
    plain = DiffusionDataCollator(base, MASK_ID, EOS_ID, None)(examples)
    eos = DiffusionDataCollator(base, MASK_ID, EOS_ID, 32)(examples)
    assert eos["input_ids"].shape[1] == 32 and eos["attention_mask"].all()
    pad_positions = plain["attention_mask"] == 0
    assert (plain["labels"][pad_positions] == IGNORE_INDEX).all()
    tail = eos["labels"][:, plain["input_ids"].shape[1] :]
    assert (tail == EOS_ID).all()  # the EOS padding is a training target
    assert count_loss_tokens(eos["labels"]) > count_loss_tokens(plain["labels"])
    assert eos["sample_index"].tolist() == [0, 1, 2]


def DiffusionDataCollatorBase():
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return DataCollatorForLanguageModeling(pad_token_id=EOS_ID)


def test_noise_depends_only_on_sample_and_epoch():
    ids, labels, valid = make_batch()
    kw = dict(mask_token_id=MASK_ID, block_size=None)
    full = build_objective("random_masking", ids, labels, valid, gens(3), **kw)
    for i in range(3):
        n = int(valid[i].sum())
        alone = build_objective("random_masking", ids[i : i + 1, :n], labels[i : i + 1, :n], valid[i : i + 1, :n],
                                sample_generators([i], 0, 0), **kw)
        assert torch.equal(alone.input_ids[0], full.input_ids[i, :n])
    other_epoch = build_objective("random_masking", ids, labels, valid, gens(3, epoch=1), **kw)
    assert not torch.equal(other_epoch.input_ids, full.input_ids)


# ------------------------------------------------------------------------------------------------- trainer


def config(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path), report_to=[], bf16=False, gradient_checkpointing=False,
                    save_strategy="no", logging_steps=1, use_cpu=True, max_length=64, disable_tqdm=True,
                    per_device_train_batch_size=4, max_steps=1, learning_rate=1e-3)
    return DiffusionSFTConfig(**{**defaults, **kw})


def conversational(pairs=PAIRS):
    return Dataset.from_list([{"prompt": [{"role": "user", "content": p.strip()}],
                               "completion": [{"role": "assistant", "content": c}]} for p, c in pairs])


def fresh(family, seed=0, **overrides):
    torch.manual_seed(seed)
    if family == "sdar":
        return SDARForCausalLM(tiny_sdar_config(**overrides))
    return LLaDAModelLM(tiny_llada_config(**overrides))


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    """1 x batch 4 and 4 x batch 1 take the same SGD step and log the same loss, which is the pure-function loss
    normalised by every completion token (not TRL's causal count)."""
    data = conversational(PAIRS + [("What is 3+4?", "\\boxed{7}")])
    deltas, losses = [], []
    for batch_size, accumulation in ((4, 1), (1, 4)):
        model = fresh("sdar")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = DiffusionSFTTrainer(model, args=config(tmp_path, per_device_train_batch_size=batch_size,
                                                         gradient_accumulation_steps=accumulation, optim="sgd",
                                                         learning_rate=0.5, max_grad_norm=0.0),
                                      train_dataset=data, processing_class=TOKENIZER)
        if batch_size == 4:
            inputs = next(iter(trainer.get_train_dataloader()))
            model.eval()
            gens_ = sample_generators(inputs["sample_index"].tolist(), trainer.args.seed, 0)
            with torch.no_grad():
                expected, _ = fast_loss(model, "block", inputs["input_ids"], inputs["labels"],
                                        inputs["attention_mask"].bool(), generators=gens_)
            model.train()
        trainer.train()
        losses.append(trainer.state.log_history[0]["loss"])
        deltas.append(torch.cat([(p.detach() - before[n]).flatten() for n, p in model.named_parameters()]))
    assert deltas[0].abs().max() > 1e-4
    torch.testing.assert_close(deltas[0], deltas[1], atol=1e-5, rtol=1e-4)
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    assert losses[0] == pytest.approx(float(expected), rel=1e-4)


@pytest.mark.parametrize("fmt", ["prompt_completion", "text", "messages_assistant_only"])
def test_trl_dataset_formats_train(tmp_path, fmt):
    tokenizer = build_tokenizer()
    kw = {}
    if fmt == "prompt_completion":
        data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in PAIRS])
    elif fmt == "text":
        data = Dataset.from_list([{"text": p + c} for p, c in PAIRS])
    else:
        tokenizer.chat_template = ASSISTANT_TEMPLATE
        data = Dataset.from_list([{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c},
                                                {"role": "user", "content": "ok"}, {"role": "assistant",
                                                                                    "content": "yes"}]}
                                  for p, c in PAIRS])
        kw.update(assistant_only_loss=True, max_length=128)
    trainer = DiffusionSFTTrainer(fresh("llada"), args=config(tmp_path, **kw), train_dataset=data,
                                  eval_dataset=data, processing_class=tokenizer)
    row = trainer.train_dataset[0]
    scored = [t for t, lab in zip(row["input_ids"], row["labels"]) if lab != IGNORE_INDEX]
    text = tokenizer.decode(scored)
    if fmt == "prompt_completion":
        assert text == PAIRS[0][1] + tokenizer.eos_token  # completion only, prompt never scored
    elif fmt == "text":
        assert text.startswith(PAIRS[0][0])  # language modelling: everything is scored
    else:
        assert text == PAIRS[0][1] + "<|im_end|>" + "yes<|im_end|>"  # only the assistant turns
    trainer.train()
    assert trainer.state.log_history[0]["loss"] > 0
    assert trainer.evaluate()["eval_loss"] > 0


ASSISTANT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_trajectory_objective_trains_from_an_unmask_step_column(tmp_path):
    rows = [{"prompt": p, "completion": c, "unmask_step": list(reversed(range(len(encode(c)) + 1)))}
            for p, c in PAIRS]
    trainer = DiffusionSFTTrainer(fresh("sdar"), args=config(tmp_path, diffusion_objective="trajectory"),
                                  train_dataset=Dataset.from_list(rows), processing_class=TOKENIZER)
    row = trainer.train_dataset[0]
    completion = [s for s, lab in zip(row["unmask_step"], row["labels"]) if lab != IGNORE_INDEX]
    assert completion == rows[0]["unmask_step"] and row["unmask_step"][0] == -1
    trainer.train()
    bad = [{**rows[0], "unmask_step": [0, 1]}]
    with pytest.raises(ValueError, match="unmask_step"):
        DiffusionSFTTrainer(fresh("sdar"), args=config(tmp_path, diffusion_objective="trajectory"),
                            train_dataset=Dataset.from_list(bad), processing_class=TOKENIZER)


def overfit(tmp_path, family, steps, **kw):
    pairs = [("What is 1+2?", "\\boxed{3}"), ("What is 9-4?", "\\boxed{5}"), ("What is 7+7?", "\\boxed{14}"),
             ("What is 8-1?", "\\boxed{7}")]
    model = fresh(family)
    args = config(tmp_path, max_steps=steps, learning_rate=3e-3, lr_scheduler_type="constant", logging_steps=10,
                  **kw)
    trainer = DiffusionSFTTrainer(model, args=args, train_dataset=conversational(pairs), processing_class=TOKENIZER)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return model, pairs, losses


def test_tiny_sdar_overfits_and_recalls_under_greedy_generate(tmp_path):
    from trl_diffusion.data.arithmetic import generate_completions

    model, pairs, losses = overfit(tmp_path, "sdar", 100)
    assert losses[-1] < 0.2 * losses[0]
    completions = generate_completions(model, TOKENIZER, [p for p, _ in pairs], max_new_tokens=12)
    assert completions == [c for _, c in pairs]


def test_tiny_llada_loss_falls(tmp_path):
    _, _, losses = overfit(tmp_path, "llada", 40)
    assert losses[-1] < 0.75 * losses[0]


def test_lora_trains_only_the_adapters(tmp_path):
    from peft import LoraConfig

    model = fresh("sdar")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DiffusionSFTTrainer(model, args=config(tmp_path, max_steps=2, learning_rate=1e-2),
                                  train_dataset=conversational(), processing_class=TOKENIZER,
                                  peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    trainer.train()
    changed = [n for n, p in trainer.model.named_parameters() if "lora_B" in n
               and not torch.equal(p.detach(), torch.zeros_like(p))]
    assert changed
    base = trainer.model.get_base_model()
    for name, param in base.named_parameters():
        if "lora_" not in name:
            key = name.replace(".base_layer", "")
            assert torch.equal(param.detach(), before[key]), name
    assert trainer.state.log_history[0]["loss"] > 0


def test_bf16_training_saves_a_loadable_model_with_a_model_card(tmp_path):
    trainer = DiffusionSFTTrainer(fresh("llada"), args=config(tmp_path, bf16=True, max_steps=2, logging_steps=1),
                                  train_dataset=conversational(), processing_class=TOKENIZER)
    trainer.train()
    assert all(math.isfinite(h["loss"]) for h in trainer.state.log_history if "loss" in h)
    trainer.save_model(str(tmp_path / "out"))
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "diffusion" in card and "trl-diffusion" in card
    reloaded = LLaDAModelLM.from_pretrained(str(tmp_path / "out"))
    assert reloaded.mask_token_id == MASK_ID


# -------------------------------------------------------------------------------------------------- errors


def test_clear_errors(tmp_path):
    data = conversational()
    with pytest.raises(ValueError, match="none of which SFT can train on"):
        DiffusionSFTTrainer(fresh("sdar"), args=config(tmp_path), train_dataset=Dataset.from_list([{"question": "x"}]),
                            processing_class=TOKENIZER)
    with pytest.raises(ValueError, match="unmask_step"):
        DiffusionSFTTrainer(fresh("sdar"), args=config(tmp_path, diffusion_objective="trajectory"),
                            train_dataset=data, processing_class=TOKENIZER)
    with pytest.raises(ValueError, match="max_length=8"):
        DiffusionSFTTrainer(fresh("sdar"), args=config(tmp_path, max_length=8, overlong_policy="error"),
                            train_dataset=data, processing_class=TOKENIZER)
    no_mask = build_tokenizer()
    no_mask.mask_token = None
    with pytest.raises(ValueError, match="no mask token"):  # and the model's mask id is not one of its tokens
        DiffusionSFTTrainer(fresh("sdar", mask_token_id=len(no_mask)), args=config(tmp_path), train_dataset=data,
                            processing_class=no_mask)
    with pytest.raises(ValueError, match="mask token id"):
        DiffusionSFTTrainer(fresh("sdar", mask_token_id=MASK_ID + 1), args=config(tmp_path), train_dataset=data,
                            processing_class=TOKENIZER)
    with pytest.raises(ValueError, match="needs a block-causal model"):
        DiffusionSFTTrainer(fresh("llada"), args=config(tmp_path, diffusion_objective="block"), train_dataset=data,
                            processing_class=TOKENIZER)
    for objective in ("random_masking", "semi_ar"):
        with pytest.raises(ValueError, match="full-attention models"):
            DiffusionSFTTrainer(fresh("sdar"), args=config(tmp_path, diffusion_objective=objective),
                                train_dataset=data, processing_class=TOKENIZER)
    with pytest.raises(ValueError, match="packed rows train with"):
        config(tmp_path, packing=True, diffusion_objective="semi_ar")
    with pytest.raises(ValueError, match="pad_to_length_with_eos"):
        config(tmp_path, pad_to_length_with_eos=True, max_length=None)


def test_truncation_and_defaults(tmp_path):
    trainer = DiffusionSFTTrainer(fresh("sdar"), args=config(tmp_path, max_length=30), train_dataset=conversational(),
                                  processing_class=TOKENIZER)
    assert trainer.objective == "block"
    assert max(len(r["input_ids"]) for r in trainer.train_dataset) == 30
    plain_args = SFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, bf16=False)
    trainer = DiffusionSFTTrainer(fresh("llada"), args=plain_args, train_dataset=conversational(),
                                  processing_class=TOKENIZER)
    assert trainer.objective == "random_masking" and isinstance(trainer.args, DiffusionSFTConfig)
    eos = DiffusionSFTTrainer(fresh("llada"), args=config(tmp_path, pad_to_length_with_eos=True, max_length=48),
                              train_dataset=conversational(), processing_class=TOKENIZER)
    batch = next(iter(eos.get_train_dataloader()))
    assert batch["input_ids"].shape[1] == 48 and batch["attention_mask"].all()
    assert (batch["labels"][:, -1] == EOS_ID).all()
    # LLaDA's SFT pads its mini-batch with EOS to the batch's longest sequence, not to a fixed length
    longest = DiffusionSFTTrainer(fresh("llada"), args=config(tmp_path, pad_to_length_with_eos=True, max_length=None,
                                                              eos_padding_length="longest"),
                                  train_dataset=conversational(), processing_class=TOKENIZER)
    rows = [longest.train_dataset[i]["input_ids"] for i in range(len(longest.train_dataset))]
    batch = longest.data_collator([longest.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[1] == max(len(ids) for ids in rows[:2]) and batch["attention_mask"].all()
    short = min(range(2), key=lambda i: len(rows[i]))
    assert len(rows[0]) != len(rows[1]) and (batch["labels"][short, len(rows[short]):] == EOS_ID).all()
    with pytest.raises(ValueError, match="eos_padding_length='longest' applies to pad_to_length_with_eos=True"):
        config(tmp_path, eos_padding_length="longest")
    wide = fresh("sdar")
    DiffusionSFTTrainer(wide, args=config(tmp_path, block_size=8), train_dataset=conversational(),
                        processing_class=TOKENIZER)
    assert wide.block_size == 8


def test_dft_loss_weights_each_token_by_its_detached_probability(family):
    """``loss_type="dft"`` (SFTConfig's Dynamic Fine-Tuning): each scored token's loss times its own probability,
    detached. Value ``sum(w p (-log p)) / n`` and gradient ``sum(w p (-grad log p)) / n`` against the NLL path's
    scores (a probability left attached would change the gradient, not the value)."""
    model = tiny_model(family)
    ids, labels, valid = make_batch()
    batch = build_objective("block" if model.block_size else "random_masking", ids, labels, valid, gens(len(ids)),
                            mask_token_id=MASK_ID, block_size=model.block_size)
    shift, params = model.logits_shift, [p for p in model.parameters() if p.requires_grad]
    normaliser = count_loss_tokens(labels, shift)
    dft, _ = diffusion_loss(model, batch, normaliser, shift, MASK_ID, loss_type="dft")
    nll, scores = diffusion_loss(model, batch, normaliser, shift, MASK_ID)
    expected = (-scores.log_probs * batch.weights * scores.log_probs.detach().exp()).sum() / normaliser
    assert_close_fp32(dft, expected)
    assert dft.item() < nll.item()  # every probability is below 1
    for got, want in zip(torch.autograd.grad(dft, params, allow_unused=True),
                         torch.autograd.grad(expected, params, allow_unused=True)):
        if want is not None:
            assert_close_fp32(got, want)
    with pytest.raises(ValueError, match="unknown loss_type 'focal'"):
        diffusion_loss(model, batch, normaliser, shift, MASK_ID, loss_type="focal")
