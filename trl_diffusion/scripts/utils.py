"""What the training scripts (:mod:`trl_diffusion.scripts`) share: their arguments checked before anything loads
(:func:`parse_script_args`, :func:`check_script_args`), the model and evaluation split they load, their run
(:func:`run_script`: a bad setting is one line, exit status 2) and their end (:func:`finish_script`)."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import gc
import importlib
import inspect
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..command_line import (
    UNUSED_ARGUMENTS,
    UsageError,
    check_config_values,
    clear_help,
    command_line_options,
    config_flag,
    explain_unknown_flags,
    one_line,
    one_line_errors,
)
from ..launching import launch_options, pause_for_gloo_workers


def resume_checkpoint(value: str | bool | None, output_dir: str | None) -> str | bool | None:
    """``resume_from_checkpoint`` as ``Trainer.train`` takes it. transformers' convention: ``true`` means the last
    ``checkpoint-*`` in ``output_dir``, ``false`` / empty means none; anything else is a checkpoint directory.
    Raises :class:`UsageError` when there is nothing to resume from."""
    if value is None or isinstance(value, bool):
        text = "true" if value else ""
    else:
        text = str(value).strip()
    if text.lower() in ("", "false", "no", "none", "0"):
        return None
    if text.lower() in ("true", "yes", "1"):
        from transformers.trainer_utils import get_last_checkpoint

        output_dir = os.path.expanduser(output_dir) if output_dir else output_dir  # as TrainingArguments expands it

        if not output_dir or not os.path.isdir(output_dir) or get_last_checkpoint(output_dir) is None:
            raise UsageError(f"resume_from_checkpoint=true but output_dir {output_dir!r} holds no checkpoint-* "
                             "folder to resume from.")
        return True
    if not os.path.isdir(text):
        raise UsageError(f"resume_from_checkpoint: no such checkpoint directory: {text}")
    return text


EVAL_ONLY_NAMES = ("math500", "aime2024", "humaneval", "arithmetic")
"""``trl-diffusion eval``'s short names that are no Hub dataset id and have no training split; given to an example
script as ``dataset_name`` they are an error. (``gsm8k`` and ``mbpp`` are also Hub ids with a train split.)"""


UNUSED_MODEL_FLAGS = {
    "trust_remote_code": "import trl_diffusion registers SDAR, LLaDA and Dream with the Auto classes.",
    "attn_implementation": "attention kernels follow attention_backend (training) and the masks the sampler builds.",
    "load_in_4bit": "quantized loading is not supported.",
    "load_in_8bit": "quantized loading is not supported.",
    "dataset_streaming": "the examples load the whole dataset (a local file or a Hub split); streaming is not "
                         "supported.",
    "ignore_bias_buffers": "the examples do not set DDP's ignored buffers (TRL applies it in its DPO script only).",
}
"""TRL flags (``ModelConfig``, ``ScriptArguments``, ``GRPOConfig`` / ``SFTConfig``) the example scripts do not
apply: setting one is an error rather than silently ignored."""


def checkpointing_off() -> dict[str, Any]:
    """An example script's default of no activation checkpointing (TRL's configs turn it on), for
    ``parser.set_defaults(**checkpointing_off())``. Where transformers has ``activation_checkpointing`` (5.23, which
    warns with a FutureWarning whenever the old name ``gradient_checkpointing`` is set) it leaves
    ``gradient_checkpointing`` unset (None), which with both names unset is off; before, it is ``False``. Not
    ``activation_checkpointing=False``: transformers reads the old name only while the new one is unset, so a
    ``--gradient_checkpointing true`` on the command line or in a recipe would then be ignored.

    Also ``ddp_find_unused_parameters=False``: without checkpointing transformers defaults DDP to searching the
    autograd graph for unused parameters at every step, and warns on every process that it found none. Every
    parameter of these models takes part in a training forward (mixture-of-experts layers run every expert while
    gradients are recorded), as transformers assumes with checkpointing on."""
    from transformers import TrainingArguments

    renamed = "activation_checkpointing" in {item.name for item in dataclasses.fields(TrainingArguments)}
    return {"gradient_checkpointing": None if renamed else False, "ddp_find_unused_parameters": False}


def find_reward(name: str) -> Callable[..., Any]:
    """The reward function ``name``: one of :data:`trl_diffusion.rewards.REWARD_FUNCTIONS`, or ``module.function``
    (a dotted path, imported; not a class, which TRL would call with the completions to build one). Raises
    :class:`UsageError` naming it when there is no such function."""

    from .. import rewards

    module_name, _, attribute = name.rpartition(".")
    if module_name in ("", "trl_diffusion.rewards"):  # ours: the ready ones only
        if attribute not in rewards.REWARD_FUNCTIONS:
            close = difflib.get_close_matches(attribute, rewards.REWARD_FUNCTIONS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            factory = " (a class or factory: build the reward in Python)" if callable(
                getattr(rewards, attribute, None)) else ""
            raise UsageError(f"reward_funcs: no reward function {attribute!r} in trl_diffusion.rewards{factory}"
                             f"{hint}; give one of {', '.join(rewards.REWARD_FUNCTIONS)} or a dotted path "
                             "module.function.")
        return getattr(rewards, attribute)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"reward_funcs: cannot import {module_name!r} for the reward {name!r}: {exc}") from None
    func = getattr(module, attribute, None)
    if not callable(func) or isinstance(func, type):
        close = difflib.get_close_matches(attribute, [n for n in dir(module) if not n.startswith("_")], n=1)
        hint = f" (did you mean {close[0]}?)" if close and close[0] != attribute else ""
        what = (f"{name} is a class, not a reward function" if isinstance(func, type)
                else f"no reward function {attribute!r} in {module_name}")
        raise UsageError(f"reward_funcs: {what}{hint}; give a function (completions, **columns) -> rewards, or an "
                         "instance of a reward class.")
    return func


def load_pretrained(model_args: Any) -> tuple[Any, Any]:
    """``(model, tokenizer)`` as the example scripts train them, from TRL's ``ModelConfig``: ``model_name_or_path``
    (the embedded model when empty) at ``model_revision``, in ``dtype`` (``ModelConfig``'s default float32 keeps
    float32 weights under bf16 mixed precision, as TRL's own scripts do; ``auto`` keeps the checkpoint's). A PEFT
    adapter folder or repo is loaded as its base model with the adapter merged in (a :class:`UsageError` with
    ``use_peft``)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import find_adapter_config_file

    from ..assets import resolve_model_path

    path = resolve_model_path(model_args.model_name_or_path)
    revision = model_args.model_revision
    tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    if not find_adapter_config_file(path, revision=revision):
        return AutoModelForCausalLM.from_pretrained(path, revision=revision, dtype=model_args.dtype), tokenizer
    # A PEFT adapter (what --use_peft saves): its base with the adapter merged in, the model it trained. Loaded as
    # transformers loads it (the adapter attached, not merged), the run could not save it (peft < 0.22).
    if getattr(model_args, "use_peft", False):
        raise UsageError(f"model_name_or_path {path!r} is a PEFT adapter: with --use_peft a new adapter would be "
                         "trained on top of it and saved against a base model it does not fit. Drop --use_peft to "
                         "train the adapter's merged model, or resume the adapter's own run "
                         "(--resume_from_checkpoint).")
    from peft import PeftConfig, PeftModel

    adapter = PeftConfig.from_pretrained(path, revision=revision)
    base = AutoModelForCausalLM.from_pretrained(adapter.base_model_name_or_path, revision=adapter.revision,
                                                dtype=model_args.dtype)
    merged = PeftModel.from_pretrained(base, path, revision=revision).merge_and_unload()
    # peft loads an adapter for inference, freezing every weight, and merging keeps them frozen: the run would train
    # nothing (with activation checkpointing the backward pass even ran, on no parameter)
    return merged.requires_grad_(True), tokenizer


