"""dLLM-RL's SFT noise and loss normalisation, by configuration: per-token mask probabilities, a mask-ratio range,
and per-row means (``mask_ratio_sampling``, ``mask_ratio_range``, ``loss_normalization``), each against a slow,
obvious computation (one forward per row or block, masks drawn by hand from the same generators)."""

import pytest
import torch
from numerics import assert_close_fp32
from test_sft import (
    TOKENIZER,
    config,
    conversational,
    gens,
    logp_block_causal,
    logp_full_attention,
    make_batch,
)
from test_sft_packing import assert_same_step, train_one_step

from trl_diffusion.states import blocks_from_prompt_end
from trl_diffusion.testing import MASK_ID, tiny_model
from trl_diffusion.trainers import DiffusionSFTTrainer
from trl_diffusion.trainers.diffusion_losses import (
    IGNORE_INDEX,
    build_objective,
    diffusion_loss,
    per_row_weights,
    rows_averaged,
    sample_generators,
)

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # their trainers write into output_dir="unused"

LOW, HIGH = 0.1, 0.9
OFFICIAL = dict(mask_ratio_range=[LOW, HIGH], mask_ratio_sampling="per_token", loss_weighting="none")


def fast_row_loss(model, objective, ids, labels, valid, normalization, per_token, length=None, **kw):
    """The objective with dLLM-RL's noise, normalised per row as the trainer does."""
    batch = build_objective(objective, ids, labels, valid, gens(len(ids)), mask_token_id=MASK_ID,
                            block_size=model.block_size, eps=LOW, high=HIGH, per_token=per_token, weighting="none",
                            **kw)
    batch.weights = per_row_weights(batch, normalization, labels.ne(IGNORE_INDEX).sum(-1), length=length)
    return diffusion_loss(model, batch, rows_averaged(batch, normalization), model.logits_shift, MASK_ID)[0]


def per_token_mask(generator, n, completion):
    """dLLM-RL's per-token masking, by hand: each real token's probability u ~ U(0.1, 0.9), then a uniform each."""
    probability = LOW + (HIGH - LOW) * torch.rand(n, generator=generator)
    return completion[:n] & (torch.rand(n, generator=generator) < probability)


def test_block_per_token_noise_and_row_length_normalisation():
    """SDAR's SFT in dLLM-RL (``sft_trado.py``): every completion token masked with its own probability
    u ~ U(0.1, 0.9), no 1/t weight, each row's loss divided by one length for the whole dataset (its padded
    response length L1, ``loss = -(logp * p_mask).sum(1) / L1``), averaged over the rows with a masked token (it
    drops the others, ``keep = p_mask.any(dim=1)``). Dividing by each sample's own length weighted a short answer's
    tokens L1 / n times more."""
    model = tiny_model("sdar")
    ids, labels, valid = make_batch()
    length = 40
    with torch.no_grad():
        loss = fast_row_loss(model, "block", ids, labels, valid, "row_length", per_token=True, length=length)
        rows = []
        for row, generator in enumerate(gens(len(ids))):
            n = int(valid[row].sum())
            masked = per_token_mask(generator, n, labels[row] != IGNORE_INDEX)
            if masked.any():
                noisy = ids[row, :n].masked_fill(masked, MASK_ID)
                rows.append(-torch.as_tensor(logp_block_causal(model, noisy, ids[row, :n], masked),
                                             dtype=torch.float32) / length)
    assert_close_fp32(loss, torch.stack(rows).mean())


def test_block_per_token_noise_and_row_tokens_normalisation():
    """``row_tokens`` (LLaDA's SFT normalisation) with dLLM-RL's per-token noise: each row's loss over its
    completion length, averaged over rows."""
    model = tiny_model("sdar")
    ids, labels, valid = make_batch()
    with torch.no_grad():
        loss = fast_row_loss(model, "block", ids, labels, valid, "row_tokens", per_token=True)
        rows = []
        for row, generator in enumerate(gens(len(ids))):
            n = int(valid[row].sum())
            masked = per_token_mask(generator, n, labels[row] != IGNORE_INDEX)
            noisy = ids[row, :n].masked_fill(masked, MASK_ID)
            score = logp_block_causal(model, noisy, ids[row, :n], masked)
            rows.append(-torch.as_tensor(score, dtype=torch.float32) / (labels[row] != IGNORE_INDEX).sum())
    assert_close_fp32(loss, torch.stack(rows).mean())


