"""SFT audit: preparing a prepared dataset again, the last padded eval batch's normaliser, Dream's per-row masked
count, and complementary masks at ratio 1."""

import math

import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32
from test_sft import PAIRS, TOKENIZER, config, conversational, encode, gens

from trl_diffusion.testing import MASK_ID, tiny_model
from trl_diffusion.trainers import DiffusionSFTTrainer
from trl_diffusion.trainers import sft_trainer as sft_trainer_module
from trl_diffusion.trainers.diffusion_losses import (
    IGNORE_INDEX,
    ScoringBatch,
    build_objective,
    count_loss_tokens,
    per_row_weights,
    rows_averaged,
    scorable,
)

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # their trainers write into output_dir="unused"


@pytest.mark.parametrize("settings", [dict(diffusion_objective="trajectory"), dict(packing=True, max_length=100)],
                         ids=["trajectory", "packing"])
def test_evaluating_the_prepared_eval_set_again_gives_the_same_loss(settings):
    """TRL's preparation is idempotent (``evaluate(trainer.eval_dataset)``); ours must be too: no second spreading of
    ``unmask_step`` (an error), no second packing of packed rows (documents merged into one, new seeds)."""
    if settings.get("diffusion_objective") == "trajectory":
        data = Dataset.from_list([{"prompt": p, "completion": c, "unmask_step": list(range(len(encode(c)) + 1))}
                                  for p, c in PAIRS])
    else:
        data = conversational(PAIRS * 3)
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=config("unused", **settings), train_dataset=data,
                                  eval_dataset=data, processing_class=TOKENIZER)
    first = trainer.evaluate()["eval_loss"]
    assert trainer.evaluate(trainer.eval_dataset)["eval_loss"] == pytest.approx(first, rel=1e-6)
    assert trainer.evaluate(data)["eval_loss"] == pytest.approx(first, rel=1e-6)


def test_a_cut_eval_batch_is_normalised_by_the_tokens_it_keeps(monkeypatch):
    """Trainer's ``prediction_step`` passes ``num_items_in_batch`` counted over the whole padded batch; the loss of
    the real samples kept from a padded last batch is their own token mean (the loss of those samples alone)."""
    trainer = DiffusionSFTTrainer(tiny_model("llada"), args=config("unused", per_device_eval_batch_size=3),
                                  train_dataset=conversational(), eval_dataset=conversational(),
                                  processing_class=TOKENIZER)
    batch = next(iter(trainer.get_eval_dataloader()))
    alone = {k: v[:1] for k, v in batch.items()}
    trainer.model.eval()
    monkeypatch.setattr(sft_trainer_module, "real_eval_rows", lambda accelerator, loader, rows: 1)
    monkeypatch.setattr(sft_trainer_module, "padded_eval_batch", lambda accelerator, loader: True)
    with torch.no_grad():
        cut = trainer.compute_loss(trainer.model, batch, num_items_in_batch=count_loss_tokens(batch["labels"]))
    monkeypatch.setattr(sft_trainer_module, "real_eval_rows", lambda accelerator, loader, rows: None)
    monkeypatch.setattr(sft_trainer_module, "padded_eval_batch", lambda accelerator, loader: False)
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, alone, num_items_in_batch=count_loss_tokens(alone["labels"]))
    assert_close_fp32(cut, expected)


def test_row_masked_counts_only_the_tokens_dream_scores():
    """Dream's shifted logits never score column 0; on plain-text rows that token can be masked, and the per-row
    divisor of ``row_masked`` must not count it (each row's weights then sum to 1 over its scored tokens)."""
    rows = [encode(p + c) for p, c in PAIRS]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)], labels[i, : len(row)], valid[i, : len(row)] = torch.tensor(row), torch.tensor(row), True
    batch = next(b for seed in range(50)
                 for b in [build_objective("random_masking", ids, labels, valid, gens(len(rows), seed),
                                           mask_token_id=MASK_ID, block_size=None, weighting="none")]
                 if (b.targets[:, 0] != IGNORE_INDEX).any())
    weights = per_row_weights(batch, "row_masked", logits_shift=True)
    sums = (weights * scorable(batch, logits_shift=True)).sum(-1)
    torch.testing.assert_close(sums, torch.ones_like(sums))


