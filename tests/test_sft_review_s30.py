"""SFT review 30: each test failed before its fix.

* a packed prepared dataset given to a second trainer with the same settings was refused: the settings recorded
  TRL's ``completion_only_loss`` inferred from the first row (True for prompt/completion rows, False for packed ones);
* a ``select`` / ``shuffle`` copy of a packed prepared dataset was packed again: its rows' documents joined into one
  (``seq_lengths`` [[12, 12], ...] became [[24], ...]), with new noise seeds;
* a ``formatting_func`` re-created for each trainer (compared by identity) refused the prepared rows, which TRL never
  formats again;
* the ``semi_ar`` construction check held int64 copies of every token (+1.7 GiB for 50M tokens);
* the collator's mask-token refusal named no token, sample or remedy, and said "training" during ``evaluate``.
"""

import functools
import re
import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest
from datasets import Dataset, IterableDataset, concatenate_datasets
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from trl_diffusion.testing import EOS_ID, MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer, sft_trainer
from trl_diffusion.trainers.diffusion_losses import IGNORE_INDEX
from trl_diffusion.trainers.sft_trainer import DiffusionDataCollator

TOKENIZER = build_tokenizer()
ROWS = [{"prompt": "abc", "completion": "defghijk"}, {"prompt": "xy", "completion": "zzzzzzz"}] * 4
NOISE = ("input_ids", "labels", "sample_index", "sample_offset")


def config(tmp_path, **overrides) -> DiffusionSFTConfig:
    fields = dict(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, save_strategy="no",
                  max_length=32, disable_tqdm=True, per_device_train_batch_size=2, max_steps=1,
                  dataset_num_proc=None)
    return DiffusionSFTConfig(**{**fields, **overrides})


def trainer(tmp_path, dataset, eval_dataset=None, **overrides) -> DiffusionSFTTrainer:
    return DiffusionSFTTrainer(tiny_model("sdar"), args=config(tmp_path, **overrides), train_dataset=dataset,
                               eval_dataset=eval_dataset, processing_class=TOKENIZER)


def packed(tmp_path, **overrides) -> DiffusionSFTTrainer:
    return trainer(tmp_path, Dataset.from_list(ROWS), packing=True, **overrides)


# --------------------------------------------------------------------- 1. completion_only_loss as configured


@pytest.mark.parametrize("packing", [False, True])
def test_a_packed_prepared_dataset_is_reused_with_the_same_settings(tmp_path, packing):
    # refused: "completion_only_loss=True when prepared, False now" (TRL infers it from the first row, which
    # packing left without prompt / completion columns)
    first = trainer(tmp_path, Dataset.from_list(ROWS), packing=packing)
    again = trainer(tmp_path, first.train_dataset, packing=packing, learning_rate=1e-3)
    assert again.train_dataset is first.train_dataset


def test_completion_only_loss_is_compared_as_configured(tmp_path):
    first = packed(tmp_path)
    with pytest.raises(ValueError, match="completion_only_loss=None when prepared, True now"):
        packed(tmp_path / "b", completion_only_loss=True).evaluate(first.train_dataset)


# --------------------------------------------------------------- 2. copies of a packed prepared dataset


def rows_of(dataset) -> list[dict]:
    return [{key: row[key] for key in (*NOISE, "seq_lengths") if key in row} for row in dataset]


@pytest.mark.parametrize("strategy", ["bfd", "wrapped"])
@pytest.mark.parametrize("copy", ["shuffle", "select", "stream"])
def test_a_copy_of_packed_rows_keeps_its_documents_and_noise(tmp_path, strategy, copy):
    """The rows are taken as they are: the same documents (seq_lengths) and noise seeds per token as the original's
    rows. They were packed again as single documents ([[12, 12], [12, 12], [10, 10, 10], [10]] became [[30], [24],
    [24], [10]]), each token's seed replaced by its new row's."""
    original = packed(tmp_path, packing_strategy=strategy).train_dataset
    if strategy == "bfd":
        assert max(len(lengths) for lengths in original["seq_lengths"]) > 1  # rows of several documents
    derived = {"shuffle": lambda: original.shuffle(seed=1), "select": lambda: original.select([2, 0]),
               "stream": lambda: original.to_iterable_dataset()}[copy]()
    again = trainer(tmp_path / "b", derived, packing=True, packing_strategy=strategy, completion_only_loss=True)
    assert rows_of(again.train_dataset) == rows_of(derived)
    assert all(row in rows_of(original) for row in rows_of(derived))


def test_a_shuffled_copy_trains_with_the_original_documents(tmp_path):
    first = packed(tmp_path)
    derived = first.train_dataset.shuffle(seed=0)
    again = trainer(tmp_path / "b", derived, packing=True)
    assert again.train_dataset["seq_lengths"] == derived["seq_lengths"]
    assert again.train_dataset["sample_index"] == derived["sample_index"]
    assert again.train_dataset["sample_offset"] == derived["sample_offset"]
    again.train()


