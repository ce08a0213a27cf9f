"""LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B, config.json ``model_type`` ``"llada"``): the whole forward against a slow
per-token reference and against transformers' Qwen3-MoE / OLMoE, the released checkpoint layout and the config
dispatch, generation (no cache, prefix and dual caches), trajectory replay, training, and what the model refuses."""

import contextlib
import json
import math

import peft
import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from moe_reference import qwen3_moe_from
from numerics import MIN_MARGIN, DecisionMargins, assert_close_fp32
from safetensors.torch import save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
)

from trl_diffusion import DiffusionValueModel, LLaDAConfig, LLaDAModelLM, LLaDAMoEConfig, LLaDAMoEModelLM
from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs, replay_logprobs
from trl_diffusion.generation import cuda_graphs, sampler
from trl_diffusion.models import LLaDAMoEModel
from trl_diffusion.models.llada_moe import LLADA_MOE_MASK_TOKEN_ID
from trl_diffusion.models.moe import SparseMoeBlock, SwiGLUMLP
from trl_diffusion.states import state_before_step
from trl_diffusion.testing import (
    build_tokenizer,
    left_pad,
    seeded_fill_,
    tiny_llada_config,
    tiny_llada_moe_config,
    tiny_moe_model,
)

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]
EXPERT_KEYS = ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
ROUTING_MARGIN = 1e-5
"""Smallest gap between the k-th and (k+1)-th routing score a test comparing two float32 paths accepts (their scores
differ by ~1e-7)."""
RELEASED_AUTO_MAP = {  # inferred from inclusionAI/dInfer tools/ (transfer.py, modeling_fused_lladamoe.py)
    "AutoConfig": "configuration_lladamoe.LLaDAConfig",
    "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
    "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
}
DLLM_AUTO_MAP = {  # what dllm's README tells users to write, with model_type "lladamoe"
    "AutoConfig": "configuration_lladamoe.LLaDAMoEConfig",
    "AutoModel": "modeling_lladamoe.LLaDAMoEModelLM",
    "AutoModelForCausalLM": "modeling_lladamoe.LLaDAMoEModelLM",
}
# every option at once: a dense layer, a shared expert, expert biases, clip_qkv, grouped-query attention
FULL_LAYOUT = dict(num_hidden_layers=3, moe_layer_freq=[1, 0, 1], shared_expert_intermediate_size=24,
                   moe_router_enable_expert_bias=True, clip_qkv=1.5)


@contextlib.contextmanager
def routing_margins():
    """Record, over every routing decision, the gap between the k-th and (k+1)-th routing score: a test comparing
    two float paths through the experts asserts it is clear, so no token can switch experts."""
    margins = []
    original = SparseMoeBlock.route

    def route(self, hidden):
        if self.top_k < self.num_experts:
            scores = F.softmax(self.gate(hidden).detach(), dim=-1, dtype=torch.float32)
            if self.expert_bias is not None:
                scores = scores + self.expert_bias
            top = scores.topk(self.top_k + 1, dim=-1).values
            margins.append(float((top[:, -2] - top[:, -1]).min()))
        return original(self, hidden)

    SparseMoeBlock.route = route
    try:
        yield margins
    finally:
        SparseMoeBlock.route = original


# ------------------------------------------------------------------------------------------------ the reference


