"""The ``trl-diffusion`` command: ``trl-diffusion <command> [--flags]``. Each command parses its own flags with
``TrlParser`` (so ``--config file.yaml`` works too) and returns an exit status.

:func:`parse_script_args` gives the example scripts the same behaviour: a bad argument is one line
``<prog>: error: <what is wrong>`` on stderr and exit status 2, never a traceback (an unknown flag is named with the
closest real one), and the same ``--help`` (:func:`clear_help`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import functools
import gc
import importlib
import io
import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

USAGE = "usage: trl-diffusion <command> [options]   (trl-diffusion <command> --help for its options)"


class UsageError(ValueError):
    """A command-line argument that cannot work; reported as one line, exit status 2."""


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
    import dataclasses

    from transformers import TrainingArguments

    renamed = "activation_checkpointing" in {item.name for item in dataclasses.fields(TrainingArguments)}
    return {"gradient_checkpointing": None if renamed else False, "ddp_find_unused_parameters": False}


def find_reward(name: str) -> Callable[..., Any]:
    """The reward function ``name``: one of :data:`trl_diffusion.rewards.REWARD_FUNCTIONS`, or ``module.function``
    (a dotted path, imported; not a class, which TRL would call with the completions to build one). Raises
    :class:`UsageError` naming it when there is no such function."""
    import importlib

    from . import rewards

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

    from .assets import resolve_model_path

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
    from .data.loading import is_local_file_name, load_training_dataset

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
    that names no directory fails, see :func:`trl_diffusion.assets.resolve_model_path`; so does a Hub id missing
    from the cache while the Hub is offline, :func:`trl_diffusion.assets.check_hub_model_cached`), a
    ``dataset_name`` that names a local file (it must exist, without a ``dataset_config``) or is one of
    :data:`EVAL_ONLY_NAMES`, ``reward_funcs`` (a list of names, each a reward function, :func:`find_reward`), no
    flag of ``UNUSED_MODEL_FLAGS``, a ``save_steps`` that would save nothing (:func:`check_save_steps_apply`;
    ``command_line`` names the options given on the command line, :func:`command_line_options`), and every
    ``resume_from_checkpoint`` (rewritten in place to what ``Trainer.train`` takes), a ``value_model`` as a
    ``model_name_or_path`` and a ``report_to`` that transformers knows (:func:`check_report_to`). A single module
    name in ``lora_target_modules`` (which TRL turns into a string, a pattern for peft) is made a one-element list."""
    from .assets import check_hub_model_cached, resolve_model_path
    from .data.loading import check_local_file_type, is_local_file_name

    for args in parsed:
        if getattr(args, "model_name_or_path", None):
            check_hub_model_cached(resolve_model_path(args.model_name_or_path), getattr(args, "model_revision", None))
        if getattr(args, "value_model", None):  # examples/math.py: a saved value model or a policy checkpoint
            check_hub_model_cached(resolve_model_path(args.value_model))
        check_report_to(getattr(args, "report_to", None))
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


def command_line_options(parser: Any, argv: Sequence[str]) -> frozenset[str]:
    """The options ``argv`` itself sets (by destination name; abbreviations resolved as argparse resolves them), not
    their defaults nor a ``--config`` file's values: ``argv`` parsed into a namespace whose every option is already
    present, which argparse then fills only with what the command line gives."""
    unset = object()
    namespace = argparse.Namespace(**{action.dest: unset for action in parser._actions})
    namespace, _ = argparse.ArgumentParser.parse_known_args(parser, list(argv), namespace=namespace)
    return frozenset(name for name, value in vars(namespace).items() if value is not unset)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``HfArgumentParser``'s formatter, without a ``(default: None)`` after a help that states its own default
    (``default: the embedded tiny model``) and without one on a ``--no_<flag>`` switch, whose stored ``False`` is not
    the field's default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if "default:" in (action.help or "") or isinstance(action, argparse._StoreFalseAction):
            return action.help
        return super()._get_help_string(action)


def clear_help(parser: Any) -> Any:
    """Make ``--help`` say what each flag does: :class:`HelpFormatter`, and each ``--no_<flag>`` switch (which
    ``HfArgumentParser`` gives the help of ``--<flag>``, e.g. "Show a progress bar.") described as the switch-off."""
    parser.formatter_class = HelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._StoreFalseAction) and action.option_strings[0].startswith("--no_"):
            action.help = f"Same as --{action.dest} false."
    return parser