@pytest.mark.parametrize("where", ["train", "evaluate"])
def test_a_copy_of_packed_rows_without_packing_is_refused(tmp_path, where):
    first = packed(tmp_path)
    derived = first.train_dataset.select(range(2))
    with pytest.raises(ValueError, match="packed rows a DiffusionSFTTrainer made .* cannot be unpacked") as refused:
        if where == "train":
            trainer(tmp_path / "b", derived)
        else:
            trainer(tmp_path / "b", Dataset.from_list(ROWS), packing=True, eval_packing=False).evaluate(derived)
    assert "Pass the rows before preparation" in str(refused.value)


def test_a_copy_of_packed_rows_with_another_strategy_or_a_shorter_max_length_is_refused(tmp_path):
    derived = packed(tmp_path).train_dataset.select(range(4))
    with pytest.raises(ValueError, match=r"packing_strategy='bfd' or 'bfd_split' .* packing_strategy='wrapped' now"):
        trainer(tmp_path / "b", derived, packing=True, packing_strategy="wrapped")
    with pytest.raises(ValueError, match="of up to 30 tokens, longer than max_length=16"):
        trainer(tmp_path / "c", derived, packing=True, max_length=16)


def test_a_users_packed_rows_are_not_packed_again(tmp_path):
    """Tokenized rows with seq_lengths are packed rows ("each document kept apart"), with packing on too."""
    ids = [[10, 11, 12, EOS_ID, 20, 21, EOS_ID], [30, 31, EOS_ID, 40, EOS_ID]]
    data = Dataset.from_list([{"input_ids": row, "labels": row, "seq_lengths": lengths}
                              for row, lengths in zip(ids, [[4, 3], [3, 2]])])
    prepared = trainer(tmp_path, data, packing=True, shuffle_dataset=False).train_dataset
    assert prepared["seq_lengths"] == [[4, 3], [3, 2]]
    assert prepared["input_ids"] == ids
    with pytest.raises(ValueError, match="longer than max_length=6"):
        trainer(tmp_path, data, packing=True, max_length=6)


# ------------------------------------------------------------------------------------- 3. formatting_func


def test_a_recreated_formatting_func_does_not_refuse_the_prepared_rows(tmp_path):
    def fmt(example, sep):
        return example["q"] + sep + example["a"]

    def make(dataset, lr):
        return DiffusionSFTTrainer(tiny_model("sdar"), args=config(tmp_path, learning_rate=lr), train_dataset=dataset,
                                   processing_class=TOKENIZER, formatting_func=functools.partial(fmt, sep=" "))

    first = make(Dataset.from_list([{"q": "abc", "a": "defghijk"}, {"q": "xy", "a": "zzzzzzz"}]), 1e-4)
    assert make(first.train_dataset, 1e-3).train_dataset is first.train_dataset


# ----------------------------------------------------------------------- 4. the construction checks' memory


def test_span_counts_match_a_row_by_row_count():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 9, size=200)
    labelled = rng.random(int(lengths.sum())) < 0.6
    offsets = np.concatenate(([0], np.cumsum(lengths)))
    expected = []  # the obvious count: a span starts at a labelled position whose left neighbour in its row is not
    for start, end in zip(offsets[:-1], offsets[1:]):
        row = labelled[start:end]
        expected.append(sum(1 for i in range(len(row)) if row[i] and (i == 0 or not row[i - 1])))
    assert sft_trainer._span_counts(labelled, offsets).tolist() == expected


def several_span_rows() -> Dataset:
    """Rows 2, 5 and 9 with two labelled spans (one row in each chunk of the column); the rest with one."""
    def row(i):
        spans = 2 if i in (2, 5, 9) else 1
        labels = [IGNORE_INDEX] + [7, IGNORE_INDEX] * spans
        ids = [MASK_ID if i in (5, 9) else 8] + [7] * (len(labels) - 1)
        return {"input_ids": ids, "labels": labels}
    return concatenate_datasets([Dataset.from_list([row(i) for i in range(start, start + 4)]) for start in (0, 4, 8)])


@pytest.mark.parametrize("order", ["stored", "shuffled"])
def test_the_column_checks_name_the_right_rows_piece_by_piece(monkeypatch, order):
    dataset = several_span_rows()
    assert dataset.data.column("labels").num_chunks == 3
    if order == "shuffled":
        dataset = dataset.select([9, 0, 5, 1, 2, 3, 4, 6, 7, 8, 10, 11])  # 9 -> 0, 5 -> 2, 2 -> 4
    several, masked = ("2 (2 spans), 5 (2 spans), 9 (2 spans)", "5 (prompt), 9 (prompt)") if order == "stored" else \
        ("0 (2 spans), 2 (2 spans), 4 (2 spans)", "0 (prompt), 2 (prompt)")
    monkeypatch.setattr(sft_trainer, "ARROW_SLICE_ROWS", 3)
    with pytest.raises(ValueError, match=re.escape(f"has 3 row(s) with several: {several}.")):
        sft_trainer._check_one_labelled_span({"train": dataset})
    with pytest.raises(ValueError, match=re.escape(f"in 2 row(s): {masked} (indices")):
        sft_trainer._check_no_mask_token(MASK_ID, "<|MASK|>", {"train": dataset})
    sft_trainer._check_rows_fit(7, None, {"train": dataset})
    with pytest.raises(ValueError, match="a row of 5 tokens"):
        sft_trainer._check_rows_fit(4, None, {"train": dataset})


