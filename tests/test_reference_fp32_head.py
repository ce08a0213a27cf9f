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


@pytest.mark.parametrize("loaded", ["in_memory", "from_path"])
def test_the_output_layer_runs_in_float32_under_mixed_precision_autocast(tmp_path, loaded):
    """``bf16=True`` runs forwards under accelerate's autocast, which made the output layer's product bf16 again
    after TRL's cast of its weights (max |logit error| 0.02 on the tiny model): TRL documents the option as "the LM
    head projection in float32, outside autocast". Checked on the policy as ``train()`` prepares it and on the
    reference (the trainer's own copy of an in-memory policy; the one TRL builds from a path)."""
    model = tiny_model("sdar").to(torch.bfloat16)
    if loaded == "from_path":
        model.save_pretrained(tmp_path / "model")
        model = str(tmp_path / "model")
    args = TraceRLConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=True, report_to="none", beta=0.1,
                         kl_reference="reference_model", cast_lm_head_to_fp32=True, num_generations=2,
                         per_device_train_batch_size=2, max_completion_length=8, block_length=4, denoising_steps=4)
    trainer = TraceRLTrainer(model, lambda completions, **kwargs: [0.0] * len(completions), args=args,
                             train_dataset=Dataset.from_list([{"prompt": "1+2="}] * 4),
                             processing_class=build_tokenizer())
    policy = trainer.accelerator.prepare_model(trainer.model)  # its forward runs under autocast, as in train()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    reference = trainer.accelerator.unwrap_model(trainer.ref_model)
    for network, head in ((policy, trainer.model.get_output_embeddings()),
                          (trainer.ref_model, reference.get_output_embeddings())):
        seen = {}
        handle = head.register_forward_hook(lambda module, inputs, output, seen=seen: seen.update(hidden=inputs[0],
                                                                                                 out=output))
        with torch.no_grad():
            network(input_ids=ids)
        handle.remove()
        assert seen["out"].dtype == torch.float32
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            exact = torch.nn.functional.linear(seen["hidden"].float(), head.weight.float())
        torch.testing.assert_close(seen["out"], exact, rtol=0, atol=0)
