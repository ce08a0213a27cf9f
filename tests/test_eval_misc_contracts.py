"""Contracts of the evaluation loop (``trl_diffusion/eval/evaluate.py``) and of the small modules the trainers share
(best-checkpoint metric, whole saves under sharded FSDP, checkpoint files, eval padding, vocabulary rows, the mask
token's wording, the math-verify check): behaviours no other test pinned."""

from __future__ import annotations

import importlib
import json
import logging

import pytest

from trl_diffusion.eval import EvalConfig, evaluate, pass_at_k, score_completions
from trl_diffusion.eval.datasets import EvalProblem
from trl_diffusion.eval.evaluate import format_prompt
from trl_diffusion.testing import build_tokenizer, tiny_model

evaluate_module = importlib.import_module("trl_diffusion.eval.evaluate")  # the package exports a function of that name

FAST = dict(max_new_tokens=4, block_length=4, denoising_steps=4, temperature=0.0, progress=False, output_dir=None)
MATH = [{"question": "What is 1+1?", "answer": "2"}, {"question": "What is 2+2?", "answer": "4"}]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("sdar"), build_tokenizer()


def math_problem(prompt="What is 1+2?", answer="3"):
    return EvalProblem(id="p0", prompt=prompt, task="math", answer=answer)


# ------------------------------------------------------------------------------------------------ EvalConfig


def test_an_unknown_remasking_strategy_is_refused_by_the_config():
    """An unknown remasking_strategy fails when the config is built, not after the model has loaded."""
    with pytest.raises(ValueError, match="remasking_strategy must be one of"):
        EvalConfig(remasking_strategy="lowest_confidence")
    assert EvalConfig(remasking_strategy="low_confidence_static").remasking_strategy == "low_confidence_static"


def test_the_arithmetic_defaults_give_way_to_values_that_were_set():
    """arithmetic's generation defaults fill only what was left unset; other datasets get none."""
    assert EvalConfig().generate_kwargs("arithmetic") == {"max_new_tokens": 16, "temperature": 0.0}
    assert EvalConfig(temperature=0.7, max_new_tokens=8).generate_kwargs("arithmetic") == {
        "max_new_tokens": 8, "temperature": 0.7}
    assert EvalConfig().generate_kwargs("gsm8k") == {}


def test_use_cache_is_read_whatever_its_case():
    """use_cache from the command line or a config file is read case-insensitively."""
    assert EvalConfig(use_cache="True").generate_kwargs()["use_cache"] is True
    assert EvalConfig(use_cache="FALSE").generate_kwargs()["use_cache"] is False
    assert EvalConfig(use_cache="Dual").generate_kwargs()["use_cache"] == "dual"


def test_pass_k_defaults_and_bounds():
    """pass@k is reported for k = 1 and k = num_samples by default; k = 0 and num_samples = 0 are refused."""
    assert EvalConfig(num_samples=4).resolved_pass_k() == [1, 4]
    assert EvalConfig().resolved_pass_k() == [1]
    assert EvalConfig(num_samples=4, pass_k=[2, 2]).resolved_pass_k() == [2]
    with pytest.raises(ValueError, match=r"pass@k needs 1 <= k <= num_samples \(4\); got k=\[0\]"):
        EvalConfig(num_samples=4, pass_k=[0, 1]).resolved_pass_k()
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        EvalConfig(num_samples=0).resolved_pass_k()


def test_pass_at_k_refuses_more_correct_samples_than_samples():
    """pass_at_k(n, c, k) with c > n is an error, not a number."""
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(2, -1, 1)


def test_math_verify_plain_is_math_verify_s_own_comparison():
    """math_grader='math_verify_plain' scores without the answer rules (5! for 120 passes); 'math_verify'
    keeps them."""
    problem, completion = math_problem(answer="120"), ["The answer is $\\boxed{5!}$."]
    plain = EvalConfig(math_grader="math_verify_plain").math_reward()
    ruled = EvalConfig(math_grader="math_verify").math_reward()
    assert score_completions([problem], completion, math_reward=plain)[0]["reward"] == 1.0
    assert score_completions([problem], completion, math_reward=ruled)[0]["reward"] == 0.0


# ------------------------------------------------------------------------------------------------ scoring


def test_score_completions_needs_one_completion_per_problem():
    """A completions list of another length than the problems is refused, not zipped short."""
    with pytest.raises(ValueError, match="2 problems but 1 completions"):
        score_completions([math_problem(), math_problem()], ["\\boxed{3}"])


CODE = EvalProblem(id="c0", prompt="Write f.", task="code",
                   tests=["assert f() == 1", "assert f() == 2", "assert f() == 3", "assert f() == 4"])


def test_a_code_completion_without_code_counts_every_test():
    """A code completion with no code block fails all of the problem's tests (tests_total is their number)."""
    [result] = score_completions([CODE], ["I cannot write it."])
    assert result == {"reward": 0.0, "status": "no_code", "tests_passed": 0, "tests_total": 4, "errors": []}


def test_a_failing_program_keeps_its_first_three_errors():
    """The errors recorded for a failing code completion are the first three."""
    [result] = score_completions([CODE], ["```python\ndef f():\n    return 0\n```"])
    assert result["reward"] == 0.0 and result["tests_total"] == 4 and result["tests_passed"] == 0
    assert len(result["errors"]) == 3


