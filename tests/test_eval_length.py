"""``trl-diffusion eval`` and the generation length: completions that ran out of room are counted
(``clipped_ratio``, TRL's ``completions/clipped_ratio``; ``clipped`` per sample row), and a run whose length nobody
chose (no ``--max_new_tokens``, nothing in ``generation_config.json``: the family default of 128 tokens, which cuts
reasoning short) says so before it starts."""

import copy
import json
import logging
from pathlib import Path

import pytest

from trl_diffusion.eval import evaluate
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


@pytest.mark.parametrize("chosen_by", ["call", "generation_config", "max_length", "arithmetic"])
def test_a_chosen_length_is_not_warned_about(caplog, model_and_tokenizer, chosen_by):
    model, tokenizer = model_and_tokenizer
    kwargs = dict(dataset=str(GSM8K), max_problems=1, output_dir=None, **QUICK)
    if chosen_by == "call":
        kwargs["max_new_tokens"] = 8
    elif chosen_by == "arithmetic":  # the embedded task's own default (16 tokens)
        kwargs["dataset"] = "arithmetic"
    else:
        model = copy.deepcopy(model)
        setattr(model.generation_config, "max_new_tokens" if chosen_by == "generation_config" else "max_length", 400)
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


def test_a_checkpoint_max_length_counts_the_prompt_in_the_fit_check():
    """generation_config.max_length counts the prompt (generate() gives max_length - prompt width new tokens): the
    first version of the check added all of it to each prompt and refused problems generate() runs."""
    rows = [{"question": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(1, 4)]
    model = tiny_model("dream", max_position_embeddings=64)
    model.generation_config.max_length = 48
    report = evaluate(dataset=rows, model=model, tokenizer=build_tokenizer(), prompt_template="{question}",
                      output_dir=None, **QUICK)
    assert report["num_problems"] == 3


def test_a_setting_that_depends_on_the_batch_is_left_to_generate():
    """With a checkpoint max_length, Dream-style ``steps`` must divide the blocks of the batch's new tokens: resolved
    per prompt alone, the check refused (naming no problem) a run generate() performs on the batch (review)."""
    tokenizer = build_tokenizer()
    rows = [{"question": "x" * 36, "answer": "1"}, {"question": "y" * 30, "answer": "2"}]
    model = tiny_model("sdar", max_position_embeddings=2048)
    model.generation_config.max_length = 48
    report = evaluate(dataset=rows, model=model, tokenizer=tokenizer, prompt_template="{question}", output_dir=None,
                      apply_chat_template=False, batch_size=2, progress=False, block_length=4, steps=24,
                      temperature=0.0)
    assert report["num_problems"] == 2