def test_random_masking_ratio_range_and_row_masked_normalisation():
    """LLaDA's random_masking in dLLM-RL: one t ~ U(0.1, 0.9) per row, each row's loss over its masked count,
    averaged over the rows with a masked token (dLLM-RL drops the others)."""
    model = tiny_model("llada")
    ids, labels, valid = make_batch()
    with torch.no_grad():
        loss = fast_row_loss(model, "random_masking", ids, labels, valid, "row_masked", per_token=False)
        rows = []
        for row, generator in enumerate(gens(len(ids))):
            n = int(valid[row].sum())
            t = LOW + (HIGH - LOW) * torch.rand(1, generator=generator)
            masked = (labels[row] != IGNORE_INDEX)[:n] & (torch.rand(n, generator=generator) < t)
            if not masked.any():
                continue
            noisy = ids[row, :n].masked_fill(masked, MASK_ID)
            rows.append(-logp_full_attention(model, noisy, ids[row, :n], masked) / int(masked.sum()))
    assert_close_fp32(loss, torch.stack([torch.as_tensor(r, dtype=torch.float32) for r in rows]).mean())


def semi_ar_rows_by_hand(model, ids, labels, valid, generators, block_length):
    """dLLM-RL's semi-AR rows, one forward each: per block, earlier blocks clean, later ones masked, the block's
    tokens each masked with their own probability; each row's loss over its masked count. A row with nothing masked
    is dropped, as dLLM-RL drops it. Returns the row losses and how many were dropped."""
    completion = labels != IGNORE_INDEX
    blocks = blocks_from_prompt_end(completion, block_length)
    rows, dropped = [], 0
    for row, generator in enumerate(generators):
        n = int(valid[row].sum())
        eligible = per_token_mask(generator, n, completion[row])
        for b in range(int(blocks[row].max()) + 1):
            masked = eligible & (blocks[row, :n] == b)
            if not masked.any():
                dropped += 1
                continue
            hidden = masked | (completion[row, :n] & (blocks[row, :n] > b))
            score = logp_full_attention(model, ids[row, :n].masked_fill(hidden, MASK_ID), ids[row, :n], masked)
            rows.append(-torch.as_tensor(score, dtype=torch.float32) / int(masked.sum()))
    return rows, dropped


@pytest.mark.parametrize("block_length", [3, 1])
def test_semi_ar_per_token_noise_one_row_per_block(block_length):
    """LLaDA / Dream semi-AR SFT in dLLM-RL, averaged over the rows with a masked token (with one-token blocks
    about half of the rows have none)."""
    model = tiny_model("llada")
    ids, labels, valid = make_batch()
    with torch.no_grad():
        loss = fast_row_loss(model, "semi_ar", ids, labels, valid, "row_masked", per_token=True,
                             semi_ar_block_length=block_length)
        rows, dropped = semi_ar_rows_by_hand(model, ids, labels, valid, gens(len(ids)), block_length)
    assert dropped > 0 or block_length > 1  # one-token blocks: some rows have nothing masked
    assert_close_fp32(loss, torch.stack(rows).mean())


def dllm_rl_trainer(family, **settings):
    torch.manual_seed(0)
    model = tiny_model(family).train()
    data = conversational()
    return DiffusionSFTTrainer(model, args=config("unused", **settings), train_dataset=data,
                               processing_class=TOKENIZER), model


@pytest.mark.parametrize("normalization", ["row_tokens", "row_length"])
def test_the_trainer_draws_dllm_rls_noise(normalization):
    """Configured on the trainer, the loss is the pure function's with the same per-sample generators."""
    length = 50 if normalization == "row_length" else None
    trainer, model = dllm_rl_trainer("sdar", loss_normalization=normalization, loss_normalization_length=length,
                                     **OFFICIAL)
    batch = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        objective = build_objective("block", batch["input_ids"], batch["labels"], batch["attention_mask"].bool(),
                                    sample_generators(batch["sample_index"].tolist(), trainer.args.seed, 0),
                                    mask_token_id=MASK_ID, block_size=4, eps=LOW, high=HIGH, per_token=True,
                                    weighting="none")
        objective.weights = per_row_weights(objective, normalization, batch["labels"].ne(IGNORE_INDEX).sum(-1),
                                            length=length)
        expected = diffusion_loss(model, objective, rows_averaged(objective, normalization), False, MASK_ID)[0]
    assert_close_fp32(loss, expected)


