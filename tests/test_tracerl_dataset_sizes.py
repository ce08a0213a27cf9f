"""TraceRLTrainer refuses datasets it could never use, by name and with the numbers: an empty train or eval
``Dataset`` (TRL's sampler yields nothing: ``train()`` returned at step 0, ``evaluate()`` logged no ``eval_loss``),
a train ``Dataset`` with fewer prompts than one generation batch takes (TRL's sampler keeps only full batches), and a
stream that declares no columns (it was refused as having "columns []")."""

from __future__ import annotations

import pytest
from datasets import Dataset, IterableDataset
from transformers import TrainingArguments

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]
EMPTY = Dataset.from_dict({"prompt": []}, features=Dataset.from_dict({"prompt": ["a"]}).features)
ONE = Dataset.from_dict({"prompt": ["abc"]})
NO_ROWS = "dataset has no rows: give it at least one example."


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def config(tmp_path, **overrides) -> TraceRLConfig:
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none",
                  per_device_eval_batch_size=4)
    values.update(overrides)
    return TraceRLConfig(**values)


def trainer(tmp_path, train=None, eval_dataset=None, **overrides) -> TraceRLTrainer:
    train = Dataset.from_dict({"prompt": PROMPTS}) if train is None else train
    return TraceRLTrainer(tiny_model("sdar").train(), distinct_chars, args=config(tmp_path, **overrides),
                          train_dataset=train, eval_dataset=eval_dataset, processing_class=build_tokenizer())


@pytest.mark.parametrize("length", [dict(max_steps=1), dict(max_steps=-1, num_train_epochs=1)])
def test_an_empty_train_dataset_is_refused_at_construction(tmp_path, length):
    # max_steps: train() returned global_step=0, loss 0.0; epochs: an error about max_steps
    with pytest.raises(ValueError, match=f"the train {NO_ROWS}"):
        trainer(tmp_path, EMPTY, **length)


@pytest.mark.parametrize("prompts, overrides, expected", [
    (1, dict(per_device_train_batch_size=8), "has 1 prompt.*takes 2 .generation_batch_size 8 / num_generations 4"),
    (1, dict(gradient_accumulation_steps=2), "has 1 prompt.*takes 2 .generation_batch_size 8 / num_generations 4"),
    (3, dict(generation_batch_size=16), "has 3 prompt.*takes 4 .generation_batch_size 16 / num_generations 4"),
    (2, dict(per_device_train_batch_size=16, max_steps=-1, num_train_epochs=2), "has 2 prompt.*takes 4"),
])
def test_fewer_prompts_than_a_generation_batch_are_refused(tmp_path, prompts, overrides, expected):
    # TRL's RepeatSampler keeps only full batches of generation_batch_size // num_generations prompts: no step
    with pytest.raises(ValueError, match=expected + ".*training would never take a step"):
        trainer(tmp_path, Dataset.from_dict({"prompt": PROMPTS[:prompts]}), **overrides)


def test_one_generation_batch_of_prompts_trains(tmp_path):
    run = trainer(tmp_path, Dataset.from_dict({"prompt": PROMPTS[:2]}), per_device_train_batch_size=8)
    assert run.train().global_step == 1


def test_the_generation_batch_counts_every_process(tmp_path, monkeypatch):
    """``generation_batch_size`` is global (per device x processes x steps_per_generation), as TRL's sampler takes
    it: on 2 processes, 4 rows per device of 4 generations take 2 prompts."""
    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: 2))
    with pytest.raises(ValueError, match=r"has 1 prompt\(s\), but one generation batch takes 2 \(generation_batch_"
                                         r"size 8 / .* x 2 process\(es\)"):
        trainer(tmp_path, ONE)


def test_an_empty_eval_dataset_is_refused_at_construction_by_name(tmp_path):
    with pytest.raises(ValueError, match=f"the eval {NO_ROWS}"):  # no eval_loss, or metric_for_best_model's KeyError
        trainer(tmp_path, eval_dataset=EMPTY, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                save_steps=1, load_best_model_at_end=True)
    with pytest.raises(ValueError, match=f"the eval 'b' {NO_ROWS}"):
        trainer(tmp_path, eval_dataset={"a": ONE, "b": EMPTY})


def test_evaluate_refuses_an_empty_eval_dataset_by_name(tmp_path):
    run = trainer(tmp_path, eval_dataset={"a": ONE})
    with pytest.raises(ValueError, match=f"the eval {NO_ROWS}"):
        run.evaluate(EMPTY)
    with pytest.raises(ValueError, match=f"the eval 'b' {NO_ROWS}"):
        run.evaluate({"a": ONE, "b": EMPTY})
    run.eval_dataset = {"a": ONE, "b": EMPTY}
    for name in (None, "b"):
        with pytest.raises(ValueError, match=f"the eval 'b' {NO_ROWS}"):
            run.evaluate(name)


def test_a_stream_without_columns_is_named_as_such(tmp_path):
    stream = IterableDataset.from_generator(lambda: iter([]))  # empty, built without features
    with pytest.raises(ValueError, match="the train dataset is a stream that declares no columns.*an empty stream"):
        trainer(tmp_path, stream)
