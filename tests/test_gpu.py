"""What only a GPU shows: compiled flex attention against SDPA (values and gradients) for the SFT objectives and
TraceRL scoring, generation on CUDA equal to the CPU, the exact KV cache, a bf16 + gradient checkpointing + LoRA
TraceRL run (SDPA and compiled flex), TraceRL rollouts on CUDA graphs, SDAR-/LLaDA-MoE decoding, the three examples,
``trl-diffusion eval`` and the commands that go through ``accelerate launch``, all on CUDA.
(``tests/test_static_cache.py`` has the CUDA-graph decoding tests.)

Skipped without CUDA. One command runs them all (under 5 minutes on one H200)::

    HF_HUB_OFFLINE=1 python -m pytest -q -m gpu tests/test_gpu.py
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch
from datasets import Dataset

from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs
from trl_diffusion.recomputed_forwards import recomputed_forwards
from trl_diffusion.testing import (
    EOS_ID,
    MASK_ID,
    build_tokenizer,
    tiny_model,
    tiny_moe_model,
)
from trl_diffusion.trainers import TraceRLConfig, TraceRLTrainer
from trl_diffusion.trainers.diffusion_losses import (
    build_objective,
    count_loss_tokens,
    diffusion_loss,
    sample_generators,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).parent.parent
CUDA = torch.device("cuda")
"""Where these tests run; ``tests/test_gpu_setups.py`` sets it to the CPU to run their set-ups in CI."""
PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]
WIDE_HEADS = {"sdar": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
              "llada": dict(d_model=256, n_heads=4, n_kv_heads=4),
              "dream": dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)}
"""Tiny models with head_dim 64: inside the set ``auto`` compiles flex attention for (in half precision)."""


def wide_model(family: str, seed: int = 0):
    return tiny_model(family, seed=seed, **WIDE_HEADS[family]).to(CUDA)


def grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_close_grads(a, b):
    """Each gradient to 1e-3 relative and 1e-4 of its largest magnitude (float32 kernels that sum in another order:
    on 2026-12-04 an absolute 1e-5 failed LLaDA's and Dream's embedding gradients, which sum over every scored
    position, while their log-probs agreed to 1e-4). A wrong mask or position moves whole rows by O(1)."""
    assert a.keys() == b.keys() and a
    for name in a:
        scale = b[name].abs().max().item()
        torch.testing.assert_close(a[name], b[name], rtol=1e-3, atol=1e-4 * scale,
                                   msg=lambda m, name=name, scale=scale: f"{name} (largest |grad| {scale:.3g}): {m}")


def sft_rows():
    rows = [([20, 21, 22, 23, 24], [30, 31, 32, 33, 34, 35, EOS_ID]), ([40, 41], [50, 51, 52, 53, EOS_ID])]
    width = max(len(p) + len(c) for p, c in rows) + 2
    ids, labels = torch.full((2, width), EOS_ID), torch.full((2, width), -100)
    valid = torch.zeros((2, width), dtype=torch.bool)
    for i, (p, c) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        labels[i, len(p) : len(p) + len(c)] = torch.tensor(c)
        valid[i, : len(p) + len(c)] = True
    return ids.to(CUDA), labels.to(CUDA), valid.to(CUDA)


@pytest.mark.parametrize(("family", "objective"), [("sdar", "block"), ("llada", "random_masking"),
                                                   ("dream", "semi_ar")])
def test_compiled_flex_equals_sdpa_for_sft_objectives(family, objective):
    model = wide_model(family).train()
    ids, labels, valid = sft_rows()
    out = {}
    for backend in ("sdpa", "flex"):
        batch = build_objective(objective, ids, labels, valid, sample_generators([0, 1], 0, 0), mask_token_id=MASK_ID,
                                block_size=model.block_size, semi_ar_block_length=4)
        model.zero_grad(set_to_none=True)
        loss, _ = diffusion_loss(model, batch, count_loss_tokens(labels, model.logits_shift), model.logits_shift,
                                 MASK_ID, attention_backend=backend)
        loss.backward()
        out[backend] = (loss.detach(), grads(model))
    assert out["sdpa"][0] > 0
    torch.testing.assert_close(out["flex"][0], out["sdpa"][0], rtol=1e-4, atol=1e-5)
    assert_close_grads(out["flex"][1], out["sdpa"][1])


def row_generators(seed: int) -> list[torch.Generator]:
    """One CPU generator per row: the sampler draws on the CPU and moves the draws, so CUDA and CPU agree."""
    return [torch.Generator().manual_seed(seed + row) for row in range(len(PROMPTS))]


def rollout(model, **kwargs):
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS], device=model.device)
    args = dict(max_new_tokens=16, block_length=4, denoising_steps=2, temperature=1.0, stop_token_ids=[],
                return_dict_in_generate=True, generator=row_generators(0))
    args.update(kwargs)
    out = model.generate(ids, mask, **args)
    return ids, mask, out.sequences[:, width:], out.unmask_step[:, width:], out.token_logprobs[:, width:]


@pytest.mark.parametrize(("family", "estimator"), [("sdar", "trajectory"), ("llada", "trajectory"),
                                                   ("dream", "trajectory"), ("sdar", "coupled")])
def test_compiled_flex_equals_sdpa_for_tracerl_scoring(family, estimator):
    model = wide_model(family).train()
    ids, mask, completion, steps, sampler = rollout(model)
    seeds = torch.tensor([3, 4, 5])
    out = {}
    for backend in ("sdpa", "flex"):
        settings = EstimatorSettings(name=estimator, block_size=4, token_budget=96, attention_backend=backend)
        model.zero_grad(set_to_none=True)
        logps, _, scored = estimate_logprobs(model, ids, mask, completion, steps, settings, seeds)
        logps.sum().backward()
        out[backend] = (logps.detach(), grads(model))
    torch.testing.assert_close(out["flex"][0], out["sdpa"][0], rtol=1e-4, atol=1e-5)
    assert_close_grads(out["flex"][1], out["sdpa"][1])
    if estimator == "trajectory":  # same weights as the sampler: ratio exactly 1, through the compiled kernel too
        assert (out["flex"][0] - sampler)[scored].abs().max() <= 1e-4


def test_recomputed_scoring_forwards_on_cuda(family="llada"):
    """``recompute_scoring_forwards`` with compiled flex attention (its BlockMask built again in the backward pass),
    LoRA dropout on the GPU (the CUDA random state restored for the recomputation) and layer-wise checkpointing
    inside: the same log-probs and gradients as one pass."""
    out = {}
    for recompute in (False, True):
        base = wide_model(family).train()
        ids, mask, completion, steps, _ = rollout(base)
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        torch.manual_seed(0)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_dropout=0.3, target_modules="all-linear"))
        backend = "flex" if CUDA.type == "cuda" else "sdpa"
        settings = EstimatorSettings(block_size=4, token_budget=96, attention_backend=backend)
        torch.manual_seed(1)
        with recomputed_forwards(model, recompute):
            logps, _, _ = estimate_logprobs(model, ids, mask, completion, steps, settings)
        logps.sum().backward()
        out[recompute] = (logps.detach(), grads(model))
    torch.testing.assert_close(out[True][0], out[False][0], rtol=1e-4, atol=1e-5)
    assert_close_grads(out[True][1], out[False][1])


def test_generate_on_cuda_equals_the_cpu(family):
    cpu = tiny_model(family)
    gpu = tiny_model(family).to(CUDA)
    for strategy in ("low_confidence_static", "low_confidence_dynamic"):
        kwargs = dict(temperature=0.0, remasking_strategy=strategy, confidence_threshold=0.3, generator=None)
        on_cpu, on_gpu = rollout(cpu, **kwargs), rollout(gpu, **kwargs)
        assert torch.equal(on_gpu[2].cpu(), on_cpu[2]) and torch.equal(on_gpu[3].cpu(), on_cpu[3]), strategy


def test_exact_kv_cache_on_cuda():
    """SDAR's block cache is exact: the same tokens and trajectory as recomputing every block."""
    model = tiny_model("sdar").to(CUDA)
    for temperature in (0.0, 1.0):
        plain = rollout(model, temperature=temperature, use_cache=False, generator=row_generators(1))
        cached = rollout(model, temperature=temperature, use_cache=True, generator=row_generators(1))
        assert torch.equal(plain[2], cached[2]) and torch.equal(plain[3], cached[3])
        torch.testing.assert_close(plain[4], cached[4], rtol=1e-4, atol=1e-5)


