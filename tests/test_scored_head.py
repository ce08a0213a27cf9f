"""The LM head runs only where a token is scored, and the packed layouts are built without a per-row loop: every
estimator, SFT objective and the value model give the same numbers (values and gradients) as the slow reference
kept here (the whole-row head and the per-row Python builder the package used before), for all three families."""

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trl_diffusion.estimators import (
    EstimatorSettings,
    ScoringChunk,
    build_scoring_chunks,
    estimate_logprobs,
    likelihood,
    step_groups,
)
from trl_diffusion.generation import sampling
from trl_diffusion.generation.sampling import sampling_logits, target_scores
from trl_diffusion.states import (
    CLEAN,
    NOT_COMMITTED,
    AttentionLayout,
    block_index,
    completion_blocks,
    positions_from_padding,
    state_before_step,
)
from trl_diffusion.testing import EOS_ID, MASK_ID, tiny_model
from trl_diffusion.trainers.diffusion_losses import (
    IGNORE_INDEX,
    build_objective,
    count_loss_tokens,
    diffusion_loss,
    sample_generators,
)
from trl_diffusion.value import DiffusionValueModel
from trl_diffusion.value.value_model import token_values

ROOT = Path(__file__).parent.parent
PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]


# ------------------------------------------------------------------------------------------------------------
# The slow references: the package's code before the scored-positions-only head and the vectorised builder
# ------------------------------------------------------------------------------------------------------------


def reference_chunks(prompt_ids, prompt_mask, completion_ids, groups, mask_token_id, block_size, token_budget=None,
                     pad_token_id=0, scored=None, prompt_noise=None, completion_mask=None):
    """One row at a time in Python: ``[prompt | whole clean completion | a copy of its block per live group]``
    (block-causal) or one whole row per live group (full attention), then greedy chunking."""
    batch, prompt_width = prompt_ids.shape
    if prompt_noise is not None:
        prompt_ids = prompt_ids.masked_fill(prompt_noise.bool() & prompt_mask.bool(), mask_token_id)
    if scored is None:
        scored = groups >= 0
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    canvas = torch.ones_like(completion_ids, dtype=torch.bool) if completion_mask is None else completion_mask.bool()
    valid = torch.cat([prompt_mask.bool(), canvas], dim=1)  # a row's own canvas only
    generated = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool),
                           torch.ones_like(completion_ids, dtype=torch.bool)], dim=1)
    full_groups = torch.cat([torch.full_like(prompt_ids, NOT_COMMITTED), groups], dim=1)
    full_scored = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool), scored.bool() & (groups >= 0)], dim=1)
    positions = positions_from_padding(valid)
    rows = []
    for r in range(batch):
        keep = valid[r]
        r_ids, r_pos, r_gen, r_groups = ids[r][keep], positions[r][keep], generated[r][keep], full_groups[r][keep]
        r_scored = full_scored[r][keep]
        completion_start = int(keep[:prompt_width].sum())  # the kept prompt columns
        n_groups = int(r_groups.max()) + 1 if bool((r_groups >= 0).any()) else 0
        if n_groups == 0 or not bool(r_scored.any()):
            continue
        live = [g for g in range(n_groups) if bool((r_scored & (r_groups == g)).any())]
        if block_size is None:
            for g in live:
                state = state_before_step(r_ids[None], r_groups[None], r_gen[None], g, mask_token_id)[0]
                targets = (r_scored & (r_groups == g)).nonzero().squeeze(-1)
                rows.append((state, r_pos, torch.zeros_like(r_pos), torch.full_like(r_pos, CLEAN), targets, r,
                             targets - completion_start))
            continue
        blocks = block_index(r_pos, block_size)
        p_ids, p_pos, p_block, p_copy = [r_ids], [r_pos], [blocks], [torch.full_like(r_pos, CLEAN)]
        targets, source = [], []
        cursor = len(r_ids)
        for g in live:
            in_group = r_scored & (r_groups == g)
            cols = (blocks == int(blocks[in_group][0])).nonzero().squeeze(-1)
            p_ids.append(state_before_step(r_ids[None], r_groups[None], r_gen[None], g, mask_token_id)[0][cols])
            p_pos.append(r_pos[cols])
            p_block.append(blocks[cols])
            p_copy.append(torch.full_like(cols, len(p_copy) - 1))
            local = in_group[cols].nonzero().squeeze(-1)
            targets.append(cursor + local)
            source.append(cols[local] - completion_start)
            cursor += len(cols)
        rows.append((torch.cat(p_ids), torch.cat(p_pos), torch.cat(p_block), torch.cat(p_copy), torch.cat(targets),
                     r, torch.cat(source)))
    chunks, current = [], []

    def flush():
        if not current:
            return
        width, n = max(len(row[0]) for row in current), len(current)
        t = {"ids": torch.full((n, width), pad_token_id), "pos": torch.zeros(n, width, dtype=torch.long),
             "block": torch.zeros(n, width, dtype=torch.long), "copy": torch.full((n, width), CLEAN),
             "valid": torch.zeros(n, width, dtype=torch.bool)}
        where = {"chunk_row": [], "chunk_col": [], "source_row": [], "source_col": []}
        for i, (r_ids, r_pos, r_block, r_copy, targets, r, source) in enumerate(current):
            length = len(r_ids)
            t["ids"][i, :length], t["pos"][i, :length], t["block"][i, :length] = r_ids, r_pos, r_block
            t["copy"][i, :length], t["valid"][i, :length] = r_copy, True
            where["chunk_row"].append(torch.full_like(targets, i))
            where["chunk_col"].append(targets)
            where["source_row"].append(torch.full_like(targets, r))
            where["source_col"].append(source)
        chunks.append(ScoringChunk(
            t["ids"], t["pos"], AttentionLayout(t["block"], t["copy"], t["valid"]),
            *(torch.cat(where[k]) for k in ("chunk_row", "chunk_col", "source_row", "source_col"))))
        current.clear()

    for row in rows:
        size = (len(current) + 1) * max(len(r[0]) for r in [*current, row])
        if current and token_budget is not None and size > token_budget:
            flush()
        current.append(row)
    flush()
    return chunks


