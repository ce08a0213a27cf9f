"""Test helper: transformers' Qwen3-MoE holding the weights of one of our tiny mixture-of-experts models, the
reference the MoE tests compare against (``tests/test_moe_aux_loss.py``, ``tests/test_llada_moe.py``)."""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from trl_diffusion import LLaDAMoEConfig, SDARMoeConfig


def qwen3_moe_from(model, path) -> Qwen3MoeForCausalLM:
    """transformers' Qwen3MoeForCausalLM holding ``model``'s weights (an SDAR-MoE or a LLaDA-MoE: the same key names,
    per-head q/k norms), saved to ``path`` and loaded with eager experts; no key may be missing, unexpected or
    mismatched. An SDAR-MoE at ``block_size=1`` is causal Qwen3-MoE; a LLaDA-MoE without expert bias, shared expert
    or clip_qkv is Qwen3-MoE with ``norm_topk_prob=False`` and a full mask."""
    c = model.config
    if isinstance(c, SDARMoeConfig):  # Qwen3-MoE's own field names
        family = dict(intermediate_size=c.intermediate_size, moe_intermediate_size=c.moe_intermediate_size,
                      norm_topk_prob=c.norm_topk_prob, decoder_sparse_step=c.decoder_sparse_step,
                      mlp_only_layers=c.mlp_only_layers, router_aux_loss_coef=c.router_aux_loss_coef)
    elif isinstance(c, LLaDAMoEConfig):
        family = dict(intermediate_size=c.dense_intermediate_size, moe_intermediate_size=c.expert_intermediate_size,
                      norm_topk_prob=False, decoder_sparse_step=1,
                      mlp_only_layers=[i for i in range(c.num_hidden_layers) if not c.layer_is_sparse(i)])
    else:
        raise TypeError(f"not an SDAR-MoE or LLaDA-MoE config: {type(c).__name__}")
    config = Qwen3MoeConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, num_experts=c.num_experts,
        num_experts_per_tok=c.num_experts_per_tok, tie_word_embeddings=False, **family,
    )
    model.save_pretrained(path)
    reference, info = Qwen3MoeForCausalLM.from_pretrained(path, config=config, dtype=torch.float32,
                                                          experts_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    return reference.eval()
