"""Pairwise option combinations of ``DiffusionSFTTrainer`` / ``DiffusionValueTrainer``: a setting that the chosen
objective never reads is refused instead of silently ignored, and options that meet (gradient accumulation with
packing, row normalisation, trajectories, LoRA; evaluation on the training data) keep the documented contracts."""

import math

import pytest
import torch
from datasets import Dataset

from trl_diffusion.testing import EOS_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()
PAIRS = [("What is 51-38?\n", "\\boxed{13}"), ("What is 9+4?\n", "\\boxed{13}"), ("Hi!\n", "\\boxed{-3}"),
         ("What is 12+7?\n", "\\boxed{19}"), ("What is 5-5?\n", "\\boxed{0}=zero")]
SMALL = {  # hidden 32, one layer
    "sdar": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16),
    "llada": dict(d_model=32, n_heads=2, n_kv_heads=2, n_layers=1, mlp_hidden_size=64),
    "dream": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1),
}


def sft_config(tmp_path, **overrides):
    fields = dict(output_dir=str(tmp_path), report_to="none", bf16=False, save_strategy="no", logging_steps=1,
                  use_cpu=True, max_length=64, disable_tqdm=True, max_steps=1, optim="sgd", learning_rate=0.1,
                  max_grad_norm=0.0, per_device_eval_batch_size=8)
    return DiffusionSFTConfig(**{**fields, **overrides})


@pytest.mark.parametrize(("field", "value", "objective"), [
    ("trajectory_shrinkage", 2, "block"), ("trajectory_shrinkage", 4, "random_masking"),
    ("trajectory_shrinkage", 2, "semi_ar"), ("trajectory_shrinkage", 2, None),
    ("semi_ar_block_length", 16, "random_masking"), ("semi_ar_block_length", 8, "complementary"),
    ("semi_ar_block_length", 4, "trajectory"), ("semi_ar_block_length", 16, None),
])
def test_an_objective_specific_length_is_refused_for_another_objective(tmp_path, field, value, objective):
    """`trajectory_shrinkage` is read by 'trajectory' only and `semi_ar_block_length` by 'semi_ar' only (None picks
    'block' or 'random_masking'). Set for another objective they used to be accepted and ignored: the run trained
    exactly as with the defaults."""
    with pytest.raises(ValueError, match=rf"{field}={value} applies to diffusion_objective="):
        sft_config(tmp_path, diffusion_objective=objective, **{field: value})
    own = "trajectory" if field == "trajectory_shrinkage" else "semi_ar"
    assert getattr(sft_config(tmp_path, diffusion_objective=own, **{field: value}), field) == value


def conversational():
    return Dataset.from_list([{"prompt": [{"role": "user", "content": p.strip()}],
                               "completion": [{"role": "assistant", "content": c}]} for p, c in PAIRS])


def text():
    return Dataset.from_list([{"text": p + c} for p, c in PAIRS])


def trajectories():
    return Dataset.from_list([{"prompt": p, "completion": c,
                               "unmask_step": list(range(len(TOKENIZER.encode(c, add_special_tokens=False)) + 1))}
                              for p, c in PAIRS])


COMBOS = {  # options that meet: (family, data, settings)
    "sdar-text-bfd-packing": ("sdar", text, dict(packing=True, max_length=32)),
    "sdar-per-token-row-tokens": ("sdar", conversational, dict(loss_normalization="row_tokens", loss_weighting="none",
                                                               mask_ratio_sampling="per_token",
                                                               mask_ratio_range=[0.1, 0.9])),
    "sdar-trajectory-shrinkage": ("sdar", trajectories, dict(diffusion_objective="trajectory",
                                                             trajectory_shrinkage=2)),
    "llada-semi-ar-per-token": ("llada", conversational, dict(diffusion_objective="semi_ar", semi_ar_block_length=4,
                                                              mask_ratio_sampling="per_token", loss_weighting="none")),
    "llada-row-masked-range": ("llada", text, dict(loss_normalization="row_masked", mask_ratio_range=[0.1, 0.9])),
    "dream-text-padding-free": ("dream", text, dict(padding_free=True, max_length=None)),
    "dream-complementary-lora-checkpointing": ("dream", conversational, dict(diffusion_objective="complementary",
                                                                             gradient_checkpointing=True)),
}