def reference_score_chunks(model, chunks, completion_ids, settings, compute_entropy):
    """Logits over every position of every packed row, then the targets picked out."""
    logps = torch.zeros(completion_ids.shape, dtype=torch.float32)
    entropies = torch.zeros_like(logps) if compute_entropy else None
    shift = 1 if model.logits_shift else 0
    for chunk in chunks:
        logits = model(input_ids=chunk.input_ids, attention_mask=chunk.layout.dense(),
                       position_ids=chunk.position_ids).logits
        log_dist = sampling_logits(logits[chunk.chunk_row, chunk.chunk_col - shift], settings.temperature,
                                   settings.top_k, settings.top_p, model.mask_token_id).log_softmax(-1)
        targets = completion_ids[chunk.source_row, chunk.source_col]
        logps = logps.index_put((chunk.source_row, chunk.source_col), log_dist.gather(-1, targets[:, None])[:, 0])
        if compute_entropy:
            probs = log_dist.exp()
            ent = -(probs * log_dist.masked_fill(probs == 0, 0.0)).sum(-1)
            entropies = entropies.index_put((chunk.source_row, chunk.source_col), ent)
    return logps, entropies


def reference_score_tokens(model, batch, logits_shift, mask_token_id):
    """SFT scoring with the whole-row head: log-prob, entropy and top-1 at every scored position."""
    mask = batch.layout.dense() if batch.layout is not None else None
    logits = model(input_ids=batch.input_ids, attention_mask=mask, position_ids=batch.position_ids).logits
    scored = batch.targets != IGNORE_INDEX
    if logits_shift:
        scored[:, 0] = False
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
    log_dist = sampling_logits(logits[scored], mask_token_id=mask_token_id).log_softmax(-1)
    picked = log_dist.gather(-1, batch.targets[scored][:, None])[:, 0]
    entropy = -(log_dist.exp() * log_dist.clamp(min=torch.finfo(log_dist.dtype).min)).sum(-1)
    top1 = log_dist.argmax(-1) == batch.targets[scored]
    return scored, picked, entropy.detach(), top1


