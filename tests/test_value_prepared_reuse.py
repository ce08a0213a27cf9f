"""A value dataset prepared (tokenized and checked) by one ``DiffusionValueTrainer`` and passed to another.

Before: every value trainer in the process skipped preparing a dataset any of them had prepared, so another
trainer's ``evaluate(other.eval_dataset)`` used prompt ids tokenized with the other tokenizer and skipped the
vocabulary, position and mask-token checks for its own model."""

import pytest
from datasets import Dataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TRAJECTORY = dict(prompt="abc", completion_ids=[30, 31, 32, 33], unmask_step=[0, 0, 1, 1], reward=1.0)


def value_trainer(tmp_path, tokenizer=None, **config):
    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                save_strategy="no", per_device_train_batch_size=2, disable_tqdm=True)
    return DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar", **config)), args=args,
                                 train_dataset=Dataset.from_list([TRAJECTORY] * 2),
                                 eval_dataset=Dataset.from_list([TRAJECTORY] * 2),
                                 processing_class=tokenizer or build_tokenizer())


def test_a_trainer_evaluates_its_own_prepared_dataset_as_it_is(tmp_path):
    trainer = value_trainer(tmp_path)
    assert trainer._prepared(trainer.eval_dataset, "eval_dataset") is trainer.eval_dataset
    twin = value_trainer(tmp_path)  # the same settings (a tokenizer built again): the rows are its rows too
    assert twin._prepared(trainer.eval_dataset, "eval_dataset") is trainer.eval_dataset


def test_a_dataset_prepared_with_other_settings_is_refused(tmp_path):
    trainer = value_trainer(tmp_path)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    other = value_trainer(tmp_path, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"prepared by a DiffusionValueTrainer with other settings: another "
                                         r"tokenizer .*before preparation"):
        other.evaluate(trainer.eval_dataset)
    smaller = value_trainer(tmp_path, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"max_positions=\d+ when prepared, 64 now"):
        smaller.evaluate(trainer.eval_dataset)


def test_a_derived_copy_of_another_tokenizers_rows_is_refused_by_row(tmp_path):
    # a shuffle / select copy is no longer the prepared dataset: it was prepared again, keeping the other
    # tokenizer's prompt_ids beside the prompt text (prepared rows carry both)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = Dataset.from_list([{**TRAJECTORY, "prompt": [{"role": "user", "content": "abc"}]}] * 2)
    first = value_trainer(tmp_path)
    prepared = first._prepared(chat, "eval_dataset")
    other = value_trainer(tmp_path, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"row 0: 'prompt_ids' are not 'prompt' tokenized with this trainer's"):
        other.evaluate(prepared.shuffle(seed=0))
    assert first.evaluate(prepared.select([1, 0]))["eval_loss"] >= 0  # the same tokenizer's rows agree
