"""Review checks of the evaluation loop (``trl_diffusion.eval.evaluate``): inputs that used to give silently wrong
results or an unclear crash."""

from __future__ import annotations

import pytest

from trl_diffusion.eval import evaluate

ROWS = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(1, 6)]


@pytest.mark.parametrize("max_problems", [-1, 0])
def test_max_problems_must_be_positive_for_rows_given_directly(max_problems):
    """Rows passed as ``dataset=`` were sliced with ``problems[:max_problems]``: -1 silently dropped the last
    problem, 0 crashed with an IndexError after generating nothing. Named datasets already refused both."""
    with pytest.raises(ValueError, match="max_problems must be positive"):
        evaluate(dataset=ROWS, model=object(), tokenizer=object(), max_problems=max_problems, output_dir="",
                 progress=False)
