"""``DiffusionValueTrainer`` rows built from a batched ``generate()`` output: ``prompt_ids`` sliced at the prompt width
(``out.sequences[r, :P]``, left-padded) with a ``prompt_mask`` column, as TraceRL carries them. The mask's 0s are
dropped, so the rows score as the sampler's states; before, the column was ignored and the pads (valid ids, pad ==
EOS) were read as prompt tokens: values off by 5-26 for every family, without an error. Without a mask, a row that
starts with the pad token is warned about; a malformed mask is refused naming the row."""

import logging

import pytest
import torch
from datasets import Dataset, IterableDataset

from trl_diffusion.estimators.trajectory import trajectory_layout
from trl_diffusion.states import attention_mask_from_positions, left_pad, positions_from_padding, state_before_step
from trl_diffusion.testing import EOS_ID, build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()
PROMPTS = ["Tell me a story", "Hi", "What is 12+7?", "ab"]  # the first is the longest: rows 0 and 1 are unpadded
SAMPLES = 2
ROW = dict(prompt_ids=[EOS_ID, EOS_ID, 20, 21], prompt_mask=[0, 0, 1, 1], completion_ids=[30, 31, 32, 33],
           unmask_step=[0, 1, 1, 2], reward=1.0)
LOGGER = "trl_diffusion.value.value_trainer"


def value_trainer(tmp_path, value_model, dataset, **overrides) -> DiffusionValueTrainer:
    args = DiffusionValueConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1,
                                save_strategy="no", **overrides)
    return DiffusionValueTrainer(value_model, args=args, train_dataset=dataset, processing_class=TOKENIZER)


def rollouts(family: str):
    """The policy, its left-padded prompts ``(ids, mask)`` repeated per sample, and ``generate()``'s output (with a
    stop id the policy commits, so some canvases end in -1 steps)."""
    policy = tiny_model(family)
    ids, mask = left_pad([TOKENIZER.encode(p, add_special_tokens=False) for p in PROMPTS], TOKENIZER.pad_token_id)
    settings = dict(max_new_tokens=8, block_length=4, denoising_steps=2, temperature=1.0, num_return_sequences=SAMPLES,
                    return_dict_in_generate=True)
    first = policy.generate(ids, mask, generator=torch.Generator().manual_seed(1), stop_token_ids=[], **settings)
    stop = int(first.sequences[0, ids.shape[1] + 1])
    out = policy.generate(ids, mask, generator=torch.Generator().manual_seed(1), stop_token_ids=[stop], **settings)
    return policy, ids.repeat_interleave(SAMPLES, 0), mask.repeat_interleave(SAMPLES, 0), out


def value_model_of(policy) -> DiffusionValueModel:
    """A value model with a random head (``from_policy``'s is zero: every value 0, every layout alike)."""
    value_model = DiffusionValueModel.from_policy(policy).eval()
    with torch.no_grad():
        value_model.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    return value_model


def trainer_values(trainer: DiffusionValueTrainer) -> torch.Tensor:
    """The values the trainer fits, ``[B, C]``, for its whole training set in one batch."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(trainer.train_dataset))])
    with torch.no_grad():
        return trainer.compute_loss(trainer.model, batch, return_outputs=True)[1]


def sampler_state_values(value_model, prompt_mask: torch.Tensor, out) -> torch.Tensor:
    """Each committed token's value on the state the sampler saw before committing it, ``[B, C]``: the value model
    run on ``generate()``'s own left-padded layout, one forward per step."""
    width = prompt_mask.shape[1]
    valid, generated = trajectory_layout(prompt_mask, out.sequences.shape[1] - width)
    positions = positions_from_padding(valid)
    attention = attention_mask_from_positions(positions, positions, valid, value_model.block_size)
    sequences = out.sequences.masked_fill(~valid, value_model.mask_token_id)
    values = torch.zeros(out.sequences.shape)
    with torch.no_grad():
        for step in range(int(out.unmask_step.max()) + 1):
            state = state_before_step(sequences, out.unmask_step, generated, step, value_model.mask_token_id)
            scored = value_model(input_ids=state, attention_mask=attention, position_ids=positions).value
            values = torch.where(out.unmask_step == step, scored, values)
    return values[:, width:]


def generate_rows(ids: torch.Tensor, mask: torch.Tensor, out, layout: str) -> list[dict]:
    """Value rows from ``generate()``'s output, as docs/value.md builds them: the prompt ``unpadded``, ``masked``
    (sliced at the prompt width with a ``prompt_mask``) or ``padded`` (sliced, no mask: the bug's rows); the
    completion is the whole canvas after the prompt, right padding and -1 steps included."""
    width, rows = ids.shape[1], []
    for r in range(ids.shape[0]):
        prompt = ids[r][mask[r].bool()] if layout == "unpadded" else out.sequences[r, :width]
        rows.append({"prompt_ids": prompt.tolist(), "completion_ids": out.sequences[r, width:].tolist(),
                     "unmask_step": out.unmask_step[r, width:].tolist(), "reward": 1.0,
                     **({"prompt_mask": mask[r].tolist()} if layout == "masked" else {})})
    return rows