MEMORY_PROBE = textwrap.dedent("""
    import sys
    import pyarrow as pa
    from datasets import load_from_disk
    from trl_diffusion.trainers import sft_trainer
    stored = load_from_disk(sys.argv[1])  # memory-mapped: the pool holds nothing yet
    sft_trainer.ARROW_SLICE_ROWS = 256
    for order in sys.argv[2:]:
        dataset = stored.shuffle(seed=0) if order == "shuffled" else stored
        sft_trainer._check_one_labelled_span({"train": dataset})
        sft_trainer._check_no_mask_token(3, "<|MASK|>", {"train": dataset})
        sft_trainer._check_rows_fit(10_000, None, {"train": dataset})
        print(order, pa.default_memory_pool().max_memory())  # the largest so far (Arrow keeps no other)
""")


def test_the_column_checks_hold_one_piece_at_a_time(tmp_path):
    """4M tokens (32 MiB per column): the checks held Arrow copies of a whole column (list_flatten of a chunked
    column, Arrow's take of a chunked list column) and, for semi_ar, int64 parent indices and torch copies of every
    token; now one piece of 256 rows (1 MiB) at a time, in the stored order and shuffled (one process, whose peak
    bounds both)."""
    rows, width = 8000, 500
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    labels = np.full(rows * width, 7, dtype=np.int64)
    labels[::width] = IGNORE_INDEX
    column = pa.ListArray.from_arrays(offsets, pa.array(labels))
    Dataset(pa.table({"input_ids": column, "labels": column})).save_to_disk(str(tmp_path / "data"), num_shards=4)
    probe = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path / "data"), "stored", "shuffled"],
                           capture_output=True, text=True, check=True)
    peaks = dict(line.split() for line in probe.stdout.strip().splitlines()[-2:])
    assert peaks.keys() == {"stored", "shuffled"}
    for order, peak in peaks.items():
        assert int(peak) < 12 * 2**20, f"{order}: {int(peak) / 2**20:.0f} MiB"


# ------------------------------------------------------------------------- 5. the collator's mask refusal


MASK_ROWS = [{"prompt": "what is it?", "completion": " a token"}, {"prompt": "what is <|MASK|>?", "completion": " a"}]


def test_a_streams_mask_token_is_refused_naming_the_token_sample_and_remedy(tmp_path):
    sft = trainer(tmp_path, IterableDataset.from_generator(lambda: iter(MASK_ROWS)))
    with pytest.raises(ValueError, match=r"a batch holds the mask token '<\|MASK\|>' \(id 3\) in 1 sample\(s\): "
                                         r"sample_index 1 \(prompt\)") as refused:
        next(iter(sft.get_train_dataloader()))
    assert "sanitize_control_tokens" in str(refused.value) and "remove or escape it" in str(refused.value)
    assert "training sequence" not in str(refused.value)


def test_a_mask_token_in_evaluate_is_refused_with_the_same_message(tmp_path):
    sft = trainer(tmp_path, Dataset.from_list(MASK_ROWS[:1] * 2), per_device_eval_batch_size=2)
    with pytest.raises(ValueError, match=r"a batch holds the mask token '<\|MASK\|>' \(id 3\) .*sample_index 1"):
        sft.evaluate(Dataset.from_list(MASK_ROWS))


def test_the_collators_mask_refusal_names_each_tokens_own_sample():
    """Packed rows carry one sample_index per token: the message names the sample of the token; rows without one
    (skip_prepare_dataset) are named by their row in the batch; the remedy follows assistant_only_loss."""
    base = DataCollatorForLanguageModeling(pad_token_id=EOS_ID)
    packed_row = {"input_ids": [10, 11, 12, MASK_ID, 13], "labels": [-100, 11, -100, MASK_ID, 13],
                  "sample_index": [4, 4, 7, 7, 7], "sample_offset": [0, 1, 0, 1, 2], "seq_lengths": [2, 3]}
    collator = DiffusionDataCollator(base, MASK_ID, EOS_ID, None, mask_token="<|MASK|>", assistant_only_loss=True)
    with pytest.raises(ValueError, match=r"in 1 sample\(s\): sample_index 7 \(completion\)") as refused:
        collator([packed_row])
    assert "sanitize_control_tokens cannot help" in str(refused.value)
    plain = [{"input_ids": [10, 11]}, {"input_ids": [MASK_ID, 12, MASK_ID]}]
    for padding_free in (False, True):
        collator = DiffusionDataCollator(base, MASK_ID, EOS_ID, None, padding_free=padding_free)
        with pytest.raises(ValueError, match=r"the mask token \(id 3\) in 1 sample\(s\): batch row 1 \(completion\)"):
            collator(plain)
