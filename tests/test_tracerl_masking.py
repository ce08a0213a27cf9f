"""dLLM-RL's masking baselines through TraceRLTrainer (``random_masking`` / ``coupled_pairs`` with per-token or
per-row ratios and several masks per response), and the scoring options of the official trainers (the mask token in
the softmax, raw logits at temperature 1, the KL summed per row).

The trainer's loss and gradients on a fixed rollout are compared with a slow transcription of dLLM-RL's rows and
loss written here: masks redrawn from each row's seed by the documented rule, one forward per official row (per row
and block for block models) with gradients, the loss summed row by row (train/rl_trado.py 441-512, 727-755;
train/rl_dream.py 307-404, 600-631)."""

import hashlib
import math

import pytest
import torch
from test_tracerl_official import (
    PROMPTS,
    assert_same_loss_and_gradient,
    banded_reward,
    base_config,
    fixed_rollout,
    make_trainer,
    official_advantages_and_kept,
    official_config,
    trained_tokens,
)

from trl_diffusion.testing import MASK_ID, tiny_model
from trl_diffusion.trainers.tracerl_config import OFFICIAL_SETTINGS, TraceRLConfig
from trl_diffusion.value import DiffusionValueModel

EPS = 0.2


def stream(seed: int, mask: int, kind: str) -> torch.Generator:
    """The generator of one sequence of draws of a response: its seed, the mask's index and the kind of draw."""
    digest = hashlib.sha256(f"{seed}:{mask}:{kind}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def drawn_masks(seed: int, sampling: str, masks: int, width: int, low=0.1, high=0.9) -> list[torch.Tensor]:
    """The masks of one response, by the rule the docs state: per mask, ``per_token`` draws u ~ U(low, high) per
    token from the mask's "threshold" stream, ``per_row`` one t ~ U(low, high) first from its "mask" stream; then
    U(0, 1) per token from the "mask" stream, masked below u (t)."""
    out = []
    for k in range(masks):
        draws = stream(seed, k, "mask")
        if sampling == "per_token":
            threshold = low + (high - low) * torch.rand(width, generator=stream(seed, k, "threshold"))
        else:
            threshold = low + (high - low) * torch.rand((), generator=draws)
        out.append(torch.rand(width, generator=draws) < threshold)
    return out


def official_rows(batch, trained, estimator, sampling, masks):
    """dLLM-RL's rows, as (response, mask index, noised half, trained tokens): ``random_masking`` one per mask,
    ``coupled`` the mask then its complement; rows without a trained token are dropped."""
    steps = batch["unmask_step"]
    width = trained.shape[1]
    rows = []
    for b in range(steps.shape[0]):
        committed = steps[b] >= 0
        for k, mask in enumerate(drawn_masks(int(batch["mask_seeds"][b]), sampling, masks, steps.shape[1])):
            for half in [mask] if estimator == "random_masking" else [mask, ~mask]:
                half = half & committed
                row = half[:width] & trained[b]
                if row.any():
                    rows.append((b, k, half, row))
    return rows


def row_logps(model, prompt, canvas, committed, half, row, temperature, exclude_mask):
    """log p of the row's tokens ``[C]`` (0 elsewhere), with gradients: the response alone (no padding) with the
    half and every never-committed position masked; block models one forward per block holding row tokens (the
    sequence up to that block, earlier blocks clean, block-causal), full attention one forward (Dream reads token
    i at position i - 1)."""
    seq = torch.cat([prompt, canvas])
    start = len(prompt)
    hidden = torch.zeros(len(seq), dtype=torch.bool)
    hidden[start:] = half | ~committed
    targets = (torch.nonzero(row).squeeze(-1) + start).tolist()
    block = model.block_size
    if block is None:
        spans = [(len(seq), targets)]
    else:
        spans = {}
        for pos in targets:
            spans.setdefault(pos // block, []).append(pos)
        spans = [(min(len(seq), (b + 1) * block), ps) for b, ps in sorted(spans.items())]
    out = torch.zeros(row.shape[0])
    for end, positions in spans:
        noisy = seq[:end].clone()
        if block is None:
            noisy[hidden[:end]] = MASK_ID
            allowed = torch.ones(end, end, dtype=torch.bool)
        else:
            in_block = torch.arange(end) >= (end - 1) // block * block
            noisy[hidden[:end] & in_block] = MASK_ID
            blocks = torch.arange(end) // block
            allowed = blocks[None, :] <= blocks[:, None]
        logits = model(input_ids=noisy[None], attention_mask=allowed[None, None],
                       position_ids=torch.arange(end)[None]).logits[0].float() / temperature
        if exclude_mask:
            logits = logits.index_fill(-1, torch.tensor([MASK_ID]), float("-inf"))
        log_dist = logits.log_softmax(-1)
        for pos in positions:
            read = pos - 1 if model.logits_shift else pos
            out = out.index_put((torch.tensor([pos - start]),), log_dist[read, seq[pos]][None])
    return out


def official_loss(rows, new, old, advantages, beta, formula, longest):
    """``trado``: exp(clamp(log ratio, +-10)), each row's (PPO + beta k3) token sum / L1; ``dream``: no clamp, each
    row's PPO mean over its tokens plus beta times its k3 sum. Both / the number of rows."""
    total = torch.zeros(())
    for (b, _, _, row), lp_new, lp_old in zip(rows, new, old):
        x = (lp_new - lp_old)[row]
        ratio = torch.exp(x.clamp(-10, 10) if formula == "trado" else x)
        surrogate = torch.minimum(ratio * advantages[b], ratio.clamp(1 - EPS, 1 + EPS) * advantages[b])
        k3 = torch.exp((-x).clamp(-10, 10) if formula == "trado" else -x) - 1 + x
        if formula == "trado":
            total = total + (-surrogate + beta * k3).sum() / longest
        elif formula == "dream":
            total = total + (-surrogate).sum() / row.sum() + beta * k3.sum()
        else:  # trl_diffusion's defaults: 1/|row| on both terms
            total = total + (-surrogate + beta * k3).sum() / row.sum()
    return total / len(rows)


CASES = [  # (family, official preset or None for the defaults, estimator, overrides, formula)
    ("sdar", "trado", "random_masking", {}, "trado"),  # rl_trado.py 441-467
    ("sdar", "trado", "coupled_pairs", {}, "trado"),  # rl_trado.py 469-512
    ("dream", "dream", "random_masking", dict(masks_per_response=3), "dream"),  # rl_dream.py 307-347
    pytest.param("dream", "dream", "coupled_pairs", dict(masks_per_response=2), "dream",  # rl_dream.py 353-404
                 marks=pytest.mark.slow),
    ("llada", None, "coupled_pairs", dict(random_mask_sampling="per_row", masks_per_response=2, temperature=0.7),
     "defaults"),
]


@pytest.mark.parametrize(("family", "preset", "estimator", "overrides", "formula"), CASES)
def test_masking_estimators_train_with_the_official_loss(tmp_path, family, preset, estimator, overrides, formula):
    """The trainer's loss and gradients equal the official rows' loss: every mask (half) a row, rows counted as
    dLLM-RL counts them (a coupled pair is two), the loss per mask in columns k * C ... of every per-token tensor,
    and, for the official presets, raw logits at temperature 1 with the mask token in the softmax."""
    sizes = dict(likelihood_estimator=estimator, block_length=8 if family != "sdar" else 4, denoising_steps=4,
                 **overrides)
    if preset is None:
        args = TraceRLConfig(**base_config(tmp_path, **sizes))
    else:
        args = official_config(tmp_path, preset, **sizes)
    trainer = make_trainer(args, family=family)
    masks = args.masks_per_response
    temperature = args.temperature if args.scoring_temperature is None else args.scoring_temperature
    if preset is not None:
        assert temperature == 1.0 and not args.exclude_mask_token_from_softmax
    if preset == "dream":
        assert args.temperature == 0.8  # rollouts at 0.8, scored at 1

    batch = fixed_rollout(trainer)
    rewards = banded_reward([p for p in PROMPTS for _ in range(4)], [""] * 16)
    advantages, kept = official_advantages_and_kept(rewards, 4)
    trained = trained_tokens(trainer, batch) & torch.tensor(kept)[:, None]
    rows = official_rows(batch, trained, estimator, args.random_mask_sampling, masks)
    width = trained.shape[1]
    if estimator == "coupled_pairs" or masks > 1:
        assert len(rows) > len({b for b, *_ in rows})  # several rows per response

    model = trainer.accelerator.unwrap_model(trainer.model)
    prompts = [batch["prompt_ids"][b][batch["prompt_mask"][b].bool()] for b in range(16)]
    new = [row_logps(model, prompts[b], batch["canvas_ids"][b], batch["unmask_step"][b] >= 0, half, row,
                     temperature, args.exclude_mask_token_from_softmax) for b, _, half, row in rows]
    # pi_old: the rows' log-probs, perturbed, laid out as the trainer's [B, masks x C] (mask k in columns k * C ...)
    noise = torch.randn(16, masks * width, generator=torch.Generator().manual_seed(3)) * 0.5
    old_layout = torch.zeros(16, masks * width)
    for (b, k, _, row), lp in zip(rows, new):
        columns = torch.nonzero(row).squeeze(-1) + k * width
        old_layout[b, columns] = lp.detach()[row] + noise[b, columns]
    batch["old_per_token_logps"] = old_layout
    old = [old_layout[b, k * width:(k + 1) * width] for b, k, _, _ in rows]
    longest = trained.sum(1).max().item()
    beta = args.beta
    assert beta == 0.01

    assert_same_loss_and_gradient(
        trainer, batch,
        lambda: official_loss(rows, new, old, torch.tensor(advantages), beta, formula, longest))
    assert batch["completion_mask"].shape == (16, masks * width) == batch["old_per_token_logps"].shape


def test_kl_summed_per_row_differs_from_the_policy_weighting(tmp_path):
    """``kl_weighting``: with 'row_sum' every trained token's KL counts once; 'as_policy' weights it like the
    policy term (1/|row|). Same rollout, same pi_old: the two losses differ by beta times the difference."""
    losses = {}
    for weighting in ("as_policy", "row_sum"):
        args = TraceRLConfig(**base_config(tmp_path, likelihood_estimator="random_masking", masks_per_response=2,
                                           random_mask_sampling="per_row", block_length=8, denoising_steps=4,
                                           kl_weighting=weighting, beta=0.5))
        trainer = make_trainer(args, family="llada")
        batch = fixed_rollout(trainer)
        with torch.no_grad():
            scored, _, _ = trainer._get_per_token_logps_and_entropies(
                trainer.model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
                torch.cat([batch["prompt_mask"], torch.ones_like(batch["completion_ids"])], 1),
                batch["completion_ids"].shape[1])
        batch["old_per_token_logps"] = scored + 0.3
        losses[weighting] = trainer._compute_loss(trainer.model, batch).item()
        assert trainer._metrics["train"]["kl"][-1] > 0
    x = torch.tensor(-0.3)
    k3 = (torch.exp(-x) - 1 + x).item()  # every scored token's k3 at log ratio -0.3
    weights = batch["completion_mask"]
    kept = (weights > 0).float()
    gap = 0.5 * k3 * (kept.sum() - weights.sum()).item() / batch["num_items_in_batch"].item()
    assert gap > 1e-3
    assert losses["row_sum"] - losses["as_policy"] == pytest.approx(gap, rel=1e-4)


def test_value_model_advantages_are_tiled_over_the_masks(tmp_path):
    """A value model with several masks per response: the token-wise advantages (one per completion token) repeat
    in each mask's columns, and the value model trains on its own states, each token weighted by its loss weights
    summed over the masks.

    With gamma = lam = 1 a token's advantage is R - V_old, so the one value step's loss (its values are V_old: the
    model has not moved yet) is sum(0.5 * A^2 * weight) / training rows, the weights being the policy's completion
    mask folded over the masks: written here from the batch alone. The value head is seeded non-zero: with
    ``from_policy``'s zero head every V_old is 0, R = A, and a value model regressed on A (or on another row's
    states) logged the same loss."""
    args = TraceRLConfig(**base_config(tmp_path, likelihood_estimator="random_masking", masks_per_response=3,
                                       dynamic_group_filtering="none", value_learning_rate=1e-3))
    # one value step (ceil(<= 48 training rows / 256)), on one piece of 16 rows
    assert (args.gamma, args.lam, args.value_batch_size, args.per_device_train_batch_size) == (1.0, 1.0, 256, 16)
    policy = tiny_model("sdar").train()
    value_model = DiffusionValueModel.from_policy(policy)
    with torch.no_grad():
        head = value_model.value_head.weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(1)))
    before = [p.detach().clone() for p in value_model.parameters()]
    trainer = make_trainer(args, model=policy, value_model=value_model)
    batch = fixed_rollout(trainer)
    width = batch["completion_ids"].shape[1]
    advantages = batch["advantages"]
    assert advantages.shape == (16, 3 * width)
    for k in (1, 2):
        torch.testing.assert_close(advantages[:, k * width:(k + 1) * width], advantages[:, :width])
    assert advantages.abs().sum() > 0
    (logged,) = trainer._metrics["train"]["value/loss"]
    folded = batch["completion_mask"].view(16, 3, width).sum(1)
    assert folded.sum() > 0
    expected = (0.5 * advantages[:, :width].double() ** 2 * folded).sum() / batch["num_items_in_batch"]
    assert math.isfinite(logged) and logged > 0
    assert logged == pytest.approx(expected.item(), rel=1e-4)
    after = list(value_model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))  # the value model took a step
    loss = trainer._compute_loss(trainer.model, batch)
    assert torch.isfinite(loss)