def first_step(tmp_path, family, data, batch, accumulation, settings):
    peft = {}
    if settings.get("gradient_checkpointing"):
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    torch.manual_seed(0)
    model = tiny_model(family, **SMALL[family]).train()
    trainer = DiffusionSFTTrainer(model, args=sft_config(tmp_path, per_device_train_batch_size=batch,
                                                         gradient_accumulation_steps=accumulation, **settings),
                                  train_dataset=data(), eval_dataset=data(), processing_class=TOKENIZER, **peft)
    eval_loss = trainer.evaluate()["eval_loss"]
    before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters() if p.requires_grad])
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad])
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    return logged, eval_loss, after - before


@pytest.mark.parametrize("name", list(COMBOS))
def test_combined_options_keep_accumulation_and_evaluation_contracts(tmp_path, name):
    """The five samples in one batch, or one at a time over five accumulation steps, log the same loss and take the
    same step (the row normalisations average over rows, then steps: equal here, one row per sample); an
    evaluation of the same data before the step, in one batch, gives that loss (epoch 0's noise)."""
    family, data, settings = COMBOS[name]
    whole, eval_loss, step = first_step(tmp_path / "whole", family, data, 8, 1, settings)
    split, _, split_step = first_step(tmp_path / "split", family, data, 1, 5, settings)
    assert all(math.isfinite(v) for v in whole.values() if isinstance(v, float))
    assert whole["loss"] > 0 and whole["scored_tokens"] > 0
    assert split["loss"] == pytest.approx(whole["loss"], rel=1e-5)
    assert eval_loss == pytest.approx(whole["loss"], rel=1e-5)
    largest = step.abs().max()
    assert largest > 1e-6
    torch.testing.assert_close(split_step, step, rtol=0, atol=1e-3 * float(largest))


VALUE_ROWS = {
    "prompt": ["What is 1?", "What is 2?", "What is 3?", "What is 4?", "What is 5?"],
    "completion_ids": [[20, 21, EOS_ID, 23, 24], [25, 26, 27], [28, 29, 30, 31, 32, 33, 34], [35, 36, 37, 38],
                       [40, 41, 42, 43, 44, 45, 46, 47]],
    "unmask_step": [[0, 1, 1, 3, 2], [0, 0, 1], [0, 1, 3, 2, 4, 5, -1], [1, 0, 2, -1], [1, 0, 3, 2, 5, 4, 6, 7]],
    "reward": [1.0, -0.5, 0.3, 2.0, -1.0],
}


@pytest.mark.parametrize(("family", "settings"), [
    ("sdar", dict(shrinkage=2, gamma=0.7, training_block_size=2, scoring_token_budget=20)),
    ("llada", dict(gamma=0.0, truncate_at_eos=False, gradient_checkpointing=True)),
    ("dream", dict(shrinkage=3, scoring_token_budget=12)),
])
def test_value_trainer_options_keep_accumulation_and_evaluation_contracts(tmp_path, family, settings):
    """Value options that meet gradient accumulation: batch 5 and 1 x 5 accumulation log the same loss and take the
    same step, which is also the evaluation loss of the same rows in one batch before the step."""
    results = []
    for batch, accumulation in ((8, 1), (1, 5)):
        value = DiffusionValueModel.from_policy(tiny_model(family, seed=1, **SMALL[family]))
        with torch.no_grad():
            value.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
        args = DiffusionValueConfig(output_dir=str(tmp_path / str(batch)), report_to="none", use_cpu=True, bf16=False,
                                    save_strategy="no", disable_tqdm=True, logging_steps=1, max_steps=1, optim="sgd",
                                    learning_rate=0.1, max_grad_norm=0.0, per_device_train_batch_size=batch,
                                    gradient_accumulation_steps=accumulation, per_device_eval_batch_size=8, **settings)
        trainer = DiffusionValueTrainer(value, args=args, train_dataset=Dataset.from_dict(VALUE_ROWS),
                                        eval_dataset=Dataset.from_dict(VALUE_ROWS), processing_class=TOKENIZER)
        eval_loss = trainer.evaluate()["eval_loss"]
        before = torch.cat([p.detach().flatten().clone() for p in value.parameters()])
        trainer.train()
        step = torch.cat([p.detach().flatten() for p in value.parameters()]) - before
        results.append((trainer.state.log_history[-2]["loss"], eval_loss, step))
    (whole, eval_loss, step), (split, _, split_step) = results
    assert whole == pytest.approx(eval_loss, rel=1e-5)
    assert split == pytest.approx(whole, rel=1e-5)
    largest = float(step.abs().max())
    assert largest > 1e-6
    torch.testing.assert_close(split_step, step, rtol=0, atol=1e-3 * largest)
