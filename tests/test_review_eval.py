"""Review checks of the evaluation loop (``trl_diffusion.eval.evaluate``): inputs that used to give silently wrong
results or an unclear crash."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trl_diffusion.eval import evaluate
from trl_diffusion.testing import build_tokenizer, tiny_model

ROWS = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(1, 6)]


@pytest.mark.parametrize("max_problems", [-1, 0])
def test_max_problems_must_be_positive_for_rows_given_directly(max_problems):
    """Rows passed as ``dataset=`` were sliced with ``problems[:max_problems]``: -1 silently dropped the last
    problem, 0 crashed with an IndexError after generating nothing. Named datasets already refused both."""
    with pytest.raises(ValueError, match="max_problems must be positive"):
        evaluate(dataset=ROWS, model=object(), tokenizer=object(), max_problems=max_problems, output_dir="",
                 progress=False)


@pytest.mark.parametrize(("family", "settings", "identical"), [
    ("dream", {"alg": "origin", "steps": 8, "temperature": 0.0}, False),  # origin commits random positions
    ("sdar", {"temperature": 1.0, "top_k": 1}, True),  # top-k 1 keeps only the argmax: greedy
    ("sdar", {"temperature": 1.0}, False),
])
def test_identical_samples_warning_matches_the_samples(family, settings, identical, tmp_path, caplog):
    """The num_samples > 1 warning that every sample will be the same fired for Dream's random ``origin`` rule at
    temperature 0 (samples differ) and stayed silent for ``top_k=1`` (samples identical, pass@k = pass@1)."""
    model, tokenizer = tiny_model(family, max_position_embeddings=2048), build_tokenizer()
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.eval.evaluate"):
        report = evaluate(dataset=ROWS[:2], model=model, tokenizer=tokenizer, num_samples=3, max_new_tokens=8,
                          prompt_template="{question}", output_dir=str(tmp_path), progress=False, **settings)
    completions: dict[int, set[str]] = {}
    for line in Path(report["samples_file"]).read_text().splitlines():
        row = json.loads(line)
        completions.setdefault(row["index"], set()).add(row["completion"])
    assert all((len(texts) == 1) == identical for texts in completions.values())
    assert ("every sample of a problem will be the same" in caplog.text) == identical
