"""Data given in other containers and file layouts: the value trainer's streams and containers, eval's and training's
readers of the same local files, SFT rows with a ``seq_lengths`` column of the user's, and rows of a DataFrame given
to ``evaluate``."""

import json

import pandas as pd
import pytest
from datasets import Dataset, DatasetDict, IterableDataset

from trl_diffusion.data import load_training_dataset
from trl_diffusion.data.loading import rows_wrapper_key
from trl_diffusion.eval import evaluate
from trl_diffusion.eval.datasets import load_eval_problems
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()
TRAJECTORY = dict(prompt="abc", completion_ids=[30, 31, 32, 33], unmask_step=[0, 0, 1, 1], reward=1.0)
QA = [{"question": "What is 2+3?", "answer": "5"}, {"question": "1+1?", "answer": "2"}]


def value_trainer(tmp_path, train_dataset, **settings):
    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                save_strategy="no", per_device_train_batch_size=2, disable_tqdm=True,
                                logging_steps=1, **settings)
    return DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")), args=args,
                                 train_dataset=train_dataset, processing_class=TOKENIZER)


# ------------------------------------------------------------------------------------------------ A: evaluate(stream)


def test_a_stream_passed_to_evaluate_is_prepared_and_checked_as_a_dataset_is(tmp_path):
    # it skipped preparation: text prompts failed with KeyError 'prompt_ids', an out-of-vocabulary id with a bare
    # IndexError (the same stream given as eval_dataset= to the constructor worked)
    trainer = value_trainer(tmp_path, Dataset.from_list([TRAJECTORY] * 2))
    expected = trainer.evaluate(Dataset.from_list([TRAJECTORY] * 2))["eval_loss"]
    stream = Dataset.from_list([TRAJECTORY] * 2).to_iterable_dataset()
    assert trainer.evaluate(stream)["eval_loss"] == pytest.approx(expected)
    oov = {**TRAJECTORY, "prompt_ids": [1, 2], "completion_ids": [30, 5000, 1, 2]}
    with pytest.raises(ValueError, match=r"row 0: 'completion_ids'\[1\] must be an integer \[0, 128\)"):
        trainer.evaluate(Dataset.from_list([oov] * 2).to_iterable_dataset())
    with pytest.raises(ValueError, match="row 0: 'reward' must be a finite number"):
        trainer.evaluate(Dataset.from_list([{**TRAJECTORY, "reward": float("nan")}] * 2).to_iterable_dataset())
    with pytest.raises(TypeError, match=r"`eval_dataset` must be a `Dataset` or `IterableDataset`, got `list`"):
        trainer.evaluate([TRAJECTORY] * 2)


# ------------------------------------------------------------------------------- B: value datasets of other types


