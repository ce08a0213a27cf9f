"""Generation speed, printed as JSON (one record per run, then a summary).

Presets:

* ``cpu`` (the default off CUDA): each family x cache mode x remasking strategy x length on a small config (hidden 128,
  2 layers, batch 1, 32-token prompt, block 4, 4 steps per block, greedy), then ratios: the cache speed-up at
  the longest length, SDAR's cached cost per token by length, and batch 16 vs batch 1.
* ``sdar-4b`` (the default on CUDA): the rollout table of the GPU issue on random weights in the SDAR-4B /
  TraDo-4B shape (hidden 2560, 36 layers, 32 query / 8 KV heads, head_dim 128, vocab 151936, intermediate 9728;
  bf16 on CUDA), built on the device from a config (no download): prompt 128, 256 new tokens, block 4, 4 steps
  per block, batch 1/16/64/128, static and dynamic (threshold 0.9), greedy, exact cache and no cache (no cache at
  batch 1/16 only: without a cache every step re-runs the whole sequence, which would not fit a 5-minute budget at
  large batch). Random weights are never confident, so dynamic decoding commits about one token per step here.
* ``llada-1.6b``: the same kind of table for LLaDA's caches on random weights in a 1.6B LLaDA shape (LLaDA-8B's
  vocabulary 126464 and head_dim 128; d_model 2048, 22 layers, 16 heads, MLP 5632): batch 16, prompt 128, 256 new
  tokens, block 32, 32 steps per block (one token per step), static; no cache, prefix and dual cache.
* ``tiny`` / ``llada-tiny``: the ``sdar-4b`` / ``llada-1.6b`` tables on tiny configs (seconds on a CPU; check the
  script).

With ``--cuda_graphs auto`` (the default) a table also has one eager row (``cuda_graphs`` "off": the first cache
mode, the smallest batch, static), the baseline the replayed steps are compared with. The greedy rows (``sampling``
"greedy") are the issue's table; one more row (``sampling`` "rollout": the first cache mode, the largest batch,
static) samples as TraceRL's rollouts do, at temperature 1 with one CPU generator per row, whose uniforms are drawn
on the host and copied to the device at every step. A table's rows run in order of priority, so that a run cut
short by a time limit keeps the targets: every cached row (by batch), the eager baseline, the rollout row, then the
uncached rows. ``peak_memory_mb`` is each call's own peak on CUDA, the process's so far on a CPU.

    python benchmarks/generation.py                                   # CPU grid (slow for 2048 uncached)
    python benchmarks/generation.py --lengths 128 512 --families sdar
    python benchmarks/generation.py --device cuda                     # the sdar-4b table (the default on CUDA)
    python benchmarks/generation.py --preset tiny                     # the same table on a tiny model
    python benchmarks/generation.py --device cuda --preset llada-1.6b # LLaDA: no cache, prefix, dual
    python benchmarks/generation.py --count_ops                       # torch ops per cached SDAR token (cpu model)
    python benchmarks/generation.py --device cuda --profile           # where a cached step's time goes (kernels)
    python benchmarks/generation.py --device cuda --fused_kernels     # the table with compiled elementwise chains
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from profiling import profile_call  # noqa: E402  (benchmarks/ is not a package)

from trl_diffusion.models import LLaDAConfig, LLaDAModelLM, SDARConfig, SDARForCausalLM, set_fused_kernels
from trl_diffusion.testing import tiny_model

CACHE_MODES = {"sdar": [False, True], "llada": [False, "dual"], "dream": [False, "dual"]}
STRATEGIES = ["low_confidence_static", "low_confidence_dynamic"]

SDAR_4B = dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               vocab_size=151936, intermediate_size=9728, max_position_embeddings=32768, rope_theta=1_000_000.0,
               rms_norm_eps=1e-6, block_size=4, mask_token_id=151669, eos_token_id=151643, bos_token_id=151643,
               tie_word_embeddings=False)  # SDAR-4B-Chat's config.json (docs: reference models.md)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, intermediate_size=128, max_position_embeddings=1024, rope_theta=10000.0, block_size=4,
            mask_token_id=511, eos_token_id=0, bos_token_id=0)
LLADA_1_6B = dict(d_model=2048, n_layers=22, n_heads=16, n_kv_heads=16, mlp_hidden_size=5632, vocab_size=126464,
                  embedding_size=126464, max_sequence_length=4096, rope=True, rope_theta=500000.0,
                  rope_full_precision=True, weight_tying=False, block_type="llama", activation_type="silu",
                  layer_norm_type="rms", rms_norm_eps=1e-5, include_bias=False, mask_token_id=126336,
                  eos_token_id=126081, pad_token_id=126081)  # LLaDA-8B-Instruct's config.json, narrower and shallower
LLADA_TINY = {**LLADA_1_6B, **dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, mlp_hidden_size=128,
                                   vocab_size=512, embedding_size=512, mask_token_id=511, eos_token_id=0,
                                   pad_token_id=0)}
MODELS = {"sdar": (SDARConfig, SDARForCausalLM), "llada": (LLaDAConfig, LLaDAModelLM)}
TABLES = {  # preset -> the rollout table's model and settings
    "sdar-4b": dict(family="sdar", config=SDAR_4B, prompt=128, new_tokens=256, block=4, steps=4,
                    batches=[1, 16, 64, 128], uncached_batches=[1, 16], caches=[True], strategies=STRATEGIES),
    "tiny": dict(family="sdar", config=TINY, prompt=16, new_tokens=32, block=4, steps=4, batches=[1, 4, 8],
                 uncached_batches=[1, 4, 8], caches=[True], strategies=STRATEGIES),
    "llada-1.6b": dict(family="llada", config=LLADA_1_6B, prompt=128, new_tokens=256, block=32, steps=32,
                       batches=[16], uncached_batches=[16], caches=["dual", "prefix"],
                       strategies=["low_confidence_static"]),
    "llada-tiny": dict(family="llada", config=LLADA_TINY, prompt=16, new_tokens=32, block=8, steps=8,
                       batches=[1, 4], uncached_batches=[1, 4], caches=["dual", "prefix"],
                       strategies=["low_confidence_static"]),
}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_generate(model, prompt: torch.Tensor, **kwargs) -> tuple[object, float]:
    """One ``generate`` call's output and wall time; on CUDA the peak-memory counter starts afresh with it."""
    synchronize(prompt.device)
    if prompt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(prompt.device)
    start = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    synchronize(prompt.device)
    return out, time.perf_counter() - start


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: the peak of the last timed call; CPU: the process's peak resident memory so far (it never resets)."""
    if device.type == "cuda":
        return round(torch.cuda.max_memory_allocated(device) / 2**20, 1)
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def record(out, seconds: float, device: torch.device, **fields) -> dict:
    generated = int((out.unmask_step >= 0).sum())
    return {**fields, "seconds": round(seconds, 3), "tokens_per_s": round(generated / seconds, 1),
            "ms_per_token": round(1000 * seconds / generated, 3), "forward_passes": out.num_forward_passes,
            "ms_per_forward": round(1000 * seconds / out.num_forward_passes, 2),
            "tokens_per_step": round(float(out.tokens_per_step.float().mean()), 3),
            "peak_memory_mb": peak_memory_mb(device)}


