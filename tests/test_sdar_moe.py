"""SDAR-MoE (SDAR-30B-A3B, ``model_type`` ``"sdar_moe"``): parity with transformers' Qwen3-MoE, the sparse block
against a slow per-token reference, the released checkpoint layout, the block-causal path shared with dense SDAR,
generation and trajectory replay, training, and what the model refuses."""

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
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from trl_diffusion import DiffusionValueModel, SDARMoeConfig, SDARMoeForCausalLM
from trl_diffusion.estimators import replay_logprobs
from trl_diffusion.generation import cuda_graphs, sampler
from trl_diffusion.models import SDARForCausalLM, SDARMoeModel
from trl_diffusion.models.common import QwenStyleMLP
from trl_diffusion.models.sdar_moe import SDARMoeSparseMoeBlock
from trl_diffusion.testing import (
    build_tokenizer,
    left_pad,
    seeded_fill_,
    tiny_moe_model,
    tiny_sdar_config,
    tiny_sdar_moe_config,
)

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]
EXPERT_KEYS = ["down_proj.weight", "gate_proj.weight", "up_proj.weight"]
ROUTING_MARGIN = 1e-5
"""Smallest gap between the k-th and (k+1)-th router probability that a test comparing two float32 paths accepts:
the paths' probabilities differ by ~1e-7, so a gap of 100 times that cannot switch a token's experts (a smaller
bound than ``MIN_MARGIN``, as a rollout routes thousands of tokens, some within 1e-4 of a tie)."""


@contextlib.contextmanager
def routing_margins():
    """Record, over every routing decision, the gap between the k-th and the (k+1)-th router probability: a test
    comparing two float paths through the experts asserts it is clear, so no token can switch experts."""
    margins = []
    original = SDARMoeSparseMoeBlock.route

    def route(self, hidden):
        if self.top_k < self.num_experts:
            probs = F.softmax(self.gate(hidden).detach(), dim=-1, dtype=torch.float32)
            top = probs.topk(self.top_k + 1, dim=-1).values
            margins.append(float((top[:, -2] - top[:, -1]).min()))
        return original(self, hidden)

    SDARMoeSparseMoeBlock.route = route
    try:
        yield margins
    finally:
        SDARMoeSparseMoeBlock.route = original


