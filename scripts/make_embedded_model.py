"""Reproduce the embedded tiny SDAR (``trl_diffusion/assets/tiny-sdar-arithmetic``): train from scratch with
DiffusionSFTTrainer on 3-digit addition / subtraction (a harder variant of the 2-digit proof task; batch 32, constant
lr 1e-3 after warmup, EOS-padded answers) for a fixed 8000 steps (about 20 minutes on 2 CPU cores; deterministic
for a given seed and thread count, the shipped model used 2 threads), measure held-out greedy accuracy, and write
the checkpoint, tokenizer, ``results.json`` and a model card.

    python scripts/make_embedded_model.py                 # the shipped settings
    python scripts/make_embedded_model.py --max_steps 400 --output_dir /tmp/tiny
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from train_arithmetic import main, make_parser, parse_arguments  # noqa: E402

from trl_diffusion.assets import EMBEDDED_FORMAT, EMBEDDED_MODEL, EMBEDDED_TASK  # noqa: E402

CARD = r"""---
library_name: transformers
tags: [trl, trl_diffusion, sdar, block-diffusion, sft]
---
# tiny-sdar-arithmetic

A {params}-parameter SDAR (Qwen3 layout, block-causal attention, block size 4) trained from scratch with
`trl_diffusion.DiffusionSFTTrainer` (`block` objective, 1/t ELBO weighting, batch 32, lr 1e-3) for {steps} steps
on {digits}-digit addition and subtraction (`trl_diffusion.data.make_problems(**trl_diffusion.assets.EMBEDDED_TASK)`),
with plain prompts `"What is 123+456?\n"` and completions `"\boxed{{579}}"` (the `prompt_completion` format), answers
padded with trained-on EOS to a fixed canvas.

Held-out greedy exact match: **{accuracy:.1%}** on {num_test} problems (`evaluate_accuracy`, 1 token per step).
It is deliberately middling, so that RL (`examples/math.py`, `scripts/tracerl_arithmetic.py`) has room to improve.

Load with `import trl_diffusion` then `AutoModelForCausalLM.from_pretrained(trl_diffusion.assets.EMBEDDED_MODEL)`.
Reproduce with `python scripts/make_embedded_model.py`.
"""

if __name__ == "__main__":
    parser = make_parser()
    parser.set_defaults(output_dir=str(EMBEDDED_MODEL), max_steps=8000, time_budget_s=1e9, decay_fraction=0.0,
                        dataset_format=EMBEDDED_FORMAT,
                        num_train=EMBEDDED_TASK["num_train"], num_test=EMBEDDED_TASK["num_test"],
                        digits=EMBEDDED_TASK["digits"], seed=EMBEDDED_TASK["seed"], family="sdar")
    script_args, training_args = parse_arguments(parser)
    result = main(script_args, training_args)
    out = Path(training_args.output_dir)
    (out / "training_args.bin").unlink(missing_ok=True)
    (out / "README.md").write_text(CARD.format(params=f"{result['num_parameters']:,}", steps=result["steps"],
                                               accuracy=result["accuracy"], num_test=result["num_test"],
                                               digits=result["digits"]))
    print(json.dumps({"written": sorted(os.listdir(out))}))