def evaluation_split(script_args: Any, args: Any, held_out: Any = None,
                     load: Callable[[str], Any] | None = None) -> Any:
    """The examples' evaluation set, as TRL's scripts take it: None unless ``args.eval_strategy`` evaluates; then
    ``held_out`` (the synthetic task's held-out problems, without ``dataset_name``) or ``load(dataset_test_split)``
    (default: ``load_training_dataset`` of ``dataset_name`` / ``dataset_config``, as the training split is loaded).
    A local file is one split, ``train``: another split name is a :class:`UsageError` saying how to slice it."""
    from ..data.loading import is_local_file_name, load_training_dataset

    if load is None:
        def load(split: str) -> Any:
            return load_training_dataset(script_args.dataset_name, script_args.dataset_config, split)

    if args.eval_strategy == "no":
        return None
    if script_args.dataset_name is None:
        return held_out
    split = script_args.dataset_test_split
    try:
        return load(split)
    except ValueError as exc:
        if not is_local_file_name(script_args.dataset_name) or "Unknown split" not in str(exc):
            raise
        raise UsageError(f"dataset_test_split={split!r}: the local file {script_args.dataset_name!r} is one split, "
                         "train; with --eval_strategy give each run its slice, e.g. --dataset_train_split "
                         "'train[:90%]' --dataset_test_split 'train[90%:]'.") from None