# ------------------------------------------------------------------------------------------------ prompts


def test_the_system_prompt_is_the_chat_s_first_message():
    """system_prompt goes into the chat template's prompt, before the user turn."""
    tokenizer = build_tokenizer()
    problem = math_problem()
    with_system = format_prompt(tokenizer, problem, EvalConfig(apply_chat_template=True, system_prompt="Be brief."))
    without = format_prompt(tokenizer, problem, EvalConfig(apply_chat_template=True))
    assert "Be brief." in with_system and "Be brief." not in without
    assert with_system.index("Be brief.") < with_system.index(problem.prompt)


# ------------------------------------------------------------------------------------------------ evaluate()


def test_a_batch_size_below_one_is_refused(model_and_tokenizer):
    """batch_size=0 is refused by name before any generation."""
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        evaluate(model=model, tokenizer=tokenizer, dataset=MATH, batch_size=0, **FAST)


def test_a_loaded_model_without_its_tokenizer_is_refused(model_and_tokenizer):
    """A model object given without a tokenizer is refused with the fix, not an AttributeError."""
    model, _ = model_and_tokenizer
    with pytest.raises(ValueError, match="a loaded model needs its tokenizer"):
        evaluate(model=model, dataset=MATH, **FAST)


def test_greedy_samples_of_a_problem_are_warned_about(model_and_tokenizer, caplog):
    """num_samples=2 with greedy decoding warns that the samples will be the same."""
    model, tokenizer = model_and_tokenizer
    with caplog.at_level(logging.WARNING, logger=evaluate_module.__name__):
        evaluate(model=model, tokenizer=tokenizer, dataset=MATH[:1], num_samples=2, **FAST)
    assert "num_samples=2 with greedy decoding" in caplog.text


def test_the_report_of_rows_given_directly(model_and_tokenizer, tmp_path):
    """Rows given directly are the 'custom' dataset; a math report has no code grader; the report returned is the
    metrics file's content."""
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset=MATH, **{**FAST, "output_dir": str(tmp_path)})
    assert report["dataset"] == report["dataset_name"] == "custom"
    assert report["math_grader"] == "math_verify" and report["code_grader"] is None
    assert isinstance(report["generation"]["stop_token_ids"], list)
    assert json.loads(open(report["metrics_file"]).read()) == report
    rows = [json.loads(line) for line in open(report["samples_file"]).read().splitlines()]
    assert len(rows) == 2 and all(row["denoising_steps"] >= 1 and row["tokens_per_step"] > 0 for row in rows)


def test_the_earlier_name_dataset_split_is_still_accepted(model_and_tokenizer):
    """evaluate(dataset_split=...) is the earlier name of dataset_test_split."""
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset=MATH, dataset_split="validation", **FAST)
    assert report["num_problems"] == 2


def test_a_model_without_diffusion_generation_is_refused(model_and_tokenizer):
    """A model object that is no trl_diffusion model is refused by name."""
    import torch

    _, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="Linear is not a trl_diffusion model"):
        evaluate(model=torch.nn.Linear(2, 2), tokenizer=tokenizer, dataset=MATH, **FAST)


def test_a_report_written_before_sources_were_recorded_is_replaced(model_and_tokenizer, tmp_path):
    """A metrics file without 'sources' (an older report) is replaced by the next run into the same files."""
    model, tokenizer = model_and_tokenizer
    settings = {**FAST, "output_dir": str(tmp_path)}
    report = evaluate(model=model, tokenizer=tokenizer, dataset=MATH, **settings)
    with open(report["metrics_file"], "w") as handle:
        json.dump({key: value for key, value in report.items() if key != "sources"}, handle)
    again = evaluate(model=model, tokenizer=tokenizer, dataset=MATH, **settings)
    assert again["metrics_file"] == report["metrics_file"]
    assert json.loads(open(report["metrics_file"]).read())["sources"] == report["sources"]


def test_a_problem_one_position_too_long_is_refused(model_and_tokenizer):
    """A prompt and its new tokens needing one position more than the model has is refused before generating; one
    that needs exactly the model's positions runs."""
    _, tokenizer = model_and_tokenizer
    rows = [{"question": "1+1=", "answer": "2"}]  # 4 tokens (character-level, no BOS) + 4 new = 8 positions
    settings = dict(tokenizer=tokenizer, dataset=rows, prompt_template="{question}", apply_chat_template=False, **FAST)
    with pytest.raises(ValueError, match=r"1 of 1 problems do not fit the model's 7 positions: 'rows/0'|"
                                         r"do not fit the model's 7 positions: .*needs 8"):
        evaluate(model=tiny_model("dream", max_position_embeddings=7), **settings)
    assert evaluate(model=tiny_model("dream", max_position_embeddings=8), **settings)["num_problems"] == 1


def test_the_arithmetic_task_is_named_whatever_its_case(model_and_tokenizer):
    """dataset='Arithmetic' is the built-in task, identified as 'arithmetic' in the report's sources."""
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset="Arithmetic", max_problems=2, **FAST)
    assert report["dataset"] == "arithmetic" and report["sources"]["dataset"] == "arithmetic"