MOE_CACHES = {"sdar_moe": True, "llada_moe": "dual"}


@pytest.mark.parametrize("family", sorted(MOE_CACHES))
def test_moe_on_cuda(family):
    """SDAR-MoE / LLaDA-MoE on CUDA: greedy decoding equals the CPU's, SDAR-MoE's exact cache equals recomputing
    (LLaDA-MoE's dual cache runs), ``cuda_graphs="auto"`` decodes eagerly (the expert dispatch reads on the host) with
    the same result, and a backward pass reaches the router."""
    cache = MOE_CACHES[family]
    cpu, gpu = tiny_moe_model(family), tiny_moe_model(family).to(CUDA)
    greedy = dict(temperature=0.0, generator=None)
    on_cpu, on_gpu = rollout(cpu, **greedy), rollout(gpu, **greedy)
    assert torch.equal(on_gpu[2].cpu(), on_cpu[2]) and torch.equal(on_gpu[3].cpu(), on_cpu[3])
    plain, cached = rollout(gpu, use_cache=False, **greedy), rollout(gpu, use_cache=cache, **greedy)
    if cache is True:
        assert torch.equal(plain[2], cached[2]) and torch.equal(plain[3], cached[3])
    graphs = rollout(gpu, cuda_graphs="auto", **greedy)
    assert torch.equal(graphs[2], on_gpu[2]) and torch.equal(graphs[3], on_gpu[3])
    gpu.train()
    gpu(input_ids=on_gpu[0]).logits.float().logsumexp(-1).mean().backward()
    router = gpu.model.layers[0].mlp.gate.weight.grad
    assert router is not None and router.abs().sum() > 0


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
def test_bf16_gradient_checkpointing_lora_tracerl_steps(tmp_path, backend):
    """bf16 weights, bf16 mixed precision, gradient checkpointing and LoRA adapters: two TraceRL steps train the
    adapters only. ``auto`` picks compiled flex for the head_dim-64 model and SDPA for the head_dim-16 one."""
    model = (wide_model("sdar") if backend == "flex" else tiny_model("sdar").to(CUDA)).to(torch.bfloat16).train()
    config = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=8, max_steps=2, logging_steps=1, report_to="none",
                           learning_rate=1e-2, block_length=4, denoising_steps=2, save_strategy="no", bf16=True,
                           gradient_checkpointing=True, disable_tqdm=True, seed=0, beta=0.0,
                           dynamic_group_filtering="none",  # distinct_chars rewards lie beyond [0, 1]
                           use_cpu=CUDA.type == "cpu")
    trainer = TraceRLTrainer(model, distinct_chars, args=config, processing_class=build_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": ["What is 1+2?", "Say hi", "abc", "7-3?"]}),
                             peft_config=peft.LoraConfig(r=4, lora_alpha=8))
    assert trainer.estimator_settings.attention_backend == backend
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert all(math.isfinite(log["loss"]) for log in trainer.state.log_history if "loss" in log)
    assert all(torch.equal(base[n], p.detach()) for n, p in trainer.model.named_parameters() if n in base)
    assert any(not torch.equal(adapters[n], p.detach()) for n, p in trainer.model.named_parameters() if n in adapters)