def check_script_args(parsed: Sequence[Any], command_line: frozenset[str] = frozenset()) -> None:
    """Validate what a script is about to load, before it loads anything: every ``model_name_or_path`` (a path
    that names no directory fails, see :func:`trl_diffusion.assets.resolve_model_path`; so do a directory that holds
    no model, :func:`trl_diffusion.assets.check_model_folder`, and a Hub id missing from the cache while the Hub is
    offline, :func:`trl_diffusion.assets.check_hub_model_cached`), a
    ``dataset_name`` that names a local file (it must exist, without a ``dataset_config``) or is one of
    :data:`EVAL_ONLY_NAMES`, ``reward_funcs`` (a list of names, each a reward function, :func:`find_reward`), no
    flag of ``UNUSED_MODEL_FLAGS``, a ``save_steps`` that would save nothing (:func:`check_save_steps_apply`;
    ``command_line`` names the options given on the command line, :func:`command_line_options`), and every
    ``resume_from_checkpoint`` (rewritten in place to what ``Trainer.train`` takes), a ``value_model`` as a
    ``model_name_or_path``, a ``report_to`` that transformers knows (:func:`check_report_to`) and an ``output_dir``
    that is no file. A single module name in ``lora_target_modules`` (which TRL turns into a string, a pattern for
    peft) is made a one-element list."""
    from ..assets import check_hub_model_cached, check_model_folder, resolve_model_path
    from ..data.loading import check_local_file_type, is_local_file_name

    for args in parsed:
        # the model, and examples/math.py's value model (a saved value model or a policy checkpoint)
        for name, revision in ((getattr(args, "model_name_or_path", None), getattr(args, "model_revision", None)),
                               (getattr(args, "value_model", None), None)):
            if name:
                path = resolve_model_path(name)
                check_model_folder(path)
                check_hub_model_cached(path, revision)
        check_report_to(getattr(args, "report_to", None))
        output_dir = getattr(args, "output_dir", None)
        if output_dir and os.path.isfile(os.path.expanduser(output_dir)):
            raise UsageError(f"output_dir {output_dir!r} is a file, not a folder: give a folder to write the run to.")
        dataset = getattr(args, "dataset_name", None)
        if dataset == "":
            raise UsageError("dataset_name is empty: leave it unset for the synthetic task, or name a Hub dataset "
                             "or a local file.")
        if dataset and is_local_file_name(dataset) and not os.path.isfile(os.path.expanduser(dataset)):
            raise UsageError(f"dataset_name: no such dataset file: {dataset}")
        if dataset:
            try:
                check_local_file_type(dataset)
            except ValueError as exc:
                raise UsageError(f"dataset_name: {exc}") from None
        if dataset and is_local_file_name(dataset) and getattr(args, "dataset_config", None) is not None:
            raise UsageError(f"dataset_config={args.dataset_config!r} was given with the local file {dataset!r}, "
                             "which has no configs: leave --dataset_config unset.")
        if hasattr(args, "dataset_name") and not dataset:
            check_dataset_flags_unset(args)
        if dataset in EVAL_ONLY_NAMES:
            raise UsageError(f"dataset_name {dataset!r} is a benchmark name of `trl-diffusion eval`, not a training "
                             "set: leave --dataset_name unset for the synthetic arithmetic task, or pass a Hub "
                             "dataset id or a local file (the math recipes train on Gen-Verse/MATH_train).")
        if isinstance(getattr(args, "reward_funcs", None), str):
            raise UsageError(f"reward_funcs must be a list of names, got the string {args.reward_funcs!r} (in a "
                             f"config file write reward_funcs: [{args.reward_funcs}]).")
        for name in getattr(args, "reward_funcs", None) or []:
            find_reward(name)
        targets = getattr(args, "lora_target_modules", None)
        if isinstance(targets, str) and re.fullmatch(r"[\w.]+", targets):
            # TRL's ModelConfig passes a single name on as a string, which peft reads as a regular expression for the
            # whole module path ("q_proj" matched nothing: "Target modules q_proj not found"); as a list peft matches
            # it as a name, as it does two names. "all-linear" and patterns (".*q_proj") stay strings.
            args.lora_target_modules = [targets]
        unused = [flag for flag, set_ in UNUSED_MODEL_FLAGS.items() if getattr(args, flag, None) not in (None, False)]
        if unused:
            raise UsageError(f"{', '.join('--' + flag for flag in unused)}: not used by the example scripts; "
                             + " ".join(UNUSED_MODEL_FLAGS[flag] for flag in unused))
        check_save_steps_apply(args, strategy_given="save_strategy" in command_line)
        if hasattr(args, "resume_from_checkpoint"):
            args.resume_from_checkpoint = resume_checkpoint(args.resume_from_checkpoint,
                                                            getattr(args, "output_dir", None))


