"""Model contracts a mutation run found untested: default positions after a cache, float and 2-D masks over a
cache, the cache's record of padding, config-driven shapes (head_dim, multi-query, qkv bias), dropout modes, logit
scaling, MoE routing helpers, the refusals and the released defaults."""

import json
import math

import pytest
import torch
from numerics import assert_close_fp32

from trl_diffusion import DiffusionCache
from trl_diffusion.models import LORA_TARGET_MODULES, DreamConfig, LLaDAModelLM, SDARConfig, SDARForCausalLM
from trl_diffusion.models.llada_moe import LLADA_MOE_MASK_TOKEN_ID
from trl_diffusion.models.moe import load_balancing_loss, router_token_mask
from trl_diffusion.testing import (
    TINY_VOCAB_SIZE,
    tiny_llada_config,
    tiny_llada_moe_config,
    tiny_model,
    tiny_moe_model,
    tiny_sdar_config,
)


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(5, TINY_VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed))


# ---- positions and masks with a cache -------------------------------------------------------------------------------


def test_sdar_default_positions_continue_after_cached_prefix():
    """a cached SDAR block without position_ids starts at the prefix's last position + 1, so block-wise
    decoding with a cache matches one full block-causal forward (an off-by-one here shifts every RoPE angle)."""
    model, ids = tiny_model("sdar"), _ids(1, 12)
    with torch.no_grad():
        full = model(ids).logits[:, 8:12]
        cache = DiffusionCache()
        model(ids[:, :8], past_key_values=cache, store_kv=True)
        cached = model(ids[:, 8:], past_key_values=cache).logits
    assert_close_fp32(cached, full)


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_default_positions_after_cache_equal_explicit(family):
    """LLaDA/Dream's default position ids after a cache of 8 keys are 8..11, as if passed explicitly; starting
    again at 0 would silently re-use the prefix's rotary positions."""
    model, ids = tiny_model(family), _ids(1, 12)
    with torch.no_grad():
        cache = DiffusionCache()
        model(ids[:, :8], past_key_values=cache, store_kv=True)
        default = model(ids[:, 8:], past_key_values=cache).logits
        explicit = model(ids[:, 8:], past_key_values=cache, position_ids=torch.arange(8, 12)[None]).logits
    assert_close_fp32(default, explicit)


def test_float_visibility_mask_equals_bool_mask():
    """a float 0/1 4-D mask (tril of ones, as SDAR's released sampler builds) is read as visibility, not as an
    additive bias; otherwise the released sampler's masks would let every query see every key."""
    model, ids = tiny_model("sdar"), _ids(1, 8)
    visible = torch.tril(torch.ones(8, 8))[None, None]
    with torch.no_grad():
        as_bool = model(ids, attention_mask=visible.bool()).logits
        as_float = model(ids, attention_mask=visible.float()).logits
    assert_close_fp32(as_float, as_bool)


def test_key_padding_mask_hides_cached_keys():
    """a 2-D mask over [cached | new] hides the cached keys it marks 0 (here keys 0..2), like a full forward with
    the same mask; a one-layer model keeps the cached K/V independent of the mask at store time."""
    model, ids = tiny_model("llada", n_layers=1), _ids(1, 12)
    mask = torch.ones(1, 12, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        reference = model(ids, attention_mask=mask, position_ids=torch.arange(12)[None]).logits[:, 8:]
        cache = DiffusionCache()
        model(ids[:, :8], past_key_values=cache, store_kv=True)
        unmasked = model(ids[:, 8:], past_key_values=cache, position_ids=torch.arange(8, 12)[None]).logits
        masked = model(ids[:, 8:], past_key_values=cache, attention_mask=mask,
                       position_ids=torch.arange(8, 12)[None]).logits
    assert_close_fp32(masked, reference)
    assert (masked - unmasked).abs().max() > 1e-3  # the mask does something at all


def test_cache_records_padding_of_later_chunks():
    """cache.valid records the padding of a second stored chunk, so a later call without a mask still hides
    those keys (as a call with the explicit full mask does)."""
    model, ids = tiny_model("llada"), _ids(1, 12)
    with torch.no_grad():
        cache = DiffusionCache()
        model(ids[:, :4], past_key_values=cache, store_kv=True)
        mask = torch.ones(1, 8, dtype=torch.long)
        mask[0, 4:6] = 0  # two padding keys in the second stored chunk
        model(ids[:, 4:8], past_key_values=cache, store_kv=True, attention_mask=mask)
        assert cache.valid.int().tolist() == [[1, 1, 1, 1, 0, 0, 1, 1]]
        implicit = model(ids[:, 8:], past_key_values=cache).logits
        full_mask = torch.cat([mask, torch.ones(1, 4, dtype=torch.long)], dim=1)
        explicit = model(ids[:, 8:], past_key_values=cache, attention_mask=full_mask).logits
    assert_close_fp32(implicit, explicit)


# ---- config-driven structure --------------------------------------------------------------------------------------


def test_qwen_style_attention_honours_config_head_dim():
    """SDAR's attention uses config.head_dim when it differs from hidden/heads (Qwen3 checkpoints do), else the
    released weights would not load."""
    torch.manual_seed(0)
    config = tiny_sdar_config(head_dim=32)
    model = SDARForCausalLM(config).eval()
    attention = model.model.layers[0].self_attn
    assert tuple(attention.q_proj.weight.shape) == (config.num_attention_heads * 32, config.hidden_size)
    assert tuple(attention.k_proj.weight.shape) == (config.num_key_value_heads * 32, config.hidden_size)
    with torch.no_grad():
        logits = model(_ids(1, 8)).logits
    assert logits.shape == (1, 8, TINY_VOCAB_SIZE) and torch.isfinite(logits).all()


def test_llada_attention_dropout_only_in_training():
    """LLaDA's attention dropout is off in eval (generation must be deterministic) and on in train mode."""
    model, ids = tiny_model("llada", attention_dropout=0.5), _ids(1, 8)
    torch.manual_seed(0)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
        model.train()
        first, second = model(ids).logits, model(ids).logits
    assert (first - second).abs().max() > 1e-3


def test_llada_moe_ignores_norm_topk_prob():
    """LLaDA-MoE never renormalises its top-k weights, whatever norm_topk_prob says (the release ignores it;
    honouring it would change the released model's outputs)."""
    ids = _ids(1, 8)
    with torch.no_grad():
        plain = tiny_moe_model("llada_moe", norm_topk_prob=False)(ids).logits
        asked = tiny_moe_model("llada_moe", norm_topk_prob=True)(ids).logits
    assert_close_fp32(asked, plain)


def test_llada_scale_logits_divides_by_sqrt_d_model():
    """LLaDA's scale_logits multiplies the logits by 1/sqrt(d_model), as the release (OLMo) does."""
    ids = _ids(1, 8)
    plain, scaled = tiny_model("llada"), tiny_model("llada", scale_logits=True)
    with torch.no_grad():
        expected = plain(ids).logits * (1 / math.sqrt(plain.config.d_model))
        actual = scaled(ids).logits
    assert_close_fp32(actual, expected)


def test_llada_multi_query_attention_has_one_kv_head():
    """multi_query_attention gives one key/value head (k_proj is head-size wide) even though n_kv_heads says
    otherwise, as in the release."""
    config = tiny_llada_config(multi_query_attention=True)
    head_size = config.d_model // config.n_heads
    k_proj = LLaDAModelLM(config).model.transformer.blocks[0].k_proj
    assert k_proj.out_features == head_size and config.n_kv_heads != 1


def test_llada_include_qkv_bias_gives_q_proj_a_bias():
    """include_qkv_bias (without include_bias) puts a bias on q/k/v, so checkpoints that carry one load."""
    block = LLaDAModelLM(tiny_llada_config(include_qkv_bias=True)).model.transformer.blocks[0]
    assert block.q_proj.bias is not None and block.k_proj.bias is not None and block.v_proj.bias is not None


# ---- MoE helpers --------------------------------------------------------------------------------------------------


def test_router_token_mask_takes_last_columns_with_cache():
    """with a cache the 2-D mask covers [cached | new]; the router loss counts the new tokens' (last L)
    columns, not the cached keys' ones."""
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1]])  # 4 cached keys, then 4 new tokens (one padding)
    assert router_token_mask(mask, None, (1, 4)).tolist() == [[1, 1, 0, 1]]


