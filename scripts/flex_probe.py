"""Which head sizes and dtypes torch's compiled flex attention can run here, forward + backward, on the masks our
packed training rows use; the facts ``states.FLEX_AUTO_HEAD_DIMS`` / ``FLEX_AUTO_DTYPES`` should follow.

For each (dtype, head_dim): a ``[prompt | clean | noisy copies]`` layout's ``BlockMask``, grouped-query heads,
compiled ``flex_attention`` against SDPA with the dense mask (forward only on a CPU, where torch's flex attention
has no backward), at one length and then at a second length (the second call is where torch recompiles with dynamic
shapes, as packed rows of changing length make it do in training). Prints one JSON record per case (``ok`` or the
error's last line) as it goes::

    python scripts/flex_probe.py --device cuda --output flex_probe.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from trl_diffusion.states import FLEX_AUTO_DTYPES, FLEX_AUTO_HEAD_DIMS


def layout(length: int, device: str):
    """A packed row: 8 prompt tokens, a clean completion, one 4-token noisy copy per completion block."""
    from trl_diffusion.states import noisy_clean_attention_layout, noisy_columns

    positions = torch.arange(length, device=device)[None]
    valid = torch.ones_like(positions, dtype=torch.bool)
    return noisy_clean_attention_layout(positions, valid, 4, noisy_columns(positions >= 8))


def probe(head_dim: int, dtype: torch.dtype, lengths: list[int], device: str) -> dict:
    from trl_diffusion.models.common import flex_attention_kernel

    record = {"head_dim": head_dim, "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__}
    torch._dynamo.reset()
    for i, length in enumerate(lengths):
        key = f"length_{length}" + ("_recompiled" if i else "")
        rows = layout(length, device)
        n = rows.block.shape[1]
        backward = device != "cpu"  # torch's flex attention has no backward on CPU (forward-only scoring works)
        generator = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(1, 4, n, head_dim, device=device, dtype=dtype, generator=generator, requires_grad=backward)
        k, v = (torch.randn(1, 2, n, head_dim, device=device, dtype=dtype, generator=generator, requires_grad=backward)
                for _ in range(2))
        start = time.perf_counter()
        try:
            out = flex_attention_kernel(torch.device(device))(q, k, v, block_mask=rows.block_mask(), enable_gqa=True)
            if backward:
                out.float().square().sum().backward()
                grads = [t.grad.clone() for t in (q, k, v)]
                for t in (q, k, v):
                    t.grad = None
            ref = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                 attn_mask=rows.dense())
            record[key] = {"ok": True, "seconds": round(time.perf_counter() - start, 1),
                           "max_abs_out_diff": float((out - ref).abs().max())}
            if backward:
                ref.float().square().sum().backward()
                record[key]["max_abs_grad_diff"] = max(float((a - b.grad).abs().max())
                                                       for a, b in zip(grads, (q, k, v)))
        except Exception as exc:  # a compile failure is the finding
            lines = [line for line in str(exc).splitlines() if line.strip()]
            record[key] = {"ok": False, "error": f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    # by default what ``auto`` enables (FLEX_AUTO_*) and head_dim 32 (the embedded model's), which it refuses
    parser.add_argument("--head_dims", nargs="+", type=int, default=[32, *FLEX_AUTO_HEAD_DIMS])
    parser.add_argument("--dtypes", nargs="+", default=[str(d).removeprefix("torch.") for d in FLEX_AUTO_DTYPES])
    parser.add_argument("--lengths", nargs="+", type=int, default=[200, 264])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    records = []
    for dtype in args.dtypes:
        for head_dim in args.head_dims:
            records.append(probe(head_dim, getattr(torch, dtype), args.lengths, args.device))
            print(json.dumps(records[-1]), flush=True)
            if args.output:
                args.output.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
