"""``trajectory`` SFT rows of rollouts that stopped early: the canvas tail a sampler never committed (``unmask_step``
-1 after a row's last committed token) is masked in every state, not scored and not counted as a loss token, so rows
built from ``generate()`` output as docs/sft.md says give back the sampler's own ``token_logprobs``."""

import pytest
import torch
from datasets import Dataset

from trl_diffusion.states import block_index, positions_from_padding, step_groups
from trl_diffusion.testing import EOS_ID, MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.trainers.diffusion_losses import (
    IGNORE_INDEX,
    build_objective,
    count_loss_tokens,
    diffusion_loss,
    trajectory_state_rows,
)

TOKENIZER = build_tokenizer()
PROMPTS = ["What is 12+7?", "Hi", "Tell me a story about x", "ab"]
MIDDLE = "before its row's last committed token"


def encode(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


def config(tmp_path, **kw) -> DiffusionSFTConfig:
    defaults = dict(output_dir=str(tmp_path), report_to=[], use_cpu=True, diffusion_objective="trajectory",
                    completion_only_loss=True, save_strategy="no", disable_tqdm=True, max_steps=1,
                    per_device_train_batch_size=2)
    return DiffusionSFTConfig(**{**defaults, **kw})


def rollout(model, repeats: int = 2):
    """Left-padded prompts and a sampled rollout of them (float32) with a stop token that ends row 0 after its first
    block: the token row 0 commits first when nothing stops it."""
    prompts = [encode(p) for p in PROMPTS]
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    settings = dict(max_new_tokens=12, block_length=4, denoising_steps=2, temperature=1.0,
                    return_dict_in_generate=True, num_return_sequences=repeats)
    free = model.generate(ids, mask, stop_token_ids=[], generator=torch.Generator().manual_seed(1), **settings)
    stop = int(free.sequences[0, width])
    out = model.generate(ids, mask, stop_token_ids=[stop], generator=torch.Generator().manual_seed(1), **settings)
    return ids.repeat_interleave(repeats, 0), mask.repeat_interleave(repeats, 0), out


def documented_rows(ids, mask, out) -> list[dict]:
    """docs/sft.md's recipe: the prompt without its padding, then the whole canvas after it with its unmask_step
    (the never-committed -1 tail and the pad tokens there included)."""
    width = ids.shape[1]
    rows = []
    for r in range(len(ids)):
        prompt = ids[r][mask[r].bool()].tolist()
        canvas = out.sequences[r, width:].tolist()
        rows.append({"input_ids": prompt + canvas, "completion_mask": [0] * len(prompt) + [1] * len(canvas),
                     "unmask_step": out.unmask_step[r, width:].tolist()})
    return rows


def assert_close_scaled(actual: float, expected: float, rel: float = 1e-4) -> None:
    assert abs(actual - expected) <= rel * max(1.0, abs(expected)), (actual, expected)


def test_rows_of_stopped_rollouts_give_back_the_samplers_logprobs(family, tmp_path):
    """compute_loss x loss tokens equals the sum of the sampler's log-probs over the committed tokens, row by row
    and for the batch of all rows (right-padded), for rollouts that stopped early (a -1 tail) and others alike."""
    model = tiny_model(family)
    ids, mask, out = rollout(model)
    committed = out.unmask_step >= 0
    stopped = committed.sum(-1) < 12  # a row that runs to the end commits max_new_tokens (SDAR: to its block's end)
    assert bool(stopped.any()) and not bool(stopped.all())
    rows = documented_rows(ids, mask, out)
    trainer = DiffusionSFTTrainer(model, args=config(tmp_path), train_dataset=Dataset.from_list(rows),
                                  processing_class=TOKENIZER)
    trainer.model.eval()
    expected = (out.token_logprobs.double() * committed).sum(-1)
    dataset = trainer.train_dataset
    for r in range(len(rows)):
        batch = trainer.data_collator([dataset[r]])
        with torch.no_grad():
            loss = trainer.compute_loss(trainer.model, batch)
        tokens = int(count_loss_tokens(batch["labels"], model.logits_shift))
        assert tokens == int(committed[r].sum())  # the tail is no loss token
        assert_close_scaled(-float(loss) * tokens, float(expected[r]))
    batch = trainer.data_collator([dataset[r] for r in range(len(rows))])
    scoring = build_objective("trajectory", batch["input_ids"], batch["labels"], batch["attention_mask"].bool(), [],
                              mask_token_id=MASK_ID, block_size=model.block_size, unmask_step=batch["unmask_step"],
                              generated=batch.get("generated"))
    if model.block_size is not None:  # SDAR: TraceRL's packed layout, one row per sample, tails included
        assert scoring.input_ids.shape[0] == len(rows)
    with torch.no_grad():
        loss = trainer.compute_loss(trainer.model, batch)
    assert_close_scaled(-float(loss) * int(count_loss_tokens(batch["labels"], model.logits_shift)),
                        float(expected.sum()))


def test_the_tail_is_masked_in_every_state_and_not_scored():
    """One whole row per state (full attention): the -1 tail is a mask in every state and a target in none, whether
    it comes labelled (as a dataset row gives it) or as ``generated`` beside labels without it (as collated)."""
    m = MASK_ID
    ids = torch.tensor([[50, 51, 60, 61, 62, 0, 0]])
    labelled = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 60, 61, 62, 0, 0]])
    steps = torch.tensor([[-1, -1, 1, 0, 1, -1, -1]])
    valid = torch.ones_like(ids).bool()
    expected_ids = [[50, 51, m, m, m, m, m], [50, 51, m, 61, m, m, m]]
    expected_targets = [[0, 0, 0, 1, 0, 0, 0], [0, 0, 1, 0, 1, 0, 0]]
    without_tail = labelled.masked_fill(steps < 0, IGNORE_INDEX)
    for labels, generated in ((labelled, None), (without_tail, labelled != IGNORE_INDEX)):
        batch = build_objective("trajectory", ids, labels, valid, [], mask_token_id=MASK_ID, block_size=None,
                                unmask_step=steps, generated=generated)
        assert batch.input_ids.tolist() == expected_ids
        assert (batch.targets != IGNORE_INDEX).long().tolist() == expected_targets