# ------------------------------------------------------------------------------------------------------------
# Inputs
# ------------------------------------------------------------------------------------------------------------


def rollout(model, seed=0, max_new_tokens=12):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    out = model.generate(ids, mask, max_new_tokens=max_new_tokens, block_length=4, denoising_steps=2,
                         temperature=1.0, stop_token_ids=[], return_dict_in_generate=True,
                         generator=torch.Generator().manual_seed(seed))
    return ids, mask, out.sequences[:, width:], out.unmask_step[:, width:]


def random_case(generator, block_size):
    """Random left-padded prompts, a canvas and a trajectory in which some columns (often a tail) were never
    committed; ``groups`` as the trajectory estimator merges them."""
    batch = int(torch.randint(1, 5, (1,), generator=generator))
    prompt_width, canvas = int(torch.randint(1, 8, (1,), generator=generator)), int(torch.randint(1, 14, (1,),
                                                                                                  generator=generator))
    lengths = torch.randint(1, prompt_width + 1, (batch,), generator=generator)
    prompt_mask = (torch.arange(prompt_width)[None] >= prompt_width - lengths[:, None]).long()
    prompt_ids = torch.randint(10, 100, (batch, prompt_width), generator=generator) * prompt_mask
    completion = torch.randint(10, 100, (batch, canvas), generator=generator)
    steps = torch.randint(0, 6, (batch, canvas), generator=generator)
    tail = torch.randint(0, canvas + 1, (batch, 1), generator=generator)
    holes = torch.rand(batch, canvas, generator=generator) < 0.2
    steps = torch.where((torch.arange(canvas)[None] >= tail) | holes, -1, steps)
    shrinkage = int(torch.randint(1, 3, (1,), generator=generator))
    blocks = completion_blocks(prompt_mask, canvas, block_size)
    groups = step_groups(steps, shrinkage, blocks)
    scored = torch.rand(batch, canvas, generator=generator) < 0.7
    return prompt_ids, prompt_mask, completion, groups, scored


