"""``recompute_scoring_forwards``: each scoring forward checkpointed as a whole, so that the backward pass holds one
forward's activations. Log-probs and gradients equal the plain path's (LoRA dropout included: its random state is
restored for the recomputation), each forward runs once more in the backward pass, and the trainers give the same
step."""

import peft
import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32

import trl_diffusion.recomputed_forwards as recomputed
from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs
from trl_diffusion.recomputed_forwards import check_recomputed_forwards, recomputed_forwards
from trl_diffusion.testing import build_tokenizer, tiny_model, tiny_moe_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer


class Through:
    """Calls ``model`` (here a PEFT wrapper) and answers the diffusion interface from ``base``."""

    def __init__(self, model, base):
        self.model, self.base = model, base

    def __call__(self, **kwargs):
        return self.model(**kwargs)

    def __getattr__(self, name):
        return getattr(self.base, name)


def scored(family: str, recompute: bool, lora: bool, layers_checkpointed: bool):
    """Log-probs, gradients, bytes autograd saved outside any checkpoint, and model forwards (before, after the
    backward) of one packed scoring of two responses, one row per forward (budget 1). ``lora``: adapters with
    dropout; ``layers_checkpointed``: transformers' (reentrant) layer-wise checkpointing inside the whole-forward
    one."""
    base = tiny_model(family).train()
    model = base
    if layers_checkpointed:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    if lora:
        torch.manual_seed(0)  # the adapters' initialisation
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_dropout=0.5, target_modules="all-linear"))
        if layers_checkpointed:
            model.enable_input_require_grads()
    generator = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(10, 100, (2, 5), generator=generator)
    completion_ids = torch.randint(10, 100, (2, 8), generator=generator)
    unmask_step = torch.stack([torch.randperm(8, generator=generator) for _ in range(2)])
    settings = EstimatorSettings(block_size=4 if base.block_size else None, token_budget=1)
    forwards, saved = [], [0]
    base.model.register_forward_hook(lambda *_: forwards.append(1))

    def pack(tensor):
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(5)
    with recomputed_forwards(model, recompute), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logps, _, _ = estimate_logprobs(Through(model, base), prompt_ids, torch.ones_like(prompt_ids),
                                        completion_ids, unmask_step, settings)
    before = len(forwards)
    logps.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logps.detach(), grads, saved[0], (before, len(forwards))


@pytest.mark.parametrize("family,lora,layers_checkpointed", [("sdar", False, False), ("llada", True, False),
                                                             ("dream", True, True)])
def test_recomputed_scoring_gives_the_same_gradients_from_one_forward_at_a_time(family, lora, layers_checkpointed):
    # with LoRA dropout the recomputation must draw the same dropout masks as the forward did
    logps, grads, saved, forwards = scored(family, False, lora, layers_checkpointed)
    logps_r, grads_r, saved_r, forwards_r = scored(family, True, lora, layers_checkpointed)
    assert_close_fp32(logps_r, logps)
    assert grads_r.keys() == grads.keys() and len(grads) > 4
    for name, grad in grads.items():
        assert_close_fp32(grads_r[name], grad)
    assert forwards[0] >= 2 and forwards == (forwards[0], forwards[0])  # several forwards, none run again
    assert forwards_r == (forwards[0], 2 * forwards[0])  # each run once more in the backward pass
    assert saved_r < saved / 20  # the forwards' activations are not kept for the backward


