"""DiffusionValueTrainer's metrics as transformers' Trainer reports them: the value statistics of an evaluation are
in what ``evaluate()`` returns (under its ``metric_key_prefix``, so ``metric_for_best_model`` can name them), and
``include_num_input_tokens_seen`` counts a trajectory batch's prompt and canvas tokens."""

import pytest
from datasets import Dataset
from test_data_format_fixes import TOKENIZER, TRAJECTORY, value_trainer

from trl_diffusion.testing import tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

ROWS = [TRAJECTORY, {**TRAJECTORY, "reward": 0.0, "completion_ids": [40, 41], "unmask_step": [0, 1]}]


def test_evaluate_returns_the_value_statistics_under_its_prefix(tmp_path):
    # they were only logged: evaluate() returned eval_loss alone, and two named eval sets logged theirs under one name
    trainer = value_trainer(tmp_path, Dataset.from_list(ROWS))
    metrics = trainer.evaluate(Dataset.from_list(ROWS))
    assert {"eval_loss", "eval_value/mean", "eval_value/explained_variance"} <= set(metrics)
    named = trainer.evaluate(Dataset.from_list(ROWS[:1]), metric_key_prefix="eval_easy")
    assert {"eval_easy_loss", "eval_easy_value/mean"} <= set(named) and "eval_value/mean" not in named
    assert trainer.state.log_history[-1]["eval_easy_value/mean"] == named["eval_easy_value/mean"]


def test_the_best_checkpoint_can_be_chosen_by_a_value_statistic(tmp_path):
    # metric_for_best_model="value/explained_variance" was a KeyError at the first evaluation
    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=2,
                                per_device_train_batch_size=2, disable_tqdm=True, eval_strategy="steps", eval_steps=1,
                                save_strategy="steps", save_steps=1, load_best_model_at_end=True,
                                metric_for_best_model="value/explained_variance", greater_is_better=True)
    trainer = DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")), args=args,
                                    train_dataset=Dataset.from_list(ROWS * 2), eval_dataset=Dataset.from_list(ROWS),
                                    processing_class=TOKENIZER)
    trainer.train()
    assert trainer.state.best_metric is not None and trainer.state.best_model_checkpoint is not None


@pytest.mark.parametrize("setting", ["all", "non_padding"])
def test_input_tokens_seen_count_prompts_and_canvases(tmp_path, setting):
    # Trainer looked for input_ids, which a trajectory batch has not: 0 tokens at every step
    trainer = value_trainer(tmp_path, Dataset.from_list(ROWS), include_num_input_tokens_seen=setting)
    trainer.train()
    prompt = len(trainer.train_dataset[0]["prompt_ids"])
    expected = 2 * prompt + (2 * 4 if setting == "all" else 4 + 2)  # canvases right-padded to 4 columns
    assert trainer.state.num_input_tokens_seen == expected
