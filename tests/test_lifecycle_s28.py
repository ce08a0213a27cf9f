"""The trainers' lifecycle beyond ``train()``: ``load_best_model_at_end`` restores TraceRL's value model and synced
reference with the policy; ``predict()`` prepares raw value rows as ``evaluate()`` does; each named eval set's
metrics (and ``predict()``'s) keep their own prefix and do not leak into the next evaluation."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import tracerl_trainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()
PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def tracerl_args(out, **overrides) -> TraceRLConfig:
    config = dict(output_dir=str(out), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none",
                  per_device_eval_batch_size=4, num_generations_eval=4)
    config.update(overrides)
    return TraceRLConfig(**config)


def falling_reward():
    """Distinct characters (rewards differ within a group, so the policy trains) minus 100 per call: every
    evaluation scores lower than the one before, so the first is the best."""
    calls = []

    def falling(completions, **kwargs):
        calls.append(None)
        return [len(set(c)) - 100.0 * len(calls) for c in completions]
    return falling


def reward_by_prompt(prompts, completions, **kwargs):
    return [10.0 if "Say hi" in str(p) else 0.0 for p in prompts]


def parameters(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def equal(state: dict[str, torch.Tensor], saved: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, saved[name].float()) for name, value in state.items())


@pytest.fixture(scope="module")
def best_at_step_1(tmp_path_factory):
    """A 3-step TraceRL run with a value model and a synced reference, evaluated and saved every step, whose best
    checkpoint (``eval_reward``) is step 1's."""
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("best")
    model = tiny_model("sdar").train()
    args = tracerl_args(out, max_steps=3, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                        load_best_model_at_end=True, metric_for_best_model="eval_reward", beta=0.1,
                        kl_reference="reference_model", sync_ref_model=True, ref_model_sync_steps=1,
                        ref_model_mixup_alpha=0.5)
    trainer = TraceRLTrainer(model, falling_reward(), args=args, train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:1]}), processing_class=TOKENIZER,
                             value_model=DiffusionValueModel.from_policy(model))
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(out / "checkpoint-1")
    return trainer, out


def test_best_model_at_end_restores_the_value_model_and_the_synced_reference(best_at_step_1):
    trainer, out = best_at_step_1
    best, last = out / "checkpoint-1", out / "checkpoint-3"
    value = parameters(trainer.accelerator.unwrap_model(trainer.value_model))
    assert equal(value, load_file(best / "value_model" / "model.safetensors"))
    assert not equal(value, load_file(last / "value_model" / "model.safetensors"))
    reference = parameters(trainer.ref_model)
    assert equal(reference, torch.load(best / tracerl_trainer.REFERENCE_STATE_NAME))
    assert not equal(reference, torch.load(last / tracerl_trainer.REFERENCE_STATE_NAME))
    # weights only: the value optimizer stays the last step's, as transformers leaves the policy's
    saved = torch.load(last / "value_state.pt", weights_only=False)["optimizer"]["state"]
    state = trainer.value_optimizer.state_dict()["state"]
    assert all(torch.equal(state[key]["exp_avg"], saved[key]["exp_avg"]) for key in saved)


def test_best_checkpoint_without_value_model_or_reference_warns(best_at_step_1, tmp_path, caplog):
    trainer, out = best_at_step_1
    copy = tmp_path / "checkpoint-1"
    shutil.copytree(out / "checkpoint-1", copy)
    shutil.rmtree(copy / "value_model")
    (copy / tracerl_trainer.REFERENCE_STATE_NAME).unlink()
    trainer.state.best_model_checkpoint = str(copy)
    with caplog.at_level(logging.WARNING, logger=tracerl_trainer.__name__):
        trainer._load_best_model()
    assert "holds no value_model/" in caplog.text and f"holds no {tracerl_trainer.REFERENCE_STATE_NAME}" in caplog.text


def test_value_predict_prepares_raw_rows(tmp_path):
    trajectory = dict(prompt="abc", completion_ids=[30, 31, 32, 33], unmask_step=[0, 0, 1, 1], reward=1.0)
    rows = [trajectory, {**trajectory, "reward": 0.0, "completion_ids": [40, 41], "unmask_step": [0, 1]}]
    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                per_device_eval_batch_size=3, disable_tqdm=True)
    trainer = DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")), args=args,
                                    train_dataset=Dataset.from_list(rows), processing_class=TOKENIZER)
    raw = Dataset.from_list(rows * 2)
    metrics = trainer.predict(raw).metrics
    assert metrics["test_loss"] == pytest.approx(trainer.evaluate(raw)["eval_loss"])
    assert "test_value/explained_variance" in metrics
    with pytest.raises(TypeError, match="`test_dataset` must be a `Dataset`"):
        trainer.predict(rows)


