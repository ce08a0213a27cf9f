"""Command-line parsing shared by the ``trl-diffusion`` commands and the training scripts: errors as one line
``<prog>: error: <what is wrong>`` with exit status 2, never a traceback (an unknown flag is named with the
closest real one), ``--help`` that says what each flag does, a ``--config`` file whose values are checked and
converted as the flags are, and ``--config <recipe name>`` for the shipped recipes."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any


class UsageError(ValueError):
    """A command-line argument that cannot work; reported as one line, exit status 2."""


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
    each int, float or bool value is converted by its flag's own converter (a bool takes what ``--flag`` takes:
    true/false, yes/no, 1/0, ...). Raises ``ValueError`` naming the key. (A single ``lora_target_modules`` name is a
    string again after TRL's ``ModelConfig``; see :func:`trl_diffusion.scripts.utils.check_script_args`.) A flag's
    alias (``dataset: ...`` for eval's ``--dataset``) is read as its flag; a file giving both is refused. The keys
    the file sets are left in ``parser.config_file_keys`` (by destination name), for what must not be named as a
    default the user kept."""
    kinds = {"int": "int", "float": "float", "string_to_bool": "bool"}  # by name: TRL wraps them for `T | None`
    set_defaults_with_config = parser.set_defaults_with_config

    def checked(**config: Any) -> list[str]:
        nullable, list_only = _nullable_fields(parser), _list_only_fields(parser)
        # a flag's alias (eval's `--dataset` for `--dataset_name`) is a key too, as any flag is
        aliases = {option[2:]: action.dest for action in parser._actions if type(action) is argparse._StoreAction
                   for option in action.option_strings if option.startswith("--") and option[2:] != action.dest}
        both = [f"{key} and {aliases[key]}" for key in config if key in aliases and aliases[key] in config]
        if both:
            raise ValueError(f"config file: {both[0]} name the same option; keep one of the two keys.")
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
        parser.config_file_keys = frozenset(config)
        return set_defaults_with_config(**config)

    parser.set_defaults_with_config = checked
    parser.config_file_keys = frozenset()
    return parser


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
        else:
            refuse_recipe(args[index + 1])
    return args


def refuse_recipe(value: str) -> None:
    """Refuse a ``--config`` value of ``trl-diffusion eval`` that is no file but names a shipped recipe (a training
    configuration: eval reads a file of its own options)."""
    from .recipes import recipe_command, recipe_names

    stem = os.path.splitext(os.path.basename(value))[0]
    if not os.path.exists(value) and stem in recipe_names():
        raise ValueError(f"--config {value}: no such file; {stem} is a shipped recipe, a training configuration of "
                         f"trl-diffusion {recipe_command(stem)}. Evaluation reads a YAML file of its own options "
                         "(trl-diffusion eval --help lists them).")


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


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


UNUSED_ARGUMENTS = "Some specified arguments are not used by the HfArgumentParser"
"""How ``HfArgumentParser`` reports command-line arguments no dataclass field takes."""

UNUSED_CONFIG_KEYS = "Unknown arguments from config file"
"""How ``TrlParser`` reports ``--config`` file keys no dataclass field takes (as ``['--key', 'value', ...]``)."""


def explain_unknown_flags(parser: Any, message: str, also: Sequence[str] = ()) -> str:
    """``HfArgumentParser``'s message for unknown arguments, rewritten to name each unknown flag with the closest
    real one (``--max_problms (did you mean --max_problems?)``), of the parser's and ``also`` (the options a training
    command passes to ``accelerate launch``); ``TrlParser``'s for unknown ``--config`` file keys the same way, with
    the keys' closest options; any other message is returned unchanged."""
    if message.startswith(UNUSED_CONFIG_KEYS):
        keys = [item[2:] for item in re.findall(r"'([^']*)'", message) if item.startswith("--")]
        options = [action.dest for action in parser._actions if action.option_strings and action.dest != "help"]
        named = []
        for key in keys:
            close = difflib.get_close_matches(key, options, n=1, cutoff=0.75)
            named.append(f"{key} (did you mean {close[0]}?)" if close else key)
        return f"config file: unknown key(s): {', '.join(named)}; --help lists the options." if keys else message
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
