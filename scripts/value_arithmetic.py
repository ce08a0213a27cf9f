"""Does the diffusion value model help? TraceRL with and without a value model, same rollouts, on the embedded tiny
SDAR and the synthetic arithmetic task. Prints held-out greedy accuracy per step and the variance of the
token-level advantages the policy was trained on, as JSON.

    python scripts/value_arithmetic.py                                  # both runs, default budget
    python scripts/value_arithmetic.py --max_steps 2 --num_eval 16      # a quick smoke run

Any ``TraceRLConfig`` flag works (``--learning_rate``, ``--value_learning_rate``, ``--gamma``, ``--lam``, ...). If the
embedded model is missing, a freshly built tiny SDAR (random weights, accuracy ~0) stands in and the JSON says so.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import TrlParser

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_FORMAT, EMBEDDED_MODEL, EMBEDDED_TASK
from trl_diffusion.data import evaluate_accuracy, make_problems, score_completion, to_dataset
from trl_diffusion.scripts.utils import checkpointing_off
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueModel


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(default=str(EMBEDDED_MODEL), metadata={"help": "Policy to train."})
    runs: list[str] = field(default_factory=lambda: ["no_value", "value"],
                            metadata={"help": "Which runs: 'no_value' (GRPO advantages) and/or 'value'."})
    eval_every: int = field(default=20, metadata={"help": "Evaluate held-out accuracy every this many steps."})
    num_eval: int = field(default=300, metadata={"help": "Held-out problems used for the accuracy curve."})


def exact_match(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last \\boxed{} is exactly the answer."""
    return [float(score_completion(c, a)) for c, a in zip(completions, answer)]


class AccuracyCurve(TrainerCallback):
    """Greedy held-out accuracy at step 0, every ``every`` steps and at the end."""

    def __init__(self, model, tokenizer, problems, every: int):
        self.model, self.tokenizer, self.problems, self.every = model, tokenizer, problems, every
        self.curve: list[tuple[int, float]] = []

    def measure(self, step: int) -> None:
        if not self.curve or self.curve[-1][0] != step:
            self.curve.append((step, round(evaluate_accuracy(self.model, self.tokenizer, self.problems,
                                                                   chat_template=EMBEDDED_CHAT_TEMPLATE), 4)))
            print(json.dumps({"step": step, "held_out_accuracy": self.curve[-1][1]}), flush=True)

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.measure(state.global_step)


class AdvantageRecorder(TraceRLTrainer):
    """TraceRLTrainer that records the variance of the token-level advantages of each generation batch (scalar GRPO
    advantages are broadcast over their completion's tokens)."""

    advantage_variances: list[float]

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        trained = output["completion_mask"] > 0
        advantages = output["advantages"]
        if advantages.dim() == 1:
            advantages = advantages[:, None].expand_as(trained)
        tokens = self.accelerator.gather_for_metrics(advantages[trained].float())
        if self.model.training and tokens.numel() > 1:
            self.advantage_variances.append(tokens.var().item())
        return output


def load_policy(path: str):
    """The policy and tokenizer; a fresh tiny SDAR when the embedded model has not been built."""
    if Path(path) == Path(EMBEDDED_MODEL) and not Path(path).is_dir():
        return tiny_model("sdar").train(), build_tokenizer(), "fresh tiny SDAR (embedded model missing)"
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path), path


def run(script_args: ScriptArguments, args: TraceRLConfig, name: str) -> dict:
    torch.manual_seed(args.seed)
    model, tokenizer, source = load_policy(script_args.model_name_or_path)
    train, test = make_problems(**EMBEDDED_TASK)
    args.output_dir = f"{args.output_dir.rstrip('/')}/{name}"
    value_model = DiffusionValueModel.from_policy(model) if name == "value" else None
    curve = AccuracyCurve(model, tokenizer, test[: script_args.num_eval], script_args.eval_every)
    curve.measure(0)
    trainer = AdvantageRecorder(model, exact_match, args=args, train_dataset=to_dataset(train, EMBEDDED_FORMAT),
                                processing_class=tokenizer, callbacks=[curve], value_model=value_model)
    trainer.advantage_variances = []
    start = time.perf_counter()
    trainer.train()
    curve.measure(trainer.state.global_step)
    logs = [log for log in trainer.state.log_history if "value/loss" in log]
    variances = trainer.advantage_variances
    return {
        "run": name,
        "model": source,
        "curve": curve.curve,
        "gain_points": round(100 * (curve.curve[-1][1] - curve.curve[0][1]), 1),
        "advantage_variance_mean": round(sum(variances) / max(len(variances), 1), 5),
        "advantage_variance_per_batch": [round(v, 5) for v in variances],
        "value_explained_variance_last": logs[-1]["value/explained_variance"] if logs else None,
        "value_loss_last": logs[-1]["value/loss"] if logs else None,
        "rollouts": trainer.state.global_step * args.per_device_train_batch_size * args.gradient_accumulation_steps,
        "train_wall_s": round(time.perf_counter() - start, 1),
    }


def make_parser() -> TrlParser:
    parser = TrlParser((ScriptArguments, TraceRLConfig))
    # the objective docs/value.md measured (trl_diffusion's defaults before the official objective): TRL's dapo
    # loss, no KL, no group filter, TRL's reward std, one value step per rollout
    parser.set_defaults(
        output_dir="runs/value_arithmetic", max_steps=100, per_device_train_batch_size=64, num_generations=8,
        max_completion_length=16, block_length=4, denoising_steps=4, remasking_strategy="low_confidence_static",
        temperature=1.0, learning_rate=1e-4, value_learning_rate=1e-3, gamma=1.0, lam=1.0, cliprange_value=0.2,
        beta=0.0, loss_type="dapo", dynamic_group_filtering="none", reward_std="sample", value_batch_size=None,
        logging_steps=10, save_strategy="no", report_to="none", bf16=False, **checkpointing_off(),
        use_cpu=True, seed=0, disable_tqdm=True,
    )
    return parser


if __name__ == "__main__":
    script_args, training_args = make_parser().parse_args_and_config()
    unknown = set(script_args.runs) - {"no_value", "value"}
    if unknown:
        raise ValueError(f"unknown runs {sorted(unknown)}; choose from 'no_value' and 'value'.")
    results = [run(script_args, copy.deepcopy(training_args), name) for name in script_args.runs]
    print(json.dumps({"results": results}, indent=1))
