"""dLLM-RL's masking estimators (Gen-Verse/dLLM-RL at 10b4fd1): ``coupled_pairs`` and ``random_masking`` with
per-token or per-row mask ratios and several masks per response, each checked against a slow transcription of the
official rows and losses written here (one forward per official row, or per row and block for block models).

Conventions that are ours and stay (listed in docs/concepts.md): SDAR blocks from absolute position 0, each
response scored as if alone (no padding in its context), the mask token excluded from the softmax, generated
positions the sampler never committed shown as masks, the sampler's canvas after the stop token kept as context.
"""

import pytest
import torch

from trl_diffusion.estimators import EstimatorSettings, draw_masks, estimate_logprobs, row_sizes
from trl_diffusion.estimators.likelihood import _draw_stream
from trl_diffusion.testing import MASK_ID, tiny_model

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]
WIDTH = 13  # completion canvas
SEEDS = torch.tensor([11, 12, 13])
ADVANTAGES = torch.tensor([0.8, -1.1, 0.4], dtype=torch.float64)
EPS, BETA = 0.2, 0.01


def fixed_batch():
    """Left-padded prompts, random completion tokens, a never-committed tail in row 1, and the tokens the loss
    keeps (row 2 stops after 9 tokens, as after a stop token)."""
    g = torch.Generator().manual_seed(0)
    width = max(map(len, PROMPTS))
    prompt_ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    prompt_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    completion = torch.randint(10, 100, (len(PROMPTS), WIDTH), generator=g)
    steps = torch.randint(0, 8, (len(PROMPTS), WIDTH), generator=g)
    steps[1, -2:] = -1
    keep = steps >= 0
    keep[2, 9:] = False
    return prompt_ids, prompt_mask, completion, steps, keep


def perturbed(family, seed, scale=0.02):
    """The "old" policy: the same weights plus small seeded noise, so ratios move and some get clipped."""
    old = tiny_model(family, seed=seed)
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in old.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    return old


def official_row_logps(model, prompt, completion, committed, half, row, block_size):
    """log p of every token of one official row (``row``, bool ``[C]``: its trained tokens) given its noisy input
    (``half``: the drawn mask, which also covers tokens after the stop token), for one unpadded response. Full
    attention: one forward of prompt + completion with the half masked (Dream: token i read from position i - 1).
    Block models: per block holding row tokens, the sequence up to that block's end with the earlier blocks clean
    and the half masked in that block, under a block-causal mask."""
    seq = torch.cat([prompt, completion])
    p_len = len(prompt)
    hidden = torch.zeros(len(seq), dtype=torch.bool)
    hidden[p_len:] = half | ~committed
    out = torch.zeros(len(completion), dtype=torch.float64)
    targets = (torch.nonzero(row).squeeze(-1) + p_len).tolist()
    if block_size is None:
        spans = [(len(seq), targets)]
    else:
        by_block = {}
        for pos in targets:
            by_block.setdefault(pos // block_size, []).append(pos)
        spans = [(min(len(seq), (b + 1) * block_size), ps) for b, ps in sorted(by_block.items())]
    for end, positions in spans:
        noisy = seq[:end].clone()
        if block_size is None:
            noisy[hidden[:end]] = MASK_ID
            allowed = torch.ones(end, end, dtype=torch.bool)
        else:
            block_start = (end - 1) // block_size * block_size
            in_block = torch.zeros(end, dtype=torch.bool)
            in_block[block_start:] = True
            noisy[hidden[:end] & in_block] = MASK_ID
            blocks = torch.arange(end) // block_size
            allowed = blocks[None, :] <= blocks[:, None]
        with torch.no_grad():
            logits = model(input_ids=noisy[None], attention_mask=allowed[None, None],
                           position_ids=torch.arange(end)[None]).logits[0].double()
        logits[:, MASK_ID] = float("-inf")  # ours: a committed token is never the mask token
        for pos in positions:
            read = pos - 1 if model.logits_shift else pos
            out[pos - p_len] = logits[read].log_softmax(-1)[seq[pos]]
    return out


def official_rows(settings, committed, keep):
    """The official rows of each response, as (response, mask index, drawn half, trained tokens) in order, empty
    rows dropped: random_masking, one row per mask; coupled, the mask then its complement (rl_trado.py 469-512,
    rl_dream.py 307-404)."""
    draws = draw_masks(settings, committed, SEEDS, len(PROMPTS[0]))
    batch, width = committed.shape
    masks = draws["masked"].view(batch, settings.masks_per_response, width)
    rows = []
    for b in range(batch):
        for k in range(settings.masks_per_response):
            halves = [masks[b, k]] if settings.name == "random_masking" else [masks[b, k], ~masks[b, k]]
            for half in halves:
                p = half & committed[b] & keep[b]
                if p.any():
                    rows.append((b, k, half & committed[b], p))
    return rows


def official_loss(rows, new, old, normalization, width):
    """dLLM-RL's PPO loss over its rows. ``trado`` (rl_trado.py 731-755): log-ratio clamped to +-10, a row's sum
    over its tokens / L1 (the padded response length) for the surrogate and the k3 KL; ``dream`` (rl_dream.py
    612-631, rl_llada.py 584-602): no clamp, surrogate / |row|, KL summed over the row. Both: / number of rows."""
    policy, kl = 0.0, 0.0
    for (b, _, _, p), lp_new, lp_old in zip(rows, new, old):
        delta = torch.where(p, lp_new - lp_old, torch.zeros_like(lp_new))
        ratio = torch.exp(delta.clamp(-10, 10) if normalization == "trado" else delta)
        adv = ADVANTAGES[b]
        surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv) * p
        k3 = torch.exp((-delta).clamp(-10, 10) if normalization == "trado" else -delta) - 1 + delta
        if normalization == "trado":
            policy = policy + surr.sum() / width
            kl = kl + (k3 * p).sum() / width
        else:
            policy = policy + surr.sum() / p.sum()
            kl = kl + (k3 * p).sum()
    return -policy / len(rows) + BETA * kl / len(rows)


