"""SFT refuses rows longer than the model's positions (``max_position_embeddings``; LLaDA's ``max_sequence_length``):
it trained at positions the model has none for, which ``generate()`` then refuses, with no message (the embedded
model has 128 positions and DiffusionSFTConfig's default max_length is 1024)."""

import pytest
from datasets import Dataset, IterableDataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer

ROWS = [{"prompt": [{"role": "user", "content": "What is 12+7? " * 3}],
         "completion": [{"role": "assistant", "content": "The answer is nineteen, 19."}]}] * 4  # 90 tokens


def sft(tmp_path, family, train_dataset, **overrides):
    limit = {"max_sequence_length": 32} if family == "llada" else {"max_position_embeddings": 32}
    config = dict(output_dir=str(tmp_path), report_to="none", use_cpu=True, max_length=128,
                  per_device_train_batch_size=4, max_steps=1, save_strategy="no", disable_tqdm=True)
    return DiffusionSFTTrainer(tiny_model(family, **limit).train(), args=DiffusionSFTConfig(**{**config, **overrides}),
                               train_dataset=train_dataset, processing_class=build_tokenizer())


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_rows_beyond_the_models_positions_are_refused_at_construction(tmp_path, family):
    with pytest.raises(ValueError, match="train dataset has a row of 90 tokens, beyond the model's 32 positions"):
        sft(tmp_path, family, Dataset.from_list(ROWS))
    with pytest.raises(ValueError, match="packed document of 90 tokens, beyond the model's 32 positions"):
        sft(tmp_path, family, Dataset.from_list(ROWS), packing=True)
    with pytest.raises(ValueError, match="pads every row to max_length=128, beyond the model's 32 positions"):
        sft(tmp_path, family, Dataset.from_list(ROWS[:1]), pad_to_length_with_eos=True)
    sft(tmp_path, family, Dataset.from_list(ROWS), max_length=32, truncation_mode="keep_end").train()  # fits: trains


def test_a_stream_is_checked_by_the_collator(tmp_path):
    stream = IterableDataset.from_generator(lambda: iter(ROWS))
    trainer = sft(tmp_path, "sdar", stream)
    with pytest.raises(ValueError, match="a row of 90 tokens needs 90 positions; the model has 32"):
        trainer.train()


def test_a_selection_is_checked_by_its_rows_not_by_the_table(tmp_path):
    """select() keeps the whole table under an index mapping: its longest row need not be the dataset's (review: a
    select([0, 0]) of a table holding a 40-token row was refused)."""
    table = Dataset.from_list([{"input_ids": list(range(10, 30))}, {"input_ids": list(range(10, 50))}])
    trainer = sft(tmp_path, "sdar", table.select([0, 0]), dataset_kwargs={"skip_prepare_dataset": True},
                  per_device_train_batch_size=2, max_length=None)
    trainer.train()


def test_a_shuffled_packed_dataset_is_checked_at_construction(tmp_path):
    """Packing shuffles the packed rows (an index mapping): the first version of the selection rule skipped it, so a
    long document was refused only by the collator, after checkpoints had been written (review)."""
    rows = [{"prompt": [{"role": "user", "content": "abc"}],
             "completion": [{"role": "assistant", "content": "ok"}]}] * 30 + ROWS[:1]
    with pytest.raises(ValueError, match="packed document of 90 tokens, beyond the model's 32 positions"):
        sft(tmp_path, "sdar", Dataset.from_list(rows), packing=True, shuffle_dataset=True)
    table = Dataset.from_list([{"input_ids": list(range(10, 30))}, {"input_ids": list(range(10, 50))}])
    with pytest.raises(ValueError, match="row of 40 tokens"):
        sft(tmp_path, "sdar", table.shuffle(seed=0), dataset_kwargs={"skip_prepare_dataset": True}, max_length=None)
