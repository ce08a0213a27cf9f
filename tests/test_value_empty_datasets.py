"""DiffusionValueTrainer refuses a dataset with no rows, naming it, where it gets it: an empty train set failed at
``train()`` with torch's "num_samples=0", an empty eval set (or member of a dict of them) evaluated to no
``eval_loss``, and an empty stream failed inside accelerate ("Batch does not contain any data"). A NaN
``metric_for_best_model`` (explained variance of constant returns) is warned about: transformers silently chose no
best checkpoint by it."""

import logging

import pytest
from datasets import Dataset, IterableDataset
from test_data_format_fixes import TOKENIZER, TRAJECTORY

from trl_diffusion.testing import tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

LOGGER = "trl_diffusion.best_metric"
ONE = [TRAJECTORY]
TWO = [TRAJECTORY, {**TRAJECTORY, "reward": 0.0}]


def no_rows() -> Dataset:
    """A 0-row dataset with the trajectory columns."""
    return Dataset.from_list(ONE).select([])


def no_rows_stream(declared: bool) -> IterableDataset:
    """An empty stream, declaring its columns or not (``from_generator`` without features)."""
    def rows():
        yield from ()
    return IterableDataset.from_generator(rows, features=no_rows().features if declared else None)


def trainer(tmp_path, train_dataset=None, eval_dataset=None, **settings) -> DiffusionValueTrainer:
    """A tiny SDAR value trainer on CPU (one row to train on unless given)."""
    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                save_strategy="no", per_device_train_batch_size=2, disable_tqdm=True, **settings)
    return DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")), args=args,
                                 train_dataset=train_dataset if train_dataset is not None else Dataset.from_list(ONE),
                                 eval_dataset=eval_dataset, processing_class=TOKENIZER)


@pytest.mark.parametrize("train,eval_,name", [
    (no_rows, None, "train"),
    (None, no_rows, "eval"),
    (None, lambda: {"a": Dataset.from_list(ONE), "b": no_rows()}, "eval 'b'"),
    (lambda: no_rows_stream(False), None, "train"),  # read for its columns: its first row shows them
    (None, lambda: no_rows_stream(False), "eval"),
])
def test_an_empty_dataset_is_refused_at_construction_by_name(tmp_path, train, eval_, name):
    with pytest.raises(ValueError, match=f"the {name} dataset has no rows"):
        trainer(tmp_path, train and train(), eval_ and eval_())


def test_a_stream_that_declares_its_columns_is_not_read_ahead(tmp_path):
    # reading its first row at construction filled a shuffle buffer, and lost the first row of a stream read once
    source = iter(TWO)
    stream = IterableDataset.from_generator(lambda: source, features=Dataset.from_list(TWO).features)
    trainer(tmp_path, stream)
    assert len(list(source)) == 2


def test_an_empty_dataset_passed_to_evaluate_or_predict_is_refused_by_name(tmp_path):
    value_trainer = trainer(tmp_path)
    with pytest.raises(ValueError, match="the eval dataset has no rows"):
        value_trainer.evaluate(no_rows())
    with pytest.raises(ValueError, match="the eval dataset has no rows"):
        value_trainer.evaluate(no_rows_stream(False))
    with pytest.raises(ValueError, match="the eval 'b' dataset has no rows"):
        value_trainer.evaluate({"a": Dataset.from_list(ONE), "b": no_rows()})
    with pytest.raises(ValueError, match="the test dataset has no rows"):
        value_trainer.predict(no_rows())


@pytest.mark.parametrize("eval_rows,warnings", [(ONE, 1), (TWO, 0)])
def test_a_nan_metric_for_best_model_is_warned_about(tmp_path, caplog, eval_rows, warnings):
    # one eval row has constant returns: explained variance NaN, never better than -inf, so no best checkpoint
    value_trainer = trainer(tmp_path, Dataset.from_list(TWO), Dataset.from_list(eval_rows), eval_strategy="steps",
                            eval_steps=1, metric_for_best_model="value/explained_variance", greater_is_better=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        value_trainer.train()
    records = [r for r in caplog.records if "metric_for_best_model" in r.getMessage()]
    assert len(records) == warnings  # once per evaluation
    if warnings:
        assert "'eval_value/explained_variance' is NaN at step 1" in records[0].getMessage()
        assert "returns of the evaluated tokens do not vary" in records[0].getMessage()
