"""TraceRL on math.

With no arguments: the embedded tiny SDAR and the synthetic arithmetic task — runs on a CPU in a few minutes and
prints held-out greedy accuracy before and after training:

    trl-diffusion math    # or, from a checkout: accelerate launch examples/math.py

dLLM-RL's TraDo config on TraDo-4B-Instruct (its MATH training set; `trl-diffusion recipes` lists the recipes):

    trl-diffusion math --accelerate_config zero3 --config trado_4b_tracerl_math

Every TRL / TraceRL config field is a flag (``--learning_rate``, ``--likelihood_estimator``, ``--shrinkage``,
``--beta``, ``--push_to_hub``, ...) and ``--config file.yaml`` is accepted. Training curves are saved as
``<output_dir>/training_curves.png``. ``--resume_from_checkpoint true`` resumes from the last checkpoint in
``--output_dir``. A bad argument (a mistyped model path, an invalid config value) is one line on stderr, exit 2.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_FORMAT, EMBEDDED_TASK
from trl_diffusion.callbacks import HeldOutAccuracyCallback, held_out_curve, save_training_curves
from trl_diffusion.command_line import UsageError
from trl_diffusion.data import arithmetic_reward, load_training_dataset, make_problems, to_dataset
from trl_diffusion.rewards import gold_text
from trl_diffusion.scripts.utils import (
    checkpointing_off,
    evaluation_split,
    find_reward,
    finish_script,
    load_pretrained,
    resume_checkpoint,
    run_script,
    setting_errors,
)

INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass
class MathScriptArguments(ScriptArguments):
    dataset_name: str | None = field(default=None, metadata={"help": "Hub name or local file of a math dataset "
                                                             "(problem/question + answer/solution columns). "
                                                             "Default: the synthetic arithmetic task."})
    reward_funcs: list[str] = field(default_factory=lambda: ["math_accuracy_reward"],
                                    metadata={"help": "Reward functions for a math dataset: names in "
                                              "trl_diffusion.rewards or dotted paths (module.function). A function "
                                              "with a `max_completion_length` parameter gets the run's value."})
    value_model: str | None = field(
        default=None,
        metadata={"help": "Train with a diffusion value model: a saved value model, or a policy checkpoint whose "
                  "backbone is copied under a zero head (as dLLM-RL initialises TraDo's)."})
    prompt_template: str | None = field(
        default=None,
        metadata={"help": "A raw prompt with `{question}`, used as is without the chat template (as dLLM-RL's "
                  "rollouts build prompts). Default: the question plus a \\boxed{} instruction as a user message, "
                  "rendered by the tokenizer's chat template."})
    num_eval: int = field(default=200, metadata={"help": "Held-out synthetic problems for the before/after accuracy."})
    eval_every: int = field(default=25, metadata={"help": "Held-out accuracy every this many steps (synthetic)."})

    def __post_init__(self):
        if self.num_eval < 1:
            raise ValueError(f"num_eval must be >= 1 (held-out problems measured before and after), got "
                             f"{self.num_eval}.")
        if self.prompt_template is not None and "{question}" not in self.prompt_template:
            raise ValueError("prompt_template must contain {question} (where each problem goes); without it every "
                             "prompt would be the same text.")
        if self.dataset_name is None:  # the synthetic task has its own prompts and reward
            if self.prompt_template is not None:
                raise ValueError("prompt_template applies to a math dataset (--dataset_name); the synthetic "
                                 "arithmetic task writes its own prompts.")
            if self.reward_funcs != ["math_accuracy_reward"]:
                raise ValueError(f"reward_funcs {self.reward_funcs} apply to a math dataset (--dataset_name); the "
                                 "synthetic arithmetic task is scored by its own arithmetic reward.")


def math_dataset(name: str, config: str | None, split: str, prompt_template: str | None = None):
    """Load a math dataset (Hub name or local json/jsonl/parquet) as prompts + ``answer``: conversational, or raw
    text from ``prompt_template``. A question column already in TRL's conversational format (a list of messages)
    keeps its messages, the instruction appended to its last user message."""
    dataset = load_training_dataset(name, config, split)
    question = next((c for c in ("problem", "question", "prompt") if c in dataset.column_names), None)
    answer = next((c for c in ("answer", "ground_truth_answer", "solution") if c in dataset.column_names), None)
    if question is None or answer is None:
        raise ValueError(f"{name}: need a problem/question column and an answer/solution column, "
                         f"found {dataset.column_names}.")

    def to_row(row, index):
        if not isinstance(row[question], (str, list)):
            raise ValueError(f"{name}: row {index} has no question text ({question!r} = {row[question]!r}).")
        gold = row[answer]
        if gold is None or (isinstance(gold, float) and math.isnan(gold)):
            gold = None  # no gold: the reward gives None and TRL leaves the row out ("None" would be an answer)
        else:
            gold = gold_text(gold)  # 1e-05 as 0.00001: math-verify reads the e of "1e-05" as Euler's number
            gold = gold.split("####")[-1].strip() if "####" in gold else gold
        if isinstance(row[question], list):  # conversational: [{"role": ..., "content": ...}, ...]
            if prompt_template is not None:
                raise ValueError(f"{name}: the {question!r} column holds chat messages; prompt_template needs the "
                                 "question as text.")
            messages = [dict(message) for message in row[question]]
            last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=None)
            if last_user is None:
                raise ValueError(f"{name}: a {question!r} conversation without a user message: {messages}")
            content = messages[last_user]["content"]
            if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...], joined: the Qwen
                # templates of SDAR / TraDo render list content as "" (an empty prompt) and Dream's fails on it
                if not all(isinstance(part, dict) and part.get("type") == "text" for part in content):
                    raise ValueError(f"{name}: row {index}'s user message has content parts other than text: "
                                     f"{content}")
                content = "".join(part["text"] for part in content)
            messages[last_user]["content"] = content + INSTRUCTION
            return {"prompt": messages, "answer": gold}
        if prompt_template is not None:
            return {"prompt": prompt_template.replace("{question}", row[question]), "answer": gold}
        return {"prompt": [{"role": "user", "content": row[question] + INSTRUCTION}], "answer": gold}

    return dataset.map(to_row, with_indices=True, remove_columns=dataset.column_names)


def load_reward(name: str, max_completion_length: int):
    """A reward function by name (``trl_diffusion.rewards``) or dotted path; ``max_completion_length`` is bound
    when the function takes it (e.g. to score truncated responses as wrong)."""
    func = find_reward(name)
    if "max_completion_length" in inspect.signature(func).parameters:
        func = functools.update_wrapper(functools.partial(func, max_completion_length=max_completion_length), func)
    return func


def main(script_args: MathScriptArguments, args: TraceRLConfig, model_args: ModelConfig) -> dict:
    model, tokenizer = load_pretrained(model_args)
    synthetic = script_args.dataset_name is None
    callbacks, held_out = [], None
    if synthetic:
        train, test = make_problems(**EMBEDDED_TASK)
        dataset, reward = to_dataset(train, EMBEDDED_FORMAT), arithmetic_reward
        problems = test[: script_args.num_eval]
        held_out = to_dataset(problems, EMBEDDED_FORMAT)
        callbacks.append(HeldOutAccuracyCallback(model, tokenizer, problems, script_args.eval_every,
                                                 chat_template=EMBEDDED_CHAT_TEMPLATE))
    else:
        reward = [load_reward(name, args.max_completion_length) for name in script_args.reward_funcs]
        if script_args.prompt_template is None and tokenizer.chat_template is None:
            raise UsageError("the tokenizer has no chat template (a base model's), and without --prompt_template the "
                             "questions become chat messages: pass --prompt_template with {question} in it, e.g. "
                             "$'Question: {question}\\nAnswer:'.")

    def load(split: str):
        return math_dataset(script_args.dataset_name, script_args.dataset_config, split, script_args.prompt_template)

    with setting_errors():  # a file without the columns, a split it lacks: one line, exit 2
        if not synthetic:
            dataset = load(script_args.dataset_train_split)
        eval_dataset = evaluation_split(script_args, args, held_out, load)
    with setting_errors():  # a setting the model's family refuses (training_block_size on LLaDA / Dream, ...)
        trainer = TraceRLTrainer(model, reward, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                                 processing_class=tokenizer,
                                 callbacks=callbacks, peft_config=get_peft_config(model_args),
                                 value_model=script_args.value_model)
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.resume_from_checkpoint, args.output_dir))
    trainer.save_model(args.output_dir)
    value_dir = None
    if trainer.value_model is not None:  # trainer.save_model saves the policy only
        value_dir = f"{args.output_dir}/value_model"  # loadable with --value_model
        if args.should_save:
            trainer.accelerator.unwrap_model(trainer.value_model).save_pretrained(value_dir)
    plot = None
    if trainer.is_world_process_zero():  # one process writes the figure
        plot = save_training_curves(
            trainer.state.log_history, f"{args.output_dir}/training_curves.png",
            ["reward", "eval/held_out_accuracy", "rollout/tokens_per_step", "rollout/sampler_logp_gap"],
            title=f"TraceRL ({args.likelihood_estimator}) on {script_args.dataset_name or 'synthetic arithmetic'}")
    result = {"output_dir": args.output_dir, "value_model": value_dir, "training_curves": str(plot) if plot else None}
    if synthetic:
        curve = held_out_curve(trainer.state.log_history)  # the whole run's, across a resume
        result.update(held_out_accuracy_before=curve[0][1], held_out_accuracy_after=curve[-1][1],
                      accuracy_curve=curve)
    return finish_script(trainer, script_args.dataset_name, result)


def make_parser(prog: str | None = None) -> TrlParser:
    """The script's parser (``prog``: the name its messages start with; default the file's)."""
    parser = TrlParser((MathScriptArguments, TraceRLConfig, ModelConfig), prog=prog,
                       description=__doc__.split("\n\n")[0])
    # defaults for the embedded model on the synthetic task; the shipped recipes set the published ones
    parser.set_defaults(
        output_dir="outputs/math", max_steps=60, per_device_train_batch_size=64, num_generations=8,
        max_completion_length=16, block_length=4, denoising_steps=4, remasking_strategy="low_confidence_static",
        learning_rate=1e-4, beta=0.0, logging_steps=5, save_strategy="no", report_to="none", bf16=False,
        seed=0, **checkpointing_off(),
    )
    return parser


if __name__ == "__main__":
    run_script(main, make_parser())
