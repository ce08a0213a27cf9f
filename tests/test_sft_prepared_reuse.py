"""SFT dataset preparation, three seeds of silently wrong data: a dataset prepared by one trainer passed to another
with other settings (it was used as it was: not truncated to the new max_length, not packed), a stream read by
several dataloader workers (each numbered its rows from 0: rows of different workers shared a noise seed), and a
user's ``sample_offset`` column (read by the collator as the noise offset)."""

from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.trainers.sft_trainer import stream_sample_index

TOKENIZER = build_tokenizer()
ROWS = [{"prompt": "abc", "completion": "defghijk"}, {"prompt": "xy", "completion": "zzzzzzz"}] * 2
STREAM_ROWS = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(8)]


def config(tmp_path, **overrides) -> DiffusionSFTConfig:
    fields = dict(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, save_strategy="no",
                  max_length=64, disable_tqdm=True, per_device_train_batch_size=2, max_steps=1)
    return DiffusionSFTConfig(**{**fields, **overrides})


def trainer(tmp_path, dataset, tokenizer=TOKENIZER, **overrides) -> DiffusionSFTTrainer:
    return DiffusionSFTTrainer(tiny_model("sdar"), args=config(tmp_path, **overrides), train_dataset=dataset,
                               processing_class=tokenizer)


# ------------------------------------------------------------------------------------ a prepared dataset again


@pytest.mark.parametrize("settings, named", [
    (dict(max_length=8), "max_length=64 when prepared, 8 now"),
    (dict(max_length=32, packing=True), "packing=False when prepared, True now"),
    # the settings as configured (None: TRL's choice by the data's format), not TRL's inference from the first row
    (dict(completion_only_loss=False), "completion_only_loss=None when prepared, False now"),
], ids=["max_length", "packing", "completion_only_loss"])
def test_a_dataset_prepared_with_other_settings_is_refused(tmp_path, settings, named):
    # it was used as it was: rows of 12 and 10 tokens stayed so under max_length=8, and packing left 4 unpacked
    # rows without seq_lengths, where the same rows given as they were gave 2 packed rows
    first = trainer(tmp_path, Dataset.from_list(ROWS))
    with pytest.raises(ValueError, match=named) as refused:
        trainer(tmp_path, first.train_dataset, **settings)
    assert "Pass the dataset given to that trainer" in str(refused.value)


def test_the_remedy_prepares_the_raw_rows_for_the_new_settings(tmp_path):
    raw = Dataset.from_list(ROWS)
    first = trainer(tmp_path, raw)
    assert max(len(ids) for ids in first.train_dataset["input_ids"]) > 8
    assert max(len(ids) for ids in trainer(tmp_path, raw, max_length=8).train_dataset["input_ids"]) == 8


def test_a_dataset_prepared_with_the_same_settings_is_used_as_it_is(tmp_path):
    """A sweep over settings that do not change the rows (here the learning rate), with the tokenizer loaded again for
    each trainer: the rows are the ones this trainer would make."""
    first = trainer(tmp_path, Dataset.from_list(ROWS))
    again = trainer(tmp_path, first.train_dataset, tokenizer=build_tokenizer(), learning_rate=1e-3)
    assert again.train_dataset is first.train_dataset


def test_a_dataset_prepared_with_another_tokenizer_is_refused(tmp_path):
    first = trainer(tmp_path, Dataset.from_list(ROWS))
    other = build_tokenizer()
    other.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    with pytest.raises(ValueError, match="another tokenizer"):
        trainer(tmp_path, first.train_dataset, tokenizer=other)


def test_evaluating_packed_training_rows_without_eval_packing_is_refused(tmp_path):
    # TRL packs the eval set by eval_packing: the packed training rows are not what eval_packing=False makes
    packed = trainer(tmp_path, Dataset.from_list(ROWS), max_length=32, packing=True, eval_packing=False)
    with pytest.raises(ValueError, match="packing=True when prepared, False now"):
        packed.evaluate(packed.train_dataset)


# ------------------------------------------------------------------------------- streams and dataloader workers


def stream(num_shards: int = 4):
    return Dataset.from_list(STREAM_ROWS).to_iterable_dataset(num_shards=num_shards)


def seeds_by_row(rows) -> dict[str, int]:
    """``sample_index`` of each prepared row, by its text (every row is distinct)."""
    return {TOKENIZER.decode(row["input_ids"]): int(row["sample_index"]) for row in rows}


def test_the_workers_rows_are_numbered_without_gaps_or_repeats():
    for workers in (1, 2, 3):
        numbered = [stream_sample_index(index, worker, workers) for worker in range(workers) for index in range(5)]
        assert sorted(numbered) == list(range(5 * workers))


def test_each_worker_of_a_stream_gives_its_rows_seeds_of_their_own(tmp_path, monkeypatch):
    """The stream read as each dataloader worker reads it (``datasets`` gives worker w of n every n-th shard, by the
    worker info torch sets in the worker): every row of the pass gets its own seed; without workers, its index."""
    prepared = trainer(tmp_path, stream()).train_dataset
    assert list(seeds_by_row(prepared).values()) == list(range(len(STREAM_ROWS)))
    seeds = {}
    for worker in range(2):
        monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda w=worker: SimpleNamespace(id=w, num_workers=2))
        seeds.update(seeds_by_row(prepared))
    assert len(seeds) == len(STREAM_ROWS)
    assert sorted(seeds.values()) == list(range(len(STREAM_ROWS)))  # each worker counted 0..3: pairs shared a seed


def test_a_stream_loaded_by_two_worker_processes_has_distinct_seeds(tmp_path):
    loader = trainer(tmp_path, stream(), dataloader_num_workers=2).get_train_dataloader()
    seeds = [index for batch in loader for index in batch["sample_index"].tolist()]
    assert sorted(seeds) == list(range(len(STREAM_ROWS)))


# ------------------------------------------------------------------------------ a user's sample_offset column


@pytest.mark.parametrize("streamed", [False, True], ids=["dataset", "stream"])
@pytest.mark.parametrize("offset", [lambda i: i * 1000, lambda i: f"id-{i}"], ids=["int", "str"])
def test_a_users_sample_offset_column_is_not_the_noise_offset(tmp_path, streamed, offset):
    # the collator read it as the seed's offset (sample_offset=tensor([0, 1000]): other masks), or failed at the first
    # batch with "too many dimensions 'str'"
    data = Dataset.from_list([{**row, "sample_offset": offset(i)} for i, row in enumerate(ROWS)])
    plain = Dataset.from_list(ROWS)
    if streamed:
        data, plain = data.to_iterable_dataset(), plain.to_iterable_dataset()
    batches = []
    for dataset in (data, plain):
        sft = trainer(tmp_path, dataset)
        rows = [row for row, _ in zip(sft.train_dataset, range(2))]
        assert all("sample_offset" not in row for row in rows)
        batches.append(sft.data_collator(rows))
    assert batches[0].keys() == batches[1].keys()
    for key, value in batches[0].items():
        torch.testing.assert_close(value, batches[1][key])
