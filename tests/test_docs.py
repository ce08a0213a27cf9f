"""The documentation runs as written: every fenced ``python`` / ``bash`` block in README.md and docs/*.md that is
marked ``<!-- test: offline -->`` (the line just before its fence) runs here, offline, and must succeed.

Convention (documented in README.md, "Development"): the marker says the block needs no network and no GPU and
finishes in well under a minute (keep its own arguments lean, e.g. ``--max_steps 2``); ``<!-- test: offline slow
-->`` marks one that takes longer (it runs under ``@pytest.mark.slow``). Python blocks run as a script, bash blocks
with ``bash -e``, each in a fresh folder where ``examples/`` and ``scripts/`` point at the checkout,
with the Hugging Face libraries forced offline.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*test:(.*?)-->\s*$")
FENCE = re.compile(r"^```\s*([A-Za-z]*)\s*$")
LANGUAGES = {"python": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
OPTIONS = {"offline", "slow"}
LINKED = ("examples", "scripts")


@dataclass
class Block:
    name: str  # file:line of the fence
    file: str
    language: str
    code: str
    slow: bool


def collect(paths: list[Path], root: Path = ROOT) -> tuple[list[Block], list[str]]:
    """The marked blocks of ``paths`` and a list of marker mistakes (a marker not right before a python / bash
    fence, an unknown option, an unclosed fence)."""
    blocks, problems = [], []
    for path in paths:
        lines = path.read_text(encoding="utf-8").splitlines()
        for index, line in enumerate(lines):
            found = MARKER.match(line.strip())
            if not found:
                continue
            where = f"{path.relative_to(root)}:{index + 1}"
            options = set(found.group(1).split())
            if "offline" not in options or options - OPTIONS:
                problems.append(f"{where}: marker options must be 'offline' [slow], got {sorted(options)}")
                continue
            fence = FENCE.match(lines[index + 1]) if index + 1 < len(lines) else None
            if fence is None or fence.group(1) not in LANGUAGES:
                problems.append(f"{where}: the marker must be the line just before a ```python or ```bash fence")
                continue
            end = next((j for j in range(index + 2, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                problems.append(f"{where}: the fenced block is never closed")
                continue
            code = "\n".join(lines[index + 2:end]) + "\n"
            blocks.append(Block(f"{path.relative_to(root)}:{index + 2}", path.name, LANGUAGES[fence.group(1)], code,
                                "slow" in options))
    return blocks, problems


BLOCKS, PROBLEMS = collect(DOCS)


def test_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_the_main_entry_points_are_covered():
    """The README, the quickstart and the evaluation page each keep runnable blocks (a marker lost in an edit
    would silently stop testing them)."""
    covered = {block.file for block in BLOCKS}
    assert {"README.md", "quickstart.md", "evaluation.md"} <= covered
    commands = "".join(block.code for block in BLOCKS)
    for entry in ("examples/math.py", "examples/sft.py", "examples/code.py", "trl-diffusion eval", "TraceRLTrainer"):
        assert entry in commands, entry


def test_the_collector_finds_marked_blocks_and_reports_mistakes(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- test: offline -->\n```python\nprint(1)\n```\n\n<!-- test: offline slow -->\n```bash\n"
                   "echo hi\n```\n<!-- test: offline -->\n\n```python\nx\n```\n<!-- test: online -->\n```bash\n"
                   "x\n```\n```python\nnot marked\n```\n")
    blocks, problems = collect([doc], root=tmp_path)
    assert [(b.name, b.language, b.code, b.slow) for b in blocks] == [("doc.md:2", "python", "print(1)\n", False),
                                                                     ("doc.md:7", "bash", "echo hi\n", True)]
    assert len(problems) == 2 and "just before" in problems[0] and "online" in problems[1]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               MPLBACKEND="Agg")
    return env


def _params():
    return [pytest.param(b, id=b.name, marks=[pytest.mark.slow] if b.slow else []) for b in BLOCKS]


@pytest.mark.parametrize("block", _params())
def test_marked_block_runs(block: Block, tmp_path):
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name, target_is_directory=True)
    script = tmp_path / ("block.py" if block.language == "python" else "block.sh")
    script.write_text(block.code, encoding="utf-8")
    command = [sys.executable, str(script)] if block.language == "python" else ["bash", "-e", "-o", "pipefail",
                                                                                 str(script)]
    result = subprocess.run(command, cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, f"{block.name} failed:\n{block.code}\n--- stderr ---\n{result.stderr[-4000:]}"
