"""DiffusionValueTrainer's metrics as transformers' Trainer reports them: the value statistics of an evaluation are
in what ``evaluate()`` returns (under its ``metric_key_prefix``, so ``metric_for_best_model`` can name them), and
``include_num_input_tokens_seen`` counts a trajectory batch's prompt and canvas tokens."""

import pytest
import torch
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


def test_a_retry_with_a_smaller_batch_logs_only_its_own_value_statistics(tmp_path):
    # auto_find_batch_size retries the training loop after an out-of-memory error: the statistics of the failed try's
    # micro-batches were summed into the retry's first log
    rows = Dataset.from_list([*ROWS, dict(prompt="xy", completion_ids=[35, 36, 37], unmask_step=[0, 1, 2], reward=0.5),
                              dict(prompt="q", completion_ids=[50, 51, 52, 53], unmask_step=[1, 0, 1, 0], reward=0.2)])

    def trainer(batch_size: int, **settings) -> DiffusionValueTrainer:
        args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                    save_strategy="no", disable_tqdm=True, logging_steps=1, seed=0,
                                    per_device_train_batch_size=batch_size, gradient_accumulation_steps=2, **settings)
        value = DiffusionValueModel.from_policy(tiny_model("sdar"))
        torch.nn.init.normal_(value.value_head.weight, generator=torch.Generator().manual_seed(0))  # values not 0
        return DiffusionValueTrainer(value, args=args, train_dataset=rows, processing_class=TOKENIZER)

    fresh = trainer(1)
    fresh.train()
    retried = trainer(2, auto_find_batch_size=True)
    compute_loss, calls = retried.compute_loss, []

    def out_of_memory_in_the_second_micro_batch(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return loss

    retried.compute_loss = out_of_memory_in_the_second_micro_batch
    retried.train()
    assert retried._train_batch_size == 1
    expected = {k: v for k, v in fresh.state.log_history[0].items() if k.startswith("value/")}
    logged = {k: v for k, v in retried.state.log_history[0].items() if k.startswith("value/")}
    assert expected and logged == pytest.approx(expected, rel=1e-5, abs=1e-6)