@pytest.mark.parametrize("shrinkage", [1, 2])
def test_packed_layout_with_a_tail_equals_one_row_per_state(shrinkage):
    """SDAR: TraceRL's packed row keeps the tail masked in the copy of its block, as the whole rows per state do."""
    model = tiny_model("sdar")
    ids = torch.tensor([[50, 51, 60, 61, 62, 63, 64, 0, 0, 0], [52, 53, 54, 65, 66, 67, 68, 69, 0, 0]])
    labels = torch.tensor([[IGNORE_INDEX] * 2 + [60, 61, 62, 63, 64, 0, 0, 0],
                           [IGNORE_INDEX] * 3 + [65, 66, 67, 68, 69, IGNORE_INDEX, IGNORE_INDEX]])
    valid = torch.tensor([[True] * 10, [True] * 8 + [False] * 2])
    steps = torch.tensor([[-1, -1, 0, 1, 2, 2, 3, -1, -1, -1], [-1, -1, -1, 0, 1, 1, 2, 3, -1, -1]])
    batch = build_objective("trajectory", ids, labels, valid, [], mask_token_id=MASK_ID, block_size=4,
                            unmask_step=steps, shrinkage=shrinkage)
    assert batch.input_ids.shape[0] == 2  # packed
    canvas = labels != IGNORE_INDEX
    scored = canvas & (steps >= 0)
    blocks = block_index(positions_from_padding(valid), 4)
    groups = step_groups(torch.where(scored, steps, -1), shrinkage, blocks)
    reference = trajectory_state_rows(ids, scored, valid, groups, MASK_ID, 4, generated=canvas)
    with torch.no_grad():
        packed = diffusion_loss(model, batch, int(scored.sum()), False, MASK_ID)[0]
        rows = diffusion_loss(model, reference, int(scored.sum()), False, MASK_ID)[0]
    assert int((batch.targets != IGNORE_INDEX).sum()) == int(scored.sum())
    assert abs(float(packed) - float(rows)) <= 1e-5 * max(1.0, abs(float(rows)))


