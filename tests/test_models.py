"""Model families: released checkpoint layout, save/load round trips, attention structure, LoRA, checkpointing,
dtypes and clear errors."""

import json
import subprocess
import sys

import peft
import pytest
import torch
from numerics import assert_close_fp32
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import trl_diffusion
from trl_diffusion.models import check_tokenizer
from trl_diffusion.testing import build_tokenizer, tiny_model

LAYER_KEYS = {
    "sdar": [
        "input_layernorm.weight",
        "mlp.down_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "post_attention_layernorm.weight",
        "self_attn.k_norm.weight",
        "self_attn.k_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.q_proj.weight",
        "self_attn.v_proj.weight",
    ],
    "dream": [
        "input_layernorm.weight",
        "mlp.down_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "post_attention_layernorm.weight",
        "self_attn.k_proj.bias",
        "self_attn.k_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_proj.bias",
        "self_attn.q_proj.weight",
        "self_attn.v_proj.bias",
        "self_attn.v_proj.weight",
    ],
    "llada": [
        "attn_norm.weight",
        "attn_out.weight",
        "ff_norm.weight",
        "ff_out.weight",
        "ff_proj.weight",
        "k_proj.weight",
        "q_proj.weight",
        "up_proj.weight",
        "v_proj.weight",
    ],
}
TOP_KEYS = {
    "sdar": ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"],
    "dream": ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"],
    "llada": ["model.transformer.ff_out.weight", "model.transformer.ln_f.weight", "model.transformer.wte.weight"],
}
LAYER_PREFIX = {"sdar": "model.layers", "dream": "model.layers", "llada": "model.transformer.blocks"}

# Fields of the released config.json files (models.md), at tiny sizes, including the extras and auto_map.
RELEASED_EXTRAS = {
    "sdar": {
        "architectures": ["SDARForCausalLM"],
        "attn_implementation": "flex_attention",
        "debug": False,
        "ep_size": 1,
        "fuse_cross_entropy": True,
        "micro_forward": False,
        "skip_checkpoint": False,
        "use_deepep": False,
        "torch_dtype": "float32",
        "transformers_version": "4.52.4",
        "auto_map": {
            "AutoConfig": "configuration_sdar.SDARConfig",
            "AutoModel": "modeling_sdar.SDARModel",
            "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM",
        },
    },
    "llada": {
        "architectures": ["LLaDAModelLM"],
        "init_device": "meta",
        "init_fn": "mitchell",
        "precision": "amp_bf16",
        "transformers_version": "4.46.3",
        "auto_map": {
            "AutoConfig": "configuration_llada.LLaDAConfig",
            "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            "AutoModel": "modeling_llada.LLaDAModelLM",
        },
    },
    "dream": {
        "architectures": ["DreamModel"],
        "use_mrope": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.46.2",
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
    },
}


def expected_keys(family, n_layers=2):
    keys = list(TOP_KEYS[family])
    for i in range(n_layers):
        keys += [f"{LAYER_PREFIX[family]}.{i}.{k}" for k in LAYER_KEYS[family]]
    return sorted(keys)


def write_released_checkpoint(model, family, directory):
    config = model.config.to_dict()
    config.update(RELEASED_EXTRAS[family])
    config.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )


def test_state_dict_keys_are_the_released_names(family):
    assert sorted(tiny_model(family).state_dict()) == expected_keys(family)


