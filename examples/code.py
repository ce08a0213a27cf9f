# /// script
# dependencies = ["trl_diffusion"]
# ///
"""TraceRL on code, rewarded by running each completion's last Python block against the row's tests in the
sandbox (``trl_diffusion.rewards.make_code_reward``).

With no arguments: a smoke run on CPU with the embedded tiny model and a synthetic code task ("write f() that
returns 47+35", tests ``assert f() == 82``). The tiny arithmetic model does not write code, so rewards stay near 0;
it shows the pipeline end to end in a minute:

    accelerate launch examples/code.py

A real run (DiffuCoder-style coupled GRPO or TraceRL on a code set with ``tests`` or HumanEval-style
``test`` + ``entry_point`` columns):

    accelerate launch examples/code.py --model_name_or_path apple/DiffuCoder-7B-Instruct \
        --dataset_name <your/code-rl-dataset> --likelihood_estimator coupled --config recipes/dream_tracerl_code.yaml
"""

from __future__ import annotations

import os
import sys

# This folder holds math.py and code.py, named like standard-library modules: drop it from the import path so that
# `python examples/<name>.py` does not import this folder's files in place of the standard library's.
if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import json
import random
from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.callbacks import save_training_curves
from trl_diffusion.data import load_training_dataset
from trl_diffusion.rewards import make_code_reward


@dataclass
class CodeScriptArguments(ScriptArguments):
    dataset_name: str | None = field(default=None, metadata={"help": "Hub name or local file with a prompt column and "
                                                             "tests (list of asserts) or test + entry_point. "
                                                             "Default: a synthetic code task."})
    timeout: float = field(default=10.0, metadata={"help": "Sandbox wall-time per completion (seconds)."})
    memory_mb: int = field(default=1024, metadata={"help": "Sandbox memory limit (MiB)."})
    partial_credit: bool = field(default=False, metadata={"help": "Reward the fraction of tests passed."})


def synthetic_code_tasks(n: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append({"prompt": [{"role": "user", "content": f"Write a Python function f() that returns {a}+{b}."}],
                     "tests": [f"assert f() == {a + b}"]})
    return Dataset.from_list(rows)


def main(script_args: CodeScriptArguments, args: TraceRLConfig, model_args: ModelConfig) -> dict:
    path = model_args.model_name_or_path or str(EMBEDDED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    if script_args.dataset_name is None:
        dataset = synthetic_code_tasks(512, args.seed)
    else:
        dataset = load_training_dataset(script_args.dataset_name, script_args.dataset_config,
                                        script_args.dataset_train_split)
    reward = make_code_reward(timeout=script_args.timeout, memory_mb=script_args.memory_mb,
                              partial_credit=script_args.partial_credit)
    trainer = TraceRLTrainer(model, reward, args=args, train_dataset=dataset, processing_class=tokenizer,
                             peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)
    plot = save_training_curves(trainer.state.log_history, f"{args.output_dir}/training_curves.png",
                                ["reward", "rollout/tokens_per_step", "completions/mean_length"],
                                title="TraceRL on code")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {"output_dir": args.output_dir, "training_curves": str(plot) if plot else None,
              "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None}
    if args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
    print(json.dumps(result))
    return result


def make_parser() -> TrlParser:
    parser = TrlParser((CodeScriptArguments, TraceRLConfig, ModelConfig))
    parser.set_defaults(output_dir="outputs/code", max_steps=5, per_device_train_batch_size=16, num_generations=4,
                        max_completion_length=32, block_length=4, denoising_steps=4, learning_rate=2e-4, beta=0.0,
                        logging_steps=1, save_strategy="no", report_to="none", bf16=False,
                        gradient_checkpointing=False, seed=0)
    return parser


if __name__ == "__main__":
    main(*make_parser().parse_args_and_config())
