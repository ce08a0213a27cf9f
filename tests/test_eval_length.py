"""``trl-diffusion eval`` and the generation length: completions that ran out of room are counted
(``clipped_ratio``, TRL's ``completions/clipped_ratio``; ``clipped`` per sample row), and a run whose length nobody
chose (no ``--max_new_tokens``, nothing in ``generation_config.json``: the family default of 128 tokens, which cuts
reasoning short) says so before it starts."""

import copy
import json
import logging
from pathlib import Path

import pytest

from trl_diffusion.eval import EvalProblem, evaluate
from trl_diffusion.testing import build_tokenizer, tiny_model

GSM8K = Path(__file__).parent / "fixtures" / "rewards" / "gsm8k_sample.jsonl"
QUICK = dict(block_length=4, denoising_steps=4, temperature=0.0, progress=False)
LOGGER = "trl_diffusion.eval.evaluate"


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("sdar", max_position_embeddings=2048), build_tokenizer()


def samples(report) -> list[dict]:
    return [json.loads(line) for line in Path(report["samples_file"]).read_text().splitlines()]


def test_clipped_marks_the_completions_without_a_stop_token(tmp_path, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset=str(GSM8K), max_problems=4, num_samples=2,
                      temperature=1.0, max_new_tokens=8, block_length=4, denoising_steps=4, progress=False,
                      stop_token_ids=[], output_dir=str(tmp_path))
    rows = samples(report)
    # no stop token: the whole canvas, at least max_new_tokens wide (block alignment can add a few columns)
    assert all(row["length"] >= 8 for row in rows if row["clipped"])
    assert any(row["clipped"] for row in rows) and not all(row["clipped"] for row in rows)
    assert report["metrics"]["clipped_ratio"] == pytest.approx(sum(row["clipped"] for row in rows) / len(rows))


def test_a_completion_that_stops_is_not_clipped(tmp_path, model_and_tokenizer):
    """Every token a stop token: every completion is empty and none ran out of room."""
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset=str(GSM8K), max_problems=2, max_new_tokens=8,
                      stop_token_ids=list(range(model.config.vocab_size)), output_dir=str(tmp_path), **QUICK)
    assert [row["length"] for row in samples(report)] == [0, 0]
    assert report["metrics"]["clipped_ratio"] == 0.0


def test_a_length_nobody_chose_is_named_before_the_run(caplog, model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        report = evaluate(model=model, tokenizer=tokenizer, dataset=str(GSM8K), max_problems=1, output_dir=None,
                          **QUICK)
    assert report["generation"]["max_new_tokens"] == 128
    assert "max_new_tokens is set neither here nor in the model's generation_config.json" in caplog.text
    assert "family default of 128 new tokens" in caplog.text


@pytest.mark.parametrize("chosen_by", ["call", "generation_config", "arithmetic"])
def test_a_chosen_length_is_not_warned_about(caplog, model_and_tokenizer, chosen_by):
    model, tokenizer = model_and_tokenizer
    kwargs = dict(dataset=str(GSM8K), max_problems=1, output_dir=None, **QUICK)
    if chosen_by == "call":
        kwargs["max_new_tokens"] = 8
    elif chosen_by == "arithmetic":  # the embedded task's own default (16 tokens)
        kwargs["dataset"] = "arithmetic"
    else:
        model = copy.deepcopy(model)
        model.generation_config.max_new_tokens = 400
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        evaluate(model=model, tokenizer=tokenizer, **kwargs)
    assert "max_new_tokens is set neither" not in caplog.text


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_problems_too_long_for_the_model_are_named_before_any_generation(family, monkeypatch):
    """One over-long problem among short ones stopped the run with generate()'s message, which names no problem;
    the check runs over every problem first (SDAR's need rounded up to whole blocks)."""
    rows = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(1, 6)]
    rows.insert(3, {"question": "Please compute this carefully: " * 3 + "7+7?", "answer": "14"})
    model = tiny_model(family, max_position_embeddings=64)
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("generated before the check"))
    with pytest.raises(ValueError, match=r"1 of 6 problems do not fit the model's 64 positions: '3' \(116 prompt "
                                         r"\+ 16 new tokens, needs 132\)"):
        evaluate(dataset=rows, model=model, tokenizer=build_tokenizer(), prompt_template="{question}",
                 max_new_tokens=16, output_dir=None, batch_size=2, **QUICK)
    short = evaluate(dataset=rows[:3], model=tiny_model(family, max_position_embeddings=64),
                     tokenizer=build_tokenizer(), prompt_template="{question}", max_new_tokens=16, output_dir=None,
                     **QUICK)
    assert short["num_problems"] == 3


@pytest.mark.parametrize("family", ["sdar", "dream"])
def test_a_checkpoint_max_length_alone_is_refused_before_any_generation(family, monkeypatch):
    """transformers' max_length counts the prompt columns, in a left-padded batch the longest prompt's: eval gave a
    completion 30 new tokens at batch size 1 and 12 at batch size 4 (and reported max_new_tokens 32)."""
    rows = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(1, 4)]
    model = tiny_model(family, max_position_embeddings=64)
    model.generation_config.max_length = 48
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: pytest.fail("generated before the check"))
    common = dict(dataset=rows, model=model, tokenizer=build_tokenizer(), prompt_template="{question}",
                  output_dir=None, **QUICK)
    with pytest.raises(ValueError, match=r"generation_config sets max_length \(48\) and no max_new_tokens.*"
                                         r"Pass --max_new_tokens"):
        evaluate(**common)
    monkeypatch.undo()
    assert evaluate(max_new_tokens=8, **common)["num_problems"] == 3  # the call's length wins, as in generate()
    model.generation_config.max_new_tokens = 8
    assert evaluate(**common)["generation"]["max_new_tokens"] == 8  # and the config's max_new_tokens


def test_clipped_and_length_do_not_depend_on_the_batch(tmp_path, model_and_tokenizer):
    """Block models round each row's completion region up to its own block end, so rows of one batch have regions
    of different widths and generate() right-pads the narrower ones with the pad token: that padding is no stop
    the model chose (it read as one: clipped_ratio 1.0 at batch size 1 and 0.25 at batch size 4)."""
    model, tokenizer = model_and_tokenizer
    problems = [EvalProblem(f"p{i}", "x" * (4 + i), "math", answer="1") for i in range(1, 5)]  # widths 5..8 mod 4
    runs = {}
    for batch_size in (1, 4):
        report = evaluate(model=model, tokenizer=tokenizer, dataset=problems, apply_chat_template=False,
                          max_new_tokens=8, batch_size=batch_size, block_length=4, denoising_steps=4,
                          temperature=1.0, stop_token_ids=[], progress=False,
                          output_dir=str(tmp_path / str(batch_size)))
        runs[batch_size] = sorted((r["index"], r["length"], r["clipped"], r["completion"]) for r in samples(report))
        runs[batch_size, "ratio"] = report["metrics"]["clipped_ratio"]
    assert runs[1] == runs[4]
    assert runs[1, "ratio"] == runs[4, "ratio"]
    clipped_lengths = {length for _, length, clipped, _ in runs[1] if clipped}
    assert len(clipped_lengths) > 1  # the clipped rows had regions of different widths: the case this checks
