"""Peak memory of TraceRL's packed trajectory scoring (``estimate_logprobs``, forward + backward) against the
response length, with and without ``scoring_token_budget`` chunking, with gradient checkpointing, and with each
scoring forward recomputed in the backward pass (``recompute_scoring_forwards``); with ``--trainer sft``, of one
``DiffusionSFTTrainer`` training step of the ``semi_ar`` objective instead (whose budget back-propagates each
forward before the next, or, with ``recompute_scoring_forwards``, runs each again in one backward).

Worst case for packing: one token committed per denoising step, block 4, so a response of L tokens becomes
one packed row of ``prompt + L`` clean tokens plus L noisy copies of a 4-token block (``prompt + 5L`` tokens).
``--family llada``: full attention, so a response is L / ``--shrinkage`` rows of ``prompt + L`` tokens, one per
merged step (dLLM-RL's LLaDA / Dream rows), which ``scoring_token_budget`` groups into forwards.
Each configuration runs in its own process. On the CPU the number is the growth of the process's peak resident
set during the step (the kernel's high-water mark is reset just before it), with glibc's mmap threshold fixed at
128 KiB (``MALLOC_MMAP_THRESHOLD_``) so that freed tensors go back to the system at once: by default glibc raises
the threshold after the first large free and keeps later blocks in its heap, and the resident set then counts
freed memory too (peaks up to ~2x; before 2026-12-04 the figures were taken that way). On CUDA it is the
allocator's peak above what was allocated before the step. Prints one JSON record per configuration, then a
summary table::

    python benchmarks/memory.py                        # CPU, L in 128 256 512 1024
    python benchmarks/memory.py --lengths 128 256 --device cuda --hidden 1024 --layers 8
    python benchmarks/memory.py --lengths 512 --vocab 151936 --dtype bfloat16   # a released vocabulary, bf16
    python benchmarks/memory.py --trainer sft --lengths 256 512 1024 --batch 1  # semi_ar SFT, LLaDA
    python benchmarks/memory.py --family llada --shrinkage 8 --batch 1 --lengths 256 512   # full-attention rows

``--trainer sft``: a LLaDA of the same shape, each sample a prompt and an answer of L tokens, ``semi_ar`` with
16-token blocks (dLLM-RL's), so one full-length row per block (L / 16 rows of ``prompt + L`` tokens a sample). The
step is Trainer's ``training_step`` (forward and backward; with a budget, one backward per forward).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

VARIANTS = {  # name: (scoring_token_budget, gradient checkpointing, recompute_scoring_forwards)
    "unchunked": (None, False, False),
    "budget_2048": (2048, False, False),
    "checkpointing": (None, True, False),
    "budget_2048_checkpointing": (2048, True, False),
    "budget_2048_recompute": (2048, False, True),
    "budget_2048_recompute_checkpointing": (2048, True, True),
}


def _peak_rss_mb() -> float:
    """The process's peak resident set (VmHWM, resettable) in MiB; ru_maxrss where /proc is unavailable."""
    status = Path("/proc/self/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mb() -> float:
    status = Path("/proc/self/status")
    for line in status.read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no /proc/self/status")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


@contextmanager
def measured_step(device: str) -> Iterator[dict]:
    """Measures the block it wraps: fills ``peak_mb`` (peak memory above what was in use before it: the allocator's
    on CUDA, the process's resident set otherwise), ``method`` and ``seconds``."""
    result = {}
    is_cuda = device.startswith("cuda")
    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / 2**20
    else:
        before = _current_rss_mb()
        exact = _reset_peak_rss()
    start = time.perf_counter()
    yield result
    if is_cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / 2**20 - before
        method = "cuda_max_memory_allocated"
    else:
        peak = _peak_rss_mb() - before
        method = "peak_rss_delta" if exact else "ru_maxrss_delta (peak not reset: includes start-up)"
        if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
            method += f" (mmap threshold {os.environ['MALLOC_MMAP_THRESHOLD_']})"
    result.update(peak_mb=round(peak, 1), method=method, seconds=round(time.perf_counter() - start, 2))


def measure(variant: str, length: int, batch: int, prompt: int, hidden: int, layers: int, vocab: int,
            device: str, dtype: str = "float32", family: str = "sdar", shrinkage: int = 1) -> dict:
    """One forward + backward of the packed ``trajectory`` estimator, one token committed per step; returns the
    step's peak memory and shape facts. ``sdar``: one packed row a response (block 4); ``llada``: full attention,
    one whole-sequence row per ``shrinkage`` merged steps."""
    from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs
    from trl_diffusion.recomputed_forwards import recomputed_forwards
    from trl_diffusion.testing import tiny_model

    budget, checkpointing, recompute = VARIANTS[variant]
    torch.manual_seed(0)
    if family == "sdar":
        model = tiny_model("sdar", hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                           num_attention_heads=max(hidden // 64, 1), num_key_value_heads=max(hidden // 128, 1),
                           head_dim=64, vocab_size=vocab, max_position_embeddings=prompt + length + 64).to(
                               device, getattr(torch, dtype))
    else:
        shape = dict(hidden=hidden, layers=layers, heads=max(hidden // 64, 1), kv_heads=max(hidden // 64, 1),
                     head_dim=64, intermediate=3 * hidden, vocab=vocab, max_length=prompt + length, dtype=dtype)
        model = _sft_benchmark().build_model("llada", shape, device)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(10, 100, (batch, prompt), generator=generator).to(device)
    prompt_mask = torch.ones_like(prompt_ids)
    completion = torch.randint(10, 100, (batch, length), generator=generator).to(device)
    steps = torch.arange(length, device=device).expand(batch, -1).contiguous()  # one token per step
    settings = EstimatorSettings(block_size=4 if family == "sdar" else None, shrinkage=shrinkage, token_budget=budget)
    shapes = []  # (rows, tokens) of each scoring forward (the recomputations in the backward pass call forward)
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: shapes.append(
        tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    with measured_step(device) as measured:
        with recomputed_forwards(model, recompute):
            logps, _, _ = estimate_logprobs(model, prompt_ids, prompt_mask, completion, steps, settings)
        logps.sum().backward()
    hook.remove()
    return {"variant": variant, "family": family, "response_length": length, "batch": batch, "prompt_length": prompt,
            "shrinkage": shrinkage, "scoring_token_budget": budget, "gradient_checkpointing": checkpointing,
            "recompute_scoring_forwards": recompute, "rows": sum(r for r, _ in shapes),
            "row_tokens": max(t for _, t in shapes), "forwards": len(shapes),
            "rows_per_forward": max(r for r, _ in shapes), **measured, "device": device,
            "model": {"hidden": hidden, "layers": layers, "vocab": vocab, "dtype": dtype,
                      "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2)}}


def _sft_benchmark():
    """``benchmarks/sft.py`` as a module: its random-token samples, LLaDA builder and tokenizer."""
    spec = importlib.util.spec_from_file_location("sft_benchmark", Path(__file__).with_name("sft.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_sft(variant: str, length: int, batch: int, prompt: int, hidden: int, layers: int, vocab: int,
                device: str, dtype: str = "float32") -> dict:
    """One ``DiffusionSFTTrainer.training_step`` of ``semi_ar`` (block 16) on a LLaDA; the step's peak memory."""
    from datasets import Dataset

    from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer

    sft = _sft_benchmark()
    build_model, tokenized_samples, tokenizer_for = sft.build_model, sft.tokenized_samples, sft.tokenizer_for

    budget, checkpointing, recompute = VARIANTS[variant]
    shape = dict(hidden=hidden, layers=layers, heads=max(hidden // 64, 1), kv_heads=max(hidden // 64, 1),
                 head_dim=64, intermediate=3 * hidden, vocab=vocab, max_length=prompt + length, dtype=dtype)
    model = build_model("llada", shape, device).train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rows = tokenized_samples([(prompt, length)] * batch, vocab)
    with tempfile.TemporaryDirectory() as output_dir:
        args = DiffusionSFTConfig(
            output_dir=output_dir, report_to=[], use_cpu=not device.startswith("cuda"), bf16=False,
            save_strategy="no", max_length=prompt + length, per_device_train_batch_size=batch,
            gradient_checkpointing=False, completion_only_loss=True, disable_tqdm=True, dataloader_pin_memory=False,
            diffusion_objective="semi_ar", semi_ar_block_length=16, scoring_token_budget=budget,
            recompute_scoring_forwards=recompute)
        trainer = DiffusionSFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows),
                                      processing_class=tokenizer_for(vocab))
        inputs = next(iter(trainer.get_train_dataloader()))
        tokens = inputs["labels"].ne(-100).sum()
        rows_seen = []  # rows of each forward
        hook = model.register_forward_pre_hook(lambda module, args, kwargs: rows_seen.append(
            kwargs["input_ids"].shape[0]), with_kwargs=True)
        with measured_step(device) as measured:
            loss = trainer.training_step(model, inputs, num_items_in_batch=tokens)
        hook.remove()
    return {"trainer": "sft", "objective": "semi_ar", "variant": variant, "response_length": length, "batch": batch,
            "prompt_length": prompt, "scoring_token_budget": budget, "gradient_checkpointing": checkpointing,
            "recompute_scoring_forwards": recompute,
            "rows": sum(rows_seen), "row_tokens": prompt + length, "rows_per_forward": max(rows_seen),
            "forwards": len(rows_seen), "loss": round(float(loss), 4), **measured, "device": device,
            "model": {"hidden": hidden, "layers": layers, "vocab": vocab, "dtype": dtype,
                      "parameters_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 256, 512, 1024])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batch", type=int, default=2, help="responses scored together (one per-device batch)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's weights")
    parser.add_argument("--output", type=Path, help="also write the records to this JSON file")
    parser.add_argument("--trainer", choices=["tracerl", "sft"], default="tracerl",
                        help="tracerl: packed trajectory scoring; sft: a semi_ar DiffusionSFTTrainer step")
    parser.add_argument("--family", choices=["sdar", "llada"], default="sdar",
                        help="tracerl: sdar (one packed row a response) or llada (one row per merged step)")
    parser.add_argument("--shrinkage", type=int, default=1, help="tracerl: denoising steps merged per scored state")
    parser.add_argument("--one", nargs=2, metavar=("VARIANT", "LENGTH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = [str(v) for v in ("--batch", args.batch, "--prompt", args.prompt, "--hidden", args.hidden,
                              "--layers", args.layers, "--vocab", args.vocab, "--device", args.device,
                              "--dtype", args.dtype, "--trainer", args.trainer, "--family", args.family,
                              "--shrinkage", args.shrinkage)]
    if args.one:
        scoring = {} if args.trainer == "sft" else {"family": args.family, "shrinkage": args.shrinkage}
        step = measure_sft if args.trainer == "sft" else measure
        record = step(args.one[0], int(args.one[1]), args.batch, args.prompt, args.hidden, args.layers,
                      args.vocab, args.device, args.dtype, **scoring)
        print(json.dumps(record))
        return
    records = []
    # freed blocks back to the system at once, so that the resident set is live memory (see the module docstring)
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    for length in args.lengths:
        for variant in args.variants:
            command = [sys.executable, __file__, "--one", variant, str(length), *shape]
            done = subprocess.run(command, capture_output=True, text=True, env=environment)
            lines = done.stdout.strip().splitlines()
            if done.returncode == 0 and lines:
                records.append(json.loads(lines[-1]))
            else:  # recorded, and the other configurations still run (one OOM must not lose the rest)
                records.append({"variant": variant, "response_length": length, "error": f"exit {done.returncode}: "
                                f"{done.stderr.strip().splitlines()[-1] if done.stderr.strip() else 'no output'}"})
            print(json.dumps(records[-1]), flush=True)
            if args.output:  # after every configuration: a run stopped by its time limit keeps what it measured
                args.output.write_text(json.dumps({"records": records}, indent=1))
    table = {f"L={r['response_length']}": {} for r in records}
    for r in records:
        table[f"L={r['response_length']}"][r["variant"]] = r.get("peak_mb", r.get("error"))
    print(json.dumps({"peak_mb": table}, indent=1))
    if args.output:
        args.output.write_text(json.dumps({"records": records, "peak_mb": table}, indent=1))


if __name__ == "__main__":
    main()