def test_tracerl_rollouts_replay_cuda_graphs(tmp_path, monkeypatch):
    """``rollout_cuda_graphs="auto"``: the rollouts run on the exact-cache graph runner without falling back, and
    the trainer scores their tokens as the sampler did (float32: the exact-state gap is rounding only)."""
    from trl_diffusion.generation import cuda_graphs

    fell_back, original = [], cuda_graphs.ExactCacheGraphRunner.run_block

    def spy(self, *args, **kwargs):
        original(self, *args, **kwargs)
        fell_back.append(self._failed)

    monkeypatch.setattr(cuda_graphs.ExactCacheGraphRunner, "run_block", spy)
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)  # an earlier test's failed capture is not this one's
    config = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=12, max_steps=2, logging_steps=1, report_to="none",
                           learning_rate=1e-2, block_length=4, denoising_steps=2, save_strategy="no", bf16=False,
                           gradient_checkpointing=False, disable_tqdm=True, seed=0, beta=0.0,
                           rollout_cuda_graphs="auto", temperature=1.0, dynamic_group_filtering="none",
                           use_cpu=CUDA.type == "cpu")
    trainer = TraceRLTrainer(tiny_model("sdar").to(CUDA).train(), distinct_chars, args=config,
                             processing_class=build_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": ["What is 1+2?", "Say hi", "abc", "7-3?"]}))
    trainer.train()
    assert fell_back and not any(fell_back)
    gaps = [log["rollout/sampler_logp_gap_exact"] for log in trainer.state.log_history
            if "rollout/sampler_logp_gap_exact" in log]
    assert gaps and max(gaps) < 1e-3


def run(command, timeout):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


EXAMPLE_RUNS = [
    ("math", ["--max_steps", "4", "--per_device_train_batch_size", "16", "--num_generations", "4",
              "--num_eval", "32", "--eval_every", "4"]),
    ("sft", ["--max_steps", "20", "--per_device_train_batch_size", "32", "--num_eval", "32", "--eval_every", "20"]),
    ("code", ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "4"]),
]
EVAL_FLAGS = ["--max_problems", "16", "--device", "cuda", "--progress", "false"]


