"""``cast_lm_head_to_fp32`` applies to the reference model too, as in TRL (grpo_trainer casts ``self.ref_model``).
When the policy is an in-memory model, ``TraceRLTrainer`` makes its own reference copy, which TRL never sees: its
output layer stayed bf16, so the KL compared float32 policy log-probs with bf16 reference ones (a non-zero ``kl`` at
step 1, where policy and reference are the same model)."""

import pytest
import torch
from datasets import Dataset

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model


@pytest.mark.parametrize("family,tied", [("sdar", False), ("sdar", True), ("llada", False), ("dream", False)])
def test_the_reference_copy_scores_in_float32_like_the_policy(tmp_path, family, tied):
    overrides = {"tie_word_embeddings": True} if tied else {}
    model = tiny_model(family, **overrides).to(torch.bfloat16)
    args = TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", beta=0.1,
                         kl_reference="reference_model", cast_lm_head_to_fp32=True, num_generations=2,
                         per_device_train_batch_size=2, max_completion_length=8, block_length=4, denoising_steps=4)
    trainer = TraceRLTrainer(model, lambda completions, **kwargs: [0.0] * len(completions), args=args,
                             train_dataset=Dataset.from_list([{"prompt": "1+2="}] * 4),
                             processing_class=build_tokenizer())
    reference = trainer.ref_model
    assert reference is not trainer.model
    assert reference.get_output_embeddings().weight.dtype == torch.float32
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    with torch.no_grad():
        policy_logits, reference_logits = trainer.model(ids).logits, reference(ids).logits
    assert reference_logits.dtype == policy_logits.dtype == torch.float32
    torch.testing.assert_close(reference_logits, policy_logits, rtol=0, atol=0)
    if tied:  # the shared embedding still feeds bf16 hidden states to the layers
        assert reference.get_input_embeddings()(ids).dtype == torch.bfloat16