def test_row_masked_averages_over_the_rows_dream_scores_a_token_of():
    """The rows ``row_masked`` averages over are those with a scored token: a Dream row whose only masked token is
    column 0 (which its shifted logits never score) has no loss and does not count; ``row_tokens`` counts every
    row."""
    ids = torch.arange(5, 17).view(3, 4)
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[0, 0] = ids[0, 0]  # only column 0
    targets[1, [0, 2]] = ids[1, [0, 2]]
    batch = ScoringBatch(ids, torch.arange(4).expand(3, 4), None, targets, (targets != IGNORE_INDEX).float())
    assert rows_averaged(batch, "row_masked", logits_shift=True) == 1
    assert rows_averaged(batch, "row_masked", logits_shift=False) == 2
    assert rows_averaged(batch, "row_tokens", logits_shift=True) == 3


def test_complementary_ratio_one_is_refused_and_never_gives_nan():
    with pytest.raises(ValueError, match="needs high < 1"):
        config("unused", diffusion_objective="complementary", mask_ratio_range=[0.5, 1.0])
    config("unused", diffusion_objective="random_masking", mask_ratio_range=[1.0, 1.0])  # all masked: fine there
    ids = torch.tensor([encode("ab+cd=ef")])
    labels, valid = ids.clone(), torch.ones_like(ids, dtype=torch.bool)
    batch = build_objective("complementary", ids, labels, valid, gens(1), mask_token_id=MASK_ID, block_size=None,
                            eps=1.0, high=1.0)
    assert all(math.isfinite(w) for w in batch.weights.flatten().tolist())


def test_the_trainer_passes_dreams_logits_shift_to_row_masked(monkeypatch):
    """The trainer, not only ``per_row_weights``: on plain-text rows Dream's masked column 0 is not scored, so each
    row's ``row_masked`` weights sum to 1 over its scored tokens (with the masked count taken without the shift, a
    row whose column 0 is masked sums below 1)."""
    import trl_diffusion.trainers.sft_trainer as sft_module

    data = Dataset.from_dict({"text": [p + c for p, c in PAIRS]})
    args = config("unused", loss_normalization="row_masked", loss_weighting="none")
    trainer = DiffusionSFTTrainer(tiny_model("dream"), args=args, train_dataset=data, processing_class=TOKENIZER)
    assert trainer.spec.logits_shift
    seen = []

    def recording(batch, *args, **kwargs):
        weights = per_row_weights(batch, *args, **kwargs)
        seen.append((weights, scorable(batch, logits_shift=True), batch.targets[:, 0] != IGNORE_INDEX))
        return weights

    monkeypatch.setattr(sft_module, "per_row_weights", recording)
    batch = next(iter(trainer.get_train_dataloader()))
    for epoch in range(40):  # other noise draws, until column 0 of some row is masked
        trainer.state.epoch = epoch
        with torch.no_grad():
            trainer.compute_loss(trainer.model, batch)
        if seen[-1][2].any():
            break
    weights, scored, first_masked = seen[-1]
    assert first_masked.any()  # the premise
    sums = (weights * scored).sum(-1)
    has = scored.any(-1)
    torch.testing.assert_close(sums[has], torch.ones_like(sums[has]))


# Found by probing the trainer with TRL's dataset formats (a second audit).


def _steps_rows(extra=0):
    """Prompt-completion rows with a recorded ``unmask_step`` (``extra`` entries too many)."""
    return Dataset.from_list([{"prompt": p, "completion": c, "unmask_step": list(range(len(encode(c)) + 1 + extra))}
                              for p, c in PAIRS])


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_an_unmask_step_column_is_ignored_by_the_objectives_that_do_not_read_it(family):
    # rollouts saved as SFT data keep their `unmask_step`; `block` / `random_masking` failed at the first batch
    # ("a row of 25 tokens has 11 'unmask_step' entries ... skip_prepare_dataset") instead of ignoring it, as TRL
    # ignores any column it does not use
    losses = []
    for data in (_steps_rows(), _steps_rows().remove_columns("unmask_step")):
        trainer = DiffusionSFTTrainer(tiny_model(family), args=config("unused"), train_dataset=data,
                                      processing_class=TOKENIZER)
        batch = next(iter(trainer.get_train_dataloader()))
        assert "unmask_step" not in batch
        losses.append(trainer.train().training_loss)
    assert losses[0] == losses[1]


