"""``attn_implementation`` on our model classes: the kernel follows the attention mask (SDPA, or flex attention for a
``BlockMask``), so "sdpa", "flex_attention" and "eager" (the same attention) load and compute the same logits, and
flash-attn or a Hub kernel is a clear error (it was transformers' "request support on the model's Hub page" with a
malformed URL for a local folder)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from trl_diffusion.testing import tiny_model

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_attn_implementation_is_refused_or_changes_nothing(tmp_path, family):
    tiny_model(family).save_pretrained(tmp_path)
    with torch.no_grad():
        default = AutoModelForCausalLM.from_pretrained(tmp_path)(IDS).logits
        for name in ("eager", "sdpa", "flex_attention"):
            assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name)(IDS).logits,
                               default), name
    for name in ("flash_attention_2", "kernels-community/flash-attn"):
        with pytest.raises(ValueError, match=f"attn_implementation='{name}': .* does not use flash-attn"):
            AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=name)
