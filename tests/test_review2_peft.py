"""PEFT / LoRA across the package (review round 2): peft's wrappers around our models, generation through an
adapter, and the trainers with ``peft_config``."""

import peft
import pytest
import torch
from numerics import assert_close_fp32
from transformers import AutoModelForCausalLM

from trl_diffusion.testing import tiny_model

PROMPT = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(0))
GREEDY = dict(max_new_tokens=8, block_length=4, denoising_steps=4, temperature=0.0)


def with_adapter(model, seed=1, **lora):
    """``model`` under a LoRA adapter with non-zero weights (a fresh adapter is the identity)."""
    torch.manual_seed(seed)  # lora_A's initialisation
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **lora))
    generator = torch.Generator().manual_seed(seed)
    for name, param in wrapped.named_parameters():
        if "lora_B" in name:
            param.data = 0.5 * torch.randn(param.shape, generator=generator)
    return wrapped.eval()


def test_causal_lm_task_type_wraps_generates_and_reloads(tmp_path, family):
    """``LoraConfig(task_type="CAUSAL_LM")`` (TRL's usual LoRA config) makes a ``PeftModelForCausalLM``, which
    reads the model's ``prepare_inputs_for_generation``: it used to raise AttributeError for every family. The
    wrapper computes what the plain ``PeftModel`` computes, and ``AutoPeftModelForCausalLM`` reloads it."""
    tiny_model(family).save_pretrained(tmp_path / "base")
    plain = with_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    causal = with_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), task_type="CAUSAL_LM")
    assert isinstance(causal, peft.PeftModelForCausalLM)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = causal(input_ids=ids).logits
        assert torch.equal(logits, plain(input_ids=ids).logits)
    sequences = causal.generate(PROMPT, torch.ones_like(PROMPT), **GREEDY)
    assert torch.equal(sequences, plain.generate(PROMPT, torch.ones_like(PROMPT), **GREEDY))
    causal.save_pretrained(tmp_path / "adapter")
    reloaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    with torch.no_grad():
        assert_close_fp32(reloaded(input_ids=ids).logits, logits)