def test_released_checkpoint_loads_without_remote_code(family, tmp_path):
    model = tiny_model(family)
    write_released_checkpoint(model, family, tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True, dtype=torch.float32)
    assert type(loaded) is type(model)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ids = torch.randint(4, 100, (2, 11))
    torch.testing.assert_close(loaded.eval()(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert type(AutoModel.from_pretrained(tmp_path)) is type(model)


def test_save_pretrained_writes_released_names_and_fields(family, tmp_path):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == expected_keys(family)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == {"sdar": "sdar", "llada": "llada", "dream": "Dream"}[family]
    for field in {
        "sdar": ["block_size", "mask_token_id", "rope_theta", "head_dim", "num_key_value_heads"],
        "llada": [
            "d_model",
            "n_layers",
            "n_heads",
            "mlp_hidden_size",
            "mask_token_id",
            "weight_tying",
            "rope_full_precision",
            "embedding_size",
        ],
        "dream": ["mask_token_id", "rope_theta", "num_key_value_heads", "hidden_size"],
    }[family]:
        assert field in saved, field
    assert "rope_parameters" not in saved  # the original code reads rope_theta


def test_reload_in_fresh_process(tmp_path):
    """Each family saved here loads bit-identically in a fresh interpreter (one interpreter for all three: its
    start-up is most of the cost): the same weights, bit for bit, and the same logits to float32 rounding (the
    loaded weights may sit at other memory alignments, which changes how the CPU kernels round)."""
    ids = torch.randint(4, 100, (1, 9))
    for family in ("sdar", "llada", "dream"):
        model = tiny_model(family)
        model.save_pretrained(tmp_path / family)
        torch.save({"ids": ids, "logits": model(ids).logits, "state": model.state_dict()},
                   tmp_path / family / "expected.pt")
    code = (  # the same thread count in both processes: the same kernels
        "import sys, torch, trl_diffusion\n"
        "from transformers import AutoModelForCausalLM\n"
        "torch.set_num_threads(int(sys.argv[1]))\n"
        "for d in sys.argv[2:]:\n"
        "    e = torch.load(d + '/expected.pt')\n"
        "    m = AutoModelForCausalLM.from_pretrained(d).eval()\n"
        "    state, saved = m.state_dict(), e['state']\n"
        "    assert state.keys() == saved.keys() and all(torch.equal(state[k], v) for k, v in saved.items())\n"
        "    error = (m(e['ids']).logits - e['logits']).abs().max().item()\n"
        "    assert error <= 1e-5 * max(1.0, e['logits'].abs().max().item()), (d, error)\n"
        "    print('reloaded', type(m).__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(torch.get_num_threads()),
                           *(str(tmp_path / f) for f in ("sdar", "llada", "dream"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("reloaded ") == 3, done.stdout


def test_rope_is_correct_after_from_pretrained(tmp_path):
    """transformers 5 builds on the meta device; our RoPE is computed from the config, never a stale buffer."""
    model = tiny_model("sdar")
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert not [n for n, _ in loaded.named_buffers()]
    ids = torch.randint(4, 100, (1, 16))
    assert_close_fp32(loaded(ids).logits, model(ids).logits)  # a stale RoPE moves them by far more
    # RoPE matters: the same tokens at shifted positions give different logits
    shifted = loaded(ids, position_ids=torch.arange(3, 19)[None]).logits
    assert not torch.allclose(shifted, model(ids).logits)


def test_sdar_attention_is_block_causal():
    model = tiny_model("sdar")  # block_size 4
    ids = torch.randint(4, 100, (1, 12))
    changed = ids.clone()
    changed[0, 5] = (ids[0, 5] + 1) % 100 + 4  # a token in block 1
    a, b = model(ids).logits, model(changed).logits
    assert torch.equal(a[:, :4], b[:, :4])  # earlier block untouched
    assert not torch.allclose(a[:, 4:8], b[:, 4:8])  # own block (both directions) changes
    assert not torch.allclose(a[:, 4], b[:, 4])  # position 4 sees position 5: bidirectional inside the block
    assert not torch.allclose(a[:, 8:], b[:, 8:])


@pytest.mark.parametrize("family_name", ["llada", "dream"])
def test_full_attention_models_see_everything(family_name):
    model = tiny_model(family_name)
    ids = torch.randint(4, 100, (1, 12))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 100 + 4
    diff = (model(ids).logits - model(changed).logits).abs().amax(-1)
    assert bool((diff > 0).all())


def test_key_padding_mask_matches_unpadded(family):
    model = tiny_model(family)
    ids = torch.randint(4, 100, (1, 10))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 10)], dim=1).long()
    positions = trl_diffusion.states.positions_from_padding(mask)
    out = model(padded, attention_mask=mask, position_ids=positions).logits[:, 3:]
    assert_close_fp32(out, model(ids).logits)


def test_custom_4d_mask_and_cache(family):
    """A custom 4-D mask equals the default one; a read-only cache pass equals the full forward."""
    model = tiny_model(family)
    ids = torch.randint(4, 100, (1, 12))
    positions = torch.arange(12)[None]
    block = model.block_size
    mask = trl_diffusion.states.attention_mask_from_positions(positions, positions, None, block)
    full = model(ids, attention_mask=mask, position_ids=positions).logits
    assert_close_fp32(full, model(ids).logits)
    if block is None:
        return
    cache = trl_diffusion.DiffusionCache()
    model(ids[:, :8], position_ids=positions[:, :8], past_key_values=cache, store_kv=True)
    tail = model(ids[:, 8:], position_ids=positions[:, 8:], past_key_values=cache).logits
    assert cache.get_seq_length() == 8  # the read-only pass did not write
    assert_close_fp32(tail, full[:, 8:])


def test_dream_logits_are_shifted_and_aligned():
    model = tiny_model("dream")
    assert model.logits_shift and not tiny_model("sdar").logits_shift and not tiny_model("llada").logits_shift
    logits = torch.arange(6.0).view(1, 3, 2)
    assert model.align_logits(logits)[0, 1].tolist() == [0.0, 1.0]
    # a column after padding inside the row reads the last real column before it, not the padding's logits
    logits = torch.arange(10.0).view(1, 5, 2)
    valid = torch.tensor([[True, True, False, False, True]])
    assert model.align_logits(logits, valid)[0].tolist() == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0],
                                                             [2.0, 3.0]]
    assert torch.equal(model.align_logits(logits, torch.ones(1, 5, dtype=torch.bool)), model.align_logits(logits))
    assert torch.equal(tiny_model("llada").align_logits(logits, valid), logits)