DATASET_FLAGS = ("dataset_config", "dataset_train_split", "dataset_test_split")
"""TRL's ``ScriptArguments`` fields that select within the ``dataset_name`` dataset."""


def check_dataset_flags_unset(args: Any) -> None:
    """Refuse :data:`DATASET_FLAGS` set to other than their defaults without a ``dataset_name``: the script then
    trains on its synthetic task, which has its own splits, and the flags would be ignored without a word."""
    defaults = {field.name: field.default for field in dataclasses.fields(args)}
    given = [f"--{name} {getattr(args, name)}" for name in DATASET_FLAGS
             if name in defaults and getattr(args, name) != defaults[name]]
    if given:
        these, them = ("these select", "them") if len(given) > 1 else ("it selects", "it")
        raise UsageError(f"{', '.join(given)}: {these} within a dataset (--dataset_name), and without one the script "
                         f"trains on its synthetic task, which has its own splits: leave {them} unset, or name the "
                         "dataset.")


def check_report_to(report_to: Any) -> None:
    """Refuse a ``report_to`` that transformers does not know (its ``Trainer`` refuses it only once the model is
    loaded)."""
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    unknown = [name for name in names if name not in ("all", "none") and name not in INTEGRATION_TO_CALLBACK]
    if unknown:
        raise UsageError(f"report_to: {', '.join(map(repr, unknown))} is not one of {sorted(INTEGRATION_TO_CALLBACK)} "
                         "(or 'all', 'none').")


