"""Step-level GAE (``trl_diffusion.value.step_gae``) against the number of merged denoising steps: the chunked
scan it runs against the step-by-step recursion it replaced (one loop iteration per step), side by side in one run.

Worst case: one token committed per step, so a response of L tokens has L merged steps. Prints one JSON record per
length with both times, their ratio and the largest difference::

    python benchmarks/advantages.py                           # CPU, L in 512 2048 8192, 8 rows
    python benchmarks/advantages.py --device cuda --rows 64
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from trl_diffusion.value.advantages import dense_steps, step_gae, step_means


def step_gae_loop(token_rewards, values, groups, mask, gamma: float, lam: float):
    """The recursion one step at a time (the previous implementation): the baseline."""
    steps, num_steps = dense_steps(groups, mask)
    r_star, v_star = step_means(token_rewards, steps, num_steps), step_means(values, steps, num_steps)
    zeros = torch.zeros(values.shape[0], 1, device=values.device)
    v_next = torch.cat([v_star, zeros], dim=1)
    ret, adv = torch.zeros_like(v_next), torch.zeros_like(v_next)
    for t in reversed(range(num_steps)):
        ret[:, t] = r_star[:, t] + gamma * ret[:, t + 1]
        adv[:, t] = r_star[:, t] - v_star[:, t] + gamma * v_next[:, t + 1] + gamma * lam * adv[:, t + 1]
    valid, following = steps >= 0, (steps + 1).clamp(min=0)
    returns = token_rewards + gamma * ret.gather(1, following)
    advantages = token_rewards - values + gamma * v_next.gather(1, following) + gamma * lam * adv.gather(1, following)
    zero = torch.zeros((), device=values.device)
    return torch.where(valid, advantages, zero), torch.where(valid, returns, zero)


def milliseconds(fn, inputs: tuple, repeats: int, device: torch.device) -> float:
    fn(*inputs)  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--lam", type=float, default=0.95)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    for length in args.lengths:
        groups = torch.arange(length, device=device).repeat(args.rows, 1)  # one token per step
        mask = torch.ones(args.rows, length, dtype=torch.bool, device=device)
        values = torch.randn(args.rows, length, device=device)
        rewards = torch.zeros(args.rows, length, device=device)
        rewards[:, -1] = 1.0  # an outcome reward on the last step
        inputs = (rewards, values, groups, mask, args.gamma, args.lam)
        loop_ms = milliseconds(step_gae_loop, inputs, args.repeats, device)
        scan_ms = milliseconds(step_gae, inputs, args.repeats, device)
        difference = max(float((a - b).abs().max()) for a, b in zip(step_gae_loop(*inputs), step_gae(*inputs)))
        print(json.dumps({"steps": length, "rows": args.rows, "device": device.type, "loop_ms": round(loop_ms, 2),
                          "scan_ms": round(scan_ms, 2), "speedup": round(loop_ms / scan_ms, 1),
                          "max_abs_difference": difference}), flush=True)


if __name__ == "__main__":
    main()