# ----------------------------------------------------------------------------------------------------------
# The CPU grid
# ----------------------------------------------------------------------------------------------------------


def threshold(strategy: str) -> dict:
    """The dynamic strategy's confidence threshold (0.9, TraDo's), for that strategy only: no other reads it."""
    return {"confidence_threshold": 0.9} if strategy == "low_confidence_dynamic" else {}


def run(family: str, cache, strategy: str, length: int, batch: int, hidden: int, device: torch.device) -> dict:
    overrides = {"sdar": dict(hidden_size=hidden, intermediate_size=4 * hidden, max_position_embeddings=4096),
                 "llada": dict(d_model=hidden, mlp_hidden_size=4 * hidden, max_sequence_length=4096),
                 "dream": dict(hidden_size=hidden, intermediate_size=4 * hidden, max_position_embeddings=4096)}
    model = tiny_model(family, **overrides[family]).to(device)
    prompt = torch.randint(10, 100, (batch, 32), device=device)
    out, seconds = timed_generate(model, prompt, max_new_tokens=length, block_length=4, denoising_steps=4,
                                  temperature=0.0, use_cache=cache, remasking_strategy=strategy,
                                  **threshold(strategy), stop_token_ids=[], return_dict_in_generate=True)
    return record(out, seconds, device, family=family, cache=str(cache), strategy=strategy, new_tokens=length,
                  batch=batch)


