"""Training-side cost of TraceRL's trajectory scoring: packed (one forward per response, a noisy copy of a block
per merged step) vs naive (one whole-sequence forward per merged step), forward + backward, for shrinkage
s in {1, 2, 4}, block 4, 256-token responses, on a small SDAR on the CPU. Prints JSON: training tokens/s and
peak memory per configuration, then packed/naive ratios. Each configuration runs in its own process so that
peak memory is its own.

    python benchmarks/training.py
    python benchmarks/training.py --response_length 128 --batch 2
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def measure(mode: str, shrinkage: int, response_length: int, batch: int, hidden: int, repeats: int) -> dict:
    from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs, replay_logprobs, step_groups
    from trl_diffusion.states import block_index
    from trl_diffusion.testing import tiny_model

    model = tiny_model("sdar", hidden_size=hidden, intermediate_size=4 * hidden, max_position_embeddings=4096).train()
    prompt_len = 32
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 100, (batch, prompt_len), generator=generator)
    prompt_mask = torch.ones_like(prompt)
    completion = torch.randint(10, 100, (batch, response_length), generator=generator)
    # one token per step, left to right inside each block, as a static 4-step schedule commits them
    steps = torch.arange(response_length).expand(batch, -1).clone()
    settings = EstimatorSettings(block_size=4, shrinkage=shrinkage)
    blocks = block_index(prompt_len + torch.arange(response_length), 4).expand(batch, -1)
    groups = step_groups(steps, shrinkage, blocks)

    def step():
        if mode == "packed":
            logps, _, _ = estimate_logprobs(model, prompt, prompt_mask, completion, steps, settings)
        else:
            full_groups = torch.cat([torch.full_like(prompt, -1), groups], 1)
            logps = replay_logprobs(model, torch.cat([prompt, completion], 1), prompt_mask, full_groups, 4)
        logps.sum().backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    seconds = (time.perf_counter() - start) / repeats
    return {"mode": mode, "shrinkage": shrinkage, "response_length": response_length, "batch": batch,
            "scored_states": int(groups.max()) + 1, "seconds_per_step": round(seconds, 3),
            "train_tokens_per_s": round(batch * response_length / seconds, 1),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--response_length", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shrinkage", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--one", nargs=2, metavar=("MODE", "S"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]), args.response_length, args.batch, args.hidden,
                                 args.repeats)))
        return
    records = []
    for shrinkage in args.shrinkage:
        for mode in ("packed", "naive"):
            command = [sys.executable, __file__, "--one", mode, str(shrinkage), "--response_length",
                       str(args.response_length), "--batch", str(args.batch), "--hidden", str(args.hidden),
                       "--repeats", str(args.repeats)]
            records.append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True)
                                      .stdout.strip().splitlines()[-1]))
            print(json.dumps(records[-1]), flush=True)
    ratios = {}
    for shrinkage in args.shrinkage:
        packed, naive = (next(r for r in records if r["mode"] == m and r["shrinkage"] == shrinkage)
                         for m in ("packed", "naive"))
        ratios[f"s={shrinkage}"] = {"packed_over_naive_tokens_per_s": round(
            packed["train_tokens_per_s"] / naive["train_tokens_per_s"], 2),
            "packed_over_naive_peak_rss": round(packed["peak_rss_mb"] / naive["peak_rss_mb"], 2)}
    print(json.dumps({"ratios": ratios}, indent=1))


if __name__ == "__main__":
    main()
