"""Second review of this release's SFT and value-row checks: fixed-size list columns (a ``List(..., length=n)``
feature or a parquet file's fixed-size lists) crashed the construction checks, which read list offsets; a user's
unpacked rows with list-valued ``sample_index`` / ``sample_offset`` columns were taken for packed rows a trainer
made; a value row with an empty ``prompt`` placeholder beside valid ``prompt_ids`` was refused."""

import pyarrow as pa
import pytest
from datasets import Dataset, Features, List, Value

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.value.value_trainer import _prepare_dataset

TOKENIZER = build_tokenizer()


def sft(tmp_path, dataset, **config):
    args = DiffusionSFTConfig(str(tmp_path), report_to=[], use_cpu=True, max_steps=1, save_strategy="no",
                              disable_tqdm=True, per_device_train_batch_size=2, **config)
    return DiffusionSFTTrainer(tiny_model("llada"), args=args, train_dataset=dataset, processing_class=TOKENIZER)


@pytest.mark.parametrize("objective", ["random_masking", "semi_ar"])
def test_fixed_size_list_columns_are_read(tmp_path, objective):
    rows = {"input_ids": [[40, 41, 42, 50, 51, 52], [43, 44, 45, 53, 54, 55]],
            "completion_mask": [[0, 0, 0, 1, 1, 1]] * 2}
    features = Features({name: List(Value("int64"), length=6) for name in rows})
    sft(tmp_path, Dataset.from_dict(rows, features=features), diffusion_objective=objective).train()
    table = pa.table({name: pa.array(values, type=pa.list_(pa.int64(), 6)) for name, values in rows.items()})
    sft(tmp_path, Dataset(table), diffusion_objective=objective)


def test_a_users_list_valued_seed_columns_are_not_taken_for_packed_rows(tmp_path):
    rows = [{"input_ids": [50, 51, 60, 61], "sample_index": [7, 7], "sample_offset": [1]},
            {"input_ids": [52, 62, 63], "sample_index": [8], "sample_offset": [2, 2]}]
    trainer = sft(tmp_path, Dataset.from_list(rows))
    assert trainer.train_dataset[1]["sample_index"] == 1 and "sample_offset" not in trainer.train_dataset.column_names
    packed = sft(tmp_path, Dataset.from_list(rows), packing=True, max_length=16)
    assert packed.train_dataset[0]["seq_lengths"] == [4, 3]


def test_an_empty_prompt_placeholder_beside_prompt_ids_is_taken():
    rows = Dataset.from_list([{"prompt": "", "prompt_ids": [15, 16], "completion_ids": [30, 31],
                               "unmask_step": [0, 1], "reward": 1.0}])
    assert _prepare_dataset(rows, TOKENIZER)[0]["prompt_ids"] == [15, 16]
