"""Rows given to eval and to the value trainer: only the rows evaluated are read and checked, and a bad row is named.

Before, ``evaluate(dataset=rows, max_problems=N)`` read and converted every row: a 1000-row
``IterableDataset`` ran its generator to the end (an unbounded stream never finished) and a bad row past the first
N was an error, while the same rows as a file loaded N problems. A ``test_time_limit`` of ``""`` failed with a bare
``could not convert string to float: ''`` (one the official grader cannot run with is refused before generation),
and a value row with a ``None`` prompt with transformers' "You need to specify either `text` or `text_target`",
neither naming the row.
"""

from __future__ import annotations

import json
import math

import pytest
from datasets import Dataset, IterableDataset

from trl_diffusion.eval import evaluate, load_eval_problems
from trl_diffusion.eval.datasets import problems_from_rows
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value.value_trainer import _prepare_dataset

FAST = dict(max_new_tokens=4, block_length=4, denoising_steps=4, temperature=0.0, progress=False, output_dir=None)
GOOD = [{"question": "What is 1+1?", "answer": "2"}, {"question": "What is 2+2?", "answer": "4"}]
STDIO = {"id": "lc/7", "question": "Echo the input.", "test_method": "stdio", "test_input": ["1\n"],
         "test_output": ["1\n"]}
VALUE_ROW = {"prompt": "abc", "completion_ids": [30, 31], "unmask_step": [0, 1], "reward": 1.0}


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("sdar"), build_tokenizer()


def _counting_stream(reads: dict, total: int = 1000) -> IterableDataset:
    """A streamed dataset of ``total`` math rows whose generator counts the rows read from it in ``reads["n"]``."""

    def rows():
        for i in range(total):
            reads["n"] += 1
            yield {"question": f"What is {i}+1?", "answer": str(i + 1)}

    return IterableDataset.from_generator(rows)


def test_a_stream_is_read_only_up_to_max_problems(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    reads = {"n": 0}
    report = evaluate(model=model, tokenizer=tokenizer, dataset=_counting_stream(reads), max_problems=2, **FAST)
    assert report["num_problems"] == 2 and report["sources"]["dataset"].startswith("custom:")
    assert reads["n"] <= 3  # the whole stream was read: 1000 rows
    generated = (row for row in [*GOOD, {"question": "never read", "answer": None}])  # a plain generator too
    assert evaluate(model=model, tokenizer=tokenizer, dataset=generated, max_problems=2, **FAST)["num_problems"] == 2


@pytest.mark.parametrize("container", [list, Dataset.from_list])
def test_rows_past_max_problems_are_not_converted_as_of_a_file(model_and_tokenizer, tmp_path, container):
    model, tokenizer = model_and_tokenizer
    rows = [*GOOD, {"question": "bad", "answer": None}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    assert len(load_eval_problems(str(path), max_problems=2)[1]) == 2
    report = evaluate(model=model, tokenizer=tokenizer, dataset=container(rows), max_problems=2, **FAST)
    assert report["num_problems"] == 2
    with pytest.raises(ValueError, match="no usable gold answer"):  # evaluated, the bad row is still refused
        evaluate(model=model, tokenizer=tokenizer, dataset=container(rows), **FAST)


@pytest.mark.parametrize("limit", ["", "soon", True])
def test_a_test_time_limit_that_is_not_seconds_names_the_row_and_the_field(limit, tmp_path):
    rows = [{**STDIO, "id": "lc/6"}, {**STDIO, "test_time_limit": limit}]
    message = r"row 1 \(format 'code_tests'\): 'test_time_limit' of problem lc/7 must be a number of seconds"
    with pytest.raises(ValueError, match=message):
        problems_from_rows(rows)
    path = tmp_path / "code.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    with pytest.raises(ValueError, match=message):
        load_eval_problems(str(path))


@pytest.mark.parametrize("limit,seconds", [(None, None), ("2", 2.0), (3, 3.0), (0.5, 0.5), (0, 0.0), (-1, -1.0),
                                           (math.inf, math.inf)])
def test_a_test_time_limit_in_seconds_or_absent_is_read(limit, seconds):
    # 0 / negative / inf load: only the official grader reads the field (the sandbox grader uses code_timeout)
    assert problems_from_rows([{**STDIO, "test_time_limit": limit}])[0].time_limit == seconds


@pytest.mark.parametrize("limit", [0, -1, math.inf])
def test_the_official_grader_refuses_a_limit_it_cannot_run_before_generating(limit, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = [{**STDIO, "id": "lc/6"}, {**STDIO, "test_time_limit": limit}]
    with pytest.raises(ValueError, match=r"--code_grader official .* 1 problem\(s\) have another: 'lc/7'"):
        evaluate(model=model, tokenizer=tokenizer, dataset=rows, code_grader="official", apply_chat_template=False,
                 **FAST)


@pytest.mark.parametrize("prompt,message", [
    (None, r"row 1: 'prompt' must be text or a conversation .*got None"),
    (5, r"row 1: 'prompt' must be text or a conversation .*got a int \(5\)"),
    (["a", "b"], r"row 1: 'prompt' must be text or a conversation .*got a list \(\['a', 'b'\]\)"),
    ("", r"row 1: the prompt is empty \(''\)"),
    ([], r"row 1: the prompt is empty \(\[\]\)"),
])
def test_a_value_prompt_that_is_not_text_nor_a_conversation_names_the_row(prompt, message):
    rows = Dataset.from_list([{**VALUE_ROW, "prompt": prompt}] * 2)  # a one-type column: row 0 has it too
    first = message.replace("row 1", "row 0")
    with pytest.raises(ValueError, match=first):
        _prepare_dataset(rows, build_tokenizer())
    rows = [VALUE_ROW, {**VALUE_ROW, "prompt": prompt}]
    if prompt is None or prompt == "":  # a column that holds text in its other rows
        with pytest.raises(ValueError, match=message):
            _prepare_dataset(Dataset.from_list(rows), build_tokenizer())


def test_a_value_trainer_names_the_row_of_a_missing_prompt_and_reads_conversations(tmp_path):
    from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                save_strategy="no")
    model = DiffusionValueModel.from_policy(tiny_model("sdar"))
    with pytest.raises(ValueError, match=r"row 1: 'prompt' must be text or a conversation .*got None"):
        DiffusionValueTrainer(model, args=args, train_dataset=Dataset.from_list([VALUE_ROW, {**VALUE_ROW,
                              "prompt": None}]), processing_class=build_tokenizer())
    chat = {**VALUE_ROW, "prompt": [{"role": "user", "content": "hi"}]}
    trainer = DiffusionValueTrainer(model, args=args, train_dataset=Dataset.from_list([chat]),
                                    processing_class=build_tokenizer())
    assert len(trainer.train_dataset[0]["prompt_ids"]) > 0
