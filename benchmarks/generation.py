"""Generation speed: tokens/s, forward passes, tokens per step and peak memory for each family x cache mode x
remasking strategy x length, on a small config on the CPU. Prints JSON (one record per run, then ratios).

    python benchmarks/generation.py                       # the full grid (slow for 2048 uncached)
    python benchmarks/generation.py --lengths 128 512 --families sdar
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from trl_diffusion.testing import tiny_model

CACHE_MODES = {"sdar": [False, True], "llada": [False, "dual"], "dream": [False, "dual"]}


def run(family: str, cache, strategy: str, length: int, batch: int, hidden: int) -> dict:
    overrides = {"sdar": dict(hidden_size=hidden, intermediate_size=4 * hidden, max_position_embeddings=4096),
                 "llada": dict(d_model=hidden, mlp_hidden_size=4 * hidden, max_sequence_length=4096),
                 "dream": dict(hidden_size=hidden, intermediate_size=4 * hidden, max_position_embeddings=4096)}
    model = tiny_model(family, **overrides[family])
    prompt = torch.randint(10, 100, (batch, 32))
    kwargs = dict(max_new_tokens=length, block_length=4, denoising_steps=4, temperature=0.0, use_cache=cache,
                  remasking_strategy=strategy, confidence_threshold=0.9, stop_token_ids=[],
                  return_dict_in_generate=True)
    start = time.perf_counter()
    out = model.generate(prompt, **kwargs)
    seconds = time.perf_counter() - start
    generated = int((out.unmask_step >= 0).sum())
    return {"family": family, "cache": str(cache), "strategy": strategy, "new_tokens": length, "batch": batch,
            "seconds": round(seconds, 3), "tokens_per_s": round(generated / seconds, 1),
            "ms_per_token": round(1000 * seconds / generated, 3), "forward_passes": out.num_forward_passes,
            "tokens_per_step": round(float(out.tokens_per_step.mean()), 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--families", nargs="+", default=["sdar", "llada", "dream"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[128, 512, 2048])
    parser.add_argument("--strategies", nargs="+", default=["low_confidence_static", "low_confidence_dynamic"])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--batch_sizes", nargs="+", type=int, default=[1, 16], help="for the batching ratio")
    args = parser.parse_args()
    torch.manual_seed(0)
    run("sdar", False, "low_confidence_static", 16, 1, args.hidden)  # warm-up (first-call overheads)
    records = []
    for family in args.families:
        for cache in CACHE_MODES[family]:
            for strategy in args.strategies:
                for length in args.lengths:
                    records.append(run(family, cache, strategy, length, 1, args.hidden))
                    print(json.dumps(records[-1]), flush=True)
    ratios = {}
    for family in args.families:
        def find(cache, length, batch=1, strategy="low_confidence_static", family=family):
            for r in records:
                if (r["family"], r["cache"], r["new_tokens"], r["batch"], r["strategy"]) == (
                        family, str(cache), length, batch, strategy):
                    return r
        longest = max(args.lengths)
        cached, plain = find(CACHE_MODES[family][1], longest), find(False, longest)
        entry = {f"cache_speedup_at_{longest}": round(plain["seconds"] / cached["seconds"], 2)}
        if family == "sdar":
            entry["cached_ms_per_token_by_length"] = {n: find(True, n)["ms_per_token"] for n in args.lengths}
            small, big = args.batch_sizes
            one = run(family, True, "low_confidence_static", 128, small, args.hidden)
            many = run(family, True, "low_confidence_static", 128, big, args.hidden)
            entry[f"batch_{big}_vs_{small}_tokens_per_s"] = round(many["tokens_per_s"] / one["tokens_per_s"], 2)
        ratios[family] = entry
    print(json.dumps({"ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