@torch.no_grad()
def reference_block(block, hidden):
    """The sparse block, token by token: softmax of the router logits (float32), top-k, renormalise when asked,
    the weighted sum of the chosen experts' SwiGLU outputs (the per-token sum in ascending expert order)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows = []
    for x in flat:
        probs = torch.softmax((block.gate.weight @ x).float(), dim=-1)
        top = sorted(range(block.num_experts), key=lambda e: -float(probs[e]))[: block.top_k]
        weights = {e: probs[e] for e in top}
        if block.norm_topk_prob:
            total = sum(weights.values())
            weights = {e: w / total for e, w in weights.items()}
        out = torch.zeros_like(x)
        for e in sorted(top):
            expert = block.experts[e]
            y = expert.down_proj.weight @ (F.silu(expert.gate_proj.weight @ x) * (expert.up_proj.weight @ x))
            out = out + y * weights[e].to(x.dtype)
        rows.append(out)
    return torch.stack(rows).reshape(hidden.shape)


# ------------------------------------------------------------------------------------------------ config & layout


def test_config_fields_and_which_layers_are_sparse():
    config = tiny_sdar_moe_config(num_hidden_layers=5, mlp_only_layers=[3], decoder_sparse_step=2)
    assert [config.layer_is_sparse(i) for i in range(5)] == [False, True, False, False, False]
    model = SDARMoeForCausalLM(config)
    for i, layer in enumerate(model.model.layers):
        if config.layer_is_sparse(i):
            assert isinstance(layer.mlp, SDARMoeSparseMoeBlock)
            assert layer.mlp.gate.weight.shape == (4, 64)
            assert layer.mlp.experts[3].up_proj.weight.shape == (32, 64)  # moe_intermediate_size
        else:
            assert type(layer.mlp) is QwenStyleMLP and layer.mlp.up_proj.weight.shape == (128, 64)
    saved = config.to_dict()
    assert saved["model_type"] == "sdar_moe"
    for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                  "decoder_sparse_step", "mlp_only_layers", "router_aux_loss_coef", "block_size", "mask_token_id",
                  "head_dim", "intermediate_size"):
        assert field in saved, field
    assert saved["output_router_logits"] is False
    assert AutoConfig.for_model("sdar_moe").model_type == "sdar_moe"
    assert SDARMoeConfig(hidden_size=256, num_attention_heads=8).head_dim == 32  # Qwen3-MoE's default head_dim


@pytest.mark.parametrize("bad,match", [
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
    (dict(num_experts_per_tok=0), "num_experts_per_tok"),
    (dict(mlp_only_layers=[2]), "mlp_only_layers"),
    (dict(num_experts=-1), "num_experts"),
    (dict(block_size=0), "block_size"),  # SDAR's own checks still apply
])
def test_config_errors(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny_sdar_moe_config(**bad)


def test_state_dict_keys_are_the_released_names():
    keys = set(tiny_moe_model("sdar_moe", mlp_only_layers=[1]).state_dict())
    expected = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(2):
        prefix = f"model.layers.{i}."
        expected |= {prefix + k for k in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                          "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                          "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                          "self_attn.q_norm.weight", "self_attn.k_norm.weight")}
    expected |= {"model.layers.0.mlp.gate.weight"}
    expected |= {f"model.layers.0.mlp.experts.{e}.{k}" for e in range(4) for k in EXPERT_KEYS}
    expected |= {f"model.layers.1.mlp.{k}" for k in EXPERT_KEYS}  # the dense layer
    assert keys == expected


# ------------------------------------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_logits_equal_transformers_qwen3_moe_with_blocks_of_one(tmp_path, norm_topk_prob):
    """Block-causal attention with blocks of 1 is causal attention: with the same weights, our model is
    transformers' Qwen3-MoE (sparse and dense layers mixed)."""
    model = tiny_moe_model("sdar_moe", block_size=1, num_hidden_layers=3, mlp_only_layers=[1],
                           norm_topk_prob=norm_topk_prob)
    reference = qwen3_moe_from(model, tmp_path)
    ids = torch.randint(5, 120, (2, 13))
    with torch.no_grad(), routing_margins() as margins:
        ours = model(ids).logits
    assert min(margins) > ROUTING_MARGIN
    with torch.no_grad():
        theirs = reference(ids).logits
    assert_close_fp32(ours, theirs)
    assert float((ours - theirs).abs().max()) < 1e-3 * float(theirs.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sparse_block_is_bitwise_transformers_qwen3_moe_block(tmp_path, dtype):
    """The dispatch does the reference's arithmetic in the reference's order (each token's expert outputs summed in
    ascending expert order; with 3 per token the order shows in bfloat16): the results are identical."""
    model = tiny_moe_model("sdar_moe", num_hidden_layers=1, num_experts_per_tok=3)
    ours = model.model.layers[0].mlp.to(dtype)
    theirs = qwen3_moe_from(model, tmp_path).model.layers[0].mlp.to(dtype)
    assert isinstance(theirs, Qwen3MoeSparseMoeBlock)
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_sparse_block_equals_a_per_token_reference(norm_topk_prob, top_k):
    block = tiny_moe_model("sdar_moe", num_hidden_layers=1, norm_topk_prob=norm_topk_prob,
                           num_experts_per_tok=top_k).model
    block = block.layers[0].mlp.double()
    x = torch.randn(2, 9, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), routing_margins() as margins:
        ours = block(x)
    assert min(margins) > ROUTING_MARGIN
    torch.testing.assert_close(ours, reference_block(block, x), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("layout", [dict(mlp_only_layers=[0, 3]), dict(decoder_sparse_step=2),
                                    dict(decoder_sparse_step=2, mlp_only_layers=[1])])
def test_model_with_dense_layers_equals_the_per_token_reference(layout, monkeypatch):
    """The whole model, with the sparse blocks replaced by the per-token reference, gives the same logits; the
    dense layers are the dense SwiGLU of width intermediate_size."""
    model = tiny_moe_model("sdar_moe", num_hidden_layers=4, **layout).double()
    kinds = [type(layer.mlp) for layer in model.model.layers]
    assert SDARMoeSparseMoeBlock in kinds and QwenStyleMLP in kinds
    ids = torch.randint(5, 120, (2, 10))
    with torch.no_grad():
        ours = model(ids).logits
        monkeypatch.setattr(SDARMoeSparseMoeBlock, "forward", reference_block)
        slow = model(ids).logits
    torch.testing.assert_close(ours, slow, rtol=1e-10, atol=1e-10)


def test_one_expert_top1_is_dense_sdar():
    """One expert with top-1 routing (weight 1) is a dense MLP: with the dense SDAR's MLP weights in the expert, the
    model is dense SDAR, block-causal mask (block size 4), KV cache and sampler included."""
    moe = tiny_moe_model("sdar_moe", num_experts=1, num_experts_per_tok=1, intermediate_size=32, mlp_only_layers=[1])
    dense = SDARForCausalLM(tiny_sdar_config(intermediate_size=32)).eval()
    state = {k.replace("mlp.experts.0.", "mlp."): v for k, v in moe.state_dict().items() if "mlp.gate." not in k}
    dense.load_state_dict(state, strict=True)
    ids = torch.randint(5, 120, (2, 11))
    with torch.no_grad():
        assert torch.equal(moe(ids).logits, dense(ids).logits)
    ids, mask = left_pad(PROMPTS)
    kw = dict(max_new_tokens=12, block_length=4, denoising_steps=2, temperature=1.0, use_cache=True,
              stop_token_ids=[], return_dict_in_generate=True)
    a = moe.generate(ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    b = dense.generate(ids, mask, generator=torch.Generator().manual_seed(0), **kw)
    assert torch.equal(a.sequences, b.sequences) and torch.equal(a.token_logprobs, b.token_logprobs)


# ------------------------------------------------------------------------------------------------ checkpoints

RELEASED_EXTRAS = {
    "architectures": ["SDARMoeForCausalLM"],
    "auto_map": {
        "AutoConfig": "configuration_sdar_moe.SDARMoeConfig",
        "AutoModel": "modeling_sdar_moe.SDARMoeModel",
        "AutoModelForCausalLM": "modeling_sdar_moe.SDARMoeForCausalLM",
    },
    "attn_implementation": "flex_attention",
    "fuse_cross_entropy": True,
    "output_router_logits": False,
    "torch_dtype": "float32",
    "transformers_version": "4.52.4",
}


def write_released_checkpoint(model, directory, drop=(), rename=None):
    config = model.config.to_dict()
    config.update(RELEASED_EXTRAS)
    config.pop("dtype", None)
    (directory / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k not in drop}
    if rename:
        state[rename[1]] = state.pop(rename[0])
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_released_checkpoint_loads_without_remote_code(tmp_path):
    model = tiny_moe_model("sdar_moe", mlp_only_layers=[1])
    write_released_checkpoint(model, tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is SDARMoeConfig
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(loaded) is SDARMoeForCausalLM and loaded.config.mlp_only_layers == [1]
    assert loaded.config.output_router_logits is False
    ids = torch.randint(5, 120, (2, 11))
    with torch.no_grad():
        assert_close_fp32(loaded(ids).logits, model(ids).logits)
    assert type(AutoModel.from_pretrained(tmp_path)) is SDARMoeForCausalLM  # as SDAR: AutoModel gives the LM
    backbone = SDARMoeModel.from_pretrained(tmp_path).eval()  # the head is the one key it ignores
    with torch.no_grad():
        assert_close_fp32(backbone(ids).last_hidden_state, model.model(ids).last_hidden_state)


@pytest.mark.parametrize("broken", [
    dict(drop=("model.layers.1.mlp.experts.3.down_proj.weight",)),
    dict(drop=("model.layers.0.mlp.gate.weight",)),
    dict(rename=("model.layers.0.mlp.experts.2.up_proj.weight", "model.layers.0.mlp.experts.2.w3.weight")),
    dict(rename=("model.layers.1.mlp.experts.0.gate_proj.weight", "model.layers.1.mlp.experts.gate_up_proj")),
])
def test_a_missing_or_renamed_expert_key_is_an_error(tmp_path, broken):
    write_released_checkpoint(tiny_moe_model("sdar_moe"), tmp_path, **broken)
    with pytest.raises(ValueError, match="does not match SDARMoeForCausalLM"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_moe_model("sdar_moe", decoder_sparse_step=2, norm_topk_prob=False)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == "sdar_moe" and saved["architectures"] == ["SDARMoeForCausalLM"]
    assert saved["decoder_sparse_step"] == 2 and saved["norm_topk_prob"] is False
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    differing = {k for k, v in loaded.config.to_dict().items() if model.config.to_dict().get(k) != v}
    assert differing == {"_name_or_path"}
    ids = torch.randint(5, 120, (2, 9))
    with torch.no_grad():
        assert_close_fp32(loaded(ids).logits, model(ids).logits)


# ------------------------------------------------------------------------------------------------ generation


def generate(model, **kw):
    ids, mask = left_pad(PROMPTS)
    args = dict(max_new_tokens=12, block_length=4, denoising_steps=2, temperature=0.0, stop_token_ids=[],
                return_dict_in_generate=True)
    return model.generate(ids, mask, **{**args, **kw}), mask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_exact_cache_equals_no_cache(temperature):
    """On the first sampling seed whose run has no decision near a tie (which float path wins a tie depends on the
    machine and the torch version: torch 2.6 met a routing gap of 1.4e-6 with seed 3)."""
    model = tiny_moe_model("sdar_moe")
    for seed in range(3, 11):
        with DecisionMargins() as margins, routing_margins() as routes:
            outs = [generate(model, use_cache=cache, temperature=temperature,
                             generator=torch.Generator().manual_seed(seed),
                             remasking_strategy="low_confidence_dynamic", confidence_threshold=0.3)[0]
                    for cache in (False, True)]
        if margins.smallest > MIN_MARGIN and min(routes) > ROUTING_MARGIN:  # no decision near a tie
            break
    else:
        pytest.fail("every seed met a decision near a tie")
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].unmask_step, outs[1].unmask_step)
    assert_close_fp32(outs[0].token_logprobs, outs[1].token_logprobs)


@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_replay_reproduces_the_sampler_logprobs(settings):
    """TraceRL's scoring: the trajectory replayed one state per step gives the sampler's own log-probs."""
    model = tiny_moe_model("sdar_moe")
    with torch.no_grad(), routing_margins() as routes:
        out, mask = generate(model, use_cache=True, generator=torch.Generator().manual_seed(0), **settings)
        replay = replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4, **settings)
    assert min(routes) > ROUTING_MARGIN
    committed = out.unmask_step >= 0
    assert committed.sum() >= 12 * len(PROMPTS)
    assert_close_fp32(replay, out.token_logprobs, committed)


def test_backward_reaches_the_router_and_the_experts_that_got_tokens():
    # top-1 without renormalising: renormalised, a token's one weight is p / p = 1 and the router's gradient only
    # rounding noise (exactly zero on some stacks)
    model = tiny_moe_model("sdar_moe", num_experts_per_tok=1, norm_topk_prob=False).train()
    ids = torch.randint(5, 120, (1, 3), generator=torch.Generator().manual_seed(0))  # 3 tokens, 1 expert each
    block = model.model.layers[0].mlp
    seen = []  # the block's input, to read which experts its tokens went to
    handle = block.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    model(ids).logits.square().mean().backward()
    handle.remove()
    with torch.no_grad():
        used = set(block.route(seen[0].reshape(-1, 64))[1].flatten().tolist())
    assert 0 < len(used) < block.num_experts
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    for e, expert in enumerate(block.experts):
        grad = expert.down_proj.weight.grad
        assert grad is not None  # every expert takes part in the backward (DDP needs it), idle ones with zeros
        assert (grad.abs().sum() > 0) == (e in used)


# ------------------------------------------------------------------------------------------------ training


def test_tracerl_step_scores_the_rollout_with_the_sampler_logprobs(tmp_path):
    from trl_diffusion import TraceRLConfig, TraceRLTrainer

    model = tiny_moe_model("sdar_moe").train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                         block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True,
                         gradient_checkpointing=False, disable_tqdm=True, seed=0, bf16=False,
                         dynamic_group_filtering="none")
    trainer = TraceRLTrainer(model, lambda completions, **kw: [float(len(set(c))) for c in completions], args=args,
                             train_dataset=Dataset.from_dict({"prompt": ["What is 1+2?", "abc"]}),
                             processing_class=build_tokenizer())
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.001  # the config's, as in TRL
    trainer.train()
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and math.isfinite(logs["aux_loss"])
    assert logs["rollout/sampler_logp_gap"] < 1e-4  # first iteration, same weights: ratio exactly 1
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert "model.layers.0.mlp.gate.weight" in changed
    assert any(".mlp.experts." in n for n in changed)


def test_sft_step_and_lora_defaults(tmp_path):
    from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer

    model = tiny_moe_model("sdar_moe").train()
    data = Dataset.from_list([{"prompt": "What is 1+2?", "completion": "3"}, {"prompt": "Hi", "completion": "yo"}])
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, gradient_checkpointing=False,
                              save_strategy="no", logging_steps=1, use_cpu=True, max_length=32, disable_tqdm=True,
                              per_device_train_batch_size=2, max_steps=1)
    trainer = DiffusionSFTTrainer(model, args=args, train_dataset=data, processing_class=build_tokenizer(),
                                  peft_config=peft.LoraConfig(r=4, lora_alpha=8))
    adapted = {n.rsplit(".lora_A", 1)[0] for n, _ in trainer.model.named_parameters() if ".lora_A" in n}
    assert any(n.endswith("mlp.experts.3.down_proj") for n in adapted)
    assert any(n.endswith("self_attn.q_proj") for n in adapted)
    assert not any(n.endswith("mlp.gate") for n in adapted)  # never the router
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_value_model_from_an_moe_policy():
    policy = tiny_moe_model("sdar_moe")
    value = DiffusionValueModel.from_policy(policy)
    assert value.block_size == 4 and type(value.model) is SDARMoeModel
    ids = torch.randint(5, 120, (2, 8))
    with torch.no_grad():
        assert torch.equal(value.model(ids).last_hidden_state, policy.model(ids).last_hidden_state)
        assert value(ids).value.abs().max() == 0  # zero head


