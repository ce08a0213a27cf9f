"""TraceRL learns: RL on the embedded tiny SDAR (middling at 3-digit addition / subtraction) raises held-out
greedy accuracy. Runs every requested objective setting x likelihood estimator with the same number of rollouts
and prints held-out accuracy per rollout as JSON.

    python scripts/tracerl_arithmetic.py                                  # previous defaults, trajectory
    python scripts/tracerl_arithmetic.py --estimators trajectory random_masking coupled mean_field
    python scripts/tracerl_arithmetic.py --settings previous_defaults official_trado --max_rollouts 100

Settings (objective fields only; the toy's sizes and learning rate are shared):

* ``previous_defaults``: trl_diffusion's defaults before the official objective (TRL's ``dapo`` loss, no KL, no
  group filter, TRL's unbiased std), one optimizer step per rollout;
* ``paper_defaults``: ``TraceRLConfig``'s defaults (the paper's formula over rows, KL 0.01 to pi_old, the 0.2-0.8
  accuracy band, population std), one optimizer step per rollout;
* ``official_trado``: ``TraceRLConfig.from_official("trado")``'s objective and sampler (1/L_max rows, log-ratio
  clamp 10, dynamic decoding at 0.9, constant lr, grad-norm clip 1, ...) with four optimizer steps of a quarter of
  the rollout each, as dLLM-RL takes several steps per rollout against a fixed pi_old.

Any ``TraceRLConfig`` flag works (``--learning_rate``, ``--num_generations``, ``--shrinkage``, ...) and wins over
the setting, except two the script sets per run: the length (``--max_rollouts``, not ``--max_steps``) and the
estimator (``--estimators``, not ``--likelihood_estimator``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field, fields

from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import TrlParser

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_FORMAT, EMBEDDED_MODEL, EMBEDDED_TASK
from trl_diffusion.callbacks import HeldOutAccuracyCallback
from trl_diffusion.data import arithmetic_reward, make_problems, to_dataset
from trl_diffusion.scripts.utils import checkpointing_off
from trl_diffusion.trainers.tracerl_config import OFFICIAL_SETTINGS

# the toy keeps its own sizes, learning rate and value settings; the rest of dLLM-RL's TraDo settings apply
_TOY_SIZES = {"num_generations", "generation_batch_size", "max_completion_length", "learning_rate", "gamma", "lam",
              "cliprange_value", "value_learning_rate", "value_batch_size", "value_train_every"}
UPDATES_PER_ROLLOUT = {"previous_defaults": 1, "paper_defaults": 1, "official_trado": 4}
SETTINGS: dict[str, dict] = {
    "previous_defaults": dict(loss_type="dapo", beta=0.0, dynamic_group_filtering="none", reward_std="sample",
                              use_bias_correction_kl=True),
    "paper_defaults": {},
    "official_trado": {k: v for k, v in OFFICIAL_SETTINGS["trado"].items() if k not in _TOY_SIZES},
}


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default=str(EMBEDDED_MODEL), metadata={"help": "Policy to train."})
    settings: list[str] = field(default_factory=lambda: ["previous_defaults"],
                                metadata={"help": f"Objective settings to compare, of {sorted(SETTINGS)}."})
    estimators: list[str] = field(default_factory=lambda: ["trajectory"],
                                  metadata={"help": "Likelihood estimators to compare (one run each)."})
    max_rollouts: int = field(default=400, metadata={"help": "Rollouts (generation batches) per run."})
    eval_every: int = field(default=20, metadata={"help": "Evaluate held-out accuracy every this many rollouts."})
    num_eval: int = field(default=300, metadata={"help": "Held-out problems used for the accuracy curve."})


def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, TraceRLConfig))
    parser.set_defaults(
        output_dir="runs/tracerl_arithmetic", per_device_train_batch_size=64, num_generations=8,
        max_completion_length=16, block_length=4, denoising_steps=4, remasking_strategy="low_confidence_static",
        temperature=1.0, learning_rate=1e-4, logging_steps=10, save_strategy="no", report_to="none", bf16=False,
        **checkpointing_off(), use_cpu=True, seed=0, disable_tqdm=True,
    )
    return parser


SET_PER_RUN = {"max_steps": "--max_rollouts", "likelihood_estimator": "--estimators"}
"""``TraceRLConfig`` fields each run sets, and the script's flag that chooses them."""