def test_the_forward_is_checkpointed_only_where_gradients_flow_and_restored_after(monkeypatch):
    calls = []
    real = recomputed.checkpoint
    monkeypatch.setattr(recomputed, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = tiny_model("llada").train()
    ids = torch.randint(5, 100, (1, 6))
    expected = model(input_ids=ids).logits
    own = model.forward  # an instance attribute set before (as accelerate's mixed-precision wrapper is) stays
    model.forward = own
    with recomputed_forwards(model, True):
        with torch.no_grad():
            assert torch.equal(model(input_ids=ids).logits, expected)
        assert not calls
        assert torch.equal(model(input_ids=ids).logits, expected) and len(calls) == 1
    assert model.forward is own
    del model.forward
    with recomputed_forwards(model, True):
        pass
    assert "forward" not in vars(model)
    with recomputed_forwards(model, False):
        model(input_ids=ids)
    assert len(calls) == 1


def test_refused_without_a_budget(tmp_path):
    for config in (TraceRLConfig, DiffusionValueConfig):
        with pytest.raises(ValueError, match="recompute_scoring_forwards=True needs a scoring_token_budget"):
            config(output_dir=str(tmp_path), use_cpu=True, bf16=False, scoring_token_budget=None,
                   recompute_scoring_forwards=True)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream", "sdar_moe", "llada_moe", "value"])
def test_refused_where_the_weights_are_gathered_in_forward_hooks(family):
    """FSDP always; DeepSpeed ZeRO-3 only for a model with weights on its root module, which none of the families
    has (ZeRO-3 runs with recomputation in tests/test_deepspeed.py)."""
    if family == "value":
        model = DiffusionValueModel.from_policy(tiny_model("sdar"))
    else:
        model = tiny_moe_model(family) if family.endswith("_moe") else tiny_model(family)
    check_recomputed_forwards(True, fsdp=False, zero_stage=2, option="x", model=model)
    check_recomputed_forwards(True, fsdp=False, zero_stage=3, option="x", model=model)
    check_recomputed_forwards(False, fsdp=True, zero_stage=3, option="x", model=model)
    with pytest.raises(ValueError, match="x=True is not supported with FSDP"):
        check_recomputed_forwards(True, fsdp=True, zero_stage=None, option="x", model=model)
    model.scale = torch.nn.Parameter(torch.ones(1))  # a weight of the root module's own
    check_recomputed_forwards(True, fsdp=False, zero_stage=2, option="x", model=model)
    with pytest.raises(ValueError, match=r"DeepSpeed ZeRO-3 .* root module \(scale\)"):
        check_recomputed_forwards(True, fsdp=False, zero_stage=3, option="x", model=model)


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def tracerl_step(tmp_path, recompute: bool):
    """One TraceRL step of a LLaDA with a value model, rows scored one per forward; the trained weights, logs and
    the number of policy and value forwards."""
    policy = tiny_model("llada").train()
    value = DiffusionValueModel.from_policy(policy)
    with torch.no_grad():
        value.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
    forwards = {"policy": 0, "value": 0}  # counted on the backbones: the recomputation calls the models' forward
    policy.model.register_forward_hook(lambda *_: forwards.__setitem__("policy", forwards["policy"] + 1))
    value.model.register_forward_hook(lambda *_: forwards.__setitem__("value", forwards["value"] + 1))
    args = TraceRLConfig(output_dir=str(tmp_path / str(recompute)), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                         block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, bf16=False,
                         gradient_checkpointing=False, disable_tqdm=True, seed=0, dynamic_group_filtering="none",
                         scoring_token_budget=1, recompute_scoring_forwards=recompute, value_learning_rate=1e-2)
    trainer = TraceRLTrainer(policy, distinct_chars, args=args, train_dataset=Dataset.from_dict({"prompt": ["ab"]}),
                             processing_class=build_tokenizer(), value_model=value)
    trainer.train()
    weights = {n: p.detach().clone() for n, p in policy.named_parameters()}
    weights.update({f"value.{n}": p.detach().clone() for n, p in value.named_parameters()})
    return weights, trainer.state.log_history[0], forwards


def test_tracerl_step_with_a_value_model_is_unchanged(tmp_path):
    weights, logs, forwards = tracerl_step(tmp_path, False)
    weights_r, logs_r, forwards_r = tracerl_step(tmp_path, True)
    assert weights_r.keys() == weights.keys()
    for name, tensor in weights.items():
        assert_close_fp32(weights_r[name], tensor)
    for key in ("loss", "value/loss", "rollout/sampler_logp_gap", "reward"):
        assert logs_r[key] == pytest.approx(logs[key], rel=1e-5, abs=1e-6), key
    # the scoring forwards with gradients (the policy's, and the value model's updates) ran once more
    assert forwards_r["policy"] > forwards["policy"] and forwards_r["value"] > forwards["value"]


def test_value_trainer_step_is_unchanged(tmp_path):
    generator = torch.Generator().manual_seed(0)
    rows = {"prompt": ["good: add", "bad: sub"] * 2, "reward": [1.0, -1.0] * 2,
            "completion_ids": [torch.randint(10, 100, (8,), generator=generator).tolist() for _ in range(4)],
            "unmask_step": [torch.randperm(8, generator=generator).div(2, rounding_mode="floor").tolist()
                            for _ in range(4)]}
    results = []
    for recompute in (False, True):
        value = DiffusionValueModel.from_policy(tiny_model("sdar", seed=3))
        args = DiffusionValueConfig(output_dir=str(tmp_path / str(recompute)), per_device_train_batch_size=4,
                                    max_steps=1, learning_rate=1e-2, logging_steps=1, report_to="none",
                                    save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
                                    scoring_token_budget=1, recompute_scoring_forwards=recompute)
        trainer = DiffusionValueTrainer(value, args=args, train_dataset=Dataset.from_dict(rows),
                                        processing_class=build_tokenizer())
        trainer.train()
        results.append(({n: p.detach().clone() for n, p in value.named_parameters()}, trainer.state.log_history))
    (plain, plain_logs), (recomputed_weights, logs) = results
    moved = [n for n, p in DiffusionValueModel.from_policy(tiny_model("sdar", seed=3)).named_parameters()
             if not torch.equal(p, plain[n])]
    assert moved  # the step trained something
    for name, tensor in plain.items():
        assert_close_fp32(recomputed_weights[name], tensor)
    assert logs[0]["loss"] == pytest.approx(plain_logs[0]["loss"], rel=1e-5)


def test_the_memory_benchmark_measures_the_same_scoring_in_each_variant(monkeypatch):
    """``benchmarks/memory.py``: the recompute variant scores in several forwards (each run again in the backward
    pass); SFT's takes the step of one forward."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "memory_benchmark", Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setitem(bench.VARIANTS, "budget_2048_recompute", (60, False, True))  # one row per forward
    records = [bench.measure(name, 8, 2, 8, 64, 1, 256, "cpu") for name in ("unchunked", "budget_2048_recompute")]
    assert [(r["forwards"], r["recompute_scoring_forwards"]) for r in records] == [(1, False), (2, True)]
    sft = [bench.measure_sft(name, 32, 2, 8, 64, 1, 256, "cpu") for name in ("unchunked", "budget_2048_recompute")]
    assert [(r["forwards"], r["recompute_scoring_forwards"]) for r in sft] == [(1, False), (4, True)]  # a row each
    assert sft[1]["loss"] == pytest.approx(sft[0]["loss"], rel=1e-5)