def our_loss(settings, new, old, committed, keep, normalization, width):
    """The same loss from the estimator's ``[B, m * C]`` outputs: per-token weights from ``draw_masks``'s rows
    (1/L1, or 1/|row| for the surrogate) and the row count from ``row_sizes``."""
    m = settings.masks_per_response
    draws = draw_masks(settings, committed, SEEDS, len(PROMPTS[0]))
    kept = draws["scored"] & keep.repeat(1, m)
    tokens_per_row, rows_per_response = row_sizes(draws["row"], kept)
    delta = torch.where(kept, new.double() - old.double(), torch.zeros_like(new, dtype=torch.float64))
    ratio = torch.exp(delta.clamp(-10, 10) if normalization == "trado" else delta)
    adv = ADVANTAGES[:, None]
    surr = torch.minimum(ratio * adv, ratio.clamp(1 - EPS, 1 + EPS) * adv)
    k3 = torch.exp((-delta).clamp(-10, 10) if normalization == "trado" else -delta) - 1 + delta
    if normalization == "trado":
        per_token = (-surr + BETA * k3) / width
    else:
        per_token = -surr / tokens_per_row.double().clamp(min=1) + BETA * k3
    return (per_token * kept).sum() / rows_per_response.sum()


CASES = [  # (family, estimator, sampling, masks per response): what each official script does
    ("sdar", "random_masking", "per_token", 1),  # rl_trado.py 441-467
    ("sdar", "coupled_pairs", "per_token", 1),  # rl_trado.py 469-512
    ("llada", "random_masking", "per_row", 3),  # rl_llada.py 301-341
    ("llada", "coupled_pairs", "per_row", 2),  # rl_llada.py 347-398
    ("dream", "random_masking", "per_row", 3),  # rl_dream.py 307-347
    ("dream", "coupled_pairs", "per_row", 2),  # rl_dream.py 353-404
]