def one_line_errors(parser: Any) -> Any:
    """Make argparse's own errors (an invalid value, a missing argument) one line, ``<prog>: error: <message>``, exit
    status 2, instead of the full usage first (hundreds of lines for a ``TrainingArguments`` parser)."""

    def error(message: str) -> None:
        print(f"{parser.prog}: error: {message} (--help lists the options)", file=sys.stderr)
        sys.exit(2)

    parser.error = error
    return parser


def _field_hints(parser: Any) -> Iterator[tuple[Any, Any]]:
    """``(dataclass field, its resolved type hint)`` for every field of ``parser``'s dataclasses; the hint is None
    where the annotations do not resolve."""
    import dataclasses
    import typing

    for dataclass_type in getattr(parser, "dataclass_types", ()):
        try:
            hints = typing.get_type_hints(dataclass_type)
        except Exception:  # an annotation that does not resolve
            hints = {}
        for item in dataclasses.fields(dataclass_type):
            yield item, hints.get(item.name)


def _nullable_fields(parser: Any) -> set[str]:
    """The dataclass fields of ``parser`` that may be None: typed ``T | None`` (or not resolvable) or None by
    default."""
    import types
    import typing

    nullable = set()
    for item, hint in _field_hints(parser):
        optional = hint is None or hint is Any or (typing.get_origin(hint) in (typing.Union, types.UnionType)
                                                   and type(None) in typing.get_args(hint))
        if optional or item.default is None:
            nullable.add(item.name)
    return nullable


def _list_only_fields(parser: Any) -> set[str]:
    """The dataclass fields of ``parser`` typed ``list[T]`` (or ``list[T] | None``): a single value given for one in a
    config file is a one-element list, as ``--flag value`` gives on the command line. Not a field that also takes a
    scalar (``TrainingArguments.debug: str | list[DebugOption]`` splits a string itself), nor one whose type does
    not resolve."""
    import types
    import typing

    fields = set()
    for item, hint in _field_hints(parser):
        union = typing.get_origin(hint) in (typing.Union, types.UnionType)
        members = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
        if hint is not None and members and all(typing.get_origin(a) is list or a is list for a in members):
            fields.add(item.name)
    return fields


def check_config_values(parser: Any) -> Any:
    """Make a ``--config`` file's values pass the checks their flags pass, and convert them as the command line does.
    TrlParser sets a YAML value as the flag's default, and argparse converts (so checks) only string defaults, and
    checks choices only on the command line: ``max_steps: 2.5`` or ``num_generations: 8.0`` reached the trainer as
    floats and failed mid-run, ``dtype: bfloat15`` failed when the model loaded, ``num_eval: null`` (a field that
    cannot be None) was a ``TypeError`` traceback, ``bf16: 0`` reached the config as the int 0, ``reward_weights:
    2`` as the int 2. Now a single value for a list field is a one-element list (as ``--flag value`` gives), and
    each int, float or bool value is converted by its flag's own converter (a bool takes
    what ``--flag`` takes: true/false, yes/no, 1/0, ...). Raises ``ValueError`` naming the key. (A single
    ``lora_target_modules`` name is a string again after TRL's ``ModelConfig``; see :func:`check_script_args`.) A
    flag's alias (``dataset: ...`` for eval's ``--dataset``) is read as its flag."""
    kinds = {"int": "int", "float": "float", "string_to_bool": "bool"}  # by name: TRL wraps them for `T | None`
    set_defaults_with_config = parser.set_defaults_with_config

    def checked(**config: Any) -> list[str]:
        nullable, list_only = _nullable_fields(parser), _list_only_fields(parser)
        # a flag's alias (eval's `--dataset` for `--dataset_name`) is a key too, as any flag is
        aliases = {option[2:]: action.dest for action in parser._actions if type(action) is argparse._StoreAction
                   for option in action.option_strings if option.startswith("--") and option[2:] != action.dest}
        config = {aliases.get(key, key): value for key, value in config.items()}
        for action in parser._actions:
            if action.dest not in config or not action.option_strings or action.dest == "help":
                continue
            value, kind = config[action.dest], kinds.get(getattr(action.type, "__name__", ""))
            if value is None and action.dest not in nullable:
                raise ValueError(f"config file: {action.dest}: null is not a value of this option (leave the key "
                                 "out for its default).")
            if (action.nargs in ("+", "*") and action.dest in list_only and value is not None
                    and not isinstance(value, list)):
                value = [value]  # `--flag value` on the command line gives a one-element list too
            if value is not None and action.choices is not None:
                for item in value if isinstance(value, list) else [value]:
                    if item not in action.choices and str(item) not in action.choices:
                        raise ValueError(f"config file: {action.dest}: {item!r} is not one of "
                                         f"{list(action.choices)}.")
            if value is not None and kind is not None:
                converted = []
                for item in value if isinstance(value, list) else [value]:
                    try:
                        converted.append(action.type(str(item)))
                    except (TypeError, ValueError, argparse.ArgumentTypeError):
                        raise ValueError(f"config file: {action.dest}: expected {kind}, got {item!r}.") from None
                value = converted if isinstance(value, list) else converted[0]
            config[action.dest] = value
        return set_defaults_with_config(**config)

    parser.set_defaults_with_config = checked
    return parser