def grads(model):
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(new, old):
    assert new.keys() == old.keys() and new
    for name in old:
        torch.testing.assert_close(new[name], old[name], rtol=1e-4, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------------------


def test_logits_to_keep_selects_positions_of_the_full_output(family):
    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        rows, cols = torch.tensor([1, 0, 1]), torch.tensor([2, 8, 0])
        torch.testing.assert_close(model(input_ids=ids, logits_to_keep=(rows, cols)).logits, full[rows, cols])
        keep = torch.rand(2, 9, generator=torch.Generator().manual_seed(1)) < 0.5
        torch.testing.assert_close(model(input_ids=ids, logits_to_keep=keep).logits, full[keep])
        torch.testing.assert_close(model(input_ids=ids, logits_to_keep=3).logits, full[:, -3:])
        torch.testing.assert_close(model(input_ids=ids, logits_to_keep=torch.tensor([4, 1])).logits, full[:, [4, 1]])
    with pytest.raises(ValueError, match="labels"):
        model(input_ids=ids, labels=ids, logits_to_keep=keep)


def test_vectorised_builder_equals_the_per_row_loop_for_full_attention():
    """Full attention: same rows, positions, layouts and targets as the per-row loop (nothing is trimmed)."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(60):
        prompt_ids, prompt_mask, completion, groups, scored = random_case(generator, None)
        budget = [None, 16, 40][int(torch.randint(0, 3, (1,), generator=generator))]
        new = build_scoring_chunks(prompt_ids, prompt_mask, completion, groups, MASK_ID, None, budget, 7, scored)
        old = reference_chunks(prompt_ids, prompt_mask, completion, groups, MASK_ID, None, budget, 7, scored)
        assert len(new) == len(old)
        for a, b in zip(new, old):
            for field in ("input_ids", "position_ids", "chunk_row", "chunk_col", "source_row", "source_col"):
                assert torch.equal(getattr(a, field), getattr(b, field)), field
            for field in ("block", "copy", "valid"):
                assert torch.equal(getattr(a.layout, field), getattr(b.layout, field)), field


def test_vectorised_builder_keeps_each_copy_and_trims_only_unseen_clean_blocks():
    """Block-causal: the copies and their targets are the per-row loop's exactly; the clean part ends where the
    last copy's block starts (later clean tokens are seen by nothing scored)."""
    generator = torch.Generator().manual_seed(1)
    trimmed = 0
    for _ in range(60):
        prompt_ids, prompt_mask, completion, groups, scored = random_case(generator, 4)
        new = build_scoring_chunks(prompt_ids, prompt_mask, completion, groups, MASK_ID, 4, None, 7, scored)
        old = reference_chunks(prompt_ids, prompt_mask, completion, groups, MASK_ID, 4, None, 7, scored)
        assert len(new) == len(old) <= 1
        if not new:
            continue
        a, b = new[0], old[0]
        assert torch.equal(a.source_row, b.source_row) and torch.equal(a.source_col, b.source_col)
        for row in range(a.input_ids.shape[0]):
            copies_a, copies_b = a.layout.copy[row] != CLEAN, b.layout.copy[row] != CLEAN
            for field in ("input_ids", "position_ids"):
                assert torch.equal(getattr(a, field)[row][copies_a], getattr(b, field)[row][copies_b])
            assert torch.equal(a.layout.copy[row][copies_a], b.layout.copy[row][copies_b])
            clean_a = a.layout.valid[row] & ~copies_a
            clean_b = b.layout.valid[row] & ~copies_b
            n_clean = int(clean_a.sum())
            last_copy_block = int(a.layout.block[row][copies_a].max())
            expected = min(int(clean_b.sum()), last_copy_block * 4)
            assert n_clean == expected
            assert torch.equal(a.input_ids[row][clean_a], b.input_ids[row][clean_b][:n_clean])
            trimmed += int(clean_b.sum()) - n_clean
    assert trimmed > 0


def score_in_pieces(monkeypatch, piece_rows, vocab):
    """Make ``target_scores`` work on pieces of ``piece_rows`` positions (None: the default, one piece here)."""
    if piece_rows is not None:
        monkeypatch.setattr(sampling, "SCORING_PIECE_ELEMENTS", piece_rows * vocab)


@pytest.mark.parametrize("piece_rows", [None, 3])
@pytest.mark.parametrize("name", ["trajectory", "random_masking", "coupled", "mean_field"])
def test_estimators_equal_the_whole_row_head(family, name, piece_rows, monkeypatch):
    """log-probs, entropies and gradients through the scored-positions head and the vectorised layouts equal the
    whole-row head over the per-row layouts (float64 weights; the head's log-softmax runs in float32 in both),
    also when the float32 scoring runs in pieces of 3 positions, recomputed in the backward pass."""
    model = tiny_model(family).double()
    score_in_pieces(monkeypatch, piece_rows, model.config.vocab_size)
    ids, mask, completion, steps = rollout(model)
    steps[0, -4:] = -1  # an uncommitted tail: its clean block is trimmed from the packed row
    settings = EstimatorSettings(name=name, block_size=4, token_budget=80, temperature=0.9, top_k=50)
    seeds = torch.tensor([3, 4, 5])
    weights = torch.rand(completion.shape, generator=torch.Generator().manual_seed(0))
    results = []
    for reference in (False, True):
        if reference:
            monkeypatch.setattr(likelihood, "build_scoring_chunks", reference_chunks)
            monkeypatch.setattr(likelihood, "score_chunks", reference_score_chunks)
        model.zero_grad(set_to_none=True)
        logps, entropies, scored = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds, True)
        (logps * weights).sum().backward()
        results.append((logps.detach(), entropies.detach(), scored, grads(model)))
    (new, new_ent, new_scored, new_grads), (old, old_ent, old_scored, old_grads) = results
    assert torch.equal(new_scored, old_scored) and bool(new_scored.any())
    torch.testing.assert_close(new, old, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new_ent, old_ent, rtol=1e-5, atol=1e-6)
    assert_same_grads(new_grads, old_grads)


