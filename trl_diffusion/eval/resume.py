"""Resuming an interrupted evaluation (``--resume``): the samples it already wrote are kept and only the missing
ones are generated. A sample's random draws are keyed by (seed, problem, sample), so the resumed run's report is
that of an uninterrupted one.

Beside the samples file an evaluation writes a *run card* (``<name>.run.json``): what decides its samples and
their scores. A resume is refused when the card differs from the new run's (another model, dataset, sampler
setting, seed, grader, weights dtype or kind of device); the batch size, the number of problems, the device index
and the number of processes may change. Each row carries a digest of its problem (question, gold answer, tests),
so a row whose problem changed is made again. Under a launch each process streams its rows to a part file
(``<name>.jsonl.part<rank>``), which the main process merges into the samples file at the end; a resume reads the
part files of an interrupted launch too.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from pathlib import Path
from typing import Any

RESUME_FREE = ("model_name_or_path", "tokenizer_name_or_path", "dataset_name", "dtype", "device", "max_problems",
               "batch_size", "pass_k", "code_workers", "output_dir", "progress", "resume")
"""``EvalConfig`` fields a resumed run may change, or that the card holds resolved instead (the model, tokenizer and
dataset as ``sources``, not as typed; the weights' dtype and the kind of device as loaded, not ``auto``)."""


def card_path(samples_path: Path) -> Path:
    return samples_path.with_suffix(".run.json")


def part_path(samples_path: Path, rank: int) -> Path:
    """Where process ``rank`` of a launch streams its rows."""
    return samples_path.with_name(f"{samples_path.name}.part{rank}")


def part_paths(samples_path: Path) -> list[Path]:
    """The part files in ``samples_path``'s folder (an interrupted launch of any size)."""
    return sorted(samples_path.parent.glob(glob.escape(samples_path.name) + ".part*"))


def run_card(config: Any, sources: dict[str, str], settings: Any, loaded: dict[str, Any],
             resolved: tuple[str, ...] = ()) -> dict[str, Any]:
    """What decides an evaluation's samples and scores: its ``sources``, every config field but ``RESUME_FREE`` and
    the ``resolved`` ones (the generation flags: the card holds the sampler settings ``generate`` resolved from
    them and the model's generation config, so ``--max_new_tokens 16`` and the same value by default are one run),
    and the ``loaded`` facts (weights, tokenizer, dtype, kind of device: a sample drawn in bfloat16 on a GPU is not
    the one drawn in float32 on a CPU; package version), as JSON values."""
    fields = {name: value for name, value in dataclasses.asdict(config).items()
              if name not in RESUME_FREE and name not in resolved}
    card = {"sources": sources, "loaded": loaded, "config": fields, "generation": dataclasses.asdict(settings)}
    return json.loads(json.dumps(card, default=repr))


def problem_digest(problem: Any) -> str:
    """A digest of everything a problem holds (question, gold answer, tests, ...): stored in each row, so a resume
    makes again the rows of a problem that changed since (a local file edited in place keeps its path)."""
    text = json.dumps(dataclasses.asdict(problem), sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_card(samples_path: Path, card: dict[str, Any]) -> None:
    """Write the run card whole (then renamed: never half a file)."""
    path = card_path(samples_path)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(card, indent=2) + "\n")
    os.replace(partial, path)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a samples or part file; a line cut short by the interruption (not JSON, or cut inside a UTF-8
    character) is left out."""
    rows = []
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError is one
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def resumed_rows(samples_path: Path, card: dict[str, Any], prompts: list[str], digests: list[str],
                 num_samples: int) -> list[dict[str, Any]]:
    """The rows an interrupted run of the same evaluation (``card``) left in ``samples_path`` and its part files, at
    most one per (problem, sample) of this run whose problem and prompt are still the same (``digests``:
    :func:`problem_digest` of this run's problems, ``prompts`` theirs), in (problem, sample) order. Raises a
    ValueError, naming what differs, when the files belong to another evaluation."""
    files = [path for path in (samples_path, *part_paths(samples_path)) if path.is_file()]
    if not files:
        return []
    path = card_path(samples_path)
    if not path.is_file():
        raise ValueError(f"cannot resume from {samples_path}: there is no run card ({path.name}) beside it, which "
                         "says how its samples were made (evaluations before this version wrote none). Run without "
                         "--resume to start again.")
    earlier = json.loads(path.read_text())
    if earlier != card:
        raise ValueError(f"cannot resume from {samples_path}: it was made with other settings "
                         f"({'; '.join(_differences(earlier, card))}). Run with the same ones, or without --resume "
                         "to start again.")
    kept: dict[tuple[int, int], dict[str, Any]] = {}
    for file in files:
        for row in read_rows(file):
            index, sample = row.get("index"), row.get("sample")
            if not (isinstance(index, int) and isinstance(sample, int) and 0 <= sample < num_samples):
                continue
            if 0 <= index < len(digests) and row.get("problem_digest") == digests[index] and \
                    row.get("prompt") == prompts[index]:
                kept.setdefault((index, sample), row)
    return [kept[key] for key in sorted(kept)]


def start_files(samples_path: Path, card: dict[str, Any], kept: list[dict[str, Any]]):
    """Begin this run's files: no metrics (they would not describe these rows), the samples file holding the
    ``kept`` rows, no part files, then the run card (last: a run stopped in between leaves no rows of another run
    beside this run's card); returns the samples file open for appending."""
    samples_path.with_suffix(".metrics.json").unlink(missing_ok=True)
    partial = samples_path.with_name(samples_path.name + ".tmp")  # the kept rows are never only in memory
    with partial.open("w", encoding="utf-8") as handle:
        handle.writelines(sample_line(row) for row in kept)
    os.replace(partial, samples_path)
    for part in part_paths(samples_path):
        part.unlink(missing_ok=True)
    write_card(samples_path, card)
    return samples_path.open("a", encoding="utf-8")


def sample_line(row: dict[str, Any]) -> str:
    """One row of a samples file."""
    return json.dumps(row, ensure_ascii=False) + "\n"


def _differences(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The settings that differ between two run cards, as ``name: earlier -> now``."""
    found = []
    for part in sorted(set(earlier) | set(now)):
        old, new = earlier.get(part), now.get(part)
        if isinstance(old, dict) and isinstance(new, dict):
            found += [f"{name}: {old.get(name)!r} -> {new.get(name)!r}" for name in sorted(set(old) | set(new))
                      if old.get(name) != new.get(name)]
        elif old != new:
            found.append(f"{part}: {old!r} -> {new!r}")
    return found