def parse_script_args(parser: Any, argv: Sequence[str] | None = None, launching: bool = False) -> tuple[Any, ...]:
    """``parser.parse_args_and_config(argv)`` followed by :func:`check_script_args`; ``--config`` may name a shipped
    recipe (:func:`config_flag`). A ``ValueError`` on the way (a config's validation, a config file value of the
    wrong type, a missing model directory or dataset file, a config file key no dataclass has) exits with status 2
    after printing ``<prog>: error: <message>``; so do argparse's own errors (:func:`one_line_errors`).

    ``launching``: the check a training command makes before it launches the script (``trl-diffusion math``): the
    same, except that the script's configs are not built (a single ``argparse.Namespace`` is returned and checked).
    Their own checks depend on the launch (GRPO's batch sizes on the number of processes) and building
    ``TrainingArguments`` takes a device, in a process that only waits for the run."""
    from .launching import launch_options

    one_line_errors(check_config_values(clear_help(parser)))
    if launching:  # TrlParser reads --config (the file's keys and value types too), then calls this
        parser.parse_args_into_dataclasses = functools.partial(_flags_only, parser)
    try:
        args = config_flag(argv, recipes=True)
        parsed = parser.parse_args_and_config(args=args)
        check_script_args(parsed, command_line_options(parser, args))
    except (OSError, ValueError) as exc:  # OSError: a --config file that cannot be read
        also = launch_options() if launching else ()
        print(f"{parser.prog}: error: {explain_unknown_flags(parser, _one_line(exc), also)}", file=sys.stderr)
        sys.exit(2)
    return parsed


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
        raise UsageError(_one_line(exc)) from exc


EMBEDDED_SCALE_FIELDS = ("max_completion_length", "max_length", "learning_rate", "per_device_train_batch_size")
"""Settings the examples default for the embedded tiny model that a real model needs its own values of."""


def example_defaults(parser: Any) -> dict[str, Any]:
    """The parser's defaults of :data:`EMBEDDED_SCALE_FIELDS`, read before parsing (``--config`` turns a config
    file's values into parser defaults)."""
    return {name: parser.get_default(name) for name in EMBEDDED_SCALE_FIELDS}


def _model_name(parsed: Sequence[Any]) -> str | None:
    """The ``model_name_or_path`` of a script's parsed arguments (TRL's ``ModelConfig``), None when unset."""
    return next((p.model_name_or_path for p in parsed if hasattr(p, "model_name_or_path")), None)


def embedded_defaults_in_use(defaults: dict[str, Any], parsed: Sequence[Any]) -> list[str]:
    """``name=value`` for each :data:`EMBEDDED_SCALE_FIELDS` setting still at the example's own default
    (``defaults``, from :func:`example_defaults`: one it sets with ``parser.set_defaults`` for the embedded tiny model,
    not the config class's default) in a run on another model (``model_name_or_path`` set, and neither the
    embedded model nor one trained from it: ``trl_diffusion.assets.is_embedded_model``). Empty for those."""
    from .assets import is_embedded_model

    model = _model_name(parsed)
    if not model or is_embedded_model(model):
        return []
    kept = []
    for settings in parsed:
        fields = {f.name: f for f in getattr(settings, "__dataclass_fields__", {}).values()}
        for name in EMBEDDED_SCALE_FIELDS:
            if name not in fields:
                continue
            example_default, class_default = defaults[name], fields[name].default
            if example_default != class_default and getattr(settings, name) == example_default:
                kept.append(f"{name}={example_default}")
    return kept


def synthetic_task_on_other_model(parsed: Sequence[Any]) -> str | None:
    """The model, when a run without ``dataset_name`` (the synthetic arithmetic task, made for the embedded tiny
    model) trains another model than the embedded one (``trl_diffusion.assets.is_embedded_model``): e.g. a recipe run
    without its ``--dataset_name`` would fine-tune a released model on 3-digit arithmetic. None otherwise."""
    from .assets import is_embedded_model

    model = _model_name(parsed)
    no_dataset = any(hasattr(p, "dataset_name") and p.dataset_name is None for p in parsed)
    return model if model and no_dataset and not is_embedded_model(model) else None