def cpu_grid(args, device: torch.device) -> None:
    run("sdar", False, "low_confidence_static", 16, 1, args.hidden, device)  # warm-up (first-call overheads)
    records = []
    for family in args.families:
        for cache in CACHE_MODES[family]:
            for strategy in args.strategies:
                for length in args.lengths:
                    records.append(run(family, cache, strategy, length, 1, args.hidden, device))
                    print(json.dumps(records[-1]), flush=True)
    ratios = {}
    primary = "low_confidence_static" if "low_confidence_static" in args.strategies else args.strategies[0]
    for family in args.families:
        def find(cache, length, strategy=primary, family=family):
            for r in records:
                if (r["family"], r["cache"], r["new_tokens"], r["batch"], r["strategy"]) == (
                        family, str(cache), length, 1, strategy):
                    return r
        longest = max(args.lengths)
        cached, plain = find(CACHE_MODES[family][1], longest), find(False, longest)
        entry = {"strategy": primary, f"cache_speedup_at_{longest}": round(plain["seconds"] / cached["seconds"], 2)}
        if family == "sdar":
            entry["cached_ms_per_token_by_length"] = {n: find(True, n)["ms_per_token"] for n in args.lengths}
            small, big = args.batch_sizes
            one = run(family, True, primary, 128, small, args.hidden, device)
            many = run(family, True, primary, 128, big, args.hidden, device)
            entry[f"batch_{big}_vs_{small}_tokens_per_s"] = round(many["tokens_per_s"] / one["tokens_per_s"], 2)
        ratios[family] = entry
    print(json.dumps({"ratios": ratios}, indent=1))


