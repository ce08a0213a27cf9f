"""accelerate's ``GradientState`` is process-wide and describes the dataloader begun last, whichever it is. A
training loop stopped by ``max_steps`` at its last batch leaves its own dataloader behind, at its end with a
remainder; the trainers read that as a padded last eval batch and scored only the first rows of any later eval-mode
``compute_loss`` outside an evaluation loop (half of an 8-row batch; the suite's results depended on test order).
The padding is now read only for the dataloader an evaluation loop iterates (inside one, the padded last batch of
two processes: tests/test_distributed_combos.py, tests/test_review_distributed.py)."""

from contextlib import contextmanager

import torch
from datasets import Dataset
from numerics import assert_close_fp32
from test_sft import PAIRS, TOKENIZER, config, conversational
from test_value_padded_prompts import ROW, value_model_of, value_trainer
from torch.utils.data import DataLoader

from trl_diffusion.testing import tiny_model
from trl_diffusion.trainers import DiffusionSFTTrainer
from trl_diffusion.trainers.eval_padding import padded_eval_batch, real_eval_rows


@contextmanager
def left_at_its_padded_end(accelerator):
    """A prepared dataloader iterated to its last batch and left there, as Trainer leaves its train dataloader;
    finished on exit (accelerate's state is process-wide: later tests must not find it)."""
    loader = accelerator.prepare(DataLoader(list(range(6)), batch_size=4))
    batches = iter(loader)
    next(batches), next(batches)
    state = accelerator.gradient_state
    assert state.active_dataloader is loader and state.end_of_dataloader and state.remainder == 2
    try:
        yield loader
    finally:
        assert next(batches, None) is None  # its end: accelerate drops it from the state
        assert state.active_dataloader is not loader


def test_the_padding_is_read_only_for_the_evaluated_dataloader():
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=config("unused"), train_dataset=conversational(),
                                  processing_class=TOKENIZER)
    with left_at_its_padded_end(trainer.accelerator) as loader:
        assert padded_eval_batch(trainer.accelerator, loader)
        assert real_eval_rows(trainer.accelerator, loader, 4) == 2
        assert not padded_eval_batch(trainer.accelerator, None)
        assert not padded_eval_batch(trainer.accelerator, DataLoader(list(range(6)), batch_size=4))
        assert real_eval_rows(trainer.accelerator, None, 4) is None


def test_sft_eval_loss_outside_an_evaluation_loop_scores_every_row():
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=config("unused", per_device_eval_batch_size=4),
                                  train_dataset=conversational(), eval_dataset=conversational(PAIRS * 2),
                                  processing_class=TOKENIZER)
    batch = next(iter(trainer.get_eval_dataloader()))
    assert batch["input_ids"].shape[0] == 4
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, batch)
        with left_at_its_padded_end(trainer.accelerator):
            after = trainer.compute_loss(trainer.model, batch)
    assert_close_fp32(after, expected)


def test_value_eval_outside_an_evaluation_loop_scores_every_row(tmp_path):
    rows = [dict(ROW, reward=float(i)) for i in range(4)]
    trainer = value_trainer(tmp_path, value_model_of(tiny_model("sdar")), Dataset.from_list(rows))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    trainer.model.eval()
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, batch, return_outputs=True)[1]
        with left_at_its_padded_end(trainer.accelerator):
            after = trainer.compute_loss(trainer.model, batch, return_outputs=True)[1]
    assert after.shape == expected.shape == (4, len(ROW["completion_ids"]))
    torch.testing.assert_close(after, expected)

