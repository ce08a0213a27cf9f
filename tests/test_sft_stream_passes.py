"""A streamed dataset (``IterableDataset``) gets fresh masks every pass, as a map-style one does. The noise epoch was
``int(state.epoch)``, which Trainer updates after each optimizer step and, for a stream, estimates from ``max_steps``:
the first step of every new pass was seeded as the previous pass (the same masks again)."""

import pytest
from datasets import Dataset

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model

ROWS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(4) for b in range(4)]


def pass_losses(tmp_path, dataset) -> list[float]:
    """Losses of 3 steps of one batch each (the whole set: one pass per step) at learning rate 0."""
    args = DiffusionSFTConfig(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=len(ROWS),
                              learning_rate=0.0, logging_steps=1, max_length=32, use_cpu=True, bf16=False,
                              report_to="none", save_strategy="no")
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=dataset,
                                  processing_class=build_tokenizer())
    trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def test_every_pass_of_a_stream_draws_the_masks_of_its_epoch(tmp_path):
    mapped = pass_losses(tmp_path / "map", Dataset.from_list(ROWS))
    streamed = pass_losses(tmp_path / "stream", Dataset.from_list(ROWS).to_iterable_dataset())
    assert len(set(mapped)) == 3  # one epoch's masks differ from the next
    assert streamed == pytest.approx(mapped, rel=1e-5)
