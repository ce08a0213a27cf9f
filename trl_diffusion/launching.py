"""How ``trl-diffusion sft|math|code`` (and ``eval`` given launch options) start their script through ``accelerate
launch``, as TRL's ``trl sft`` does: which arguments go to the launcher and which to the script, whether this process
is already one a launch started, and the launch itself with the run's exit status; and how a launched process leaves
its process group at the end (:func:`leave_launch`, :func:`pause_for_gloo_workers`)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

LAUNCHED = "TRL_DIFFUSION_LAUNCHED"
"""Set by :func:`launch` for the processes it starts, which run the command in place (never launch again)."""

LAUNCH_MARKERS = ((LAUNCHED,), ("LOCAL_RANK", "WORLD_SIZE"),
                  ("ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND"))
"""The environment of a process a launch started: :func:`launch`'s, ``torchrun``'s (and accelerate's processes
under it), and what ``accelerate launch`` of one process sets for it, all three (a user may export one of them, such
as ``ACCELERATE_USE_CPU`` to keep accelerate on the CPU, which is no launch)."""

ACCELERATE_CONFIG = ("--accelerate_config", "--accelerate-config")
"""TRL's launcher option: ``--accelerate_config NAME|FILE``, a config file or the name of one TRL ships (``zero3``,
``fsdp2``, ...), given to ``accelerate launch`` as its ``--config_file``."""

NOT_LAUNCH_OPTIONS = ("-m", "--module", "--no_python", "--no-python")
"""``accelerate launch`` options a training command refuses: it launches its own script as a module."""


def launched() -> str | None:
    """The variables of :data:`LAUNCH_MARKERS` that say a launch started this process (``"LOCAL_RANK and
    WORLD_SIZE"``), None when no set of them is."""
    for names in LAUNCH_MARKERS:
        if all(name in os.environ for name in names):
            return " and ".join(names) if len(names) < 3 else f"{', '.join(names[:-1])} and {names[-1]}"
    return None


def launch_options() -> dict[str, bool]:
    """Every option ``accelerate launch`` takes (both spellings) and :data:`ACCELERATE_CONFIG`, each with whether it
    takes a value."""
    from accelerate.commands.launch import launch_command_parser

    options = {option: action.nargs != 0 for action in launch_command_parser()._actions
               for option in action.option_strings}
    return options | dict.fromkeys(ACCELERATE_CONFIG, True)


def split_launch_args(parser: Any, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """``argv`` as ``(launch_args, script_args)``: each option of ``accelerate launch`` that the script's ``parser``
    does not have (and :data:`ACCELERATE_CONFIG`), with its value, in the first, ``--accelerate_config`` written as
    ``--config_file`` (:func:`accelerate_config_file`); everything else, in order, in the second, so that an unknown
    option is reported by the script's parser. The two options both have (``--gradient_accumulation_steps`` and
    ``--debug``) are the script's. Raises ``ValueError`` for :data:`NOT_LAUNCH_OPTIONS` and a launch option without
    its value."""
    script_options = {option for action in parser._actions for option in action.option_strings} | {"--config"}
    takes_value = launch_options()
    launch_args: list[str] = []
    script_args: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        option, has_value = token.split("=", 1)[0], "=" in token
        index += 1
        if option in NOT_LAUNCH_OPTIONS:
            raise ValueError(f"{option} is not an option here: the command launches its own script.")
        if option not in takes_value or option in script_options:
            script_args.append(token)
            continue
        launch_args.append(token)
        if takes_value[option] and not has_value:
            if index == len(argv) or argv[index].startswith("--"):
                raise ValueError(f"{option} (an accelerate launch option) needs a value.")
            launch_args.append(argv[index])
            index += 1
    return accelerate_config_file(launch_args), script_args


def launched_processes(launch_args: Sequence[str]) -> int | None:
    """The ``--num_processes`` (or ``--num-processes``) of ``launch_args``, None when the launch's config decides."""
    for index, token in enumerate(launch_args):
        option, equals, value = token.partition("=")
        if option in ("--num_processes", "--num-processes"):
            return int(value if equals else launch_args[index + 1])
    return None


def launch_request(parser: Any, argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """:func:`split_launch_args`, refusing launch options in a process a launch started (:func:`launched`): they
    would be ignored there."""
    launch_args, script_args = split_launch_args(parser, argv)
    where = launched()
    if where and launch_args:
        raise ValueError(f"{launch_args[0]} is an option of accelerate launch, but this process was started by a "
                         f"launch already ({where} in its environment): give it to that launch.")
    return launch_args, script_args


def accelerate_config_file(launch_args: list[str]) -> list[str]:
    """``launch_args`` with ``--accelerate_config NAME|FILE`` as ``--config_file FILE`` (TRL's resolution: a file,
    else a config TRL ships). ``ValueError`` when it is neither (TRL's message), given twice, or given with
    ``--config_file``, which would win over it without a word."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    args = []
    for token in launch_args:  # one spelling, two tokens: what TRL's function reads
        option, equals, value = token.partition("=")
        if option in ACCELERATE_CONFIG:
            args += [ACCELERATE_CONFIG[0], *([value] if equals else [])]
        else:
            args.append(token)
    given = args.count(ACCELERATE_CONFIG[0])
    if given > 1:
        raise ValueError("--accelerate_config is given twice: give one config.")
    config_files = [arg for arg in args if arg.split("=", 1)[0] in ("--config_file", "--config-file")]
    if given and config_files:
        raise ValueError("--accelerate_config and --config_file both name the accelerate config: give one.")
    return resolve_accelerate_config_argument(args)


def launch(prog: str, argv: list[str]) -> int:
    """``accelerate launch <argv>`` from this process (accelerate starts the run's processes, with :data:`LAUNCHED`
    set); returns the exit status: 0, or that of the run's failed process (its error is already on stderr; of
    several, the first to fail by itself, not one ``torchrun`` then stopped), 128 + the signal for one killed by a
    signal. A launch setting accelerate refuses before starting anything (a missing ``--config_file``, ``--cpu`` with
    ``--multi_gpu``, DeepSpeed not installed) is one line, exit status 2, as an invalid option value is."""
    import subprocess

    from accelerate.commands.launch import launch_command, launch_command_parser
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from .command_line import one_line, one_line_errors

    launch_parser = launch_command_parser()
    launch_parser.prog = prog
    args = one_line_errors(launch_parser).parse_args(argv)
    args.quiet = False  # quiet makes accelerate exit 1 for any failed run; the run's status is reported either way
    try:
        check_processes_start(args)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    previous = os.environ.get(LAUNCHED)
    os.environ[LAUNCHED] = "1"
    try:
        launch_command(args)
    except subprocess.CalledProcessError as exc:  # one process
        return exc.returncode if exc.returncode > 0 else 128 - exc.returncode
    except ChildFailedError as exc:  # torchrun's processes
        rank, failure = min(exc.failures.items(), key=lambda item: (item[1].exitcode <= 0, item[1].timestamp))
        print(f"{prog}: error: process {rank} of the launch exited with status {failure.exitcode} (its error is "
              "above).", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except (ValueError, OSError, ImportError) as exc:  # accelerate's checks of its settings, before any process
        print(f"{prog}: error: accelerate launch: {one_line(exc)}", file=sys.stderr)
        return 2
    finally:
        if previous is None:
            del os.environ[LAUNCHED]
        else:
            os.environ[LAUNCHED] = previous
    return 0


def check_processes_start(args: Any) -> None:
    """Refuse ``--num_processes N`` (N > 1) that ``accelerate launch`` (its parsed ``args``) would run as one
    process: without ``--multi_gpu`` (or DeepSpeed, FSDP, Megatron, TPU, several machines, an MPI hostfile), an
    accelerate config file (given, or the machine's from ``accelerate config``) and two accelerators (with which it
    turns multi-GPU on itself), it starts a single process, which then runs alone on all the data, and says nothing
    of the others."""
    distributed = (args.multi_gpu, args.use_deepspeed, args.use_fsdp, args.use_megatron_lm, args.tpu,
                   (args.num_machines or 1) > 1, args.config_file, args.mpirun_hostfile)
    if (args.num_processes or 1) < 2 or any(distributed):
        return
    import torch
    from accelerate.commands.config import default_config_file

    if os.path.isfile(default_config_file) or torch.accelerator.device_count() > 1:
        return
    remedy = ("drop --cpu (which accelerate does not combine with --multi_gpu) and add --multi_gpu; a training "
              "script's --use_cpu true keeps the processes on the CPU, joined over gloo" if args.cpu else
              "add --multi_gpu (on a CPU, where the processes join over gloo, a training script also needs --use_cpu "
              "true) or --config_file FILE")
    raise ValueError(f"--num_processes {args.num_processes}: accelerate launch starts one process here (no "
                     f"--multi_gpu, no accelerate config, fewer than two GPUs); {remedy}.")


GLOO_EXIT_PAUSE_SECONDS = 0.1


def pause_for_gloo_workers() -> None:
    """Sleep briefly (releasing the GIL) before leaving a process group, so that gloo's worker threads finish letting
    go of their last collective's tensors. torch 2.6 joins those threads while holding the GIL, and a thread that
    still holds the last reference to a tensor made in Python needs the GIL to free it: the process never exits.
    Measured with two processes on two busy CPU cores (broadcasts, a barrier, then ``destroy_process_group``): with
    torch 2.6, 4 and 2 of 20 runs hung (two measurements), none of 20 (twice) with this pause; with torch 2.13, none
    of 16 without it (``scripts/gloo_exit_check.py``)."""
    time.sleep(GLOO_EXIT_PAUSE_SECONDS)


def leave_launch(wait: bool) -> None:
    """Leave the process group an evaluation under ``accelerate launch`` / ``torchrun`` joined (nothing happens
    without one): after the other processes (``wait``), then together, as
    :func:`trl_diffusion.scripts.utils.leave_process_group` does for training (a process exiting with gloo's threads up
    can abort). Call it at the end of your own script that runs :func:`trl_diffusion.eval.evaluate` under a launch."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait:
        dist.barrier()
    pause_for_gloo_workers()
    dist.destroy_process_group()
