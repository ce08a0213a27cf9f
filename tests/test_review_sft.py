"""Review of SFT, the value model and their data: each test guards a bug that was reproduced (batch-dependent
values, silently skipped metrics, batch-dependent noise seeds, a misleading error hint)."""

import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from trl_diffusion.testing import EOS_ID, MASK_ID, TINY_CONFIGS, build_tokenizer, seeded_fill_, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.trainers.sft_trainer import DiffusionDataCollator
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()
PAIRS = [("What is 12+7?\n", "\\boxed{19}"), ("Hi!\n", "\\boxed{-3}")]

# Rollouts with canvases of different lengths (and prompts of different lengths), as a stored value dataset has.
ROLLOUTS = [
    dict(prompt_ids=[10, 11, 12, 13, 14], completion_ids=[20, 21, 22, 23, EOS_ID, EOS_ID, 30, 31],
         unmask_step=[2, 0, 1, 3, 4, 5, 6, 7], reward=1.0),
    dict(prompt_ids=[15, 16], completion_ids=[24, 25, 26, 27, 28, 29], unmask_step=[1, 0, 2, 2, 3, -1], reward=-0.5),
    dict(prompt_ids=[40, 41, 42, 43, 44, 45, 46], completion_ids=[50, 51, 52], unmask_step=[0, 1, 2], reward=0.25),
]


def sft_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path), report_to=[], bf16=False, save_strategy="no", use_cpu=True,
                    max_length=64, disable_tqdm=True, per_device_train_batch_size=2, max_steps=1)
    return DiffusionSFTConfig(**{**defaults, **kw})


def test_value_of_a_rollout_does_not_depend_on_the_canvases_it_is_batched_with(tmp_path, family):
    """A shorter canvas right-padded to the batch width is valued as it was sampled: the padding columns are not
    extra mask tokens in its states (full attention saw them all; SDAR saw those in its last block)."""
    model = seeded_fill_(DiffusionValueModel(TINY_CONFIGS[family]()), 1).eval()
    trainer = DiffusionValueTrainer(model, args=DiffusionValueConfig(output_dir=str(tmp_path), report_to=[],
                                                                     use_cpu=True),
                                    train_dataset=Dataset.from_list(ROLLOUTS), processing_class=TOKENIZER)

    def values(rows):
        batch = trainer.data_collator(rows)
        with torch.no_grad():
            _, out = trainer.compute_loss(model, batch, return_outputs=True)
        return out * batch["trained_mask"]

    together = values(ROLLOUTS)
    for i, row in enumerate(ROLLOUTS):
        alone = values([row])[0]
        assert alone.abs().max() > 0.1  # the head is not zero: the comparison means something
        assert_close_fp32(together[i, : len(alone)], alone)


def test_compute_metrics_is_refused_instead_of_silently_skipped(tmp_path):
    """Trainer calls compute_metrics only when the loss returns logits; the diffusion loss returns none, so a
    user's metrics would never run."""
    data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in PAIRS])
    for name in ("compute_metrics", "preprocess_logits_for_metrics"):
        with pytest.raises(ValueError, match=name):
            DiffusionSFTTrainer(tiny_model("llada"), args=sft_args(tmp_path), train_dataset=data, eval_dataset=data,
                                processing_class=TOKENIZER, **{name: lambda *a: {}})


def test_noise_seed_of_an_unprepared_sample_ignores_the_batch_padding():
    """skip_prepare_dataset: a sample's noise is seeded from its content, not from the padding its batch adds."""
    collator = DiffusionDataCollator(DataCollatorForLanguageModeling(pad_token_id=EOS_ID), MASK_ID, EOS_ID, None)
    short, long = {"input_ids": [10, 11, 12]}, {"input_ids": [20, 21, 22, 23, 24]}
    alone = collator([short])["sample_index"]
    batched = collator([short, long])["sample_index"]
    assert batched[0] == alone[0]
    assert batched[1] == collator([long])["sample_index"][0]


def test_trajectory_length_error_names_completion_only_loss(tmp_path):
    """Pre-tokenized rows with a completion_mask train on the whole sequence unless completion_only_loss=True (TRL's
    default for datasets without a prompt column): the error says so, and with it the rows train."""
    rows = []
    for p, c in PAIRS:
        prompt, completion = TOKENIZER.encode(p), TOKENIZER.encode(c) + [EOS_ID]
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion),
                     "unmask_step": list(range(len(completion)))})
    data = Dataset.from_list(rows)
    with pytest.raises(ValueError, match="completion_only_loss=True"):
        DiffusionSFTTrainer(tiny_model("sdar"), args=sft_args(tmp_path, diffusion_objective="trajectory"),
                            train_dataset=data, processing_class=TOKENIZER)
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=sft_args(tmp_path, diffusion_objective="trajectory",
                                                                    completion_only_loss=True),
                                  train_dataset=data, processing_class=TOKENIZER)
    row, prompt_length = trainer.train_dataset[0], len(TOKENIZER.encode(PAIRS[0][0]))
    assert row["unmask_step"] == [-1] * prompt_length + rows[0]["unmask_step"]