def check_save_steps_apply(args: Any, strategy_given: bool = False) -> None:
    """Refuse a ``save_steps`` of its own with ``save_strategy="no"`` left at the example's default: the examples
    default to saving nothing (no checkpoints for the tiny model), where transformers defaults to ``"steps"``, so
    ``--save_steps 10`` alone would silently save nothing (and a later ``--resume_from_checkpoint`` find nothing).
    ``strategy_given``: ``--save_strategy`` is on the command line, which overrides a config file's ``save_steps``
    (``--config <recipe> --save_strategy no`` turns the recipe's checkpoints off)."""
    fields = getattr(type(args), "__dataclass_fields__", {})
    if "save_steps" not in fields or getattr(args, "save_strategy", None) != "no" or strategy_given:
        return
    if args.save_steps != fields["save_steps"].default:
        raise UsageError(f"save_steps={args.save_steps:g} saves nothing: save_strategy is 'no' (the examples' "
                         "default; transformers' is 'steps'). Pass --save_strategy steps to save a checkpoint every "
                         f"{args.save_steps:g} steps.")


CONFIG_HELP = ("--config FILE|RECIPE reads the options from a YAML file or a shipped recipe (trl-diffusion recipes "
               "lists them); options on the command line override it.")
"""What a training script's ``--help`` says of ``--config``, which TrlParser reads before argparse sees it."""


def parse_script_args(parser: Any, argv: Sequence[str] | None = None, launching: bool = False) -> tuple[Any, ...]:
    """``parser.parse_args_and_config(argv)`` followed by :func:`check_script_args`; ``--config`` may name a shipped
    recipe (:func:`config_flag`). A ``ValueError`` on the way (a config's validation, a config file value of the
    wrong type, a missing model directory or dataset file, a config file key no dataclass has) exits with status 2
    after printing ``<prog>: error: <message>``; so do argparse's own errors (:func:`one_line_errors`).

    ``launching``: the check a training command makes before it launches the script (``trl-diffusion math``): the
    same, except that the script's TRL config is made without its own checks (:func:`_flags_only`), which depend on
    the launch (GRPO's batch sizes on the number of processes) and take a device, in a process that only waits for
    the run; and each Hub dataset is checked to load (:func:`check_hub_datasets`)."""
    one_line_errors(check_config_values(clear_help(parser)))
    for action in parser._actions:
        if action.dest in UNUSED_MODEL_FLAGS:
            action.help = f"Not used by these scripts (an error when set): {UNUSED_MODEL_FLAGS[action.dest]}"
    if CONFIG_HELP not in (parser.epilog or ""):
        parser.epilog = " ".join(filter(None, [CONFIG_HELP, parser.epilog]))
    if launching:  # TrlParser reads --config (the file's keys and value types too), then calls this
        parser.parse_args_into_dataclasses = functools.partial(_flags_only, parser)
    try:
        args = config_flag(argv, recipes=True)
        parsed = parser.parse_args_and_config(args=args)
        check_script_args(parsed, command_line_options(parser, args))
        if launching:
            check_hub_datasets(parsed)
    except (OSError, ValueError) as exc:  # OSError: a --config file that cannot be read
        also = list(launch_options()) if launching else []
        print(f"{parser.prog}: error: {explain_unknown_flags(parser, one_line(exc), also)}", file=sys.stderr)
        sys.exit(2)
    return parsed


def check_hub_datasets(parsed: Sequence[Any]) -> None:
    """Refuse a Hub ``dataset_name`` (with its ``dataset_config``) that ``datasets`` cannot load
    (:func:`trl_diffusion.data.loading.check_hub_dataset`): the check before a launch, so that a misspelt or
    unreachable dataset is one line, once, not one per process after each loaded the model."""
    from ..data.loading import check_hub_dataset

    for args in parsed:
        if getattr(args, "dataset_name", None):
            check_hub_dataset(args.dataset_name, getattr(args, "dataset_config", None))


