"""TraceRL learns: RL on the embedded tiny SDAR (middling at 3-digit addition / subtraction) raises held-out
greedy accuracy. Runs every requested likelihood estimator with the same number of rollouts and prints a table of
held-out accuracy per step (the paper's estimator ablation, at toy scale) as JSON.

    python scripts/tracerl_arithmetic.py                                  # trajectory only
    python scripts/tracerl_arithmetic.py --estimators trajectory random_masking coupled mean_field

Any ``TraceRLConfig`` flag works (``--learning_rate``, ``--num_generations``, ``--shrinkage``, ...).
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import TrlParser

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_FORMAT, EMBEDDED_MODEL, EMBEDDED_TASK
from trl_diffusion.callbacks import HeldOutAccuracyCallback
from trl_diffusion.data import arithmetic_reward, make_problems, to_dataset


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default=str(EMBEDDED_MODEL), metadata={"help": "Policy to train."})
    estimators: list[str] = field(default_factory=lambda: ["trajectory"],
                                  metadata={"help": "Likelihood estimators to compare (one run each)."})
    eval_every: int = field(default=20, metadata={"help": "Evaluate held-out accuracy every this many steps."})
    num_eval: int = field(default=300, metadata={"help": "Held-out problems used for the accuracy curve."})


def run(script_args: ScriptArguments, args: TraceRLConfig, estimator: str) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    train, test = make_problems(**EMBEDDED_TASK)
    args.likelihood_estimator = estimator
    args.output_dir = f"{args.output_dir.rstrip('/')}/{estimator}"
    callback = HeldOutAccuracyCallback(model, tokenizer, test[: script_args.num_eval], script_args.eval_every,
                                                 chat_template=EMBEDDED_CHAT_TEMPLATE)
    trainer = TraceRLTrainer(model, arithmetic_reward, args=args, train_dataset=to_dataset(train, EMBEDDED_FORMAT),
                             processing_class=tokenizer, callbacks=[callback])
    start = time.perf_counter()
    trainer.train()
    return {"estimator": estimator, "curve": callback.curve, "train_wall_s": round(time.perf_counter() - start, 1),
            "gain_points": round(100 * (callback.curve[-1][1] - callback.curve[0][1]), 1),
            "rollouts": trainer.state.global_step * args.per_device_train_batch_size
            * args.gradient_accumulation_steps}


def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, TraceRLConfig))
    parser.set_defaults(
        output_dir="runs/tracerl_arithmetic", max_steps=400, per_device_train_batch_size=64, num_generations=8,
        max_completion_length=16, block_length=4, denoising_steps=4, remasking_strategy="low_confidence_static",
        temperature=1.0, learning_rate=1e-4, beta=0.0, logging_steps=10, save_strategy="no", report_to="none",
        bf16=False, gradient_checkpointing=False, use_cpu=True, seed=0, disable_tqdm=True,
    )
    return parser


if __name__ == "__main__":
    script_args, training_args = make_parser().parse_args_and_config()
    results = [run(script_args, copy.deepcopy(training_args), e) for e in script_args.estimators]
    print(json.dumps({"results": results}, indent=1))