# ------------------------------------------------------------------------------------------------ refusals


def test_a_router_loss_coefficient_is_refused_by_the_trainers(tmp_path):
    from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer

    data = Dataset.from_list([{"prompt": "What is 1+2?", "completion": "3"}])
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, max_length=32,
                              router_aux_loss_coef=0.01)
    trainer = DiffusionSFTTrainer(tiny_moe_model("sdar_moe"), args=args, train_dataset=data,
                                  processing_class=build_tokenizer())
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.01


def graph_runners_forced(monkeypatch):
    """Choose runners as on CUDA (on the CPU), recording the ones ``generate`` builds."""
    built = []
    original = sampler.runner_class

    def choose(settings, device, generator):
        return original(settings, torch.device("cuda"), generator)

    def spy_init(self, *args, **kwargs):
        built.append(type(self))
        raise RuntimeError("stop: a graph runner was built")

    monkeypatch.setattr(sampler, "runner_class", choose)
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)
    monkeypatch.setattr(cuda_graphs.GraphRunner, "__init__", spy_init)
    return built


def test_cuda_graphs_auto_decodes_an_moe_eagerly_and_on_is_refused(monkeypatch):
    built = graph_runners_forced(monkeypatch)
    kw = dict(max_new_tokens=8, temperature=0.0, use_cache=True, stop_token_ids=[])
    ids = torch.tensor([[5, 6, 7]])
    dense = seeded_fill_(SDARForCausalLM(tiny_sdar_config())).eval()
    with pytest.raises(RuntimeError, match="graph runner was built"):  # control: a dense SDAR would be captured
        dense.generate(ids, cuda_graphs="auto", **kw)
    assert built == [cuda_graphs.ExactCacheGraphRunner]
    built.clear()
    model = tiny_moe_model("sdar_moe")
    assert torch.equal(model.generate(ids, cuda_graphs="auto", **kw), model.generate(ids, cuda_graphs="off", **kw))
    assert not built  # the eager loop
    with pytest.raises(ValueError, match="cannot be captured as a CUDA graph"):
        model.generate(ids, cuda_graphs="on", **kw)
    assert not cuda_graphs.cuda_graph_capturable(peft.get_peft_model(tiny_moe_model("sdar_moe"), peft.LoraConfig(r=2)))
