"""Train a ~0.8M-parameter SDAR or LLaDA from scratch on 2-digit addition / subtraction with DiffusionSFTTrainer,
then measure greedy exact match on held-out problems with ``model.generate``. Prints one JSON record.

    python scripts/train_arithmetic.py --family sdar  --output_dir runs/sdar
    python scripts/train_arithmetic.py --family llada --output_dir runs/llada --loss_weighting none

Every ``DiffusionSFTConfig`` / ``SFTConfig`` flag works too (``--learning_rate``, ``--per_device_train_batch_size``,
``--diffusion_objective``, ...). Defaults: AdamW lr 1e-3 (50 warmup steps), grad-norm clipping 1.0, batch 32,
t ~ U(eps, 1) masking with 1/t weights, answers padded with trained-on EOS (``--pad_to_length_with_eos``) to
``--max_length`` (default: the longest prompt + 16 answer tokens), 780 s of training whose last quarter
decays the learning rate linearly to 0 (``--time_budget_s``, ``--decay_fraction``), then evaluation. Measured
results and what each choice is for: docs/sft.md.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import torch
from trl import TrlParser

from trl_diffusion.callbacks import TimeBudgetCallback
from trl_diffusion.data import evaluate_accuracy, make_problems, to_dataset
from trl_diffusion.models import LLaDAModelLM, SDARForCausalLM
from trl_diffusion.scripts.utils import checkpointing_off
from trl_diffusion.testing import build_tokenizer, tiny_llada_config, tiny_sdar_config
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer

MAX_NEW_TOKENS = 16


@dataclass
class ArithmeticArguments:
    family: str = field(default="sdar", metadata={"help": "Model family: 'sdar' (block) or 'llada' (full).",
                                                  "choices": ["sdar", "llada"]})
    digits: int = field(default=2, metadata={"help": "Operands have up to this many digits."})
    num_train: int = field(default=12000, metadata={"help": "Training problems."})
    num_test: int = field(default=500, metadata={"help": "Held-out problems (disjoint from training)."})
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Transformer layers."})
    time_budget_s: float = field(default=780.0, metadata={"help": "Stop training after this many seconds."})
    decay_fraction: float = field(default=0.25, metadata={"help": "Decay the learning rate linearly to 0 over this "
                                                          "last fraction of the time budget (0 = no decay)."})
    eval_batch_size: int = field(default=100, metadata={"help": "Prompts per generate() call at evaluation."})
    dataset_format: str = field(default="prompt_completion",
                                metadata={"help": "TRL dataset format of the task: 'conversational' (chat template) "
                                          "or 'prompt_completion' (plain 'What is a+b?\\n' prompts, shorter).",
                                          "choices": ["conversational", "prompt_completion"]})


def build_model(family: str, hidden: int, layers: int, seed: int):
    """A fresh model (standard init) of about 1M parameters for hidden=128, layers=4."""
    torch.manual_seed(seed)
    if family == "sdar":
        # no pad id, as SDAR's released configs: every embedding row trains (a pad id would freeze EOS's, id 0)
        config = tiny_sdar_config(hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                                  max_position_embeddings=128, pad_token_id=None)
        return SDARForCausalLM(config)
    config = tiny_llada_config(d_model=hidden, n_heads=4, n_kv_heads=4, n_layers=layers,
                               mlp_hidden_size=3 * hidden, max_sequence_length=128)
    return LLaDAModelLM(config)


def _chat(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def make_parser() -> TrlParser:
    # Answers padded with trained-on EOS up to a fixed canvas (LLaDA's SFT recipe; for SDAR it also fills the
    # answer's last block): at inference the positions after the answer are masks that must become EOS, and a model
    # never trained on them decodes digits or braces there. The canvas's default length comes from the task
    # (parse_arguments); max_length=64 only lets the first pass validate.
    parser = TrlParser((ArithmeticArguments, DiffusionSFTConfig))
    parser.set_defaults(
        output_dir="runs/arithmetic", max_steps=20000, per_device_train_batch_size=32, learning_rate=1e-3,
        max_grad_norm=1.0, lr_scheduler_type="constant_with_warmup", warmup_steps=50, weight_decay=0.0,
        logging_steps=200, save_strategy="no", report_to="none", bf16=False, **checkpointing_off(),
        pad_to_length_with_eos=True, max_length=64, seed=0, disable_tqdm=True, dataloader_drop_last=True,
    )
    return parser


def canvas_length(script_args: ArithmeticArguments, seed: int) -> int:
    """The task's longest prompt (as formatted for training) plus the answer's tokens."""
    tokenizer = build_tokenizer()
    train, test = make_problems(script_args.num_train, script_args.num_test, digits=script_args.digits, seed=seed)
    chat = script_args.dataset_format == "conversational"
    return MAX_NEW_TOKENS + max(len(tokenizer.encode(_chat(tokenizer, p.prompt) if chat else p.prompt + "\n",
                                                     add_special_tokens=False)) for p in train + test)


def parse_arguments(parser: TrlParser, argv: list[str] | None = None) -> tuple[ArithmeticArguments,
                                                                             DiffusionSFTConfig]:
    """Parse twice: the first pass reads the task, whose EOS canvas becomes the default ``max_length`` of the
    second (a ``--max_length`` given on the command line wins, and every flag is validated as usual)."""
    script_args, args = parser.parse_args_and_config(argv)
    parser.set_defaults(max_length=canvas_length(script_args, args.seed))
    return parser.parse_args_and_config(argv)


def main(script_args: ArithmeticArguments, args: DiffusionSFTConfig) -> dict:
    start = time.perf_counter()
    tokenizer = build_tokenizer()
    train, test = make_problems(script_args.num_train, script_args.num_test, digits=script_args.digits,
                                seed=args.seed)
    model = build_model(script_args.family, script_args.hidden_size, script_args.num_layers, args.seed)
    budget = TimeBudgetCallback(script_args.time_budget_s, script_args.decay_fraction)
    trainer = DiffusionSFTTrainer(model, args=args, train_dataset=to_dataset(train, script_args.dataset_format),
                                  processing_class=tokenizer, callbacks=[budget])
    train_start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - train_start
    eval_start = time.perf_counter()
    model.eval()
    accuracy = evaluate_accuracy(model, tokenizer, test, batch_size=script_args.eval_batch_size,
                                 max_new_tokens=MAX_NEW_TOKENS,
                                 chat_template=script_args.dataset_format == "conversational")
    eval_seconds = time.perf_counter() - eval_start
    losses = [(h["step"], round(h["loss"], 4)) for h in trainer.state.log_history if "loss" in h]
    result = {
        "family": script_args.family,
        "dataset_format": script_args.dataset_format,
        "objective": trainer.objective,
        "digits": script_args.digits,
        "accuracy": accuracy,
        "num_test": len(test),
        "steps": trainer.state.global_step,
        "train_wall_s": round(train_seconds, 1),
        "eval_wall_s": round(eval_seconds, 1),
        "total_wall_s": round(time.perf_counter() - start, 1),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "final_loss": losses[-1][1] if losses else None,  # JSON has no NaN
        "loss_trajectory": losses,
        "seed": args.seed,
        "learning_rate": args.learning_rate,
        "batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps,
    }
    os.makedirs(args.output_dir, exist_ok=True)
    trainer.save_model(args.output_dir)
    with open(os.path.join(args.output_dir, "results.json"), "w") as handle:
        json.dump(result, handle, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    script_args, training_args = parse_arguments(make_parser())
    main(script_args, training_args)