@pytest.mark.parametrize(("family", "name", "sampling", "masks"), CASES)
def test_masking_estimators_equal_the_official_rows_and_loss(family, name, sampling, masks):
    model = tiny_model(family, seed=4)
    old_model = perturbed(family, seed=4)
    prompt_ids, prompt_mask, completion, steps, keep = fixed_batch()
    committed = steps >= 0
    block = 4 if family == "sdar" else None
    settings = EstimatorSettings(name=name, block_size=4, token_budget=48, random_mask_sampling=sampling,
                                 masks_per_response=masks)
    with torch.no_grad():
        new, _, scored = estimate_logprobs(model, prompt_ids, prompt_mask, completion, steps, settings, SEEDS)
        old, _, _ = estimate_logprobs(old_model, prompt_ids, prompt_mask, completion, steps, settings, SEEDS)
    assert new.shape == (3, settings.score_width(WIDTH)) == (3, masks * WIDTH) and scored.shape == new.shape

    # per token: the estimate equals the official row's forward, wherever a kept token is trained
    rows = official_rows(settings, committed, keep)
    prompts = [prompt_ids[b][prompt_mask[b].bool()] for b in range(3)]
    off_new, off_old = [], []
    for b, _, half, p in rows:
        args = (prompts[b], completion[b], committed[b], half, p, block)
        off_new.append(official_row_logps(model, *args))
        off_old.append(official_row_logps(old_model, *args))
    for (b, k, _, p), lp in zip(rows, off_new):
        torch.testing.assert_close(new[b].view(masks, WIDTH)[k][p].double(), lp[p], rtol=1e-5, atol=1e-5)

    # the loss: official rows vs our per-token weights and row count
    normalization = "trado" if family == "sdar" else "dream"
    expected = official_loss(rows, off_new, off_old, normalization, WIDTH)
    got = our_loss(settings, new, old, committed, keep, normalization, WIDTH)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
    assert abs(float(expected)) > 1e-3  # a loss that could be wrong


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_multi_mask_packing_does_not_depend_on_the_token_budget(family):
    model = tiny_model(family, seed=2)
    prompt_ids, prompt_mask, completion, steps, _ = fixed_batch()
    out = []
    for budget in (None, 40):
        settings = EstimatorSettings(name="coupled_pairs", block_size=4, token_budget=budget,
                                     random_mask_sampling="per_row", masks_per_response=3)
        with torch.no_grad():
            out.append(estimate_logprobs(model, prompt_ids, prompt_mask, completion, steps, settings, SEEDS))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0][2], out[1][2])


def test_coupled_pairs_scores_every_committed_token_once_per_pair():
    committed = torch.ones(2, 40, dtype=torch.bool)
    committed[1, 30:] = False
    settings = EstimatorSettings(name="coupled_pairs", random_mask_sampling="per_row", masks_per_response=4)
    draws = draw_masks(settings, committed, torch.tensor([5, 6]), 3)
    rows = draws["row"].view(2, 4, 40)
    assert torch.equal(draws["scored"], committed.repeat(1, 4))
    for k in range(4):  # pair k: rows 2k (the mask) and 2k + 1 (its complement), together every committed token
        first, second = rows[:, k] == 2 * k, rows[:, k] == 2 * k + 1
        assert torch.equal(first | second, committed) and not bool((first & second).any())
        assert torch.equal(first, draws["masked"].view(2, 4, 40)[:, k])


def test_per_row_sampling_draws_one_ratio_per_mask_and_per_token_one_per_token():
    committed = torch.ones(1, 400, dtype=torch.bool)
    fractions = {}
    for sampling in ("per_token", "per_row"):
        settings = EstimatorSettings(name="random_masking", random_mask_sampling=sampling, masks_per_response=64)
        draws = draw_masks(settings, committed, torch.tensor([3]), 1)
        fractions[sampling] = draws["masked"].view(64, 400).float().mean(1)
        if sampling == "per_row":
            t = draws["t"][0]
            assert bool(((t >= 0.1) & (t <= 0.9)).all())
            assert (fractions[sampling] - t).abs().max() < 0.1  # each mask masks about t of its tokens
    # one ratio per mask: the masked fraction spreads over U(0.1, 0.9); per token it concentrates near 0.5
    assert fractions["per_row"].std() > 0.15
    assert fractions["per_token"].std() < 0.05
    assert (fractions["per_token"] - 0.5).abs().max() < 0.12


def test_per_token_masks_follow_the_spec():
    """Mask k of a row: u ~ U(low, high) per token from the row's "threshold" stream of mask k, then U(0, 1) per
    token from its "mask" stream; masked where the draw is below u (the estimator's default since it was added)."""
    committed = torch.ones(2, 30, dtype=torch.bool)
    settings = EstimatorSettings(name="random_masking", masks_per_response=2)
    draws = draw_masks(settings, committed, torch.tensor([8, 9]), 1)
    for row, seed in enumerate((8, 9)):
        for k in range(2):
            u = 0.1 + 0.8 * torch.rand(30, generator=_draw_stream(seed, k, "threshold"))
            expected = torch.rand(30, generator=_draw_stream(seed, k, "mask")) < u
            assert torch.equal(draws["masked"][row, k * 30:(k + 1) * 30], expected)


