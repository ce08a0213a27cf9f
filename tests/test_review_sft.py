"""Review of SFT, the value model and their data: each test guards a bug that was reproduced (batch-dependent
values, silently skipped metrics, batch-dependent noise seeds, a misleading error hint)."""

import torch
from datasets import Dataset
from numerics import assert_close_fp32

from trl_diffusion.testing import EOS_ID, TINY_CONFIGS, build_tokenizer, seeded_fill_
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()

# Rollouts with canvases of different lengths (and prompts of different lengths), as a stored value dataset has.
ROLLOUTS = [
    dict(prompt_ids=[10, 11, 12, 13, 14], completion_ids=[20, 21, 22, 23, EOS_ID, EOS_ID, 30, 31],
         unmask_step=[2, 0, 1, 3, 4, 5, 6, 7], reward=1.0),
    dict(prompt_ids=[15, 16], completion_ids=[24, 25, 26, 27, 28, 29], unmask_step=[1, 0, 2, 2, 3, -1], reward=-0.5),
    dict(prompt_ids=[40, 41, 42, 43, 44, 45, 46], completion_ids=[50, 51, 52], unmask_step=[0, 1, 2], reward=0.25),
]


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