def refuse_fields_set_per_run(args: TraceRLConfig) -> None:
    """A field the script would overwrite, given in any spelling (``--max-steps``, a prefix, a ``--config`` file),
    is an error rather than silently ignored."""
    defaults = {f.name: f.default for f in fields(TraceRLConfig)}
    for name, instead in SET_PER_RUN.items():
        if getattr(args, name) != defaults[name]:
            raise ValueError(f"--{name} is set by this script for each run; pass {instead} instead.")


def config_for(setting: str, argv: list[str]) -> tuple[ScriptArguments, TraceRLConfig]:
    """The setting's fields as flags, then the command line's (which win); a rollout of 64 responses cut into
    ``UPDATES_PER_ROLLOUT[setting]`` optimizer steps."""
    if setting not in SETTINGS:
        raise ValueError(f"unknown setting {setting!r}; choose from {sorted(SETTINGS)}.")
    updates = UPDATES_PER_ROLLOUT[setting]
    flags = [f"--{k}={v}" for k, v in SETTINGS[setting].items()]
    if updates > 1:
        flags += [f"--per_device_train_batch_size={64 // updates}", f"--steps_per_generation={updates}"]
    return make_parser().parse_args_and_config(flags + argv)


def run(script_args: ScriptArguments, args: TraceRLConfig, setting: str, estimator: str) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(script_args.model_name_or_path)
    model = AutoModelForCausalLM.from_pretrained(script_args.model_name_or_path)
    train, test = make_problems(**EMBEDDED_TASK)
    updates = args.steps_per_generation // args.gradient_accumulation_steps
    if script_args.max_rollouts < 1:
        raise ValueError(f"max_rollouts must be >= 1, got {script_args.max_rollouts}.")
    args.likelihood_estimator = estimator
    args.max_steps = script_args.max_rollouts * updates
    args.output_dir = f"{args.output_dir.rstrip('/')}/{setting}-{estimator}"
    callback = HeldOutAccuracyCallback(model, tokenizer, test[: script_args.num_eval],
                                       script_args.eval_every * updates, chat_template=EMBEDDED_CHAT_TEMPLATE)
    trainer = TraceRLTrainer(model, arithmetic_reward, args=args, train_dataset=to_dataset(train, EMBEDDED_FORMAT),
                             processing_class=tokenizer, callbacks=[callback])
    start = time.perf_counter()
    trainer.train()
    filtered = [entry["filtered_groups"] for entry in trainer.state.log_history if "filtered_groups" in entry]
    return {"setting": setting, "estimator": estimator,
            "curve": [(step // updates, accuracy) for step, accuracy in callback.curve],
            "train_wall_s": round(time.perf_counter() - start, 1),
            "gain_points": round(100 * (callback.curve[-1][1] - callback.curve[0][1]), 1),
            "rollouts": script_args.max_rollouts, "responses": script_args.max_rollouts * args.generation_batch_size,
            "optimizer_steps": trainer.state.global_step,
            "mean_filtered_groups": round(sum(filtered) / len(filtered), 3) if filtered else None}


if __name__ == "__main__":
    argv = sys.argv[1:]
    script_args, parsed = make_parser().parse_args_and_config(argv)
    refuse_fields_set_per_run(parsed)
    results = [run(*config_for(setting, argv), setting, estimator)
               for setting in script_args.settings for estimator in script_args.estimators]
    print(json.dumps({"results": results}, indent=1))