def _flags_only(parser: Any, args: Sequence[str], **unused: Any) -> tuple[Any, ...]:
    """``HfArgumentParser.parse_args_into_dataclasses`` for the check before a launch: each dataclass from the command
    line over the parser's defaults (a config file's values among them), unknown arguments refused, as there; but a
    ``TrainingArguments`` (the script's TRL config) is made without its ``__post_init__``, whose checks count the
    launch's processes and which takes a device: its fields as given, for :func:`check_script_args`."""
    from transformers import TrainingArguments

    namespace, unknown = parser.parse_known_args(args=args)
    if unknown:
        raise ValueError(f"{UNUSED_ARGUMENTS}: {unknown}")
    parsed = []
    for dataclass_type in parser.dataclass_types:
        values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(dataclass_type) if f.init}
        if issubclass(dataclass_type, TrainingArguments):
            unchecked = dataclass_type.__new__(dataclass_type)
            vars(unchecked).update(values)
            parsed.append(unchecked)
        else:
            parsed.append(dataclass_type(**values))
    return tuple(parsed)


@contextlib.contextmanager
def setting_errors():
    """Re-raise a ``ValueError`` of the block as :class:`UsageError` (still a ``ValueError``): what an example can
    only check once the model and the data are loaded (a setting the model's family refuses, such as a block size
    for full-attention LLaDA / Dream, a dataset without the columns the script needs) is a bad argument too."""
    try:
        yield
    except UsageError:
        raise
    except ValueError as exc:
        raise UsageError(one_line(exc)) from exc


EMBEDDED_SCALE_FIELDS = ("max_completion_length", "max_length", "learning_rate", "per_device_train_batch_size", "beta",
                         "max_steps", "bf16", "save_strategy")
"""Settings the examples default for the embedded tiny model that a real model needs its own values of (TraceRL's
``beta`` 0: no KL; a short toy run; no bf16 mixed precision, which TRL turns on by default; no checkpoints). Also
named: activation checkpointing off (:func:`checkpointing_off`; TRL's configs turn it on)."""


def example_defaults(parser: Any) -> dict[str, Any]:
    """The parser's defaults of :data:`EMBEDDED_SCALE_FIELDS`, read before parsing (``--config`` turns a config
    file's values into parser defaults)."""
    return {name: parser.get_default(name) for name in EMBEDDED_SCALE_FIELDS}


def _model_name(parsed: Sequence[Any]) -> str | None:
    """The ``model_name_or_path`` of a script's parsed arguments (TRL's ``ModelConfig``), None when unset."""
    return next((p.model_name_or_path for p in parsed if hasattr(p, "model_name_or_path")), None)


def embedded_defaults_in_use(defaults: dict[str, Any], parsed: Sequence[Any],
                             given: frozenset[str] = frozenset()) -> list[str]:
    """``name=value`` for each :data:`EMBEDDED_SCALE_FIELDS` setting still at the example's own default
    (``defaults``, from :func:`example_defaults`: one it sets with ``parser.set_defaults`` for the embedded tiny model,
    not the config class's default) in a run on another model (``model_name_or_path`` set, and neither the
    embedded model nor one trained from it: ``trl_diffusion.assets.is_embedded_model``). Empty for those. ``given``:
    the options the command line or the ``--config`` file sets (:func:`command_line_options`,
    ``parser.config_file_keys``), never named: the user chose that value. Nor is ``bf16`` under a launch's mixed
    precision (``ACCELERATE_MIXED_PRECISION``, which transformers follows) or with ``fp16``."""
    from transformers import TrainingArguments

    from ..assets import is_embedded_model

    model = _model_name(parsed)
    if not model or is_embedded_model(model):
        return []
    if os.environ.get("ACCELERATE_MIXED_PRECISION", "no") != "no" or any(getattr(p, "fp16", False) for p in parsed):
        given = given | {"bf16"}  # mixed precision chosen otherwise
    kept = []
    for settings in parsed:
        fields = {f.name: f for f in getattr(settings, "__dataclass_fields__", {}).values()}
        for name in EMBEDDED_SCALE_FIELDS:
            if name not in fields:
                continue
            example_default, class_default = defaults[name], fields[name].default
            if name not in given and example_default != class_default and getattr(settings, name) == example_default:
                kept.append(f"{name}={example_default}")
        if isinstance(settings, TrainingArguments) and fields["gradient_checkpointing"].default is True:
            checkpointing = getattr(settings, "activation_checkpointing", settings.gradient_checkpointing)
            if not checkpointing and not given & {"gradient_checkpointing", "activation_checkpointing"}:
                kept.append("gradient_checkpointing=False")
    return kept