@pytest.mark.parametrize(("name", "extra"), EXAMPLE_RUNS)
def test_example_runs_on_cuda(tmp_path, name, extra):
    """The README's commands, on the GPU with their defaults (``math.py`` crashed here when ``auto`` compiled flex
    attention for the embedded model's small heads)."""
    out = run([sys.executable, str(ROOT / "examples" / f"{name}.py"), "--output_dir", str(tmp_path), *extra], 300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (tmp_path / "model.safetensors").is_file()
    if name in ("math", "sft"):
        assert 0.0 <= result["held_out_accuracy_after"] <= 1.0


def test_cli_eval_on_cuda(tmp_path):
    out = run([sys.executable, "-m", "trl_diffusion.cli", "eval", *EVAL_FLAGS, "--output_dir", str(tmp_path)], 300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["num_problems"] == 16 and 0.0 <= report["metrics"]["accuracy"] <= 1.0


def test_training_command_launches_on_cuda(tmp_path):
    """``trl-diffusion math``, the README's headline command, goes through ``accelerate launch`` (one process on one
    GPU, no accelerate config): the parent checks the flags and waits, the launched process trains."""
    flags = ["--max_steps", "2", "--per_device_train_batch_size", "16", "--num_generations", "4", "--num_eval", "16",
             "--eval_every", "2"]
    out = run([sys.executable, "-m", "trl_diffusion.cli", "math", "--output_dir", str(tmp_path), *flags], 300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert (tmp_path / "model.safetensors").is_file() and 0.0 <= result["held_out_accuracy_after"] <= 1.0


def test_eval_command_launches_on_cuda(tmp_path):
    """``trl-diffusion eval --num_processes 1`` launches itself and reports once."""
    out = run([sys.executable, "-m", "trl_diffusion.cli", "eval", "--num_processes", "1", *EVAL_FLAGS,
               "--output_dir", str(tmp_path)], 300)
    assert out.returncode == 0, out.stderr[-3000:]
    report, _ = json.JSONDecoder().raw_decode(out.stdout[out.stdout.index("{"):])  # printed once, by process 0
    assert report["num_problems"] == 16 and 0.0 <= report["metrics"]["accuracy"] <= 1.0
