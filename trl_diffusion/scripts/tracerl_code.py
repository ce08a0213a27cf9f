"""TraceRL on code, rewarded by running each completion's last Python block against the row's tests in the
sandbox (``trl_diffusion.rewards.make_code_reward``).

With no arguments: the embedded tiny SDAR on a synthetic code task, on a CPU in a few minutes. Each row asks for
``a+b`` and its test is ``assert f() == <a+b>``. The tiny model was trained on arithmetic and answers
``\\boxed{579}`` rather than writing code, so this example turns its answer (or that of a model trained from it,
``--model_name_or_path outputs/sft``) into the program ``def f(): return <boxed text>`` (``answer_as_program``);
every completion is then run in the sandbox against the test, and the reward rises as the model learns:

    trl-diffusion code    # or, from a checkout: accelerate launch examples/code.py

A real run (DiffuCoder-style coupled GRPO or TraceRL on a code set with ``tests`` or HumanEval-style
``test`` + ``entry_point`` columns; the model writes the code itself):

    trl-diffusion code --accelerate_config zero2 --config diffucoder_7b_coupled_code \
        --dataset_name <your/code-rl-dataset>

Every TRL / TraceRL config field is a flag and ``--config file.yaml`` is accepted; ``--resume_from_checkpoint true``
resumes from the last checkpoint in ``--output_dir``. A bad argument is one line on stderr, exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Dataset
from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_FORMAT, EMBEDDED_TASK, is_embedded_model
from trl_diffusion.callbacks import save_training_curves
from trl_diffusion.data import extract_boxed, load_training_dataset, make_problems
from trl_diffusion.rewards import SandboxLimits, make_code_reward
from trl_diffusion.scripts.utils import (
    checkpointing_off,
    evaluation_split,
    finish_script,
    load_pretrained,
    resume_checkpoint,
    run_script,
    setting_errors,
)


@dataclass
class CodeScriptArguments(ScriptArguments):
    dataset_name: str | None = field(default=None, metadata={"help": "Hub name or local file with a prompt column and "
                                                             "tests (list of asserts) or test + entry_point. "
                                                             "Default: a synthetic code task."})
    timeout: float = field(default=10.0, metadata={"help": "Sandbox wall-time per completion (seconds)."})
    memory_mb: int = field(default=1024, metadata={"help": "Sandbox memory limit (MiB)."})
    partial_credit: bool = field(default=False, metadata={"help": "Reward the fraction of tests passed."})
    num_eval: int = field(default=64, metadata={"help": "Held-out synthetic tasks evaluated with --eval_strategy "
                                                        "(without --dataset_name)."})

    def __post_init__(self):
        if self.num_eval < 1:
            raise ValueError(f"num_eval must be >= 1 (held-out tasks for --eval_strategy), got {self.num_eval}.")
        # the sandbox's own checks (timeout finite and > 0, memory_mb >= 1) now, not after the model has loaded
        try:
            SandboxLimits(timeout=self.timeout, memory_mb=self.memory_mb)
        except ValueError as exc:  # these flags have the limits' names
            raise ValueError(str(exc).removeprefix("SandboxLimits.")) from None


def synthetic_code_tasks(plain: bool, problems: list) -> Dataset:
    """Arithmetic problems of the embedded model's task (``EMBEDDED_TASK``) as code tasks with one test,
    ``assert f() == a+b``. ``plain``: the embedded model's own prompts (``"What is a+b?\\n"``, ``EMBEDDED_FORMAT``);
    otherwise a chat request for the function."""
    rows = []
    for p in problems:
        request = f"Write a Python function f() that returns {p.a}{p.op}{p.b}, in a ```python``` code block."
        prompt = p.prompt + "\n" if plain else [{"role": "user", "content": request}]
        rows.append({"prompt": prompt, "tests": [f"assert f() == {p.answer}"]})
    return Dataset.from_list(rows)


class AnswerAsProgram:
    """Wraps a code reward for a model that answers ``\\boxed{...}`` instead of writing code: the boxed text becomes
    the program ``def f(): return <text>`` (no box: no program, reward 0), which the sandbox runs as usual."""

    def __init__(self, reward):
        self.reward, self.__name__ = reward, reward.__name__

    def __call__(self, completions, **kwargs):
        programs = []
        for completion in completions:
            answer = extract_boxed(completion if isinstance(completion, str) else completion[-1]["content"])
            programs.append(f"```python\ndef f():\n    return {answer}\n```" if answer else "")
        return self.reward(programs, **kwargs)


def main(script_args: CodeScriptArguments, args: TraceRLConfig, model_args: ModelConfig) -> dict:
    model, tokenizer = load_pretrained(model_args)
    reward = make_code_reward(timeout=script_args.timeout, memory_mb=script_args.memory_mb,
                              partial_credit=script_args.partial_credit)
    held_out = None
    if script_args.dataset_name is None:
        embedded = is_embedded_model(model.config)  # the embedded model, or one trained from it
        plain = embedded and EMBEDDED_FORMAT != "conversational"
        train, test = make_problems(**EMBEDDED_TASK)
        dataset = synthetic_code_tasks(plain, train)
        held_out = synthetic_code_tasks(plain, test[: script_args.num_eval])
        reward = AnswerAsProgram(reward) if embedded else reward
    with setting_errors():  # a dataset that cannot be loaded, a split the file lacks: one line, exit 2
        if script_args.dataset_name is not None:
            dataset = load_training_dataset(script_args.dataset_name, script_args.dataset_config,
                                            script_args.dataset_train_split)
        eval_dataset = evaluation_split(script_args, args, held_out)
    with setting_errors():  # a setting the model's family refuses, a dataset without a prompt: one line, exit 2
        trainer = TraceRLTrainer(model, reward, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                                 processing_class=tokenizer,
                                 peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.resume_from_checkpoint, args.output_dir))
    trainer.save_model(args.output_dir)
    plot = None
    if trainer.is_world_process_zero():  # one process writes the figure
        plot = save_training_curves(trainer.state.log_history, f"{args.output_dir}/training_curves.png",
                                    ["reward", "rollout/tokens_per_step", "completions/mean_length"],
                                    title="TraceRL on code")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {"output_dir": args.output_dir, "training_curves": str(plot) if plot else None,
              "reward_first": rewards[0] if rewards else None, "reward_last": rewards[-1] if rewards else None,
              "reward_curve": rewards}
    return finish_script(trainer, script_args.dataset_name, result)


def make_parser(prog: str | None = None) -> TrlParser:
    """The script's parser (``prog``: the name its messages start with; default the file's)."""
    parser = TrlParser((CodeScriptArguments, TraceRLConfig, ModelConfig), prog=prog,
                       description=__doc__.split("\n\n")[0])
    # defaults for the embedded model on the synthetic task; the shipped recipes set the published ones
    parser.set_defaults(output_dir="outputs/code", max_steps=40, per_device_train_batch_size=64, num_generations=8,
                        max_completion_length=16, block_length=4, denoising_steps=4,
                        remasking_strategy="low_confidence_static", learning_rate=1e-4, beta=0.0, logging_steps=5,
                        save_strategy="no", report_to="none", bf16=False, seed=0,
                        **checkpointing_off())
    return parser


if __name__ == "__main__":
    run_script(main, make_parser())
