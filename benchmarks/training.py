"""Training-side cost of TraceRL's trajectory scoring (forward + backward of ``estimate_logprobs``), as JSON.

Worst case for packing: one token committed per denoising step, block 4, so each response of R tokens becomes one
packed row of ``prompt + R`` clean tokens plus R noisy copies of a 4-token block. Each configuration runs in its
own process (its own peak memory and compile caches); a configuration that fails is recorded with its error.

Presets (flags given explicitly override a preset's shape):

* ``small`` (default): packed vs naive (one whole-sequence forward per merged step) for shrinkage 1, 2, 4 on a
  small random SDAR, SDPA; the CPU comparison.
* ``tiny``: the same measurement, a few seconds on a CPU (what the test runs).
* ``sdar-4b``: SDAR-4B / TraDo-4B shapes with random bf16 weights built on the device (no download): hidden 2560,
  36 layers, 32 query / 8 KV heads, head_dim 128, vocab 151936, intermediate 9728; 4 rows x (256 prompt + 512
  response), gradient checkpointing; flex and SDPA side by side.

Every record has seconds per step, tokens/s and peak memory; on CUDA also an MFU estimate::

    MFU = 6 x parameters x processed tokens / seconds per step / 790e12

counting every parameter except the input embedding table (a lookup, no matmul) and every token the forward
processes (the packed rows' clean context and noisy copies, not only the scored ones; padding excluded), against
the ~790 TFLOP/s dense bf16 peak measured on an H200. The LM head now runs only at scored tokens, so this count
slightly overstates the work done: it is the count earlier measurements used, kept for comparison.

    python benchmarks/training.py                                    # CPU, packed vs naive
    python benchmarks/training.py --preset tiny
    python benchmarks/training.py --preset sdar-4b --device cuda --output sdar4b.json --profile
    python benchmarks/training.py --preset sdar-4b --device cuda --backends sdpa --kernels eager fused
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import profile_call  # noqa: E402  (benchmarks/ is not a package)

H200_BF16_PEAK_FLOPS = 790e12
"""Dense bf16 matmul throughput measured on one H200 (the MFU denominator)."""

PRESETS = {
    "small": dict(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=512, vocab=128, batch=4,
                  prompt_length=32, response_length=256, dtype="float32", checkpointing=False,
                  modes=["packed", "naive"], shrinkage=[1, 2, 4], backends=["sdpa"], warmup=1, repeats=2),
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=128, batch=2,
                 prompt_length=8, response_length=16, dtype="float32", checkpointing=False, modes=["packed"],
                 shrinkage=[1], backends=["sdpa"], warmup=1, repeats=1),
    "sdar-4b": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728, vocab=151936,
                    batch=4, prompt_length=256, response_length=512, dtype="bfloat16", checkpointing=True,
                    modes=["packed"], shrinkage=[1], backends=["flex", "sdpa"], warmup=2, repeats=5),
}
SHAPE = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "batch", "prompt_length",
         "response_length", "dtype", "checkpointing", "warmup", "repeats")
BLOCK = 4


def build_model(shape: dict, device: str, kernels: str = "eager"):
    """A random-weight SDAR of ``shape``, built directly on ``device`` in its dtype (no download, no copy);
    ``kernels`` "fused": its elementwise chains compiled (``set_fused_kernels``)."""
    from trl_diffusion.models import SDARConfig, SDARForCausalLM, set_fused_kernels

    config = SDARConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"],
                        intermediate_size=shape["intermediate"], num_hidden_layers=shape["layers"],
                        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
                        head_dim=shape["head_dim"], block_size=BLOCK,
                        max_position_embeddings=shape["prompt_length"] + shape["response_length"] + 64,
                        mask_token_id=shape["vocab"] - 1, pad_token_id=0, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = SDARForCausalLM._from_config(config, dtype=getattr(torch, shape["dtype"]))
    model.train()
    if kernels == "fused":
        set_fused_kernels(model)
    if shape["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def measure(mode: str, shrinkage: int, backend: str, shape: dict, device: str, profile: bool = False,
            kernels: str = "eager") -> dict:
    """Seconds per forward + backward step of one configuration, with its token counts, MFU and peak memory;
    ``profile`` adds the 20 operators with the most self time in one more step (where the time goes)."""
    from trl_diffusion.estimators import (
        EstimatorSettings,
        build_scoring_chunks,
        estimate_logprobs,
        replay_logprobs,
        step_groups,
    )
    from trl_diffusion.states import block_index

    model = build_model(shape, device, kernels)
    batch, prompt_len, response = shape["batch"], shape["prompt_length"], shape["response_length"]
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 100, (batch, prompt_len), generator=generator).to(device)
    prompt_mask = torch.ones_like(prompt)
    completion = torch.randint(10, 100, (batch, response), generator=generator).to(device)
    # one token per step, left to right inside each block, as a static 4-step schedule commits them
    steps = torch.arange(response, device=device).expand(batch, -1).contiguous()
    settings = EstimatorSettings(block_size=BLOCK, shrinkage=shrinkage, attention_backend=backend)
    blocks = block_index(prompt_len + torch.arange(response, device=device), BLOCK).expand(batch, -1)
    groups = step_groups(steps, shrinkage, blocks)
    if mode == "packed":
        chunks = build_scoring_chunks(prompt, prompt_mask, completion, groups, model.mask_token_id, BLOCK)
        processed = sum(int(c.layout.valid.sum()) for c in chunks)
    else:
        processed = (int(groups.max()) + 1) * batch * (prompt_len + response)
    is_cuda = device.startswith("cuda")

    def step():
        if mode == "packed":
            logps, _, _ = estimate_logprobs(model, prompt, prompt_mask, completion, steps, settings)
        else:
            full_groups = torch.cat([torch.full_like(prompt, -1), groups], 1)
            logps = replay_logprobs(model, torch.cat([prompt, completion], 1), prompt_mask, full_groups, BLOCK)
        logps.sum().backward()
        model.zero_grad(set_to_none=True)
        if is_cuda:
            torch.cuda.synchronize()

    warmup_seconds = []
    for _ in range(shape["warmup"]):  # compiles flex attention on CUDA (and fused kernels)
        begin = time.perf_counter()
        step()
        warmup_seconds.append(round(time.perf_counter() - begin, 2))
        print(f"warm-up step: {warmup_seconds[-1]} s", file=sys.stderr, flush=True)  # kept by a timeout's record
    if is_cuda:
        torch.cuda.reset_peak_memory_stats()
        baseline = torch.cuda.memory_allocated()
    start = time.perf_counter()
    for _ in range(shape["repeats"]):
        step()
    seconds = (time.perf_counter() - start) / shape["repeats"]
    embedding = model.get_input_embeddings().weight.numel()
    parameters = sum(p.numel() for p in model.parameters()) - embedding
    record = {"mode": mode, "shrinkage": shrinkage, "attention_backend": backend, "kernels": kernels, "device": device,
              "dtype": shape["dtype"], "gradient_checkpointing": shape["checkpointing"], "batch": batch,
              "prompt_length": prompt_len, "response_length": response, "scored_tokens": batch * response,
              "processed_tokens": processed, "parameters_without_input_embedding": parameters,
              "seconds_per_step": round(seconds, 4), "scored_tokens_per_s": round(batch * response / seconds, 1),
              "processed_tokens_per_s": round(processed / seconds, 1), "warmup_seconds": warmup_seconds}
    if is_cuda:
        flops = 6 * parameters * processed
        record.update(model_flops_per_step=flops, mfu=round(flops / seconds / H200_BF16_PEAK_FLOPS, 4),
                      peak_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                      peak_memory_above_weights_gib=round((torch.cuda.max_memory_allocated() - baseline) / 2**30, 2),
                      gpu=torch.cuda.get_device_name())
    else:
        record["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    if profile:
        record["profile"] = profile_call(step, is_cuda)[0]
    return record


def run_one(mode: str, shrinkage: int, backend: str, shape: dict, device: str, timeout: float,
            profile: bool = False, kernels: str = "eager") -> dict:
    """``measure`` in a fresh process; a failure becomes a record with its error."""
    spec = {"mode": mode, "shrinkage": shrinkage, "backend": backend, "shape": shape, "device": device,
            "profile": profile, "kernels": kernels}
    command = [sys.executable, __file__, "--one", json.dumps(spec)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as expired:  # what it printed so far (the warm-up steps' times) says where
        stderr = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr
        return {"mode": mode, "shrinkage": shrinkage, "attention_backend": backend, "kernels": kernels,
                "error": f"timeout {timeout}s",
                "stderr_tail": (stderr or "").strip().splitlines()[-5:]}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"mode": mode, "shrinkage": shrinkage, "attention_backend": backend, "kernels": kernels,
                "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(lines[-1])


def summarize(records: list[dict]) -> dict:
    """Side-by-side table (seconds per step, MFU, peak) per configuration, and packed/naive ratios."""
    table = {}
    for r in records:
        if "error" in r:
            continue
        key = f"{r['mode']} s={r['shrinkage']} {r['attention_backend']} {r['kernels']}"
        table[key] = {k: r[k] for k in ("seconds_per_step", "processed_tokens_per_s", "mfu", "peak_memory_gib",
                                        "peak_rss_mb") if k in r}
    ratios = {}
    for packed in (r for r in records if r.get("mode") == "packed" and "error" not in r):
        naive = next((r for r in records if r.get("mode") == "naive" and "error" not in r
                      and r["shrinkage"] == packed["shrinkage"]
                      and r["attention_backend"] == packed["attention_backend"]
                      and r["kernels"] == packed["kernels"]), None)
        if naive is not None:
            ratios[f"s={packed['shrinkage']} {packed['attention_backend']} {packed['kernels']}"] = {
                "packed_over_naive_scored_tokens_per_s": round(
                    packed["scored_tokens_per_s"] / naive["scored_tokens_per_s"], 2)}
    return {"table": table, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=list(PRESETS), default="small")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--modes", nargs="+", choices=["packed", "naive"])
    parser.add_argument("--backends", nargs="+", choices=["auto", "sdpa", "flex"])
    parser.add_argument("--shrinkage", nargs="+", type=int)
    parser.add_argument("--kernels", nargs="+", choices=["eager", "fused"], default=["eager"],
                        help="the layers' elementwise chains: eager, and/or fused (compiled; set_fused_kernels)")
    for name in SHAPE:
        kind = {"dtype": str, "checkpointing": lambda v: v.lower() in ("1", "true", "yes")}.get(name, int)
        parser.add_argument(f"--{name}", type=kind, help=f"override the preset's {name}")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per configuration")
    parser.add_argument("--profile", action="store_true", help="add each configuration's top operators by time")
    parser.add_argument("--output", type=Path,
                        help="also write the records and the summary to this JSON file (rewritten after each record)")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        spec = json.loads(args.one)
        print(json.dumps(measure(spec["mode"], spec["shrinkage"], spec["backend"], spec["shape"], spec["device"],
                                 spec["profile"], spec["kernels"])))
        return
    preset = PRESETS[args.preset]
    shape = {name: getattr(args, name) if getattr(args, name) is not None else preset[name] for name in SHAPE}
    records = []
    for shrinkage in args.shrinkage or preset["shrinkage"]:
        for backend in args.backends or preset["backends"]:
            for mode in args.modes or preset["modes"]:
                for kernels in args.kernels:
                    records.append(run_one(mode, shrinkage, backend, shape, args.device, args.timeout, args.profile,
                                           kernels))
                    print(json.dumps(records[-1]), flush=True)
                    summary = {"preset": args.preset, **summarize(records)}
                    if args.output:  # after every record: a run killed by an outer time limit keeps what it measured
                        args.output.write_text(json.dumps({"records": records, **summary}, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