def test_tracerl_named_eval_sets_keep_their_prefix(tmp_path):
    eval_sets = {"a": Dataset.from_dict({"prompt": PROMPTS[:2]}), "b": Dataset.from_dict({"prompt": PROMPTS[2:3]})}
    args = tracerl_args(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                        load_best_model_at_end=True, metric_for_best_model="eval_a_reward")
    trainer = TraceRLTrainer(tiny_model("sdar").train(), reward_by_prompt, args=args,
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=eval_sets,
                             processing_class=TOKENIZER)
    trainer.train()
    train_log, eval_a, eval_b = (next(h for h in trainer.state.log_history if key in h)
                                 for key in ("loss", "eval_a_loss", "eval_b_loss"))
    assert "reward" in train_log and not any(key.startswith("eval_") for key in train_log)
    assert eval_a["eval_a_reward"] == 5.0 and eval_b["eval_b_reward"] == 0.0  # "Say hi" is one of set a's two
    assert "eval_b_entropy" in eval_b and not any(key.startswith(("eval_reward", "eval_a_")) for key in eval_b)
    assert trainer.state.best_metric == 5.0
    metrics = trainer.evaluate(eval_sets["b"])  # the default prefix keeps its names
    assert metrics["eval_reward"] == 0.0 and "eval_entropy" in metrics and "eval_rollout/forward_passes" in metrics


def test_tracerl_predict_does_not_leak_into_the_next_evaluation(tmp_path):
    trainer = TraceRLTrainer(tiny_model("sdar").train(), reward_by_prompt, args=tracerl_args(tmp_path),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             eval_dataset=Dataset.from_dict({"prompt": ["abc"]}), processing_class=TOKENIZER)
    assert trainer.evaluate()["eval_reward"] == 0.0
    predicted = trainer.predict(Dataset.from_dict({"prompt": ["Say hi"]})).metrics
    assert trainer.evaluate()["eval_reward"] == 0.0  # was 5.0: the mean of predict's batch and its own
    assert predicted["test_reward"] == 10.0  # predict() reports them instead


def sft_data(count: int) -> Dataset:
    pairs = [("What is 12+7?", "\\boxed{19}"), ("Hi!", "\\boxed{-3}"), ("abc", "def")]
    rows = [{"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": c}]}
            for p, c in pairs]
    return Dataset.from_list((rows * count)[:count])


def sft_trainer(out, **overrides) -> DiffusionSFTTrainer:
    config = dict(output_dir=str(out), report_to=[], bf16=False, use_cpu=True, max_length=64, disable_tqdm=True,
                  per_device_train_batch_size=2, per_device_eval_batch_size=3, max_steps=1, logging_steps=1)
    config.update(overrides)
    return DiffusionSFTTrainer(tiny_model("sdar"), args=DiffusionSFTConfig(**config), train_dataset=sft_data(4),
                               eval_dataset={"a": sft_data(3), "b": sft_data(1)}, processing_class=TOKENIZER)


def test_sft_named_eval_sets_keep_their_prefix(tmp_path):
    trainer = sft_trainer(tmp_path, eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
                          load_best_model_at_end=True, metric_for_best_model="eval_a_mean_token_accuracy",
                          greater_is_better=True)
    trainer.train()
    train_log = next(h for h in trainer.state.log_history if "loss" in h)
    assert "entropy" in train_log and not any(key.startswith("eval_") for key in train_log)
    eval_a, eval_b = (next(h for h in trainer.state.log_history if key in h) for key in ("eval_a_loss", "eval_b_loss"))
    assert trainer.state.best_metric == eval_a["eval_a_mean_token_accuracy"]
    assert {"eval_b_entropy", "eval_b_mean_token_accuracy", "eval_b_scored_tokens"} <= set(eval_b)
    assert not any(key.startswith(("eval_entropy", "eval_a_")) for key in eval_b)
    metrics = trainer.evaluate("b")  # the default prefix keeps its names
    assert metrics["eval_scored_tokens"] == eval_b["eval_b_scored_tokens"] and "eval_entropy" in metrics


def test_sft_predict_does_not_leak_into_the_next_evaluation(tmp_path):
    trainer = sft_trainer(tmp_path)
    before = trainer.evaluate("b")
    predicted = trainer.predict(trainer.eval_dataset["a"]).metrics
    assert trainer.evaluate("b")["eval_scored_tokens"] == before["eval_scored_tokens"]
    assert predicted["test_scored_tokens"] == trainer.evaluate("a")["eval_scored_tokens"]


def test_sft_predict_prepares_raw_rows_as_evaluate_does(tmp_path):
    """TRL's SFTTrainer prepares a dataset passed to evaluate() but not to predict(): raw rows failed there with
    "No columns in the dataset match the model's forward method signature"."""
    trainer = sft_trainer(tmp_path)
    raw = sft_data(3)
    predicted = trainer.predict(raw).metrics
    evaluated = trainer.evaluate(raw)
    assert predicted["test_loss"] == pytest.approx(evaluated["eval_loss"])
    assert predicted["test_scored_tokens"] == evaluated["eval_scored_tokens"]
