"""The ``trl-diffusion`` command: ``trl-diffusion <command> [--flags]``. Each command parses its own flags with
``TrlParser`` (so ``--config file.yaml`` works too; :mod:`trl_diffusion.command_line` makes its errors one
line) and returns an exit status. ``sft``, ``math`` and ``code`` run the training scripts of
:mod:`trl_diffusion.scripts` through ``accelerate launch``."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys
from collections.abc import Callable, Sequence

from .command_line import (
    check_config_values,
    clear_help,
    config_flag,
    explain_unknown_flags,
    one_line,
    one_line_errors,
)
from .launching import leave_launch
from .scripts.utils import TRAINING_SCRIPTS, check_recipe_command, parse_script_args, run_script

USAGE = ("usage: trl-diffusion <command> [options]   (trl-diffusion <command> --help for its options; "
         "trl-diffusion --version)")


def _eval(argv: list[str]) -> int:
    """Evaluate a model on a benchmark (MATH-500, GSM8K, AIME 2024, code sets, local files, arithmetic)."""
    from trl import TrlParser

    from .eval import EvalConfig, evaluate
    from .eval.evaluate import check_before_loading
    from .eval.processes import check_launch_device
    from .launching import launch, launch_options, launch_request, launched_processes

    parser = one_line_errors(check_config_values(clear_help(TrlParser(
        dataclass_types=[EvalConfig], prog="trl-diffusion eval",
        description="Evaluate a diffusion language model on a benchmark, a local file or the synthetic task "
                    "(docs/evaluation.md in the repository and the source distribution explains each option). It "
                    "runs in this process; given options of accelerate launch (--num_processes N, --config_file "
                    "FILE, ...) it runs on their processes, each evaluating its share of the samples.",
        epilog="--config FILE reads the options from a YAML file (its keys are the options' names); options on the "
               "command line override it."))))
    also = list(launch_options())  # unknown flags are named with the closest of these too
    try:
        launch_args, argv = launch_request(parser, argv)
        check_eval_launch(launch_args)
        if launch_args:  # checked here first (an EvalConfig takes no device): a mistake is one line, not N
            (config,) = parser.parse_args_and_config(args=config_flag(argv))
            check_launch_device(config.device, launched_processes(launch_args))
            check_before_loading(config)
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {explain_unknown_flags(parser, one_line(exc), also)}", file=sys.stderr)
        return 2
    if launch_args:
        return launch(parser.prog, [*launch_args, "--module", "trl_diffusion.cli", "eval", *argv])
    try:
        (config,) = parser.parse_args_and_config(args=config_flag(argv))  # a training recipe is no eval config
        report = evaluate(config)
    except (OSError, ValueError) as exc:  # FileNotFoundError is an OSError
        print(f"{parser.prog}: error: {explain_unknown_flags(parser, one_line(exc), also)}", file=sys.stderr)
        leave_launch(wait=False)  # every process raises the errors raised after the launch began: none is waiting
        return 2
    leave_launch(wait=True)
    if int(os.environ.get("RANK") or 0) == 0:  # under a launch every process has the report: print it once
        print(json.dumps(report, indent=2))
    return 0


EVAL_LAUNCH_SETTINGS = {
    "cpu": "the device is eval's own --device (--device cpu)",
    "mixed_precision": "the weights' precision is eval's own --dtype",
    **dict.fromkeys(("use_deepspeed", "use_fsdp", "use_megatron_lm"),
                    "evaluation is data parallel only: each process holds the whole model"),
    **dict.fromkeys(("dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
                     "dynamo_use_regional_compilation"),
                    "evaluation compiles nothing (accelerate compiles a model it prepares, and eval prepares none); "
                    "on CUDA the decoding steps replay as CUDA graphs, eval's own --cuda_graphs"),
}
"""Options of ``accelerate launch`` that an evaluation would not follow, with what to do instead."""


def check_eval_launch(launch_args: Sequence[str]) -> None:
    """Refuse a launch option of :data:`EVAL_LAUNCH_SETTINGS` for ``trl-diffusion eval`` (``--dynamo_backend no``
    aside), and an accelerate config file (``--config_file``, ``--accelerate_config``) that asks for the CPU,
    DeepSpeed, FSDP, Megatron or a dynamo backend: eval takes
    the processes from the launch, and its device, dtype and model from its own flags (``--cpu`` would still
    evaluate on the GPU). A config's ``mixed_precision`` is left alone: TRL's ``multi_gpu`` sets bf16, and the
    weights' precision is ``--dtype`` either way."""
    from accelerate.commands.config.config_args import load_config_from_file

    for index, token in enumerate(launch_args):
        option = token.split("=", 1)[0]
        name = option.lstrip("-").replace("-", "_")
        value = token.split("=", 1)[1] if "=" in token else (launch_args[index + 1:] or [""])[0]
        if name == "dynamo_backend" and value.lower() == "no":  # accelerate's "no compilation": nothing to refuse
            continue
        if name in EVAL_LAUNCH_SETTINGS:
            raise ValueError(f"{option} is not an evaluation setting: {EVAL_LAUNCH_SETTINGS[name]}.")
        if name == "config_file":  # read as accelerate launch reads it
            path = token.split("=", 1)[1] if "=" in token else launch_args[index + 1]
            settings = load_config_from_file(path)
            if settings.use_cpu:
                raise ValueError(f"{path} sets use_cpu, which is not an evaluation setting: "
                                 f"{EVAL_LAUNCH_SETTINGS['cpu']}.")
            backend = str((settings.dynamo_config or {}).get("dynamo_backend", "NO"))
            if backend.upper() != "NO":
                raise ValueError(f"{path} sets dynamo_backend {backend}, which is not an evaluation setting: "
                                 f"{EVAL_LAUNCH_SETTINGS['dynamo_backend']}.")
            kind = str(getattr(settings.distributed_type, "value", settings.distributed_type))
            if kind in ("DEEPSPEED", "FSDP", "MEGATRON_LM"):
                raise ValueError(f"{path} asks for {kind}, which is not an evaluation setting: "
                                 f"{EVAL_LAUNCH_SETTINGS['use_deepspeed']} (a multi_gpu config is).")