# ------------------------------------------------------------------------------------------------ presets, errors


def test_official_presets_carry_the_official_masking_and_scoring_settings():
    """configs/rl_{trado,dream,llada}.yaml train TraceRL; their random_masking / coupled settings (lower_p 0.1,
    upper_p 0.9, mask_times_per_sample 35 for Dream / LLaDA, per-token ratios for TraDo) come with the preset, and
    all three trainers score raw logits with the mask token in the softmax."""
    expected = {"trado": ("per_token", 1, "as_policy"), "dream": ("per_row", 35, "row_sum"),
                "llada": ("per_row", 35, "row_sum")}
    for name, (sampling, masks, kl) in expected.items():
        args = TraceRLConfig.from_official(name, num_processes=8 if name != "llada" else 1, output_dir="x",
                                           use_cpu=True)
        assert args.likelihood_estimator == "trajectory"
        assert (args.random_mask_sampling, args.masks_per_response, args.kl_weighting) == (sampling, masks, kl)
        assert (args.random_mask_low, args.random_mask_high) == (0.1, 0.9)
        assert args.scoring_temperature == 1.0 and args.exclude_mask_token_from_softmax is False


@pytest.mark.parametrize(("name", "estimator", "processes", "accumulation"), [
    ("trado", "trajectory", 8, 8),  # 256 rows / ~4 per response = 64 responses
    ("trado", "random_masking", 8, 32),  # 256 rows of one mask each: 4 steps of a 1024-response rollout
    ("trado", "coupled_pairs", 8, 16),  # two rows per response: 8 steps
    ("dream", "trajectory", 8, 2),  # 2048 rows / 128 merged steps = 16 responses
    ("dream", "random_masking", 8, 8),  # 2048 / 35 = 58.5 responses -> 64 (4 steps of 256; dLLM-RL ~4.4)
    ("llada", "trajectory", 1, 4),  # 256 rows / 64 merged steps
    ("llada", "coupled_pairs", 1, 4),  # 256 / 70 = 3.7 responses -> 4
])
def test_official_batch_layout_follows_the_rows_per_response(name, estimator, processes, accumulation):
    args = TraceRLConfig.from_official(name, num_processes=processes, likelihood_estimator=estimator, output_dir="x",
                                       use_cpu=True)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, accumulation)
    assert (args.generation_batch_size // processes) % accumulation == 0  # each rollout is whole optimizer steps


def test_official_layout_with_only_a_per_device_batch_keeps_the_rows_per_step():
    # one of the two layout fields silently abandoned the official layout: per_device 4 left TRL's accumulation 1
    # (4 responses a step instead of 64), an accumulation alone TRL's per-device 8 (128)
    official = TraceRLConfig.from_official("trado", num_processes=8, output_dir="x", use_cpu=True)
    wider = TraceRLConfig.from_official("trado", num_processes=8, per_device_train_batch_size=4, output_dir="x",
                                        use_cpu=True)
    assert (wider.per_device_train_batch_size, wider.gradient_accumulation_steps) == (4, 2)
    assert wider.per_device_train_batch_size * wider.gradient_accumulation_steps == \
        official.per_device_train_batch_size * official.gradient_accumulation_steps
    with pytest.raises(ValueError, match="gradient_accumulation_steps without per_device_train_batch_size"):
        TraceRLConfig.from_official("trado", gradient_accumulation_steps=16, output_dir="x", use_cpu=True)
    with pytest.raises(ValueError, match="per_device_train_batch_size must be an integer >= 1, got 0"):
        TraceRLConfig.from_official("trado", per_device_train_batch_size=0, output_dir="x", use_cpu=True)
    # with steps_per_generation the rollout is steps x processes x per-device batch (16 here): accumulation 8 holds
    # all of it, the nearest to the official 64 responses
    layout = TraceRLConfig.from_official("trado", num_processes=1, per_device_train_batch_size=2,
                                         steps_per_generation=8, output_dir="x", use_cpu=True)
    assert (layout.gradient_accumulation_steps, layout.generation_batch_size) == (8, 16)


@pytest.mark.parametrize(("name", "steps"), [("trado", 32), ("dream", 16), ("llada", 16)])
def test_official_preset_takes_a_steps_per_generation_override(name, steps):
    # the preset's generation_batch_size stayed beside it: TRL's "can not be both configured" for one field given
    args = TraceRLConfig.from_official(name, num_processes=1, steps_per_generation=steps, output_dir="x",
                                       use_cpu=True)
    assert (args.steps_per_generation, args.generation_batch_size) == (steps, steps)
    assert steps % args.gradient_accumulation_steps == 0  # each rollout is whole optimizer steps


def test_official_preset_refuses_diffucoders_coupled_layout():
    with pytest.raises(ValueError, match="coupled_pairs"):
        TraceRLConfig.from_official("dream", likelihood_estimator="coupled", output_dir="x", use_cpu=True)


@pytest.mark.parametrize(("fields", "field"), [
    ({"random_mask_sampling": "per_block"}, "random_mask_sampling"),
    ({"masks_per_response": 0}, "masks_per_response"),
    ({"masks_per_response": 2.0}, "masks_per_response"),
    ({"scoring_temperature": 0.0}, "scoring_temperature"),
    ({"scoring_temperature": float("inf")}, "scoring_temperature"),
    ({"kl_weighting": "mean"}, "kl_weighting"),
    ({"kl_weighting": "row_sum", "loss_type": "dapo", "step_normalization": "sequence"}, "kl_weighting"),
])
def test_masking_and_scoring_config_errors_name_the_field(fields, field):
    with pytest.raises(ValueError, match=field):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, **fields)


def test_presets_list_only_config_fields():
    fields = set(TraceRLConfig.__dataclass_fields__)
    for settings in OFFICIAL_SETTINGS.values():
        assert set(settings) <= fields


@pytest.mark.parametrize("loss_type", ["dr_grpo", "grpo"])
def test_trl_loss_types_average_the_estimates_of_the_masks(tmp_path, loss_type):
    """Under TRL's loss types each of a response's m masks gives an estimate of its loss, and they are averaged:
    every scored token weighs 1/m. ``dr_grpo`` divides by a constant (B x max_completion_length), so weights of 1
    would make its loss m times the one-mask loss (``grpo`` divides by the weights and would not show it)."""
    args = TraceRLConfig(**base_config(tmp_path, likelihood_estimator="random_masking", masks_per_response=2,
                                       loss_type=loss_type, dynamic_group_filtering="none"))
    batch = fixed_rollout(make_trainer(args))
    weights = batch["completion_mask"]
    assert weights.shape[1] == 2 * batch["completion_ids"].shape[1]
    scored = weights[weights != 0]
    assert scored.numel() > 0
    torch.testing.assert_close(scored, torch.full_like(scored, 0.5))