def test_the_head_sees_only_the_scored_positions(family):
    """The vocabulary-wide head gets one row per target, not every position of the packed rows."""
    model = tiny_model(family)
    ids, mask, completion, steps = rollout(model)
    seen = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, args, out: seen.append(args[0].shape))
    try:
        with torch.no_grad():
            _, _, scored = estimate_logprobs(model, ids, mask, completion, steps, EstimatorSettings(block_size=4))
    finally:
        handle.remove()
    assert sum(s[0] for s in seen) == int(scored.sum())
    assert all(len(s) == 2 for s in seen)


def sft_rows():
    rows = [([20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, EOS_ID]), ([40, 41], [50, 51, 52, 53, 54, EOS_ID])]
    width = max(len(p) + len(c) for p, c in rows) + 2
    ids, labels = torch.full((2, width), EOS_ID), torch.full((2, width), -100)
    valid = torch.zeros((2, width), dtype=torch.bool)
    steps = torch.full((2, width), -1)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        valid[i, : len(p) + len(c)] = True
        steps[i, len(p) : len(p) + len(c)] = torch.arange(len(c)) // 2
    return ids, labels, valid, steps


SFT_CASES = [("sdar", "block"), ("sdar", "complementary"), ("sdar", "trajectory"), ("llada", "random_masking"),
             ("llada", "semi_ar"), ("llada", "complementary"), ("llada", "trajectory"), ("dream", "random_masking"),
             ("dream", "semi_ar"), ("dream", "complementary"), ("dream", "trajectory")]


