"""The option tables of the docs show the code's defaults: every field (or flag) a table names exists, and the
default it shows is the dataclass's. Parsed from the pages themselves, so a changed default or a renamed field fails
here rather than misleading a reader."""

from __future__ import annotations

import ast
import dataclasses
import math
import re
from pathlib import Path

import pytest
from trl import GRPOConfig

from trl_diffusion import DiffusionSFTConfig, TraceRLConfig
from trl_diffusion.eval import EvalConfig

DOCS = Path(__file__).resolve().parent.parent / "docs"
# (page, the table's header, the config its rows name)
TABLES = [
    ("sft.md", "| field | default | meaning |", DiffusionSFTConfig),
    ("tracerl.md", "| field | default | meaning |", TraceRLConfig),
    ("value.md", "| `TraceRLConfig` field | default | meaning |", TraceRLConfig),
    ("evaluation.md", "| flag | default | meaning |", EvalConfig),
]
# Defaults a table writes in words, as the code spells them. A cell not here must be a Python literal.
IN_WORDS = {
    "GRPO's": "from GRPOConfig",
    "= `block_length`": None,  # training_block_size: None reads the sampler's block_length
    "None (= `temperature`)": None,
    "model": None,  # eval: the checkpoint's generation settings
    "model, then `auto`": None,
    "model eos": None,
    "none": None,
    "all": None,
    "per name": None,
    "per task": None,
    "the model's": None,
    "embedded model": None,
    "cuda if available": None,
    "1 and n": None,
    "16 (100 for `arithmetic`)": None,
    "true; false for the embedded model and a `dllm_rl_*` prompt": None,
}


def table_rows(page: str, header: str) -> list[tuple[list[str], str]]:
    """(the names in the first cell, the default cell) of each row of the table under ``header``."""
    lines = (DOCS / page).read_text().splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        cells = [cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]]
        names = re.findall(r"`-*([A-Za-z_0-9]+)`", cells[0].split("(")[0])
        if names:
            rows.append((names, cells[1]))
    return rows


def documented_values(cell: str, count: int) -> list:
    """The default(s) a cell shows: ``4, 4`` for two fields, ``**0.01** (GRPO: 0.0)`` as 0.01."""
    if cell in IN_WORDS:
        return [IN_WORDS[cell]] * count
    cell = re.sub(r"\s*\(.*\)$", "", cell.replace("**", "")).strip()
    parts = [part.strip().strip("`") for part in cell.split(",")] if count > 1 else [cell.strip("`")]
    assert len(parts) == count, f"{cell!r} shows {len(parts)} values for {count} fields"
    values = []
    for part in parts:
        spelled = {"true": "True", "false": "False"}.get(part, part)
        try:
            values.append(ast.literal_eval(spelled))
        except (ValueError, SyntaxError):
            values.append(part)  # a bare string (`group_mean`)
    return values


def code_default(config: type, name: str):
    field = {field.name: field for field in dataclasses.fields(config)}[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def same(documented, actual) -> bool:
    if isinstance(documented, float) or isinstance(actual, float):
        return actual is not None and not isinstance(actual, str) and math.isclose(documented, actual)
    return documented == actual or (isinstance(actual, (list, tuple)) and list(documented) == list(actual))


@pytest.mark.parametrize(("page", "header", "config"), TABLES, ids=[page for page, _, _ in TABLES])
def test_a_tables_defaults_are_the_codes(page, header, config):
    rows = table_rows(page, header)
    assert len(rows) >= 5, f"the table under {header!r} in {page} was not found whole"
    fields = {field.name for field in dataclasses.fields(config)}
    wrong = []
    for names, cell in rows:
        for name, documented in zip(names, documented_values(cell, len(names))):
            if name not in fields:
                wrong.append(f"{name}: not a field of {config.__name__}")
                continue
            actual = code_default(config, name)
            if documented == "from GRPOConfig":
                documented = code_default(GRPOConfig, name)
            if not same(documented, actual):
                wrong.append(f"{name}: the table shows {cell!r}, the code has {actual!r}")
    assert not wrong, f"{page}: " + "; ".join(wrong)
