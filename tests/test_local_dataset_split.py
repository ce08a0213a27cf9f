"""The training examples' local-file loading: a split selects (or slices) the file's one ``train`` split, a config
is refused, and a row without question text is named (before: the split and config were silently ignored, and a
null question was a ``TypeError`` deep inside ``datasets.map``)."""

import json

import pytest
from test_cli import load_example

from trl_diffusion.data import load_training_dataset
from trl_diffusion.scripts.utils import parse_script_args


@pytest.fixture
def local_file(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(5)]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return str(path)


def test_a_split_slices_a_local_file(local_file):
    assert len(load_training_dataset(local_file)) == 5
    assert [row["answer"] for row in load_training_dataset(local_file, split="train[:2]")] == ["1", "2"]


def test_another_split_name_of_a_local_file_is_an_error(local_file):
    with pytest.raises(ValueError, match='Unknown split "test"'):
        load_training_dataset(local_file, split="test")


def test_a_config_with_a_local_file_is_refused(local_file):
    with pytest.raises(ValueError, match="dataset_config='main' was given with the local file"):
        load_training_dataset(local_file, config="main")


def test_math_dataset_names_a_row_without_question_text(tmp_path):
    path = tmp_path / "data.jsonl"
    rows = [{"question": "What is 1+1?", "answer": "2"}, {"question": None, "answer": "3"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    with pytest.raises(ValueError, match=r"row 1 has no question text \('question' = None\)"):
        load_example("math").math_dataset(str(path), None, "train")


def test_math_dataset_keeps_a_missing_gold_answer_missing(tmp_path):
    """A null answer became the text "None", which math_accuracy_reward then scored as a gold answer: a completion
    writing \\boxed{None} earned 1.0. It stays None, so the reward leaves the row out."""
    from trl_diffusion.rewards import math_accuracy_reward

    path = tmp_path / "data.jsonl"
    rows = [{"question": "What is 1+1?", "answer": None}, {"question": "What is 2+2?", "answer": "#### 4"}]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    dataset = load_example("math").math_dataset(str(path), None, "train")
    assert dataset["answer"] == [None, "4"]
    assert math_accuracy_reward(["\\boxed{None}", "\\boxed{4}"], answer=dataset["answer"]) == [None, 1.0]


@pytest.mark.parametrize("example", ["math", "sft", "code"])
def test_the_examples_refuse_a_config_with_a_local_file_before_loading_anything(capsys, local_file, example):
    parser = load_example(example).make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--dataset_name", local_file, "--dataset_config", "main"])
    assert exit_info.value.code == 2
    assert "dataset_config='main' was given with the local file" in capsys.readouterr().err


def test_upper_case_names_and_wrapped_rows_load_as_local_files(tmp_path):
    # `UP.JSONL` was taken for a Hub id (a network error after the model loaded), and `{"rows": [...]}`, which eval
    # reads as its rows, loaded as one row whose only column was the list
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(3)]
    upper = tmp_path / "UP.JSONL"
    upper.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    assert load_training_dataset(str(upper))["answer"] == ["1", "2", "3"]
    wrapped = tmp_path / "wrapped.json"
    for text in (json.dumps({"rows": rows}), json.dumps({"rows": rows}, indent=1)):
        wrapped.write_text(text)
        assert load_training_dataset(str(wrapped)).column_names == ["question", "answer"]
    # one row whose column holds objects is a row, not a wrapper of them (its prompt and completion were lost)
    single = tmp_path / "single.json"
    for row in ({"messages": [{"role": "user", "content": "hi"}]},
                {"prompt": "2+2?", "completion": "4", "tools": [{"name": "calc", "description": "adds"}]}):
        for indent in (None, 1):
            single.write_text(json.dumps(row, indent=indent))
            assert load_training_dataset(str(single)).column_names == list(row)
    wrapped.write_bytes(b"\xef\xbb\xbf" + json.dumps({"rows": rows}, indent=1).encode())
    with pytest.raises(ValueError, match="byte-order mark"):  # loaded as one row with a `rows` column
        load_training_dataset(str(wrapped))
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(rows))
    assert len(load_training_dataset(str(plain))) == 3


@pytest.mark.parametrize("example", ["math", "sft"])
def test_another_kind_of_file_is_refused_before_anything_loads(capsys, tmp_path, example):
    csv = tmp_path / "data.csv"
    csv.write_text("question,answer\n1+1,2\n")
    with pytest.raises(ValueError, match=r"dataset file .*data.csv' is not one of \('.json', '.jsonl', '.parquet'\)"):
        load_training_dataset(str(csv))
    parser = load_example(example).make_parser()
    with pytest.raises(SystemExit) as exit_info:
        parse_script_args(parser, ["--dataset_name", str(csv)])
    assert exit_info.value.code == 2
    assert "is not one of" in capsys.readouterr().err


@pytest.mark.parametrize("name, text", [
    ("empty.jsonl", ""), ("blank.jsonl", "\n \n"), ("list.json", " [ ]\n"), ("rows.json", '{"rows": []}'),
    ("data.json", '{"version": 1, "data": []}'), ("bom.json", "\ufeff[]"),
])
def test_a_file_of_no_rows_is_refused_by_training_and_eval(tmp_path, name, text):
    # training failed with a bare StopIteration or datasets' 'Instruction "train" corresponds to no data!'; eval took
    # an empty wrapper for one row of an unknown format
    from trl_diffusion.eval.datasets import load_eval_problems

    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="holds no rows"):
        load_training_dataset(str(path))
    with pytest.raises(ValueError, match="the dataset has no rows"):
        load_eval_problems(str(path))


def test_a_row_with_an_empty_list_beside_its_columns_stays_a_row(tmp_path):
    path = tmp_path / "row.json"
    path.write_text(json.dumps({"prompt": "2+2?", "completion": "4", "tools": []}))
    assert load_training_dataset(str(path)).column_names == ["prompt", "completion", "tools"]