def test_a_users_sample_index_column_does_not_mark_a_dataset_as_prepared():
    # "input_ids" + "sample_index" was taken as "prepared by this trainer": TRL's preparation was skipped whole, so
    # completion_mask was ignored (the prompt scored), max_length did not truncate and every row had seed 0
    rows = []
    for p, c in PAIRS + [("A long question " * 8, "a long answer " * 4)]:
        prompt, completion = encode(p), encode(c)
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    args = config("unused", completion_only_loss=True, max_length=20)
    plain = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=Dataset.from_list(rows),
                                processing_class=TOKENIZER).train_dataset
    with_column = Dataset.from_list([{**row, "sample_index": 0} for row in rows])
    prepared = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=with_column,
                                   processing_class=TOKENIZER).train_dataset
    for column in ("input_ids", "labels", "sample_index"):
        assert prepared[column] == plain[column]
    assert len(prepared) == len(plain) and max(len(ids) for ids in prepared["input_ids"]) <= 20
    assert prepared["sample_index"] == list(range(len(prepared)))  # the trainer's seeds, not the column's zeros


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_too_many_steps_are_an_error_also_for_a_row_of_exactly_max_length(truncation_mode):
    # a row whose length happened to equal max_length was taken as truncated: its extra `unmask_step` entries were
    # dropped silently (the first ones kept, or the last ones with keep_end) instead of refused as at any other length
    row_length = len(encode(PAIRS[0][0])) + len(encode(PAIRS[0][1])) + 1
    data = Dataset.from_list([{"prompt": PAIRS[0][0], "completion": PAIRS[0][1],
                               "unmask_step": list(range(len(encode(PAIRS[0][1])) + 4))}])
    for max_length in (64, row_length):
        with pytest.raises(ValueError, match="'unmask_step' has"):
            DiffusionSFTTrainer(tiny_model("sdar"), train_dataset=data, processing_class=TOKENIZER,
                                args=config("unused", diffusion_objective="trajectory", max_length=max_length,
                                            truncation_mode=truncation_mode))


@pytest.mark.parametrize("truncation_mode", ["keep_start", "keep_end"])
def test_truncated_trajectory_rows_keep_the_steps_of_the_tokens_kept(truncation_mode):
    completion = "a long answer " * 4
    steps = list(range(len(encode(completion)) + 1))
    prompt_length = len(encode(PAIRS[0][0]))
    data = Dataset.from_list([{"prompt": PAIRS[0][0], "completion": completion, "unmask_step": steps}])
    max_length = prompt_length + 5
    row = DiffusionSFTTrainer(tiny_model("sdar"), train_dataset=data, processing_class=TOKENIZER,
                              args=config("unused", diffusion_objective="trajectory", max_length=max_length,
                                          truncation_mode=truncation_mode)).train_dataset[0]
    assert len(row["input_ids"]) == len(row["unmask_step"]) == max_length
    kept = [step for step, label in zip(row["unmask_step"], row["labels"]) if label != IGNORE_INDEX]
    assert kept == (steps[:5] if truncation_mode == "keep_start" else steps[-max_length:])


def test_a_micro_batch_that_scores_no_token_logs_no_entropy_or_accuracy(tmp_path, monkeypatch):
    """Low mask ratios on one-letter answers: some micro-batches mask nothing. Their entropy and accuracy were
    logged as 0.0 and averaged in (logged entropy 1.47 for 3.93 over the micro-batches that scored a token)."""
    seen = []
    log_metrics = DiffusionSFTTrainer._log_metrics

    def recording(self, mode, inputs, scores, counted=True):
        seen.append((mode, int(scores.scored.sum()), float(scores.entropy.sum()), int(scores.is_top1.sum())))
        return log_metrics(self, mode, inputs, scores, counted)

    monkeypatch.setattr(DiffusionSFTTrainer, "_log_metrics", recording)
    pairs = [(a, b) for a, b in zip("acegikmo", "bdfhjlnp")]
    trainer = DiffusionSFTTrainer(tiny_model("llada"), processing_class=TOKENIZER, train_dataset=conversational(pairs),
                                  args=config(tmp_path, per_device_train_batch_size=1, gradient_accumulation_steps=8,
                                              mask_ratio_range=[0.05, 0.3], learning_rate=0.0))
    trainer.train()
    scored = [(count, entropy, correct) for mode, count, entropy, correct in seen if mode == "train" and count > 0]
    assert 0 < len(scored) < len(seen)  # some micro-batches masked nothing
    logged = trainer.state.log_history[0]
    assert logged["entropy"] == pytest.approx(sum(e / n for n, e, _ in scored) / len(scored), rel=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(sum(c / n for n, _, c in scored) / len(scored), abs=1e-6)


def test_num_tokens_counts_the_samples_tokens_not_the_padding():
    """``num_tokens`` (TRL's metric) counts the real tokens of the trained samples: the three rows' own lengths, not
    the padded batch's width times three."""
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=config("unused", per_device_train_batch_size=3),
                                  train_dataset=conversational(), processing_class=TOKENIZER)
    lengths = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    assert len(lengths) == 3 and len(set(lengths)) > 1  # a padded batch
    trainer.train()
    (logged,) = [entry["num_tokens"] for entry in trainer.state.log_history if "loss" in entry]
    assert logged == sum(lengths)