def test_dream_loss_scores_no_label_at_the_first_column():
    # nothing predicts column 0 of a shifted model: its label was scored against logits[0] (the prediction of
    # column 1), and transformers' Trainer counted it in num_items_in_batch
    import torch.nn.functional as F

    model = tiny_model("dream")
    ids = torch.randint(5, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    out = model(ids, labels=ids)
    logits = out.logits.float()
    next_token = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    assert_close_fp32(out.loss, next_token)
    only_first = torch.full_like(ids, -100)
    only_first[:, 0] = ids[:, 0]
    assert torch.isnan(model(ids, labels=only_first).loss)  # no labelled token left, as an all -100 batch
    assert model.loss_type == "ForCausalLM" and tiny_model("sdar").loss_type is None  # Trainer counts labels[:, 1:]


def test_a_new_models_padding_row_starts_at_zero_and_a_loaded_one_is_kept(tmp_path):
    # Dream's release zeroes its embedding's padding_idx row at init (the row never gets a gradient); ours drew it
    # at random. A checkpoint's row is loaded as it is.
    from trl_diffusion.testing import MODEL_CLASSES, tiny_dream_config

    model = MODEL_CLASSES["dream"](tiny_dream_config())  # as built from a config (tiny_model fills every weight)
    embedding = model.get_input_embeddings()
    assert embedding.padding_idx is not None and not embedding.weight[embedding.padding_idx].any()
    assert embedding.weight.abs().sum() > 0
    with torch.no_grad():
        embedding.weight[embedding.padding_idx] = 0.5
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).get_input_embeddings()
    assert (loaded.weight[loaded.padding_idx] == 0.5).all()


def test_lora_default_targets_and_training_step(family):
    model = tiny_model(family).train()
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8))
    targets = {n.split(".lora_A")[0].split(".")[-1] for n, p in lora.named_parameters() if "lora_A" in n}
    assert {"q_proj", "v_proj"} <= targets
    ids = torch.randint(4, 100, (2, 8))
    loss = lora(ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for n, p in lora.named_parameters() if p.requires_grad)


