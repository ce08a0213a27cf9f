"""Tiny configs, seeded weights and a locally built tokenizer, so tests and examples run offline.

The tokenizer is character-level (printable ASCII + newline) with the special tokens the families use:
``<|endoftext|>`` (eos and pad), ``<|im_start|>``, ``<|im_end|>`` (chat end), ``<|MASK|>`` (mask) and
``<|unk|>``, and a Qwen-style chat template.
"""

from __future__ import annotations

import string

import torch
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from .models import (
    DreamConfig,
    DreamModel,
    LLaDAConfig,
    LLaDAModelLM,
    LLaDAMoEConfig,
    LLaDAMoEModelLM,
    SDARConfig,
    SDARForCausalLM,
    SDARMoeConfig,
    SDARMoeForCausalLM,
)
from .states import left_pad as left_pad  # the padded prompts the tests generate from

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>", "<|unk|>"]
EOS_ID, IM_START_ID, IM_END_ID, MASK_ID, UNK_ID = range(len(SPECIAL_TOKENS))
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
TINY_VOCAB_SIZE = 128

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer with mask, pad and eos tokens and a chat template (ids < 128)."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    assert len(vocab) <= TINY_VOCAB_SIZE
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<|unk|>", ignore_merges=True))
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        mask_token="<|MASK|>",
        unk_token="<|unk|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_sdar_config(**overrides) -> SDARConfig:
    fields = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_theta=10000.0, block_size=4, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                  pad_token_id=EOS_ID, bos_token_id=EOS_ID)
    return SDARConfig(**{**fields, **overrides})


def tiny_sdar_moe_config(**overrides) -> SDARMoeConfig:
    """A tiny SDAR-MoE config: tiny SDAR's sizes, 4 experts of width 32, 2 per token with renormalised weights
    (``norm_topk_prob``; JetEngine, SDAR's inference engine, always renormalises), every layer sparse. Not in
    ``TINY_CONFIGS``: build ``SDARMoeForCausalLM`` from it."""
    fields = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_theta=10000.0, block_size=4, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                  pad_token_id=EOS_ID, bos_token_id=EOS_ID, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return SDARMoeConfig(**{**fields, **overrides})


def tiny_llada_config(**overrides) -> LLaDAConfig:
    fields = dict(d_model=64, n_heads=4, n_kv_heads=4, n_layers=2, mlp_hidden_size=128, mlp_ratio=2,
                  vocab_size=TINY_VOCAB_SIZE, embedding_size=TINY_VOCAB_SIZE, max_sequence_length=512, rope=True,
                  rope_theta=10000.0, rope_full_precision=True, weight_tying=False, block_type="llama",
                  activation_type="silu", layer_norm_type="rms", rms_norm_eps=1e-5, attention_dropout=0.0,
                  residual_dropout=0.0, embedding_dropout=0.0, mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                  pad_token_id=EOS_ID)
    return LLaDAConfig(**{**fields, **overrides})


def tiny_llada_moe_config(**overrides) -> LLaDAMoEConfig:
    """A tiny LLaDA-MoE config: 2 layers of 4 heads over 2 key/value heads (16 wide) with per-head q/k norms, every
    layer sparse (4 experts of width 32, 2 per token; a dense layer, ``moe_layer_freq`` 0, has width 128), no shared
    expert, no expert bias. Not in ``TINY_CONFIGS``: build ``LLaDAMoEModelLM`` from it."""
    fields = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, dense_intermediate_size=128, expert_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, partial_rotary_factor=1.0, qk_layernorm=True, num_experts=4,
                  num_experts_per_tok=2, moe_layer_freq=[1, 1], mask_token_id=MASK_ID, eos_token_id=EOS_ID,
                  pad_token_id=EOS_ID)
    return LLaDAMoEConfig(**{**fields, **overrides})


def tiny_dream_config(**overrides) -> DreamConfig:
    fields = dict(vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                  mask_token_id=MASK_ID, pad_token_id=EOS_ID, eos_token_id=EOS_ID, bos_token_id=EOS_ID)
    return DreamConfig(**{**fields, **overrides})


TINY_CONFIGS = {"sdar": tiny_sdar_config, "llada": tiny_llada_config, "dream": tiny_dream_config}
MODEL_CLASSES = {"sdar": SDARForCausalLM, "llada": LLaDAModelLM, "dream": DreamModel}


def seeded_fill_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Overwrite every weight from a seeded generator, in sorted state-dict key order: 1-D norm weights get
    ``1 + 0.1 * N(0, 1)``, everything else ``0.2 * N(0, 1)``. The recipe the reference-parity numbers used."""
    generator = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    with torch.no_grad():
        for name in sorted(state):
            tensor = state[name]
            w = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
            is_norm = tensor.dim() == 1 and ("norm" in name or "ln_f" in name)
            tensor.copy_(1.0 + 0.1 * w if is_norm else 0.2 * w)
    return model


def tiny_model(family: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A tiny model of ``family`` (``sdar``, ``llada`` or ``dream``) with seeded weights, in eval mode."""
    config = TINY_CONFIGS[family](**config_overrides)
    return seeded_fill_(MODEL_CLASSES[family](config), seed).eval()


TINY_MOE_MODELS = {"sdar_moe": (tiny_sdar_moe_config, SDARMoeForCausalLM),
                   "llada_moe": (tiny_llada_moe_config, LLaDAMoEModelLM)}
TINY_EXPERT_BIAS = (0.15, -0.1, 0.0, 0.05)
"""The expert bias of a tiny LLaDA-MoE that has one (``moe_router_enable_expert_bias``): large enough to move the
choice of some tokens' experts, unlike the N(0, 0.2) ``seeded_fill_`` would give it, and fixed."""


def tiny_moe_model(family: str, seed: int = 0, **config_overrides) -> torch.nn.Module:
    """A tiny SDAR-MoE or LLaDA-MoE (``sdar_moe`` / ``llada_moe``) with seeded weights, in eval mode; an expert bias,
    where the config asks for one, is ``TINY_EXPERT_BIAS``."""
    make_config, model_class = TINY_MOE_MODELS[family]
    model = seeded_fill_(model_class(make_config(**config_overrides)), seed).eval()
    with torch.no_grad():
        for name, bias in model.named_buffers():
            if name.endswith("expert_bias"):
                bias.copy_(torch.tensor(TINY_EXPERT_BIAS[: bias.numel()]))
    return model