@pytest.mark.parametrize("name,sampling", [("random_masking", "per_token"), ("random_masking", "per_row"),
                                           ("coupled_pairs", "per_token"), ("coupled", "per_token"),
                                           ("mean_field", "per_token")])
def test_draws_do_not_depend_on_the_padded_width(name, sampling):
    """A row's draws are a function of its seed and of the column: a batch padded wider (a longer canvas beside
    it, another process layout) or a longer left-padded prompt leaves them as they were."""
    multi = name in ("random_masking", "coupled_pairs")
    settings = EstimatorSettings(name=name, random_mask_sampling=sampling, masks_per_response=3 if multi else 1)
    seeds = torch.tensor([11, 12])
    narrow = draw_masks(settings, torch.ones(2, 20, dtype=torch.bool), seeds, 6)
    wide = draw_masks(settings, torch.ones(2, 32, dtype=torch.bool), seeds, 9)
    if name == "mean_field":  # prompt noise, aligned at the prompt's end
        assert torch.equal(wide["prompt_noise"][:, 3:], narrow["prompt_noise"])
        return
    masks = 3 if multi else 1
    for k in range(masks):
        assert torch.equal(wide["masked"][:, k * 32:k * 32 + 20], narrow["masked"][:, k * 20:(k + 1) * 20])
    if narrow["t"] is not None:
        assert torch.equal(wide["t"], narrow["t"])
    assert narrow["masked"].any() and (~narrow["masked"]).any()


@pytest.mark.parametrize("name", ["random_masking", "coupled_pairs"])
def test_masks_depend_on_the_row_seed_only(name):
    model = tiny_model("llada")
    prompt_ids, prompt_mask, completion, steps, _ = fixed_batch()
    settings = EstimatorSettings(name=name, random_mask_sampling="per_row", masks_per_response=2)
    with torch.no_grad():
        a = estimate_logprobs(model, prompt_ids, prompt_mask, completion, steps, settings, SEEDS)
        b = estimate_logprobs(model, prompt_ids, prompt_mask, completion, steps, settings, SEEDS)
        alone = estimate_logprobs(model, prompt_ids[1:2], prompt_mask[1:2], completion[1:2], steps[1:2], settings,
                                  SEEDS[1:2])
        other = estimate_logprobs(model, prompt_ids, prompt_mask, completion, steps, settings, SEEDS + 100)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])  # old, new and reference see the same masks
    torch.testing.assert_close(alone[0][0], a[0][1], rtol=1e-5, atol=1e-5)  # not the batch's neighbours
    assert torch.equal(alone[2][0], a[2][1])
    masked = draw_masks(settings, steps >= 0, SEEDS, 7)["masked"]
    assert not torch.equal(masked, draw_masks(settings, steps >= 0, SEEDS + 100, 7)["masked"])
    assert not torch.equal(a[0], other[0])


def test_row_sizes_count_kept_tokens_and_non_empty_rows():
    rows = torch.tensor([[0, 0, 1, -1, 2, 2, 2], [1, 1, 0, 0, -1, -1, 3]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 0, 1], [1, 1, 0, 0, 1, 1, 1]])
    tokens, count = row_sizes(rows, keep)
    assert tokens.tolist() == [[2, 2, 1, 0, 2, 0, 2], [2, 2, 0, 0, 0, 0, 1]]
    assert count.tolist() == [3, 2]  # row 0 of response 1 lost all its tokens: dropped, as dLLM-RL drops it


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(name="random_masking", masks_per_response=0), "masks_per_response"),
    (dict(name="random_masking", masks_per_response=2.0), "masks_per_response"),
    (dict(name="random_masking", random_mask_sampling="per_block"), "random_mask_sampling"),
    (dict(name="trajectory", masks_per_response=4), "masks_per_response"),
    (dict(name="coupled", random_mask_sampling="per_row"), "random_mask_sampling"),
])
def test_bad_masking_settings_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EstimatorSettings(**kwargs)