GLOO_EXIT_PAUSE_SECONDS = 0.1


def pause_for_gloo_workers() -> None:
    """Sleep briefly (releasing the GIL) before leaving a process group, so that gloo's worker threads finish letting
    go of their last collective's tensors. torch 2.6 joins those threads while holding the GIL, and a thread that
    still holds the last reference to a tensor made in Python needs the GIL to free it: the process never exits.
    Measured with two processes on two busy CPU cores (broadcasts, a barrier, then ``destroy_process_group``): with
    torch 2.6, 4 and 2 of 20 runs hung (two measurements), none of 20 (twice) with this pause; with torch 2.13, none
    of 16 without it (``scripts/gloo_exit_check.py``)."""
    time.sleep(GLOO_EXIT_PAUSE_SECONDS)


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


def run_script(main: Callable[..., Any], parser: Any, argv: Sequence[str] | None = None) -> Any:
    """``main(*parse_script_args(parser, argv))``, with a :class:`UsageError` raised by ``main`` (see
    :func:`setting_errors`) reported as one line ``<prog>: error: <message>``, exit status 2, as a bad flag is.
    A run on another model than the embedded one that keeps the example's tiny-model sizes, or trains on the synthetic
    task (no ``dataset_name``), says so on stderr (main process only): e.g. 16-token completions would cut every
    answer of a real model."""
    defaults = example_defaults(parser)
    parsed = parse_script_args(parser, argv)
    kept = embedded_defaults_in_use(defaults, parsed)
    synthetic_model = synthetic_task_on_other_model(parsed)
    if kept and int(os.environ.get("RANK", "0")) == 0:
        print(f"{parser.prog}: warning: {', '.join(kept)} are this example's defaults for the embedded tiny model; "
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
        print(f"{parser.prog}: error: {_one_line(exc)}", file=sys.stderr)
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


def config_flag(argv: Sequence[str] | None, recipes: bool = False) -> list[str]:
    """``argv`` (default ``sys.argv[1:]``) with ``--config=file.yaml`` written ``--config file.yaml``, the only form
    TrlParser reads (the other was reported as an unknown ``--config=...`` argument), and, with ``recipes`` (the
    training scripts), a shipped recipe's name as its file (:func:`config_file`). Raises ``ValueError`` when
    ``--config`` has no file after it (TrlParser's ``IndexError`` traceback)."""
    args = list(sys.argv[1:] if argv is None else argv)
    for index, arg in enumerate(args):
        if arg.startswith("--config="):
            args[index:index + 1] = ["--config", arg.split("=", 1)[1]]
            break
    if "--config" in args:
        index = args.index("--config")
        if index == len(args) - 1:
            raise ValueError("--config needs a file: --config file.yaml")
        if recipes:
            args[index + 1] = config_file(args[index + 1])
    return args


def config_file(value: str) -> str:
    """A training script's ``--config`` value as a file: an existing file is itself; a name without a folder or a
    file extension is the shipped recipe of that name (:func:`trl_diffusion.recipes.recipe_path`, whose error names
    the recipes); any other value is a path, which TrlParser reports when it is not a file, except a missing one
    named like a recipe (``recipes/trado_4b_tracerl_math.yaml``, where the recipes were before they shipped with the
    package), whose error names the recipe."""
    from .recipes import recipe_names, recipe_path

    if os.path.isfile(value):
        return value
    separators = [separator for separator in (os.sep, os.altsep, "/") if separator]
    stem, extension = os.path.splitext(os.path.basename(value))
    if not any(separator in value for separator in separators) and not extension:
        return str(recipe_path(value))
    if not os.path.exists(value) and stem in recipe_names():
        raise ValueError(f"--config {value}: no such file; the shipped recipe of that name is --config {stem}.")
    return value


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


UNUSED_ARGUMENTS = "Some specified arguments are not used by the HfArgumentParser"
"""How ``HfArgumentParser`` reports command-line arguments no dataclass field takes."""


def explain_unknown_flags(parser: Any, message: str, also: Sequence[str] = ()) -> str:
    """``HfArgumentParser``'s message for unknown arguments, rewritten to name each unknown flag with the closest
    real one (``--max_problms (did you mean --max_problems?)``), of the parser's and ``also`` (the options a training
    command passes to ``accelerate launch``); any other message is returned unchanged."""
    if not message.startswith(UNUSED_ARGUMENTS):
        return message
    flags = [item for item in re.findall(r"'([^']*)'", message) if item.startswith("-")]
    if not flags:
        return message
    known = [option for action in parser._actions for option in action.option_strings] + list(also)
    named = []
    for flag in flags:
        close = difflib.get_close_matches(flag.split("=", 1)[0], known, n=1, cutoff=0.75)
        named.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    return f"unknown argument(s): {', '.join(named)}; --help lists the options."


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
                    "FILE, ...) it runs on their processes, each evaluating its share of the samples."))))
    also = list(launch_options())  # unknown flags are named with the closest of these too
    try:
        launch_args, argv = launch_request(parser, argv)
        check_eval_launch(launch_args)
        if launch_args:  # checked here first (an EvalConfig takes no device): a mistake is one line, not N
            (config,) = parser.parse_args_and_config(args=config_flag(argv))
            check_launch_device(config.device, launched_processes(launch_args))
            check_before_loading(config)
    except (OSError, ValueError) as exc:
        print(f"{parser.prog}: error: {explain_unknown_flags(parser, _one_line(exc), also)}", file=sys.stderr)
        return 2
    if launch_args:
        return launch(parser.prog, [*launch_args, "--module", "trl_diffusion.cli", "eval", *argv])
    try:
        (config,) = parser.parse_args_and_config(args=config_flag(argv))  # a training recipe is no eval config
        report = evaluate(config)
    except (OSError, ValueError) as exc:  # FileNotFoundError is an OSError
        print(f"{parser.prog}: error: {explain_unknown_flags(parser, _one_line(exc), also)}", file=sys.stderr)
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
}
"""Options of ``accelerate launch`` that an evaluation would not follow, with what to do instead."""


