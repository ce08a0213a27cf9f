"""Diffusion SFT.

With no arguments: continues training the embedded tiny SDAR on the synthetic arithmetic task (CPU, a few
minutes) and prints held-out greedy accuracy before and after:

    trl-diffusion sft    # or, from a checkout: accelerate launch examples/sft.py

A real run (long-CoT SFT of SDAR/TraDo; `trl-diffusion recipes` lists the recipes):

    trl-diffusion sft --accelerate_config zero3 --config sdar_4b_long_cot_sft --dataset_name <your/dataset>

Every TRL SFTConfig / DiffusionSFTConfig field is a flag (``--diffusion_objective``, ``--loss_weighting``,
``--pad_to_length_with_eos``, ``--assistant_only_loss``, ...); ``--config file.yaml`` is accepted. Training curves are
saved as ``<output_dir>/training_curves.png``. ``--resume_from_checkpoint true`` resumes from the last checkpoint in
``--output_dir``. A bad argument (a mistyped model path, an invalid config value) is one line on stderr, exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.assets import EMBEDDED_CHAT_TEMPLATE, EMBEDDED_FORMAT, EMBEDDED_TASK
from trl_diffusion.callbacks import HeldOutAccuracyCallback, held_out_curve, save_training_curves
from trl_diffusion.data import load_training_dataset, make_problems, to_dataset
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
class SFTScriptArguments(ScriptArguments):
    dataset_name: str | None = field(default=None, metadata={"help": "Hub name or local file of an SFT dataset in a "
                                                             "TRL format. Default: the synthetic arithmetic task."})
    num_eval: int = field(default=200, metadata={"help": "Held-out synthetic problems for the before/after accuracy."})
    eval_every: int = field(default=100, metadata={"help": "Held-out accuracy every this many steps (synthetic)."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Train on the first this many examples only (>= 1; default: all), as transformers' examples do: a "
                "quick try skips preparing the whole set (the synthetic task's 12,000 problems take about 15 s on "
                "two CPU cores)."})

    def __post_init__(self):
        if self.num_eval < 1:
            raise ValueError(f"num_eval must be >= 1 (held-out problems measured before and after), got "
                             f"{self.num_eval}.")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"max_train_samples must be >= 1 (or unset), got {self.max_train_samples}.")


def main(script_args: SFTScriptArguments, args: DiffusionSFTConfig, model_args: ModelConfig) -> dict:
    model, tokenizer = load_pretrained(model_args)
    callbacks, held_out = [], None
    if script_args.dataset_name is None:
        train, test = make_problems(**EMBEDDED_TASK)
        problems = test[: script_args.num_eval]
        dataset, held_out = to_dataset(train, EMBEDDED_FORMAT), to_dataset(problems, EMBEDDED_FORMAT)
        callbacks.append(HeldOutAccuracyCallback(model, tokenizer, problems, script_args.eval_every,
                                                 chat_template=EMBEDDED_CHAT_TEMPLATE))
    with setting_errors():  # a dataset that cannot be loaded, a split the file lacks: one line, exit 2
        if script_args.dataset_name is not None:
            dataset = load_training_dataset(script_args.dataset_name, script_args.dataset_config,
                                            script_args.dataset_train_split)
        eval_dataset = evaluation_split(script_args, args, held_out)
    if script_args.max_train_samples is not None:
        dataset = dataset.select(range(min(script_args.max_train_samples, len(dataset))))
    with setting_errors():  # a setting the model's family refuses (block_size on LLaDA / Dream, ...): one line, exit 2
        trainer = DiffusionSFTTrainer(model, args=args, train_dataset=dataset, eval_dataset=eval_dataset,
                                      processing_class=tokenizer,
                                      callbacks=callbacks, peft_config=get_peft_config(model_args))
    trainer.train(resume_from_checkpoint=resume_checkpoint(args.resume_from_checkpoint, args.output_dir))
    trainer.save_model(args.output_dir)
    plot = None
    if trainer.is_world_process_zero():  # one process writes the figure
        plot = save_training_curves(trainer.state.log_history, f"{args.output_dir}/training_curves.png",
                                    ["loss", "mean_token_accuracy", "eval/held_out_accuracy"],
                                    title=f"Diffusion SFT ({trainer.objective})")
    result = {"output_dir": args.output_dir, "training_curves": str(plot) if plot else None}
    if callbacks:
        curve = held_out_curve(trainer.state.log_history)  # the whole run's, across a resume
        result.update(held_out_accuracy_before=curve[0][1], held_out_accuracy_after=curve[-1][1])
    return finish_script(trainer, script_args.dataset_name, result)


def make_parser(prog: str | None = None) -> TrlParser:
    """The script's parser (``prog``: the name its messages start with; default the file's)."""
    parser = TrlParser((SFTScriptArguments, DiffusionSFTConfig, ModelConfig), prog=prog,
                       description=__doc__.split("\n\n")[0])
    parser.set_defaults(output_dir="outputs/sft", max_steps=200, per_device_train_batch_size=32, learning_rate=5e-4,
                        max_grad_norm=1.0, lr_scheduler_type="constant", logging_steps=20, save_strategy="no",
                        report_to="none", bf16=False, max_length=64, seed=0, **checkpointing_off())
    return parser


if __name__ == "__main__":
    run_script(main, make_parser())