@torch.no_grad()
def reference_logits(model, ids, key_mask=None):
    """LLaDA-MoE's forward written out from the released modeling code, one row and one token at a time, in float64
    except where the release computes in float32 whatever the model's dtype: the RMSNorm statistics, the RoPE
    tables, the router softmax (and the expert bias added to it). RMSNorm: weight * x / sqrt(mean(x^2) + eps);
    attention: q/k/v projections, RMSNorm of every head of q and k, clamp of q, k, v to ±clip_qkv, RoPE (rotate-half,
    base rope_theta, positions 0..L-1), softmax(q k^T / sqrt(head_dim)) over the keys the 2-D mask keeps (query head h
    reads key/value head h // (heads / kv_heads)), o_proj; MLP: a dense SwiGLU where moe_layer_freq is 0, else per
    token: softmax of the router logits + expert_bias, the top-k of that, the sum over them of score * expert SwiGLU
    (no renormalisation), plus the shared expert; final norm; lm_head."""
    c = model.config
    w = {k: v.double() for k, v in model.state_dict().items()}
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    hd = c.hidden_size // heads
    half = hd // 2
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)

    def rms(x, weight):
        x32 = x.float()
        return weight * (x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + c.rms_norm_eps)).double()

    def swiglu(prefix, x):
        gate, up = w[prefix + "gate_proj.weight"] @ x, w[prefix + "up_proj.weight"] @ x
        return w[prefix + "down_proj.weight"] @ (F.silu(gate) * up)

    def rope(x, t):  # x [heads, hd] at position t
        cos, sin = torch.cos(t * inv_freq).double(), torch.sin(t * inv_freq).double()
        x1, x2 = x[:, :half], x[:, half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    rows = []
    for b in range(ids.shape[0]):
        length = ids.shape[1]
        keep = [True] * length if key_mask is None else [bool(v) for v in key_mask[b]]
        x = w["model.embed_tokens.weight"][ids[b]]
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            n = rms(x, w[p + "input_layernorm.weight"])
            q = (n @ w[p + "self_attn.q_proj.weight"].T).view(length, heads, hd)
            k = (n @ w[p + "self_attn.k_proj.weight"].T).view(length, kv_heads, hd)
            v = (n @ w[p + "self_attn.v_proj.weight"].T).view(length, kv_heads, hd)
            if c.qk_layernorm:
                q, k = rms(q, w[p + "self_attn.q_norm.weight"]), rms(k, w[p + "self_attn.k_norm.weight"])
            if c.clip_qkv is not None:
                q, k, v = (t.clamp(-c.clip_qkv, c.clip_qkv) for t in (q, k, v))
            q = torch.stack([rope(q[t], t) for t in range(length)])
            k = torch.stack([rope(k[t], t) for t in range(length)])
            attn = torch.zeros(length, heads, hd, dtype=torch.float64)
            for t in range(length):
                for h in range(heads):
                    g = h // (heads // kv_heads)
                    scores = torch.stack([q[t, h] @ k[s, g] / math.sqrt(hd) if keep[s] else
                                          torch.tensor(-math.inf, dtype=torch.float64) for s in range(length)])
                    attn[t, h] = torch.softmax(scores, dim=0) @ v[:, g]
            x = x + attn.reshape(length, -1) @ w[p + "self_attn.o_proj.weight"].T
            n = rms(x, w[p + "post_attention_layernorm.weight"])
            out = torch.zeros_like(x)
            for t in range(length):
                if c.moe_layer_freq is not None and c.moe_layer_freq[i] == 0:
                    out[t] = swiglu(p + "mlp.", n[t])
                    continue
                scores = torch.softmax((w[p + "mlp.gate.weight"] @ n[t]).float(), dim=0)
                if c.moe_router_enable_expert_bias:
                    scores = (scores + w[p + "mlp.expert_bias"]).float()
                scores = scores.double()
                top = sorted(range(c.num_experts), key=lambda e: -float(scores[e]))[: c.num_experts_per_tok]
                for e in sorted(top):
                    out[t] = out[t] + scores[e] * swiglu(p + f"mlp.experts.{e}.", n[t])
                if c.shared_expert_intermediate_size is not None:
                    out[t] = out[t] + swiglu(p + "shared_expert.", n[t])
            x = x + out
        rows.append(rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T)
    return torch.stack(rows)


@pytest.mark.parametrize("layout", [dict(), FULL_LAYOUT, dict(qk_layernorm=False, num_key_value_heads=4)])
def test_logits_equal_the_slow_reference(layout):
    model = tiny_moe_model("llada_moe", **layout).double()
    ids, mask = left_pad([[5, 17, 33, 90, 100, 7, 64, 12, 3], [40, 41, 42, 43, 44]])
    with torch.no_grad(), routing_margins() as margins:
        ours = model(ids).logits
        ours_padded = model(ids, attention_mask=mask).logits
    assert min(margins) > ROUTING_MARGIN  # no token near a tie
    assert_close_fp32(ours, reference_logits(model, ids))
    # key padding: the pad columns are hidden from every query (the release ignores masks: same for unpadded rows)
    assert_close_fp32(ours_padded, reference_logits(model, ids, mask))
    assert not torch.allclose(ours_padded[1], ours[1])


def test_the_expert_bias_ranks_and_weights():
    """With the expert bias the reference's choices change for some tokens, and the biased scores are the weights:
    the model equals the reference with the bias, not without it."""
    model = tiny_moe_model("llada_moe", moe_router_enable_expert_bias=True).double()
    ids = torch.randint(5, 120, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ours = model(ids).logits
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.expert_bias.zero_()
        unbiased = reference_logits(model, ids)
    assert not torch.allclose(ours, unbiased, rtol=1e-3, atol=1e-3)


def test_logits_equal_transformers_qwen3_moe_with_a_full_mask(tmp_path):
    """Without expert bias, shared expert or clip_qkv, LLaDA-MoE is transformers' Qwen3-MoE (per-head q/k norms,
    grouped-query attention, a dense layer) with norm_topk_prob=False and a full 4-D mask instead of the causal one."""
    model = tiny_moe_model("llada_moe", num_hidden_layers=3, moe_layer_freq=[1, 0, 1])
    reference = qwen3_moe_from(model, tmp_path)
    ids = torch.randint(5, 120, (2, 13))
    full = torch.ones(2, 1, 13, 13, dtype=torch.bool)
    with torch.no_grad(), routing_margins() as margins:
        ours = model(ids).logits
    assert min(margins) > ROUTING_MARGIN
    with torch.no_grad():
        theirs = reference(ids, attention_mask=full).logits
        causal = reference(ids).logits
    assert_close_fp32(ours, theirs)
    assert (ours - causal).abs().max() > 1e-2  # the mask really is bidirectional


def test_logits_equal_transformers_olmoe_with_one_head(tmp_path):
    """With one attention head OLMoE's q/k norms (over the whole projection) are per-head norms: transformers'
    OlmoeForCausalLM with a full mask is LLaDA-MoE, clip_qkv included (every layer sparse, as OLMoE's)."""
    model = tiny_moe_model("llada_moe", num_attention_heads=1, num_key_value_heads=1, clip_qkv=0.5)
    model.save_pretrained(tmp_path)
    c = model.config
    config = OlmoeConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                         intermediate_size=c.expert_intermediate_size, num_hidden_layers=c.num_hidden_layers,
                         num_attention_heads=1, num_key_value_heads=1,
                         rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_position_embeddings,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta}, clip_qkv=c.clip_qkv,
                         num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok, norm_topk_prob=False,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=0)
    reference, info = OlmoeForCausalLM.from_pretrained(tmp_path, config=config, dtype=torch.float32,
                                                       experts_implementation="eager", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.randint(5, 120, (2, 11))
    with torch.no_grad(), routing_margins() as margins:
        ours = model(ids).logits
    assert min(margins) > ROUTING_MARGIN
    with torch.no_grad():
        theirs = reference.eval()(ids, attention_mask=torch.ones(2, 1, 11, 11, dtype=torch.bool)).logits
        model.config.clip_qkv = None
        unclipped = tiny_moe_model("llada_moe", num_attention_heads=1, num_key_value_heads=1)(ids).logits
    assert_close_fp32(ours, theirs)
    assert (ours - unclipped).abs().max() > 1e-2  # the clamp is active at 0.5


# ------------------------------------------------------------------------------------------------ config & layout


def test_config_fields_and_layers():
    config = tiny_llada_moe_config(**FULL_LAYOUT)
    assert config.model_type == "llada" and config.head_dim == 16
    model = LLaDAMoEModelLM(config)
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert kinds == [SparseMoeBlock, SwiGLUMLP, SparseMoeBlock]
    assert model.model.layers[1].mlp.up_proj.weight.shape == (128, 64)  # dense_intermediate_size
    assert model.model.layers[0].mlp.experts[3].up_proj.weight.shape == (32, 64)  # expert_intermediate_size
    assert model.model.layers[0].shared_expert.up_proj.weight.shape == (24, 64)
    assert model.model.layers[1].shared_expert is None  # shared experts sit on sparse layers only
    assert not model.model.layers[0].mlp.norm_topk_prob  # never renormalised
    saved = config.to_dict()
    assert saved["model_type"] == "llada" and saved["architectures"] == ["LLaDAMoEModelLM"]
    assert saved["output_router_logits"] is False and "head_dim" not in saved
    for field in ("dense_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size",
                  "moe_layer_freq", "qk_layernorm", "clip_qkv", "moe_router_enable_expert_bias",
                  "partial_rotary_factor", "router_aux_loss_coef", "norm_topk_prob", "mask_token_id"):
        assert field in saved, field
    # the released config.json has no mask_token_id: the released tokenizer's <|mask|> when the vocabulary holds it
    assert LLaDAMoEConfig(vocab_size=157184).mask_token_id == LLADA_MOE_MASK_TOKEN_ID == 156895
    assert LLaDAMoEConfig(vocab_size=157184, mask_token_id=5).mask_token_id == 5
    assert tiny_llada_moe_config(mask_token_id=None).mask_token_id is None
    assert all(tiny_llada_moe_config(moe_layer_freq=None).layer_is_sparse(i) for i in range(2))  # unset: all sparse


@pytest.mark.parametrize("bad,match", [
    (dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(moe_layer_freq=[1]), "moe_layer_freq"),
    (dict(shared_expert_intermediate_size=-1), "shared_expert_intermediate_size"),
    (dict(num_key_value_heads=3), "multiple of num_key_value_heads"),
    (dict(head_dim=32), "head_dim"),
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_llada_moe_config(**bad)


def test_a_model_needs_every_size():
    config = LLaDAMoEConfig()  # the released class's "unset" sizes: a config, not a model
    with pytest.raises(ValueError, match="not set"):
        LLaDAMoEModelLM(config)
    with pytest.raises(ValueError, match="dense_intermediate_size is not set"):
        LLaDAMoEModelLM(tiny_llada_moe_config(moe_layer_freq=[1, 0], dense_intermediate_size=None))


def test_state_dict_keys_are_the_released_names():
    keys = set(tiny_moe_model("llada_moe", **FULL_LAYOUT).state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(3):
        prefix = f"model.layers.{i}."
        expected |= {prefix + k for k in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                          "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                          "self_attn.q_norm.weight", "self_attn.k_norm.weight")}
    for i in (0, 2):
        expected |= {f"model.layers.{i}.mlp.gate.weight", f"model.layers.{i}.mlp.expert_bias"}
        expected |= {f"model.layers.{i}.mlp.experts.{e}.{k}" for e in range(4) for k in EXPERT_KEYS}
        expected |= {f"model.layers.{i}.shared_expert.{k}" for k in EXPERT_KEYS}
    expected |= {f"model.layers.1.mlp.{k}" for k in EXPERT_KEYS}  # the dense layer
    assert keys == expected
    plain = set(tiny_moe_model("llada_moe", qk_layernorm=False).state_dict())
    assert not any("_norm.weight" in k and "self_attn" in k for k in plain)


# ------------------------------------------------------------------------------------------------ checkpoints


def write_released_checkpoint(model, directory, model_type="llada", auto_map=None, rename=None):
    config = model.config.to_dict()
    config.update({"model_type": model_type, "auto_map": auto_map or RELEASED_AUTO_MAP,
                   "architectures": ["LLaDAMoEModelLM"], "output_router_logits": False, "rope_scaling": None,
                   "torch_dtype": "bfloat16", "transformers_version": "4.46.3"})
    for key in ("dtype", "mask_token_id"):  # the released config.json is reported to have no mask_token_id
        config.pop(key, None)
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if rename:
        state[rename[1]] = state.pop(rename[0])
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("model_type,auto_map", [("llada", RELEASED_AUTO_MAP), ("lladamoe", DLLM_AUTO_MAP)])
def test_released_checkpoint_loads_without_remote_code(tmp_path, model_type, auto_map):
    model = tiny_moe_model("llada_moe", **FULL_LAYOUT)
    write_released_checkpoint(model, tmp_path, model_type, auto_map)
    config = AutoConfig.from_pretrained(tmp_path)
    assert type(config) is LLaDAMoEConfig and config.model_type == "llada"
    assert type(LLaDAConfig.from_pretrained(tmp_path)) is LLaDAMoEConfig  # LLaDAConfig's loading dispatches
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded) is LLaDAMoEModelLM and loaded.config.moe_layer_freq == [1, 0, 1]
    assert loaded.config.output_router_logits is False
    ids = torch.randint(5, 120, (2, 11))
    with torch.no_grad():
        assert_close_fp32(loaded(ids).logits, model(ids).logits)  # expert biases loaded (they are not zero)
    assert type(AutoModel.from_pretrained(tmp_path)) is LLaDAMoEModelLM  # as the release's auto_map: the LM
    backbone = LLaDAMoEModel.from_pretrained(tmp_path, dtype=torch.float32).eval()  # ignores the head only
    with torch.no_grad():
        assert_close_fp32(backbone(ids).last_hidden_state, model.model(ids).last_hidden_state)
    with pytest.raises(ValueError, match="are for LLaDAMoEModelLM, not LLaDAModelLM"):
        LLaDAModelLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("rename", [
    ("model.layers.0.mlp.experts.2.up_proj.weight", "model.layers.0.mlp.experts.2.w3.weight"),
    ("model.layers.2.mlp.gate.weight", "model.layers.2.mlp.router.weight"),
    ("model.layers.0.shared_expert.down_proj.weight", "model.layers.0.mlp.shared_expert.down_proj.weight"),
    ("model.layers.2.mlp.expert_bias", "model.layers.2.mlp.gate.e_score_correction_bias"),
    ("model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.query_norm.weight"),
])
def test_a_renamed_key_is_an_error(tmp_path, rename):
    write_released_checkpoint(tiny_moe_model("llada_moe", **FULL_LAYOUT), tmp_path, rename=rename)
    with pytest.raises(ValueError, match="does not match LLaDAMoEModelLM"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_moe_model("llada_moe", **FULL_LAYOUT)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "llada" and saved["architectures"] == ["LLaDAMoEModelLM"]
    # what the released code needs to rebuild the model (its defaults: partial_rotary_factor -1, moe_layer_freq [])
    assert saved["partial_rotary_factor"] == 1.0 and saved["moe_layer_freq"] == [1, 0, 1]
    assert saved["qk_layernorm"] is True and saved["shared_expert_intermediate_size"] == 24
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is LLaDAMoEModelLM
    differing = {k for k, v in loaded.config.to_dict().items() if model.config.to_dict().get(k) != v}
    assert differing == {"_name_or_path"}
    ids = torch.randint(5, 120, (2, 9))
    with torch.no_grad():
        assert_close_fp32(loaded(ids).logits, model(ids).logits)


def test_a_dense_llada_config_still_gives_the_dense_model(tmp_path):
    dense = seeded_fill_(LLaDAModelLM(tiny_llada_config())).eval()
    dense.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is LLaDAConfig
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is LLaDAModelLM
    assert type(AutoConfig.for_model("llada")) is LLaDAConfig


# ------------------------------------------------------------------------------------------------ generation


def gen(model, ids, mask=None, **kw):
    args = dict(max_new_tokens=12, block_length=4, denoising_steps=2, temperature=0.0, stop_token_ids=[],
                return_dict_in_generate=True)
    return model.generate(ids, mask, **{**args, **kw})


def test_greedy_generation_without_cache():
    """Greedy decoding runs, fills the canvas, keeps the prompt, and every token it commits is the argmax (mask token
    excluded) of the model's unshifted logits at its own position on the state before its step."""
    model = tiny_moe_model("llada_moe", **FULL_LAYOUT)
    ids, mask = left_pad(PROMPTS)
    out = gen(model, ids, mask)
    completion = out.sequences[:, ids.shape[1]:]
    assert completion.shape == (3, 12) and not (completion == model.mask_token_id).any()
    assert (out.unmask_step[:, ids.shape[1]:] >= 0).all()
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
    prompt = torch.tensor([PROMPTS[0]])
    with DecisionMargins() as margins, routing_margins() as routes:
        single = gen(model, prompt)
    assert margins.smallest > MIN_MARGIN and min(routes) > ROUTING_MARGIN
    generated = torch.zeros_like(single.sequences, dtype=torch.bool)
    generated[:, prompt.shape[1]:] = True
    for step in range(int(single.unmask_step.max()) + 1):
        state = state_before_step(single.sequences, single.unmask_step, generated, step, model.mask_token_id)
        with torch.no_grad():
            logits = model(state).logits[0]
        logits[:, model.mask_token_id] = -math.inf
        committed = (single.unmask_step[0] == step).nonzero().flatten()
        assert len(committed) == 2  # 4 columns per block in 2 steps
        assert torch.equal(single.sequences[0, committed], logits[committed].argmax(-1))


@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_prefix_and_dual_caches_equal_no_cache_when_nothing_can_go_stale(mode):
    """As for dense LLaDA: with one layer the cached columns' keys depend on their own tokens only, so the cached
    decode equals the uncached one; with two layers they go stale and it differs (the cache is used)."""
    ids, mask = left_pad(PROMPTS)
    for n_layers in (1, 2):
        model = tiny_moe_model("llada_moe", num_hidden_layers=n_layers, moe_layer_freq=[1] * n_layers)
        with DecisionMargins() as margins, routing_margins() as routes:
            plain = gen(model, ids, mask, denoising_steps=4)
            cached = gen(model, ids, mask, denoising_steps=4, use_cache=mode)
        if n_layers == 1:
            assert margins.smallest > MIN_MARGIN and min(routes) > ROUTING_MARGIN
            assert torch.equal(cached.sequences, plain.sequences)
            assert torch.equal(cached.unmask_step, plain.unmask_step)
            assert_close_fp32(cached.token_logprobs, plain.token_logprobs)
        else:
            committed = plain.unmask_step >= 0
            assert not torch.equal(cached.unmask_step, plain.unmask_step) or \
                (cached.token_logprobs - plain.token_logprobs)[committed].abs().max() > 1e-3
        assert cached.num_forward_passes == plain.num_forward_passes == 3 * 4


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_replay_reproduces_the_sampler_logprobs(settings):
    """TraceRL's scoring: the trajectory replayed one state per step, and TraceRL's packed estimator (several steps'
    states per row under a 4-D mask, in chunks of a token budget), give the sampler's own log-probs."""
    model = tiny_moe_model("llada_moe", **FULL_LAYOUT)
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    with torch.no_grad(), routing_margins() as routes:
        out = gen(model, ids, mask, generator=torch.Generator().manual_seed(0), **settings)
        replay = replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4, **settings)
        packed, _, scored = estimate_logprobs(model, ids, mask, out.sequences[:, width:], out.unmask_step[:, width:],
                                              EstimatorSettings(block_size=4, token_budget=64, **settings))
    assert min(routes) > ROUTING_MARGIN
    committed = out.unmask_step >= 0
    assert committed.sum() >= 12 * len(PROMPTS)
    assert_close_fp32(replay, out.token_logprobs, committed)
    assert torch.equal(scored, committed[:, width:])
    assert_close_fp32(packed, out.token_logprobs[:, width:], scored)


def test_backward_reaches_the_router_and_the_experts_that_got_tokens():
    model = tiny_moe_model("llada_moe", num_experts_per_tok=1, shared_expert_intermediate_size=8).train()
    ids = torch.randint(5, 120, (1, 3))  # 3 tokens, 1 expert each: at least one of the 4 experts is idle
    block = model.model.layers[0].mlp
    seen = []
    handle = block.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    model(ids).logits.square().mean().backward()
    handle.remove()
    with torch.no_grad():
        used = set(block.route(seen[0].reshape(-1, 64))[1].flatten().tolist())
    assert 0 < len(used) < block.num_experts
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    assert model.model.layers[0].shared_expert.up_proj.weight.grad.abs().sum() > 0
    for e, expert in enumerate(block.experts):
        grad = expert.down_proj.weight.grad
        assert grad is not None  # every expert takes part in the backward (DDP needs it), idle ones with zeros
        assert (grad.abs().sum() > 0) == (e in used)


# ------------------------------------------------------------------------------------------------ training


def test_lora_defaults_adapt_attention_and_experts_never_the_router(tmp_path):
    from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer

    model = tiny_moe_model("llada_moe", **FULL_LAYOUT).train()
    data = Dataset.from_list([{"prompt": "What is 1+2?", "completion": "3"}, {"prompt": "Hi", "completion": "yo"}])
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, gradient_checkpointing=False,
                              save_strategy="no", logging_steps=1, use_cpu=True, max_length=32, disable_tqdm=True,
                              per_device_train_batch_size=2, max_steps=1)
    trainer = DiffusionSFTTrainer(model, args=args, train_dataset=data, processing_class=build_tokenizer(),
                                  peft_config=peft.LoraConfig(r=4, lora_alpha=8))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trainer.model.named_parameters() if ".lora_A" in n}
    for suffix in ("self_attn.q_proj", "self_attn.o_proj", "mlp.experts.3.down_proj", "mlp.experts.0.gate_proj",
                   "shared_expert.up_proj", "layers.1.mlp.down_proj"):
        assert any(n.endswith(suffix) for n in adapted), suffix
    assert not any(n.endswith("mlp.gate") or n.endswith("lm_head") for n in adapted)  # never the router
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_value_model_from_an_moe_policy(tmp_path):
    policy = tiny_moe_model("llada_moe", **FULL_LAYOUT)
    value = DiffusionValueModel.from_policy(policy)
    assert value.block_size is None and type(value.model) is LLaDAMoEModel
    ids = torch.randint(5, 120, (2, 8))
    with torch.no_grad():
        assert torch.equal(value.model(ids).last_hidden_state, policy.model(ids).last_hidden_state)
        assert value(ids).value.abs().max() == 0  # zero head
    value.save_pretrained(tmp_path)
    loaded = DiffusionValueModel.from_pretrained(tmp_path)
    assert type(loaded.model) is LLaDAMoEModel
    with torch.no_grad():
        assert_close_fp32(loaded.model(ids).last_hidden_state, policy.model(ids).last_hidden_state)


# ------------------------------------------------------------------------------------------------ refusals


def test_cuda_graphs_auto_decodes_eagerly_and_on_is_refused(monkeypatch):
    built = []
    original = sampler.runner_class

    def spy_init(self, *args, **kwargs):
        built.append(type(self))
        raise RuntimeError("stop: a graph runner was built")

    # choose runners as on CUDA (on the CPU), recording the graph runners generate builds
    monkeypatch.setattr(sampler, "runner_class", lambda settings, device, generator:
                        original(settings, torch.device("cuda"), generator))
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)
    monkeypatch.setattr(cuda_graphs.GraphRunner, "__init__", spy_init)
    kw = dict(max_new_tokens=8, block_length=4, temperature=0.0, use_cache="dual", stop_token_ids=[])
    ids = torch.tensor([[5, 6, 7]])
    dense = seeded_fill_(LLaDAModelLM(tiny_llada_config())).eval()
    with pytest.raises(RuntimeError, match="graph runner was built"):  # control: dense LLaDA would be captured
        dense.generate(ids, cuda_graphs="auto", **kw)
    assert built == [cuda_graphs.WindowCacheGraphRunner]
    built.clear()
    model = tiny_moe_model("llada_moe")
    assert torch.equal(model.generate(ids, cuda_graphs="auto", **kw), model.generate(ids, cuda_graphs="off", **kw))
    assert not built  # the eager loop
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph"):
        model.generate(ids, cuda_graphs="on", **kw)
    adapted = peft.get_peft_model(tiny_moe_model("llada_moe"), peft.LoraConfig(r=2))
    assert not cuda_graphs.cuda_graph_capturable(adapted)