def test_masked_prompts_score_as_the_samplers_states(tmp_path, family, caplog):
    policy, ids, mask, out = rollouts(family)
    committed = out.unmask_step[:, ids.shape[1]:] >= 0
    assert (~committed).any() and (mask == 0).any()  # stopped canvases (-1 tails) and padded prompts are covered
    value_model = value_model_of(policy)
    reference = sampler_state_values(value_model, mask, out)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        masked = value_trainer(tmp_path, value_model, Dataset.from_list(generate_rows(ids, mask, out, "masked")))
        unpadded = value_trainer(tmp_path, value_model, Dataset.from_list(generate_rows(ids, mask, out, "unpadded")))
    assert not caplog.records  # neither layout looks padded
    assert "prompt_mask" not in masked.train_dataset.column_names
    assert masked.train_dataset["prompt_ids"] == unpadded.train_dataset["prompt_ids"]
    values = trainer_values(masked)
    scale = max(1.0, float(reference[committed].abs().max()))
    torch.testing.assert_close(values[committed], trainer_values(unpadded)[committed], rtol=0, atol=1e-5 * scale)
    torch.testing.assert_close(values[committed], reference[committed], rtol=0, atol=1e-4 * scale)


def test_sliced_prompts_without_a_mask_are_warned_about_once(tmp_path, caplog):
    policy, ids, mask, out = rollouts("sdar")
    rows = generate_rows(ids, mask, out, "padded")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        value_trainer(tmp_path, value_model_of(policy), Dataset.from_list(rows))
    assert len(caplog.records) == 1  # rows 2-7 are all padded: the first is named
    assert "train_dataset row 2: 'prompt_ids' starts with the pad token '<|endoftext|>' (id 0)" in caplog.text
    assert "'prompt_mask'" in caplog.text and "strip the padding" in caplog.text


def test_rows_that_do_not_look_padded_are_not_warned_about(tmp_path, caplog):
    # the tiny tokenizer has no BOS; released ones: SDAR/TraDo none, LLaDA's and Dream's BOS is not their pad token
    base = {k: v for k, v in ROW.items() if k not in ("prompt_ids", "prompt_mask")}
    datasets = [[{**base, "prompt": "Hi"}], [{**base, "prompt": [{"role": "user", "content": "Hi"}]}],
                [{**base, "prompt_ids": TOKENIZER.encode("Hi")}],
                [{**base, "prompt_ids": [EOS_ID, 20], "prompt_mask": [1, 1]}]]  # the mask says it is a prompt token
    model = value_model_of(tiny_model("sdar"))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        trainers = [value_trainer(tmp_path, model, Dataset.from_list(rows)) for rows in datasets]
    assert not caplog.records
    assert trainers[-1].train_dataset["prompt_ids"] == [[EOS_ID, 20]]


@pytest.mark.parametrize("mask,message", [
    ([0, 1, 0, 1], r"row 1: 'prompt_mask'\[2\] is 0 after the 1 at column 1: only left padding"),
    ([1, 1, 1, 0], r"row 1: 'prompt_mask'\[3\] is 0 after the 1 at column 0"),
    ([0, 0, 0, 0], r"row 1: 'prompt_mask' is all 0"),
    ([0, 1, 1], r"row 1: 'prompt_mask' must hold one 0 or 1 per 'prompt_ids' token \(4\), got 3 entries"),
    (None, r"row 1: 'prompt_mask' must hold one 0 or 1 per 'prompt_ids' token \(4\), got None \(a missing value\)"),
    ([0, 2, 1, 1], r"row 1: 'prompt_mask'\[1\] must be 0 \(padding\) or 1 \(prompt token\), got 2"),
    # a float in one row makes the column float (Arrow): the first row is refused, as float ids are
    ([0.0, 0.0, 1.0, 1.0], r"row 0: 'prompt_mask'\[0\] must be 0 \(padding\) or 1 \(prompt token\), got 0.0"),
])
def test_a_mask_that_is_not_left_padding_is_refused_by_row(tmp_path, mask, message):
    rows = [ROW, {**ROW, "prompt_mask": mask}]
    with pytest.raises(ValueError, match=message):
        value_trainer(tmp_path, value_model_of(tiny_model("sdar")), Dataset.from_list(rows))


def test_a_mask_without_prompt_ids_is_refused(tmp_path):
    row = {**{k: v for k, v in ROW.items() if k != "prompt_ids"}, "prompt": "Hi"}
    with pytest.raises(ValueError, match="'prompt_mask' column but no 'prompt_ids'.*drop 'prompt_mask'"):
        value_trainer(tmp_path, value_model_of(tiny_model("sdar")), Dataset.from_list([row]))


def test_masked_rows_train_and_evaluate_from_a_stream_too(tmp_path):
    booleans = {"prompt_mask": [False, False, True, True]}  # a boolean mask (torch's .bool().tolist()) is one too
    rows = [{**ROW, **booleans}, {**ROW, "prompt_ids": [EOS_ID, 22, 23, 24], "prompt_mask": [False, True, True, True]}]
    stream = IterableDataset.from_generator(lambda: iter(rows))  # declares no columns
    trainer = value_trainer(tmp_path, value_model_of(tiny_model("sdar")), stream, per_device_train_batch_size=2)
    prepared = list(trainer.train_dataset)
    assert [row["prompt_ids"] for row in prepared] == [[20, 21], [22, 23, 24]]
    assert all("prompt_mask" not in row for row in prepared)
    trainer.train()
    assert "eval_loss" in trainer.evaluate(Dataset.from_list(rows))