@pytest.mark.parametrize("piece_rows", [None, 3])
@pytest.mark.parametrize(("family", "objective"), SFT_CASES)
def test_sft_objectives_equal_the_whole_row_head(family, objective, piece_rows, monkeypatch):
    model = tiny_model(family).double()
    score_in_pieces(monkeypatch, piece_rows, model.config.vocab_size)
    ids, labels, valid, steps = sft_rows()
    batch = build_objective(objective, ids, labels, valid, sample_generators([0, 1], 0, 0), mask_token_id=MASK_ID,
                            block_size=model.block_size, semi_ar_block_length=4, unmask_step=steps, shrinkage=1)
    normaliser = count_loss_tokens(labels, model.logits_shift)
    loss, scores = diffusion_loss(model, batch, normaliser, model.logits_shift, MASK_ID)
    loss.backward()
    new_grads = grads(model)
    model.zero_grad(set_to_none=True)
    scored, picked, entropy, top1 = reference_score_tokens(model, batch, model.logits_shift, MASK_ID)
    reference_loss = -(picked * batch.weights[scored].to(picked.dtype)).sum() / normaliser
    reference_loss.backward()
    assert torch.equal(scores.scored, scored) and bool(scored.any())
    torch.testing.assert_close(scores.log_probs[scored], picked.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(scores.entropy[scored], entropy, rtol=1e-5, atol=1e-6)
    assert torch.equal(scores.is_top1[scored], top1)
    torch.testing.assert_close(loss.detach(), reference_loss.detach(), rtol=1e-6, atol=0.0)
    assert_same_grads(new_grads, grads(model))


class Float32Sizes(TorchDispatchMode):
    """Records the size of every float32 tensor an operation produces."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.sizes.append(tensor.numel())
        return out


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_target_scores_never_hold_a_whole_float32_vocabulary_tensor(monkeypatch, entropy_grad):
    """bf16 logits [N, V]: log-probs, entropies, top-1 and the gradient equal the one-piece computation (float64),
    while no float32 tensor larger than a piece (2 positions x V) is ever made, forward or backward, and none of
    the pieces is kept for the backward pass (each is recomputed there)."""
    n, vocab = 24, 64
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n, vocab, generator=g)).bfloat16().requires_grad_()
    settings = dict(temperature=0.7, top_k=20, mask_token_id=5)
    ranked = sampling_logits(logits.detach(), **settings).argsort(dim=-1, descending=True, stable=True)
    targets = ranked[torch.arange(n), torch.arange(n) % 4]  # within the top-k; the top-1 every 4th position
    weights = torch.randn(n, generator=g)
    monkeypatch.setattr(sampling, "SCORING_PIECE_ELEMENTS", 2 * vocab)
    saved = []  # float32 elements kept for the backward pass (not counting what a checkpoint recomputes)

    def pack(tensor):
        saved.append(tensor.numel() if tensor.dtype == torch.float32 else 0)
        return tensor

    with Float32Sizes() as sizes:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            picked, entropy, top1 = target_scores(logits, targets, **settings, entropy=True,
                                                  entropy_grad=entropy_grad, top1=True)
            loss = ((picked + entropy) * weights).sum()
        loss.backward()
    assert max(sizes.sizes) == 2 * vocab and entropy.requires_grad == entropy_grad
    assert sum(saved) <= 4 * n  # per-position values only: the vocabulary-wide pieces are recomputed
    reference = logits.detach().double().requires_grad_()
    log_dist = sampling_logits(reference, **settings).log_softmax(-1)  # float32, as the pieces compute it
    ref_picked = log_dist.gather(-1, targets[:, None])[:, 0]
    probs = log_dist.exp()
    ref_entropy = -(probs * log_dist.masked_fill(probs == 0, 0.0)).sum(-1)
    ((ref_picked + (ref_entropy if entropy_grad else ref_entropy.detach())) * weights).sum().backward()
    torch.testing.assert_close(picked, ref_picked.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy.detach(), ref_entropy.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(top1, log_dist.argmax(-1) == targets) and int(top1.sum()) == n // 4
    torch.testing.assert_close(logits.grad, reference.grad.bfloat16())


def test_token_values_equal_the_whole_row_value_head(family):
    policy = tiny_model(family)
    value = DiffusionValueModel.from_policy(policy).double()
    torch.nn.init.normal_(value.value_head.weight, generator=torch.Generator().manual_seed(0))
    ids, mask, completion, steps = rollout(policy)
    steps[1, -4:] = -1
    new, groups = token_values(value, ids, mask, completion, steps, shrinkage=2, token_budget=80)
    new.sum().backward()
    new_grads = grads(value)
    value.zero_grad(set_to_none=True)
    block = 4 if value.block_size is not None else None
    shown = None  # a block model's states show each row up to its last committed token (as the policy's)
    if block is not None:
        last = [max(col for col in range(steps.shape[1]) if steps[row, col] >= 0) for row in range(len(steps))]
        shown = torch.arange(steps.shape[1])[None] <= torch.tensor(last)[:, None]
    old = torch.zeros(completion.shape, dtype=torch.float32)
    for chunk in reference_chunks(ids, mask, completion, groups, MASK_ID, block, 80, completion_mask=shown):
        out = value(input_ids=chunk.input_ids, attention_mask=chunk.layout.dense(), position_ids=chunk.position_ids)
        old = old.index_put((chunk.source_row, chunk.source_col), out.value[chunk.chunk_row, chunk.chunk_col])
    old.sum().backward()
    assert bool((steps >= 0).any())
    torch.testing.assert_close(new, old, rtol=1e-6, atol=1e-7)
    assert_same_grads(new_grads, grads(value))


def load_training_benchmark():
    spec = importlib.util.spec_from_file_location("training_benchmark", ROOT / "benchmarks" / "training.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_training_benchmark_runs_the_tiny_preset_and_builds_the_4b_shape():
    bench = load_training_benchmark()
    record = bench.measure("packed", 1, "sdpa", bench.PRESETS["tiny"], "cpu", profile=True)
    # 2 rows x (20 clean tokens: prompt 8 + completion up to the last block + 16 copies of a 4-token block)
    assert record["processed_tokens"] == 2 * (20 + 16 * 4) and record["scored_tokens"] == 32
    assert record["seconds_per_step"] > 0 and "mfu" not in record  # no H200 peak to compare with on a CPU
    assert record["profile"] and all(op["self_ms"] >= 0 for op in record["profile"])
    table = bench.summarize([record])["table"]
    assert table["packed s=1 sdpa eager"]["seconds_per_step"] == record["seconds_per_step"]
    model = bench.build_model(bench.PRESETS["sdar-4b"], "meta")  # the real shapes, no memory
    embedding = model.get_input_embeddings().weight.numel()
    assert embedding == 151936 * 2560 and model.dtype == torch.bfloat16 and model.is_gradient_checkpointing
    assert 4.0e9 < sum(p.numel() for p in model.parameters()) - embedding < 4.1e9