def test_the_value_trainer_trains_on_a_stream_that_does_not_declare_its_columns(tmp_path):
    # IterableDataset.from_generator has column_names None: TypeError 'NoneType' object is not iterable
    def rows():
        yield from [TRAJECTORY, {**TRAJECTORY, "reward": 0.0}]

    trainer = value_trainer(tmp_path, IterableDataset.from_generator(rows))
    trainer.train()
    assert [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    def without_reward():
        yield {key: value for key, value in TRAJECTORY.items() if key != "reward"}

    with pytest.raises(ValueError, match=r"missing \['reward'\]"):
        value_trainer(tmp_path, IterableDataset.from_generator(without_reward))


@pytest.mark.parametrize("container,message", [
    ("datasetdict", r"got `DatasetDict`: pick one split"),  # was: missing [...] (has ['test', 'train'])
    ("list", r"got `list`: convert rows with datasets.Dataset.from_list"),  # was: AttributeError
    ("pandas", r"got `DataFrame`: convert rows .*Dataset.from_pandas"),  # was: AttributeError
])
def test_a_value_dataset_of_another_type_is_refused_as_trl_refuses_it(tmp_path, container, message):
    rows = [TRAJECTORY] * 2
    dataset = {"datasetdict": lambda: DatasetDict(train=Dataset.from_list(rows), test=Dataset.from_list(rows)),
               "list": lambda: rows, "pandas": lambda: pd.DataFrame(rows)}[container]()
    with pytest.raises(TypeError, match=r"`train_dataset` must be a `Dataset` or `IterableDataset`, " + message):
        value_trainer(tmp_path, dataset)


# ------------------------------------------------------------------------ C, D: eval and training read the same files


def test_eval_reads_a_file_with_a_byte_order_mark_as_training_does(tmp_path):
    for name, text in (("bom.jsonl", "\n".join(json.dumps(row) for row in QA)), ("bom.json", json.dumps(QA))):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert load_training_dataset(str(path))["answer"] == ["5", "2"]
        assert [problem.answer for problem in load_eval_problems(str(path))[1]] == ["5", "2"]  # was: "neither JSON"


@pytest.mark.parametrize("name,data,indent", [
    ("meta.json", {"version": 1, "data": QA}, 1),
    ("meta_one_line.json", {"version": 1, "data": QA}, None),
    ("wrapped.jsonl", {"data": QA}, None),
    ("meta.jsonl", {"version": "v2", "data": QA}, None),
])
def test_training_reads_a_file_that_wraps_its_rows_as_eval_does(tmp_path, name, data, indent):
    # eval read 2 problems; training read 1 row with columns data (and version), then failed on a missing column
    path = tmp_path / name
    path.write_text(json.dumps(data, indent=indent))
    assert [problem.answer for problem in load_eval_problems(str(path))[1]] == ["5", "2"]
    dataset = load_training_dataset(str(path))
    assert dataset.column_names == ["question", "answer"] and dataset["answer"] == ["5", "2"]


def test_an_object_that_is_a_row_is_not_read_as_a_wrapper_by_either_reader(tmp_path):
    path = tmp_path / "one.json"
    for row in ({"prompt": "2+2?", "completion": "4", "tools": [{"name": "calc"}]},
                {"messages": [{"role": "user", "content": "hi"}], "id": 3}):
        path.write_text(json.dumps(row))
        assert load_training_dataset(str(path)).column_names == list(row)
    problem = {"problem": "1+1?", "answer": "2", "hints": [{"level": 1, "text": "add"}]}
    for suffix in ("json", "jsonl"):
        path = tmp_path / f"problem.{suffix}"
        path.write_text(json.dumps(problem))
        assert load_training_dataset(str(path)).column_names == list(problem)
        assert [p.answer for p in load_eval_problems(str(path))[1]] == ["2"]


# ------------------------------------------------------------------------------ E: SFT with a `seq_lengths` column


@pytest.mark.parametrize("padding_free", [False, True])
def test_a_users_seq_lengths_column_does_not_make_rows_packed(tmp_path, padding_free):
    # it made the collator take every row for a packed one: "a packed row of 15 tokens has seq_lengths [3]"; TRL's
    # SFTTrainer trains on the same rows (its collator reads the column only with padding_free)
    rows = [{"prompt": p, "completion": c, "seq_lengths": [3]} for p, c in
            [("What is 1+2?\n", "3"), ("Hi\n", "yo"), ("abc\n", "def"), ("x\n", "y")]]
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, gradient_checkpointing=False,
                              save_strategy="no", logging_steps=1, use_cpu=True, disable_tqdm=True,
                              max_length=None if padding_free else 64, per_device_train_batch_size=2, max_steps=1,
                              padding_free=padding_free)
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=Dataset.from_list(rows),
                                  processing_class=TOKENIZER)
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[0] == (1 if padding_free else 2)  # one row per sample, or the batch in one row
    assert batch["sample_index"].tolist() == [0, 1]  # one document per sample
    trainer.train()
    assert [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert "seq_lengths" not in trainer.train_dataset.column_names


# --------------------------------------------------------------------------------- F: evaluate(dataset=DataFrame)


def test_evaluate_takes_the_rows_of_a_dataframe():
    # "each row must be a mapping of column names to values, got a str ('question')": its column names were iterated
    model, tokenizer = tiny_model("sdar", max_position_embeddings=2048), build_tokenizer()
    settings = dict(model=model, tokenizer=tokenizer, output_dir=None, max_new_tokens=4, block_length=4,
                    denoising_steps=4, progress=False)
    report = evaluate(dataset=pd.DataFrame(QA), **settings)
    assert report["num_problems"] == 2 and report["dataset"] == "custom"
    assert report["sources"]["dataset"] == evaluate(dataset=QA, **settings)["sources"]["dataset"]
    # a frame read from parquet (or Dataset.to_pandas()) holds list cells as numpy arrays: MBPP's test_imports
    mbpp = [{"task_id": 1, "text": "Write add(a, b).", "test_list": ["assert add(1, 2) == 3"], "test_setup_code": "",
             "test_imports": ["import math", "import re"]}]
    frame = Dataset.from_list(mbpp).to_pandas()
    assert type(frame.iloc[0]["test_imports"]).__name__ == "ndarray"
    report = evaluate(dataset=frame, code_workers=1, **settings)
    assert report["num_problems"] == 1
    assert report["sources"]["dataset"] == evaluate(dataset=mbpp, code_workers=1, **settings)["sources"]["dataset"]
    # a missing value is NaN in a frame (None in a list of rows): MBPP's prefix failed on `*nan`
    rows = [mbpp[0], {"task_id": 2, "text": "Write sub(a, b).", "test_list": ["assert sub(3, 2) == 1"]}]
    assert evaluate(dataset=pd.DataFrame(rows), code_workers=1, **settings)["num_problems"] == 2


@pytest.mark.parametrize(("data", "key"), [
    ({"question": "Which city is largest?", "answer": "B", "data": [{"city": "A"}, {"city": "B"}]}, None),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}, None),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": []}]}, None),
    ({"query": "weather?", "tools": [{"type": "function"}]}, None),
    ({"version": 1, "data": [{"prompt": "Translate", "from": "en"}, {"prompt": "T2", "from": "fr"}]}, "data"),
    ({"records": [{"prompt": "p", "role": "tutor"}]}, "records"),
    ({"version": 1, "info": {"a": 1}, "problems": [{"question": "q", "answer": "1"}]}, "problems"),
])
def test_the_wrapper_rule_on_single_rows_and_wrappers(data, key):
    # the first version of the shared rule split single rows with a list column into rows of that list
    assert rows_wrapper_key(data) == key