def test_the_trainer_averages_row_masked_over_the_rows_with_a_masked_token():
    """Through the trainer (LLaDA, semi_ar in one-token blocks): the mean, over the rows with a masked token only,
    of each row's loss over its masked tokens, the rows built by hand from the trainer's batch and generators."""
    trainer, model = dllm_rl_trainer("llada", diffusion_objective="semi_ar", semi_ar_block_length=1,
                                     loss_normalization="row_masked", **OFFICIAL)
    batch = next(iter(trainer.get_train_dataloader()))
    model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        generators = sample_generators(batch["sample_index"].tolist(), trainer.args.seed, 0)
        rows, dropped = semi_ar_rows_by_hand(model, batch["input_ids"], batch["labels"],
                                             batch["attention_mask"].bool(), generators, 1)
    assert dropped > 0
    assert_close_fp32(loss, torch.stack(rows).mean())


def test_row_means_under_gradient_accumulation():
    """Per-row means are averaged over accumulation steps, as dLLM-RL's accelerate loop does: 1 x batch 4 and
    2 x batch 2 take the same SGD step and log the same loss."""
    deltas, losses = [], []
    for batch_size, accumulation in ((4, 1), (2, 2)):
        trainer, model = dllm_rl_trainer("llada", per_device_train_batch_size=batch_size,
                                         gradient_accumulation_steps=accumulation, optim="sgd", learning_rate=0.5,
                                         max_grad_norm=0.0, loss_normalization="row_masked",
                                         mask_ratio_range=[LOW, HIGH], loss_weighting="none")
        trainer.train_dataset = trainer.train_dataset.select([0, 1, 2, 0])  # 4 rows: equal micro-batches
        delta, loss = train_one_step(trainer, model)
        deltas.append(delta)
        losses.append(loss)
    assert_same_step(deltas, losses)


@pytest.mark.parametrize(("settings", "message"), [
    (dict(mask_ratio_range=[0.9, 0.1]), "mask_ratio_range must be"),
    (dict(mask_ratio_range=[0.0, 0.5]), "mask_ratio_range must be"),
    (dict(mask_ratio_sampling="per_token"), "set loss_weighting='none'"),
    (dict(mask_ratio_sampling="per_token", loss_weighting="none", diffusion_objective="complementary"),
     "applies to"),
    (dict(loss_normalization="row_tokens", diffusion_objective="semi_ar"), "applies to"),
    (dict(loss_normalization="row_masked", packing=True), "packed row holds several samples"),
    (dict(mask_ratio_range=[0.1, 0.9], diffusion_objective="trajectory"), "recorded"),
    (dict(loss_normalization="row_length"), "set it"),
    (dict(loss_normalization_length=2000), "applies to loss_normalization='row_length' only"),
    (dict(loss_normalization="row_length", loss_normalization_length=0), "must be >= 1"),
    # mask_eps was accepted and read by nothing
    (dict(mask_ratio_range=[0.2, 0.8], mask_eps=0.3), "mask_eps=0.3 would be ignored: mask_ratio_range"),
    (dict(diffusion_objective="trajectory", mask_eps=0.2), "mask_eps=0.2 would be ignored: 'trajectory'"),
])
def test_settings_that_do_not_fit_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        config("unused", **settings)


def test_the_long_cot_sft_recipe_is_dllm_rls_objective():
    """The sdar_4b_long_cot_sft recipe (dLLM-RL's sft_trado.yaml) parses to dLLM-RL's noise and normalisation."""
    from pathlib import Path

    from test_cli import load_example
    from test_review_cli import CPU

    recipe = Path(__file__).resolve().parents[1] / "trl_diffusion" / "recipes" / "sdar_4b_long_cot_sft.yaml"
    args = load_example("sft").make_parser().parse_args_and_config(["--config", str(recipe), *CPU])[1]
    assert (args.mask_ratio_range, args.mask_ratio_sampling, args.loss_normalization, args.loss_normalization_length,
            args.loss_weighting, args.exclude_mask_token_from_softmax) == (
        [LOW, HIGH], "per_token", "row_length", 2000, "none", False)