def count_ops(args, device: torch.device, new_tokens: int = 128) -> None:
    """Torch operations dispatched from Python per generated token, SDAR exact cache, static, batch 1 (the CPU
    grid's model): a count that does not depend on how busy the machine is, unlike the wall time of a step that is
    bound by per-operation overhead."""
    from torch.profiler import profile

    model = tiny_model("sdar", hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                       max_position_embeddings=4096).to(device)
    if args.fused_kernels:
        set_fused_kernels(model)
    prompt = torch.randint(10, 100, (1, 32), device=device)
    settings = dict(block_length=4, denoising_steps=4, temperature=0.0, use_cache=True, stop_token_ids=[],
                    remasking_strategy="low_confidence_static", return_dict_in_generate=True)
    model.generate(prompt, max_new_tokens=16, **settings)  # warm-up
    with profile() as prof:
        model.generate(prompt, max_new_tokens=new_tokens, **settings)
    top_level = [e for e in prof.events() if e.name.startswith("aten::")
                 and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    print(json.dumps({"family": "sdar", "cache": "exact", "new_tokens": new_tokens, "hidden": args.hidden,
                      "fused_kernels": args.fused_kernels,
                      "torch_ops_per_token": round(len(top_level) / new_tokens, 1)}))


# ----------------------------------------------------------------------------------------------------------
# The rollout table (random weights from a config, built on the device)
# ----------------------------------------------------------------------------------------------------------


def build_model(family: str, config: dict, device: torch.device, fused_kernels: bool = False):
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config_class, model_class = MODELS[family]
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class._from_config(config_class(**config), dtype=dtype)
    if fused_kernels:
        set_fused_kernels(model)
    return model.eval()


def rollout_table(args, device: torch.device) -> None:
    table = TABLES[args.preset]
    config, prompt_length, new_tokens = table["config"], table["prompt"], table["new_tokens"]
    batches = args.batch_sizes_table or table["batches"]
    began = time.perf_counter()
    model = build_model(table["family"], config, device, args.fused_kernels)
    built = time.perf_counter() - began
    token_ids = (10, config["mask_token_id"] - 1)  # random prompts of ordinary tokens
    settings = dict(max_new_tokens=new_tokens, block_length=table["block"], denoising_steps=table["steps"],
                    stop_token_ids=[], return_dict_in_generate=True)
    # (batch, cache, strategy, cuda_graphs, sampling) rows in order of priority, so that a run cut short by a time
    # limit keeps the targets: every cached row, then the eager baseline, then the largest batch sampled as TraceRL's
    # rollouts are, then the uncached rows (the slowest)
    first_cache = table["caches"][0]
    runs = [(batch, cache, strategy, args.cuda_graphs, "greedy") for batch in batches for cache in table["caches"]
            for strategy in table["strategies"]]
    if args.cuda_graphs == "auto":
        runs.append((min(batches), first_cache, "low_confidence_static", "off", "greedy"))
    runs.append((max(batches), first_cache, "low_confidence_static", args.cuda_graphs, "rollout"))
    runs += [(batch, False, strategy, args.cuda_graphs, "greedy") for batch in batches
             if batch in table["uncached_batches"] for strategy in table["strategies"]]
    rows, warm = [], set()
    for batch, cache, strategy, graphs, sampling in runs:
        prompt = torch.randint(*token_ids, (batch, prompt_length), device=device,
                               generator=torch.Generator(device=device).manual_seed(batch))
        call = dict(settings, use_cache=cache, cuda_graphs=graphs, **rollout_sampling(sampling, batch))
        warmup = None
        if (batch, cache, graphs, sampling) not in warm:  # first calls compile kernels / capture graphs
            # (with generators of their own: the timed call's start unused)
            warmup = timed_generate(model, prompt, **{**call, **rollout_sampling(sampling, batch),
                                                      "max_new_tokens": table["block"]})[1]
            warm.add((batch, cache, graphs, sampling))
        out, seconds = timed_generate(model, prompt, remasking_strategy=strategy, **threshold(strategy), **call)
        rows.append(record(out, seconds, device, batch=batch, cache=cache_name(cache), strategy=strategy,
                           cuda_graphs=graphs, sampling=sampling, fused_kernels=args.fused_kernels,
                           new_tokens=new_tokens, prompt=prompt_length,
                           warmup_seconds=None if warmup is None else round(warmup, 1)))
        print(json.dumps(rows[-1]), flush=True)
    summary = {"preset": args.preset, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
               else "cpu", "torch": torch.__version__, "fused_kernels": args.fused_kernels,
               "build_seconds": round(built, 1),
               "total_seconds": round(time.perf_counter() - began, 1),
               "table": [{k: r[k] for k in ("batch", "cache", "strategy", "cuda_graphs", "sampling", "tokens_per_s",
                                            "ms_per_forward", "tokens_per_step")} for r in rows]}
    print(json.dumps(summary, indent=1))


def profile_table(args, device: torch.device, blocks: int = 2) -> None:
    """Where a cached decoding step's time goes, for a rollout preset's model at its smallest and largest batch:
    the top operators (device time on CUDA: the kernels by name, which also says which attention kernel SDPA
    chose) and the device kernels per forward, from one eager call of ``blocks`` blocks (a replayed CUDA graph runs
    the same kernels, launched at once)."""
    table = TABLES[args.preset]
    config = table["config"]
    model = build_model(table["family"], config, device, args.fused_kernels)
    settings = dict(max_new_tokens=blocks * table["block"], block_length=table["block"],
                    denoising_steps=table["steps"], stop_token_ids=[], return_dict_in_generate=True,
                    use_cache=table["caches"][0], cuda_graphs="off", temperature=0.0)
    for batch in sorted({min(table["batches"]), max(table["batches"])}):
        prompt = torch.randint(10, config["mask_token_id"] - 1, (batch, table["prompt"]), device=device,
                               generator=torch.Generator(device=device).manual_seed(batch))
        model.generate(prompt, **settings)  # warm-up
        out = {}

        def call(prompt=prompt, out=out):
            out["generated"] = model.generate(prompt, **settings)

        operators, kernels = profile_call(call, device.type == "cuda", top=25)
        forwards = out["generated"].num_forward_passes
        per_forward = None if kernels is None else round(kernels / forwards)
        cache = cache_name(settings["use_cache"])
        print(json.dumps({"profile": {"preset": args.preset, "fused_kernels": args.fused_kernels, "batch": batch,
                                      "cache": cache, "forwards": forwards,
                                      "kernels_per_forward": per_forward, "top": operators}}), flush=True)


def rollout_sampling(sampling: str, batch: int) -> dict:
    """``generate()`` arguments of a row's sampling: ``greedy`` (the issue's table), or ``rollout``, as TraceRL's
    rollouts sample (temperature 1, one CPU generator per row, whose uniforms are drawn on the host and copied to
    the device at every step)."""
    if sampling == "greedy":
        return {"temperature": 0.0}
    return {"temperature": 1.0, "generator": [torch.Generator().manual_seed(row) for row in range(batch)]}


def cache_name(cache) -> str:
    return {True: "exact", False: "none"}.get(cache, cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=["cpu", *TABLES],
                        help="default: sdar-4b on CUDA, cpu elsewhere")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (the models are built there)")
    parser.add_argument("--cuda_graphs", choices=["auto", "off"], default="auto",
                        help="generate()'s cuda_graphs (rollout table presets)")
    parser.add_argument("--families", nargs="+", default=["sdar", "llada", "dream"], help="cpu preset")
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048], help="cpu preset")
    parser.add_argument("--strategies", nargs="+", default=STRATEGIES, help="cpu preset")
    parser.add_argument("--hidden", type=int, default=128, help="cpu preset")
    parser.add_argument("--batch_sizes", nargs=2, type=int, default=[1, 16], help="cpu preset: batching ratio")
    parser.add_argument("--batch_sizes_table", nargs="+", type=int, help="rollout table presets: batch sizes")
    parser.add_argument("--profile", action="store_true",
                        help="rollout table presets: profile eager cached steps at the smallest and largest batch "
                             "(top operators, kernels per forward) instead of the table")
    parser.add_argument("--fused_kernels", action="store_true",
                        help="rollout table presets, --profile and --count_ops: the model's elementwise chains "
                             "compiled into fused kernels (trl_diffusion.set_fused_kernels); warm-up calls include "
                             "the compilation")
    parser.add_argument("--count_ops", action="store_true",
                        help="print the torch operations per cached SDAR token (cpu preset's model) and stop "
                             "(with --fused_kernels: the compiled kernels are not counted)")
    args = parser.parse_args()
    device = torch.device(args.device)
    args.preset = args.preset or ("sdar-4b" if device.type == "cuda" else "cpu")
    torch.manual_seed(0)
    if args.count_ops:
        count_ops(args, device)
    elif args.profile and args.preset != "cpu":
        profile_table(args, device)
    elif args.preset == "cpu":
        cpu_grid(args, device)
    else:
        rollout_table(args, device)


if __name__ == "__main__":
    main()