def test_load_balancing_loss_with_nothing_counted_is_zero():
    """an all-zero token_mask gives a finite 0 aux loss (a fully padded micro-batch must not NaN the loss)."""
    logits = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    loss = load_balancing_loss([logits], 4, 2, torch.zeros(6))
    assert torch.isfinite(loss) and loss.item() == 0.0


# ---- refusals -----------------------------------------------------------------------------------------------------


def test_llada_refuses_embedding_smaller_than_vocab():
    """embedding_size < vocab_size is refused (ids past it would have no row), as the release does."""
    with pytest.raises(ValueError, match=r"embedding_size \(100\) is smaller than vocab_size"):
        LLaDAModelLM(tiny_llada_config(embedding_size=100))


def test_rope_theta_zero_is_refused():
    """rope_theta 0 is refused (it gives inf/NaN inverse frequencies)."""
    with pytest.raises(ValueError, match=r"\['rope_theta'\] must be a positive number, got 0"):
        SDARConfig(rope_parameters={"rope_type": "default", "rope_theta": 0})


def test_boolean_logits_to_keep_must_be_batch_by_length():
    """a boolean logits_to_keep that is not [B, L] is refused instead of silently selecting batch rows."""
    model = tiny_model("sdar")
    keep = torch.tensor([True, False, True, False])
    with torch.no_grad(), pytest.raises(ValueError, match=r"a boolean logits_to_keep must be \[B, L\]"):
        model(_ids(4, 4), logits_to_keep=keep)


# ---- released defaults --------------------------------------------------------------------------------------------


def test_dream_default_mask_token_id_is_released():
    """Dream's default mask id is 151666, the released config's and tokenizer's <|mask|>; 151665 is
    </tool_response>, so a wrong default would denoise into a real token."""
    assert DreamConfig().mask_token_id == 151666


def test_llada_moe_mask_default_needs_room_in_vocab():
    """LLaDA-MoE defaults mask_token_id to LLADA_MOE_MASK_TOKEN_ID only when the vocabulary holds that id."""
    assert tiny_llada_moe_config(vocab_size=LLADA_MOE_MASK_TOKEN_ID, mask_token_id=None).mask_token_id is None
    config = tiny_llada_moe_config(vocab_size=LLADA_MOE_MASK_TOKEN_ID + 1, mask_token_id=None)
    assert config.mask_token_id == LLADA_MOE_MASK_TOKEN_ID


def test_llada_default_lora_targets_include_up_proj():
    """LLaDA's default LoRA targets cover up_proj (its MLP is ff_proj * up_proj), not only half the MLP."""
    assert "up_proj" in LORA_TARGET_MODULES["llada"]


def test_dtype_auto_writes_no_torch_dtype(tmp_path):
    """a config with dtype "auto" writes no torch_dtype (transformers 4 cannot load torch_dtype "auto")."""
    config = tiny_sdar_config()
    config.dtype = "auto"
    config.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "torch_dtype" not in written