def test_gradient_checkpointing_gives_same_gradients(family):
    ids = torch.randint(4, 100, (2, 8))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(family).train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model(ids, labels=ids).loss.backward()
        grads.append(model.get_input_embeddings().weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def _release_rms_norm(x, weight, eps):
    """The releases' eager RMSNorm, written out: fp32 variance, cast back, then the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _release_rotary(x, positions, theta, full_precision):
    """The HF rotate-half RoPE of the releases, written out: ``x * cos + rotate_half(x) * sin``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    emb = (positions.float()[..., None] * inv_freq).repeat(1, 1, 2)[:, None]
    cos, sin = emb.cos(), emb.sin()
    rotated = torch.cat([-x[..., dim // 2:], x[..., : dim // 2]], dim=-1)
    if full_precision:
        rotated32 = torch.cat([-x.float()[..., dim // 2:], x.float()[..., : dim // 2]], dim=-1)
        return (x.float() * cos + rotated32 * sin).to(x.dtype)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_rotary_equal_the_releases_formulas(dtype):
    """``rms_norm`` (one ``F.rms_norm`` call) and ``apply_rotary`` (a roll and a signed sin table) compute exactly the
    releases' arithmetic; only the number of operations changed. Checked at far positions, where RoPE errors show."""
    from trl_diffusion.models.common import RotaryTables, apply_rotary, rotary_cos_sin
    from trl_diffusion.models.kernels import rms_norm

    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(2, 5, 64, generator=g)).to(dtype)
    weight = (0.5 + torch.rand(64, generator=g)).to(dtype)
    # fp32: equal up to a last-place difference; bf16: up to one bf16 rounding step flipped by such a difference
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1e-5)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), _release_rms_norm(x, weight, 1e-6), **tol)
    q = torch.randn(2, 4, 5, 32, generator=g).to(dtype)
    k = torch.randn(2, 2, 5, 32, generator=g).to(dtype)
    positions = torch.tensor([[0, 1, 2, 3, 4], [1000, 1001, 1002, 2040, 4095]])
    cos, signed_sin = rotary_cos_sin(positions, 32, 10000.0)
    for full_precision in (False, True):
        rq, rk = apply_rotary(q, k, RotaryTables(cos, signed_sin), full_precision)
        torch.testing.assert_close(rq, _release_rotary(q, positions, 10000.0, full_precision), **tol)
        torch.testing.assert_close(rk, _release_rotary(k, positions, 10000.0, full_precision), **tol)


def test_bf16_forward_is_close_to_fp32_also_at_far_positions(family):
    """RoPE depends on relative positions only, so fp32 logits at positions 480-495 equal those at 0-15; in bf16 they
    stay within bf16 rounding of them (mean error ~2% of the mean |logit|). RoPE angles computed in bf16 (an 8-bit
    mantissa: 480 + 1 rounds to 480) would be off by up to a radian there: errors of 30-70%. (At small positions
    bf16 angles are nearly exact, which is why positions near the end of the table are used.)"""
    model = tiny_model(family)
    ids = torch.randint(4, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    near = torch.arange(16)[None]
    far = near + 480
    reference = model(ids, position_ids=near).logits
    assert_close_fp32(model(ids, position_ids=far).logits, reference, rel=1e-3)
    for positions in (near, far):
        out = model.to(torch.bfloat16)(ids, position_ids=positions).logits
        assert out.dtype == torch.bfloat16
        error = (out.float() - reference).abs()
        assert error.mean() < 0.08 * reference.abs().mean() and error.max() < 0.15 * reference.abs().max()


def test_errors_are_clear(family, tmp_path):
    model = tiny_model(family)
    with pytest.raises(ValueError, match="attention_mask of shape"):
        model(torch.randint(4, 100, (1, 8)), attention_mask=torch.ones(1, 1, 8, 5, dtype=torch.bool))
    state = {k: v for k, v in model.state_dict().items() if "norm" not in k or "0" not in k}
    state["model.unexpected.weight"] = torch.zeros(2)
    model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_config_errors():
    with pytest.raises(ValueError, match="block_size"):
        trl_diffusion.SDARConfig(block_size=0)
    with pytest.raises(ValueError, match="not supported"):
        tiny_model("llada", block_type="sequential")
    model = tiny_model("sdar", mask_token_id=None)
    with pytest.raises(ValueError, match="no mask token"):
        _ = model.mask_token_id


def test_tokenizer_check():
    tokenizer = build_tokenizer()
    check_tokenizer(tokenizer, tiny_model("sdar"))
    with pytest.raises(ValueError, match="differs"):
        check_tokenizer(tokenizer, tiny_model("sdar", mask_token_id=7))


def test_auto_config_registration():
    for model_type in ("sdar", "llada", "Dream"):
        assert AutoConfig.for_model(model_type).model_type == model_type


def test_trl_create_model_from_path(family, tmp_path):
    """TRL loads policies and reference models by path through create_model_from_path (reads config.auto_map)."""
    from trl.trainer.utils import create_model_from_path

    tiny_model(family).save_pretrained(tmp_path)
    assert type(create_model_from_path(str(tmp_path))) is type(tiny_model(family))


@pytest.mark.parametrize("autocast", [False, True])
def test_rotary_tables_cast_once_per_forward(family, autocast, monkeypatch):
    """The rotary tables are cast to the dtype q/k rotate in once per forward, not in every layer: the same logits
    bit for bit as casting them in each layer (bf16 weights, or float32 weights under bf16 autocast, where SDAR's
    q/k norms give float32 q/k), and two casts fewer per layer in a bf16 forward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trl_diffusion.models import common

    class CountCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.casts += func.overloadpacket.__name__ == "_to_copy"
            return func(*args, **(kwargs or {}))

    model = tiny_model(family).eval()
    if not autocast:
        model = model.to(torch.bfloat16)
    ids = torch.randint(4, 100, (2, 12), generator=torch.Generator().manual_seed(0))

    def logits_and_casts():
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast), CountCasts() as counter:
            return model(ids).logits, counter.casts

    once, casts = logits_and_casts()

    class CastEveryTime(common.RotaryTables):  # what every layer did before
        def cast(self, dtype):
            cos, signed_sin = self._tables[torch.float32]
            return cos.to(dtype), signed_sin.to(dtype)

    monkeypatch.setattr(common, "RotaryTables", CastEveryTime)
    every_layer, casts_every_layer = logits_and_casts()
    assert torch.equal(once, every_layer)
    layers = model.config.n_layers if family == "llada" else model.config.num_hidden_layers
    full_precision = getattr(model.config, "rope_full_precision", False)
    if not autocast and not full_precision:
        assert casts_every_layer - casts == 2 * (layers - 1)
    else:  # fp32 tables (LLaDA) or fp32 q/k: nothing to cast, either way
        assert casts_every_layer >= casts


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "broadcast_rows"])
def test_grouped_query_attention_folds_the_heads_exactly(mask_kind):
    """Decoding over a KV cache folds each key/value head's query heads into the query length: the same attention
    as SDPA with ``enable_gqa`` (float64, to rounding), for no mask, a boolean or additive ``[B, 1, Q, K]`` mask,
    and one shared by the batch; padded keys stay unseen."""
    from trl_diffusion.models.common import grouped_query_attention

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 8, 4, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 10, 16, generator=g, dtype=torch.float64) for _ in range(2))
    visible = torch.rand(3, 1, 4, 10, generator=g) < 0.7
    visible[..., 0] = True  # every query sees a key
    mask = {"none": None, "bool": visible, "float": torch.zeros(visible.shape, dtype=torch.float64).masked_fill(
        ~visible, float("-inf")), "broadcast_rows": visible[:1]}[mask_kind]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_query_attention(q, k, v, mask), expected, rtol=1e-12, atol=1e-12)
    if mask_kind == "bool":  # a wrong fold (heads matched to the wrong key/value head, or the mask's rows) shows
        wrong = torch.nn.functional.scaled_dot_product_attention(q, k.flip(1), v.flip(1), attn_mask=mask,
                                                                 enable_gqa=True)
        assert not torch.allclose(grouped_query_attention(q, k, v, mask), wrong)


def test_cached_decoding_uses_the_folded_heads(monkeypatch):
    """SDAR's cached forwards (grouped-query heads) attend through ``grouped_query_attention``; a forward without a
    cache (training, scoring) does not."""
    from trl_diffusion.models import common

    calls = []
    fold = common.grouped_query_attention
    monkeypatch.setattr(common, "grouped_query_attention", lambda *a: calls.append(1) or fold(*a))
    model = tiny_model("sdar").eval()
    assert model.config.num_attention_heads != model.config.num_key_value_heads
    ids = torch.tensor([[11, 12, 13, 14, 15]])
    model(ids)
    assert calls == []
    model.generate(ids, max_new_tokens=4, use_cache=True)
    assert len(calls) >= model.config.num_hidden_layers


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rms_norm_of_half_inputs_computes_in_float32(dtype):
    """``rms_norm`` hands half-precision inputs to ``F.rms_norm`` as they are: it must give the same bits, values and
    gradients, as casting them to float32 and back around the call (the releases' arithmetic), which torch does
    inside the call."""
    import torch.nn.functional as F

    from trl_diffusion.models.kernels import rms_norm

    g = torch.Generator().manual_seed(0)
    for shape in [(2, 37, 256), (3, 5, 8, 64), (1, 2052, 128)]:
        x0 = (3 * torch.randn(*shape, generator=g)).to(dtype)
        w0 = (0.5 + torch.rand(shape[-1], generator=g)).to(dtype)
        upstream = torch.randn(*shape, generator=g).to(dtype)
        results = []
        for norm in (lambda x, w: rms_norm(x, w, 1e-6),
                     lambda x, w: w * F.rms_norm(x.float(), x.shape[-1:], eps=1e-6).to(dtype)):
            x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
            out = norm(x, w)
            (out * upstream).sum().backward()
            results.append((out, x.grad, w.grad))
        assert results[0][0].dtype == dtype
        assert all(torch.equal(a, b) for a, b in zip(*results))