def _env(argv: list[str]) -> int:
    """Print the versions and devices to paste into a bug report (TRL's `trl env`, plus this package's)."""
    prog = "trl-diffusion env"
    if argv in (["-h"], ["--help"]):
        print(f"usage: {prog}\n\n{_env.__doc__}")
        return 0
    if argv:
        print(f"{prog}: error: takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    from trl.scripts.env import print_env

    with contextlib.redirect_stdout(io.StringIO()) as trl_report:
        print_env()
    lines = [f"- {name}: {value}" for name, value in diffusion_environment().items()]
    print("\n".join([trl_report.getvalue().rstrip(), *lines]))
    return 0


def diffusion_environment() -> dict[str, str]:
    """What ``trl-diffusion env`` adds to TRL's report: this package's version, the optional packages it reads, and
    which attention kernel ``attention_backend="auto"`` runs here for a model with head_dim 128 in bfloat16 (the
    released SDAR / TraDo shape) and for the embedded model (head_dim 32, float32)."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from . import __version__
    from .states import AttentionFacts, flex_attention_problem, resolve_attention_backend

    def installed(package: str) -> str:
        try:
            return version(package)
        except PackageNotFoundError:
            return "not installed"

    device = "cuda" if torch.cuda.is_available() else "cpu"
    report = {"trl_diffusion version": __version__}
    report |= {f"{package} version": installed(package) for package in ("math-verify", "flash-attn", "kernels")}
    for label, head_dim, dtype in (("head_dim 128, bfloat16", 128, torch.bfloat16),
                                   ("embedded model: head_dim 32, float32", 32, torch.float32)):
        backend = resolve_attention_backend("auto", device, head_dim, dtype, training=True)
        reason, _ = flex_attention_problem(AttentionFacts(device, head_dim, dtype))
        report[f"attention_backend='auto' on {device} ({label})"] = backend if reason is None else \
            f"{backend} ({reason})"
    return report


def train(name: str, argv: list[str]) -> int:
    """Run the training script of command ``name`` (:data:`TRAINING_SCRIPTS`; what ``examples/<name>.py`` runs).

    In a process that a launch started (:func:`trl_diffusion.launching.launched`: ``accelerate launch -m
    trl_diffusion.cli <name>``, ``torchrun``, or this command's own launch) it runs here. Otherwise it goes through
    ``accelerate launch``, as TRL's ``trl sft`` does, so that the machine's accelerate config applies (every GPU, as
    ``accelerate launch examples/<name>.py``): the options ``accelerate launch`` has and the script lacks
    (``--num_processes``, ``--config_file``, ``--accelerate_config``, ...) go to it, every other argument to the
    script. What of the script's arguments can be checked before the launch is checked here (:func:`parse_script_args`
    with ``launching``), so such a mistake is one line, once, not one per process; the run exits with its status."""
    from .launching import launch, launch_request, launched

    module = importlib.import_module(f"trl_diffusion.scripts.{TRAINING_SCRIPTS[name]}")
    prog = f"trl-diffusion {name}"
    parser = module.make_parser(prog)
    try:
        launch_args, script_args = launch_request(parser, argv)
        check_recipe_command(name, script_args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if launched():
        run_script(module.main, parser, script_args)
        return 0
    parser.epilog = ("Options of accelerate launch (--num_processes, --config_file FILE, --accelerate_config "
                     "NAME|FILE, --mixed_precision, ...) go to accelerate launch, which runs the script.")
    parse_script_args(parser, script_args, launching=True)  # -h prints the help; a mistake: one line, exit 2
    return launch(prog, [*launch_args, "--module", "trl_diffusion.cli", name, *script_args])


def _sft(argv: list[str]) -> int:
    """Diffusion SFT on a dataset or the synthetic task, through accelerate launch."""
    return train("sft", argv)


def _math(argv: list[str]) -> int:
    """TraceRL on a math dataset or the synthetic task, through accelerate launch."""
    return train("math", argv)


def _code(argv: list[str]) -> int:
    """TraceRL on code rewarded by sandboxed tests, through accelerate launch."""
    return train("code", argv)


def _recipes(argv: list[str]) -> int:
    """List the shipped recipes: the published configs, each run with --config <name>."""
    from .recipes import RECIPES_DIR, recipe_command, recipe_names, recipe_summary

    prog = "trl-diffusion recipes"
    if argv in (["-h"], ["--help"]):
        print(f"usage: {prog}\n\n{_recipes.__doc__} Each file's header says how to launch it and where it "
              "deviates from the official run.")
        return 0
    if argv:
        print(f"{prog}: error: takes no arguments, got {' '.join(argv)}", file=sys.stderr)
        return 2
    names = recipe_names()
    width = max(map(len, names))
    lines = [f"{name:<{width}}  trl-diffusion {recipe_command(name):<4}  {recipe_summary(name)}" for name in names]
    print("\n".join([*lines, "", f"Run one with the command beside it: trl-diffusion <command> --config <name>. The "
                     f"files are in {RECIPES_DIR}; each header says how to launch it and where it deviates."]))
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"sft": _sft, "math": _math, "code": _code, "eval": _eval,
                                                   "recipes": _recipes, "env": _env}
"""Subcommands."""


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``trl-diffusion`` console script."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        commands = "\n".join(f"  {name:<10}{(fn.__doc__ or '').strip()}" for name, fn in COMMANDS.items())
        print(f"{USAGE}\n\ncommands:\n{commands}", file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] == "--version":
        from . import __version__

        print(f"trl-diffusion {__version__}")
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"trl-diffusion: unknown command {args[0]!r}; choose one of {sorted(COMMANDS)}.\n{USAGE}",
              file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":
    sys.exit(main())