def synthetic_task_on_other_model(parsed: Sequence[Any]) -> str | None:
    """The model, when a run without ``dataset_name`` (the synthetic arithmetic task, made for the embedded tiny
    model) trains another model than the embedded one (``trl_diffusion.assets.is_embedded_model``): e.g. a recipe run
    without its ``--dataset_name`` would fine-tune a released model on 3-digit arithmetic. None otherwise."""
    from ..assets import is_embedded_model

    model = _model_name(parsed)
    no_dataset = any(hasattr(p, "dataset_name") and p.dataset_name is None for p in parsed)
    return model if model and no_dataset and not is_embedded_model(model) else None


def leave_process_group(trainer: Any) -> None:
    """End a script's distributed run: wait for every process, then leave the process group together (a process
    exiting with gloo's threads still up can abort with "terminate called without an active exception"); nothing
    happens in a single process. Call it last, after everything that needs the other processes.

    The DistributedDataParallel wrappers go first. A DDP reducer holds the process group; freed after
    ``destroy_process_group`` (when the trainer goes), it destroyed the group itself, holding the GIL while joining
    gloo's worker threads, one of which was still releasing a collective's tensors and waited for the GIL: one process
    of a two-process CPU run never exited (seen in CI). Without them, the group is destroyed by torch's own binding,
    which releases the GIL."""
    accelerator = trainer.accelerator
    accelerator.wait_for_everyone()
    trainer.model_wrapped = trainer.model
    if getattr(trainer, "value_model", None) is not None:
        trainer.value_model = accelerator.unwrap_model(trainer.value_model)
    accelerator.free_memory()  # its list of prepared models holds the wrappers too
    gc.collect()
    pause_for_gloo_workers()
    accelerator.end_training()


def finish_script(trainer: Any, dataset_name: str | None, result: dict[str, Any]) -> dict[str, Any]:
    """A training script's last steps, in order: push to the Hub under ``push_to_hub`` (the model card names
    ``dataset_name``), leave the process group (:func:`leave_process_group`: last, after everything that needs the
    other processes), and print ``result`` as one JSON line from the main process only; returns ``result``."""
    if trainer.args.push_to_hub:
        trainer.push_to_hub(dataset_name=dataset_name)
    leave_process_group(trainer)
    if trainer.is_world_process_zero():
        print(json.dumps(result))
    return result


TRAINING_SCRIPTS = {"sft": "sft", "math": "tracerl_math", "code": "tracerl_code"}
"""The training commands' modules in :mod:`trl_diffusion.scripts` (not ``math`` / ``code``: a script run by its path
would have its folder first on the import path, where those names hide the standard library's modules)."""


def check_recipe_command(name: str, argv: Sequence[str]) -> None:
    """Refuse a shipped recipe given to another training command than its own (``trl-diffusion sft --config
    trado_4b_tracerl_math``, or ``examples/sft.py`` given it): its keys failed as unknown ones, or, between ``math``
    and ``code``, it would have run with the other script's data and reward."""
    from ..recipes import RECIPES_DIR, recipe_command

    try:
        args = config_flag(argv, recipes=True)
    except ValueError:  # no file after --config, no such recipe: the script's parsing says so
        return
    if "--config" not in args:
        return
    path = Path(args[args.index("--config") + 1]).resolve()
    if path.parent == RECIPES_DIR and (command := recipe_command(path.stem)) != name:
        raise ValueError(f"--config {path.stem} is a recipe of trl-diffusion {command} (examples/{command}.py), not "
                         f"of trl-diffusion {name}: run trl-diffusion {command} --config {path.stem}.")