def test_the_tail_is_not_a_loss_token(tmp_path):
    """The collator takes the tail out of the labels (Trainer's num_items_in_batch and count_loss_tokens count only
    scored tokens) and passes the whole canvas as ``generated``; a training step and an evaluation run."""
    model = tiny_model("llada")
    rows = [{"input_ids": [50, 51, 60, 61, 0, 0, 0], "completion_mask": [0, 0, 1, 1, 1, 1, 1],
             "unmask_step": [1, 0, -1, -1, -1]},
            {"input_ids": [52, 62, 63], "completion_mask": [0, 1, 1], "unmask_step": [0, 1]}]
    trainer = DiffusionSFTTrainer(model, args=config(tmp_path, per_device_eval_batch_size=2),
                                  train_dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows),
                                  processing_class=TOKENIZER)
    batch = trainer.data_collator([trainer.train_dataset[0], trainer.train_dataset[1]])
    assert (batch["labels"] != IGNORE_INDEX).long().tolist() == [[0, 0, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0]]
    assert batch["generated"].long().tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 0, 0, 0, 0]]
    assert int(count_loss_tokens(batch["labels"])) == 4
    _, counted = trainer.get_batch_samples(iter([batch]), 1, torch.device("cpu"))
    assert int(counted) == 4
    assert trainer.train().training_loss > 0
    assert trainer.evaluate()["eval_loss"] > 0


def test_a_never_committed_token_before_a_committed_one_is_refused(tmp_path):
    """The value trainer's rule: a -1 only after a row's last committed token; and a row must commit something."""
    model = tiny_model("llada")
    middle = [{"input_ids": [50, 60, 61, 62], "completion_mask": [0, 1, 1, 1], "unmask_step": [0, -1, 1]}]
    with pytest.raises(ValueError, match=MIDDLE):
        DiffusionSFTTrainer(model, args=config(tmp_path), train_dataset=Dataset.from_list(middle),
                            processing_class=TOKENIZER)
    nothing = [{"input_ids": [50, 60, 61], "completion_mask": [0, 1, 1], "unmask_step": [-1, -1]}]
    with pytest.raises(ValueError, match="no committed token"):
        DiffusionSFTTrainer(model, args=config(tmp_path), train_dataset=Dataset.from_list(nothing),
                            processing_class=TOKENIZER)
    ids = torch.tensor([[50, 60, 61, 62]])
    labels = torch.tensor([[IGNORE_INDEX, 60, 61, 62]])
    with pytest.raises(ValueError, match=MIDDLE):
        build_objective("trajectory", ids, labels, torch.ones_like(ids).bool(), [], mask_token_id=MASK_ID,
                        block_size=None, unmask_step=torch.tensor([[-1, 0, -1, 1]]))
    # rows used as given (skip_prepare_dataset): refused when their batch is collated
    trainer = DiffusionSFTTrainer(model, args=config(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
                                  train_dataset=Dataset.from_list([{"input_ids": [50, 60, 61, 62],
                                                                    "labels": [IGNORE_INDEX, 60, 61, 62],
                                                                    "unmask_step": [-1, 0, -1, 1]}]),
                                  processing_class=TOKENIZER)
    with pytest.raises(ValueError, match=MIDDLE):
        trainer.data_collator([trainer.train_dataset[0]])


def test_truncation_keeps_the_tail_masked_and_drops_rows_left_with_only_tail(tmp_path):
    """``keep_start`` cuts the tail as any token (what is kept stays -1, labelled, and is taken out of the labels
    when collated); ``keep_end`` cutting into the tail past every committed token drops the row (nothing to train
    on), as rows left without a label are dropped."""
    model = tiny_model("llada")
    rows = [{"input_ids": [50, 51, 60, 61, 0, 0, 0, 0], "completion_mask": [0, 0, 1, 1, 1, 1, 1, 1],
             "unmask_step": [1, 0, -1, -1, -1, -1]},
            {"input_ids": [52, 62, 63, 64, 65], "completion_mask": [0, 1, 1, 1, 1], "unmask_step": [0, 1, 1, 2]}]
    start = DiffusionSFTTrainer(model, args=config(tmp_path, max_length=6), train_dataset=Dataset.from_list(rows),
                                processing_class=TOKENIZER).train_dataset
    assert start[0]["unmask_step"] == [-1, -1, 1, 0, -1, -1]
    assert start[0]["labels"] == [IGNORE_INDEX, IGNORE_INDEX, 60, 61, 0, 0]
    end = DiffusionSFTTrainer(model, args=config(tmp_path, max_length=4, truncation_mode="keep_end"),
                              train_dataset=Dataset.from_list(rows), processing_class=TOKENIZER).train_dataset
    assert len(end) == 1 and end[0]["input_ids"] == [62, 63, 64, 65]


def test_packing_stays_refused_for_trajectory(tmp_path):
    """Packed rows would put several rollouts' canvases in one row; ``trajectory`` takes none (a tail or not)."""
    for name in ("packing", "padding_free"):
        with pytest.raises(ValueError, match="does not apply to diffusion_objective='trajectory'"):
            config(tmp_path, **{name: True})