def check_eval_launch(launch_args: Sequence[str]) -> None:
    """Refuse a launch option of :data:`EVAL_LAUNCH_SETTINGS` for ``trl-diffusion eval``, and an accelerate config
    file (``--config_file``, ``--accelerate_config``) that asks for the CPU, DeepSpeed, FSDP or Megatron: eval takes
    the processes from the launch, and its device, dtype and model from its own flags (``--cpu`` would still
    evaluate on the GPU). A config's ``mixed_precision`` is left alone: TRL's ``multi_gpu`` sets bf16, and the
    weights' precision is ``--dtype`` either way."""
    from accelerate.commands.config.config_args import load_config_from_file

    for index, token in enumerate(launch_args):
        option = token.split("=", 1)[0]
        name = option.lstrip("-").replace("-", "_")
        if name in EVAL_LAUNCH_SETTINGS:
            raise ValueError(f"{option} is not an evaluation setting: {EVAL_LAUNCH_SETTINGS[name]}.")
        if name == "config_file":  # read as accelerate launch reads it
            path = token.split("=", 1)[1] if "=" in token else launch_args[index + 1]
            settings = load_config_from_file(path)
            if settings.use_cpu:
                raise ValueError(f"{path} sets use_cpu, which is not an evaluation setting: "
                                 f"{EVAL_LAUNCH_SETTINGS['cpu']}.")
            kind = str(getattr(settings.distributed_type, "value", settings.distributed_type))
            if kind in ("DEEPSPEED", "FSDP", "MEGATRON_LM"):
                raise ValueError(f"{path} asks for {kind}, which is not an evaluation setting: "
                                 f"{EVAL_LAUNCH_SETTINGS['use_deepspeed']} (a multi_gpu config is).")


def leave_launch(wait: bool) -> None:
    """Leave the process group an evaluation under ``accelerate launch`` / ``torchrun`` joined (nothing happens
    without one): after the other processes (``wait``), then together, as :func:`leave_process_group` does for
    training (a process exiting with gloo's threads up can abort)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait:
        dist.barrier()
    pause_for_gloo_workers()
    dist.destroy_process_group()


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


TRAINING_SCRIPTS = {"sft": "sft", "math": "tracerl_math", "code": "tracerl_code"}
"""The training commands' modules in :mod:`trl_diffusion.scripts` (not ``math`` / ``code``: a script run by its path
would have its folder first on the import path, where those names hide the standard library's modules)."""


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
    from .recipes import recipe_names, recipe_summary

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
    print("\n".join(f"{name:<{width}}  {recipe_summary(name)}" for name in names))
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
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"trl-diffusion: unknown command {args[0]!r}; choose one of {sorted(COMMANDS)}.\n{USAGE}",
              file=sys.stderr)
        return 2
    return command(args[1:])


if __name__ == "__main__":  # python -m trl_diffusion.cli: run the package's module, whose UsageError the scripts raise
    from trl_diffusion.cli import main as package_main

    sys.exit(package_main())
