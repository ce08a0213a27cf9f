"""The ``trl-diffusion`` command: ``trl-diffusion <command> [--flags]``. Each command parses its own flags with
``TrlParser`` (so ``--config file.yaml`` works too) and returns an exit status."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

USAGE = "usage: trl-diffusion <command> [options]   (trl-diffusion <command> --help for its options)"


def _eval(argv: list[str]) -> int:
    """Evaluate a model on a benchmark (MATH-500, GSM8K, AIME 2024, code sets, local files, arithmetic)."""
    from trl import TrlParser

    from .eval import EvalConfig, evaluate

    parser = TrlParser(dataclass_types=[EvalConfig], prog="trl-diffusion eval",
                       description="Evaluate a diffusion language model; see docs/evaluation.md.")
    (config,) = parser.parse_args_and_config(args=argv)
    try:
        report = evaluate(config)
    except (FileNotFoundError, ValueError) as exc:
        print(f"trl-diffusion eval: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2))
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {"eval": _eval}
"""Subcommands; ``sft`` and ``tracerl`` will join ``eval`` here."""


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


if __name__ == "__main__":
    sys.exit(main())