def script_command(main: Callable[..., Any]) -> str | None:
    """The training command whose script (in this package) defines ``main``, None for another function. Read from
    the file, not the module name, which is ``__main__`` for a script run by its path or with ``python -m``; through
    ``functools.partial`` and ``functools.wraps`` wrappers; None for what has no source file (a callable object)."""
    try:
        path = Path(inspect.getfile(inspect.unwrap(getattr(main, "func", main)))).resolve()
    except TypeError:
        return None
    if path.parent != Path(__file__).resolve().parent:
        return None
    return next((name for name, module in TRAINING_SCRIPTS.items() if module == path.stem), None)


def run_script(main: Callable[..., Any], parser: Any, argv: Sequence[str] | None = None) -> Any:
    """``main(*parse_script_args(parser, argv))``, with a :class:`UsageError` raised by ``main`` (see
    :func:`setting_errors`) reported as one line ``<prog>: error: <message>``, exit status 2, as a bad flag is.
    A run on another model than the embedded one that keeps the example's tiny-model sizes, or trains on the synthetic
    task (no ``dataset_name``), says so on stderr (main process only): e.g. 16-token completions would cut every
    answer of a real model. A shipped recipe of another command than ``main``'s is refused first
    (:func:`check_recipe_command`), as ``trl-diffusion <command>`` refuses it before its launch."""
    given = sys.argv[1:] if argv is None else argv
    command = script_command(main)
    try:  # trl-diffusion <command> checked this before its launch; examples/<command>.py did not
        if command is not None:
            check_recipe_command(command, given)
    except ValueError as exc:
        print(f"{parser.prog}: error: {exc}", file=sys.stderr)
        sys.exit(2)
    defaults = example_defaults(parser)
    parsed = parse_script_args(parser, argv)
    kept = embedded_defaults_in_use(defaults, parsed, command_line_options(parser, given) | parser.config_file_keys)
    synthetic_model = synthetic_task_on_other_model(parsed)
    if kept and int(os.environ.get("RANK", "0")) == 0:
        verb = "is this example's default" if len(kept) == 1 else "are this example's defaults"
        print(f"{parser.prog}: warning: {', '.join(kept)} {verb} for the embedded tiny model; "
              "a real model needs its own (the shipped recipes set the published ones: --config <name>, names "
              "listed by trl-diffusion recipes).",
              file=sys.stderr)
    if synthetic_model and int(os.environ.get("RANK", "0")) == 0:
        print(f"{parser.prog}: warning: no --dataset_name: {synthetic_model} trains on the synthetic arithmetic task "
              "made for the embedded tiny model; pass --dataset_name (a Hub dataset or a local json/jsonl/parquet "
              "file) to train on your data.", file=sys.stderr)
    try:
        check_one_process_group(parsed)
        return main(*parsed)
    except UsageError as exc:
        print(f"{parser.prog}: error: {one_line(exc)}", file=sys.stderr)
        sys.exit(2)


def check_one_process_group(parsed: Sequence[Any]) -> None:
    """Refuse a launch whose processes would each train alone: the launch started ``WORLD_SIZE`` > 1 processes, but
    the training arguments see one (a GPU config, ``distributed_type: MULTI_GPU``, on a machine without CUDA and
    without ``--use_cpu true``): each would train on all the data, all writing the same ``output_dir``."""
    import torch
    from transformers import TrainingArguments

    if "LOCAL_RANK" not in os.environ:  # not started by torchrun: a WORLD_SIZE exported for something else
        return
    started = int(os.environ.get("WORLD_SIZE") or 1)
    for args in parsed:
        if isinstance(args, TrainingArguments) and started > 1 and args.world_size == 1:
            remedy = ("without CUDA, pass --use_cpu true (the processes then join one group over gloo)"
                      if not torch.cuda.is_available() else "check the launch's distributed settings")
            raise UsageError(f"this launch started {started} processes, but each sees only itself and would train "
                             f"alone, all writing {args.output_dir}: {remedy}.")
