"""Tests for the evaluation loop and the ``trl-diffusion`` command on small fixtures in the real benchmark formats."""

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from trl_diffusion.cli import main
from trl_diffusion.eval import EvalConfig, detect_format, evaluate, load_eval_problems, pass_at_k, score_completions
from trl_diffusion.testing import build_tokenizer, tiny_model

FIXTURES = Path(__file__).parent / "fixtures"
MATH500 = FIXTURES / "rewards" / "math500_sample.jsonl"
GSM8K = FIXTURES / "rewards" / "gsm8k_sample.jsonl"
AIME24 = FIXTURES / "rewards" / "aime24_sample.jsonl"
HUMANEVAL = FIXTURES / "eval" / "humaneval_sample.jsonl"
CODE_TESTS = FIXTURES / "eval" / "code_tests_sample.jsonl"
FAST = dict(max_new_tokens=8, block_length=4, denoising_steps=4, progress=False)


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    return tiny_model("sdar", max_position_embeddings=2048), build_tokenizer()


def test_pass_at_k_matches_hand_computation():
    # n=5 samples, c=2 correct: pass@1 = 2/5; pass@2 = 1 - C(3,2)/C(5,2) = 1 - 3/10; pass@3 = 1 - C(3,3)/C(5,3).
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert pass_at_k(5, 0, 3) == 0.0
    assert pass_at_k(5, 3, 3) == 1.0  # fewer than k wrong samples: some k-subset always has a correct one
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


@pytest.mark.parametrize("path, fmt, task", [
    (MATH500, "problem_answer", "math"), (AIME24, "problem_answer", "math"), (GSM8K, "question_answer", "math"),
    (HUMANEVAL, "humaneval", "code"), (CODE_TESTS, "code_tests", "code"),
])
def test_formats_are_detected_from_columns(path, fmt, task):
    assert detect_format(_rows(path)[0]) == fmt
    tag, problems = load_eval_problems(str(path))
    assert tag == path.stem and len(problems) == len(_rows(path)) and {p.task for p in problems} == {task}


def test_gold_answers_prompts_and_tests():
    _, gsm8k = load_eval_problems(str(GSM8K))
    assert gsm8k[0].answer == "18" and "\\boxed{}" in gsm8k[0].prompt and "Janet" in gsm8k[0].prompt
    _, humaneval = load_eval_problems(str(HUMANEVAL))
    assert humaneval[0].id == "HumanEvalStyle/0" and humaneval[0].tests[0].rstrip().endswith("check(running_max)")
    _, code = load_eval_problems(str(CODE_TESTS), prompt_template="Solve: {question}")
    assert [p.stdio for p in code] == [True, False] and len(code[0].tests) == 3 and code[1].prompt.startswith("Solve:")
    _, arithmetic = load_eval_problems("arithmetic", max_problems=3)
    assert len(arithmetic) == 3 and arithmetic[0].prompt.startswith("What is ")


STDIO_FORGERY = """
import sys


class Always(str):  # a str that equals everything, and whose split() does too
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__

    def split(self, *args):
        return Always()


harness = sys._getframe(1).f_globals  # the frame that exec()s this program: the stdio harness
harness["_stdio_run"] = lambda stdin_text: Always("forged")
print(0)
"""


def test_stdio_tests_are_decided_outside_the_sandbox():
    """Every stdio test is a probe (the program's output) plus a comparison made in this process: a correct program
    passes with all tests verified; a program that replaces the harness's runner with one returning always-equal
    strings, or prints a wrong answer, fails."""
    _, problems = load_eval_problems(str(CODE_TESTS))
    stdio = problems[0]
    assert stdio.stdio and all("_stdio_run(" in t and ".split() ==" in t for t in stdio.tests)
    solution = _rows(CODE_TESTS)[0]["solution"]
    right, forged, wrong = score_completions([stdio] * 3, [f"```python\n{c}```" for c in (
        solution, STDIO_FORGERY, "print(0)\n")])
    assert right["reward"] == 1.0 and right["tests_verified"] == right["tests_total"] == 3
    assert forged["reward"] == 0.0 and forged["tests_verified"] == 3
    assert wrong["reward"] == 0.0 and wrong["tests_passed"] == 1  # "-5 5" -> "0" is right by chance


def test_hub_names_map_to_their_sources(monkeypatch):
    import datasets

    calls = []

    def fake_load_dataset(repo, config=None, split=None):
        calls.append((repo, config, split))
        return datasets.Dataset.from_list(_rows(GSM8K))

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    tag, problems = load_eval_problems("gsm8k", max_problems=2)
    assert tag == "gsm8k" and len(problems) == 2 and problems[0].answer == "18"
    load_eval_problems("someone/their_set", split="eval")
    assert calls == [("hf://datasets/openai/gsm8k", "main", "test"), ("hf://datasets/someone/their_set", None, "eval")]


def test_scoring_reference_solutions():
    math500 = _rows(MATH500)
    _, problems = load_eval_problems(str(MATH500))
    assert [r["reward"] for r in score_completions(problems, [r["solution"] for r in math500])] == [1.0] * 5
    shifted = score_completions(problems, [r["solution"] for r in math500[1:] + math500[:1]])
    assert sum(r["reward"] for r in shifted) == 0.0
    for path in (HUMANEVAL, CODE_TESTS):
        _, problems = load_eval_problems(str(path))
        rows = _rows(path)
        code = [r["prompt"] + r["canonical_solution"] if "canonical_solution" in r else r["solution"] for r in rows]
        right = [f"```python\n{c}```" for c in code]
        assert [s["reward"] for s in score_completions(problems, right)] == [1.0, 1.0], path
        wrong = score_completions(problems, ["no code here", "```python\nprint(0)\n```"])
        assert [s["reward"] for s in wrong] == [0.0, 0.0] and wrong[0]["status"] == "no_code"


def test_evaluate_report_and_jsonl(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    report = evaluate(model=model, tokenizer=tokenizer, dataset=str(MATH500), num_samples=2, temperature=1.0,
                      output_dir=str(tmp_path), **FAST)
    assert report["dataset"] == "math500_sample" and report["task"] == "math"
    assert report["num_problems"] == 5 and report["num_samples"] == 2
    metrics = report["metrics"]
    for key in ("accuracy", "pass@1", "pass@2", "avg_length", "tokens_per_step", "throughput_tokens_per_s",
                "generation_seconds", "num_forward_passes", "boxed_rate", "num_unscored"):
        assert key in metrics, key
    assert 0.0 <= metrics["accuracy"] <= 1.0 and metrics["num_unscored"] == 0 and metrics["tokens_per_step"] > 0
    assert report["generation"]["max_new_tokens"] == 8 and report["generation"]["temperature"] == 1.0
    rows = [json.loads(line) for line in Path(report["samples_file"]).read_text().splitlines()]
    assert len(rows) == 10 and {(r["index"], r["sample"]) for r in rows} == {(i, s) for i in range(5) for s in (0, 1)}
    for row in rows:
        assert {"id", "prompt", "completion", "reward", "correct", "length", "gold", "prediction"} <= set(row)
        # SDAR decodes whole blocks: the prompt's last partial block is filled too, so up to 8 + 3 tokens
        assert row["prompt"].startswith("<|im_start|>user\n") and 0 <= row["length"] <= 8 + 3
    assert metrics["accuracy"] == pytest.approx(sum(r["reward"] for r in rows) / 10)
    assert metrics["avg_length"] == pytest.approx(sum(r["length"] for r in rows) / 10)
    assert json.loads(Path(report["metrics_file"]).read_text())["metrics"] == metrics


def test_a_second_evaluation_into_the_same_files_is_refused(model_and_tokenizer, tmp_path):
    # two runs started at once into one output_dir interleaved their rows (spliced mid-line) and either run's
    # metrics described the mixture
    import fcntl

    model, tokenizer = model_and_tokenizer
    samples = tmp_path / f"{Path(model.name_or_path or 'model').name or 'model'}__math500_sample.jsonl"
    with open(samples.with_suffix(".lock"), "w") as held:  # what a running evaluation holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="another evaluation is writing"):
            evaluate(model=model, tokenizer=tokenizer, dataset=str(MATH500), output_dir=str(tmp_path), **FAST)
        assert not samples.exists()
    report = evaluate(model=model, tokenizer=tokenizer, dataset=str(MATH500), output_dir=str(tmp_path), **FAST)
    assert Path(report["samples_file"]) == samples and not samples.with_suffix(".lock").exists()


def test_an_evaluation_on_a_file_system_without_locks_runs_and_says_so(model_and_tokenizer, tmp_path, monkeypatch,
                                                                        caplog):
    # Lustre without -o flock (ENOSYS), NFS without a lock daemon (ENOLCK): the run failed before generating
    import errno
    import fcntl

    def no_locks(handle, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    model, tokenizer = model_and_tokenizer
    with caplog.at_level("WARNING"):
        report = evaluate(model=model, tokenizer=tokenizer, dataset=str(MATH500), output_dir=str(tmp_path), **FAST)
    assert Path(report["samples_file"]).is_file() and not list(tmp_path.glob("*.lock"))
    assert any("runs without the check" in record.getMessage() for record in caplog.records)


def test_an_evaluation_where_fcntl_does_not_exist_runs_and_says_so(model_and_tokenizer, tmp_path, monkeypatch,
                                                                   caplog):
    # Windows has no fcntl: the import failed every evaluation, with an output_dir or without
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` then raises ImportError
    model, tokenizer = model_and_tokenizer
    with caplog.at_level("WARNING"):
        report = evaluate(model=model, tokenizer=tokenizer, dataset=str(MATH500), output_dir=str(tmp_path), **FAST)
        evaluate(model=model, tokenizer=tokenizer, dataset=str(MATH500), output_dir="", **FAST)
    assert Path(report["samples_file"]).is_file()
    assert any("no fcntl on this system" in record.getMessage() for record in caplog.records)


def test_a_sampled_completion_does_not_depend_on_the_batch_size_or_the_problems_evaluated(model_and_tokenizer,
                                                                                           tmp_path):
    # one generator shared by every batch made each sample depend on batch_size and on the problems before it
    model, tokenizer = model_and_tokenizer

    def samples(name, **kwargs):
        report = evaluate(model=model, tokenizer=tokenizer, dataset=str(MATH500), num_samples=2, temperature=1.0,
                          output_dir=str(tmp_path / name), **FAST, **kwargs)
        rows = [json.loads(line) for line in Path(report["samples_file"]).read_text().splitlines()]
        return {(r["index"], r["sample"]): r["completion"] for r in rows}

    everything = samples("all", batch_size=10)
    assert samples("small_batches", batch_size=3) == everything
    assert samples("subset", batch_size=10, max_problems=2) == {k: v for k, v in everything.items() if k[0] < 2}
    assert len(set(everything.values())) > 1  # sampled, not greedy
    assert samples("other_seed", batch_size=10, seed=1) != everything


def test_pass_at_k_aggregation_over_samples(model_and_tokenizer, monkeypatch):
    """Pass@k of the report is the unbiased estimator averaged over problems, from each problem's n samples."""
    ev = importlib.import_module("trl_diffusion.eval.evaluate")  # the module (the package attribute is the function)

    model, tokenizer = model_and_tokenizer
    verdicts = iter([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0])  # problem 0: 1 of 4 correct; problem 1: 2 of 4
    monkeypatch.setattr(ev, "score_completions", lambda problems, *a: [{"reward": next(verdicts)} for _ in problems])
    rows = [{"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}, {"question": "What is 1+2?", "answer": "#### 3"}]
    report = evaluate(model=model, tokenizer=tokenizer, dataset=rows, num_samples=4, pass_k=[1, 2, 4], batch_size=8,
                      output_dir=None, temperature=1.0, use_cache="true", **FAST)
    metrics = report["metrics"]
    assert metrics["accuracy"] == pytest.approx(3 / 8)
    assert metrics["pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + pass_at_k(4, 2, 2)) / 2)
    assert metrics["pass@4"] == 1.0 and report["samples_file"] is None


def test_evaluate_code_dynamic_decoding_and_rows(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    rows = _rows(HUMANEVAL)
    report = evaluate(model=model, tokenizer=tokenizer, dataset=rows, remasking_strategy="low_confidence_dynamic",
                      confidence_threshold=0.5, temperature=0.0, output_dir=None, **FAST)
    assert report["dataset"] == "custom" and report["task"] == "code" and "boxed_rate" not in report["metrics"]
    assert report["generation"]["remasking_strategy"] == "low_confidence_dynamic"
    assert report["metrics"]["accuracy"] == 0.0 and report["metrics"]["pass@1"] == 0.0


def test_rows_in_a_container_that_is_not_rows_are_a_clear_error(model_and_tokenizer):
    # a DatasetDict (load_dataset without split=) or a dict of columns iterated as its keys: AttributeError 'str'
    # object has no attribute 'items'; a None question: TypeError from str.replace
    from datasets import Dataset, DatasetDict

    model, tokenizer = model_and_tokenizer
    rows = [{"problem": "What is 1+2?", "answer": "3"}]
    for container in (DatasetDict(test=Dataset.from_list(rows)), {"problem": ["What is 1+2?"], "answer": ["3"]}):
        with pytest.raises(TypeError, match=r"dataset must be rows .*pass one split \(dataset\['test'\]\)"):
            evaluate(model=model, tokenizer=tokenizer, dataset=container, output_dir=None, **FAST)
    with pytest.raises(ValueError, match="each row must be a mapping"):
        evaluate(model=model, tokenizer=tokenizer, dataset=["What is 1+2?"], output_dir=None, **FAST)
    with pytest.raises(ValueError, match=r"row 1 \(format 'problem_answer'\): the question must be text, got None"):
        evaluate(model=model, tokenizer=tokenizer, dataset=[*rows, {"problem": None, "answer": "2"}],
                 output_dir=None, **FAST)


def test_errors_are_clear(tmp_path, model_and_tokenizer):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_eval_problems(str(tmp_path / "missing.jsonl"))
    odd = tmp_path / "odd.jsonl"
    odd.write_text(json.dumps({"instruction": "x", "output": "y"}) + "\n")
    with pytest.raises(ValueError, match="unknown dataset format"):
        load_eval_problems(str(odd))
    with pytest.raises(ValueError, match="unknown dataset 'no_such_benchmark'"):
        load_eval_problems("no_such_benchmark")
    csv = tmp_path / "data.csv"
    csv.write_text("problem,answer\n1+1,2\n")
    with pytest.raises(ValueError, match="unsupported dataset file"):
        load_eval_problems(str(csv))
    no_gold = tmp_path / "no_gold.jsonl"
    no_gold.write_text(json.dumps({"problem": "1+1?", "answer": ""}) + "\n")
    with pytest.raises(ValueError, match="no usable gold answer"):
        load_eval_problems(str(no_gold))
    model, tokenizer = model_and_tokenizer

    def no_forward(module, args, kwargs):
        raise AssertionError("evaluate generated before refusing pass_k")

    # refused by the config before any generation, not by pass_at_k() once everything was sampled
    hook = model.register_forward_pre_hook(no_forward, with_kwargs=True)
    try:
        with pytest.raises(ValueError, match=re.escape("pass@k needs 1 <= k <= num_samples (2); got k=[4].")):
            evaluate(EvalConfig(num_samples=2, pass_k=[4]), model=model, tokenizer=tokenizer)
    finally:
        hook.remove()
    with pytest.raises(TypeError, match="unknown arguments"):
        evaluate(model=model, tokenizer=tokenizer, num_sample=2)
    with pytest.raises(ValueError, match="denoising_steps"):
        evaluate(model=model, tokenizer=tokenizer, dataset=str(GSM8K), block_length=2, denoising_steps=4)


def test_cli_dispatch_and_errors(capsys):
    assert main([]) == 2
    assert main(["no-such-command"]) == 2 and "unknown command" in capsys.readouterr().err
    assert main(["eval", "--dataset", "/nonexistent/data.jsonl", "--progress", "false"]) == 2
    assert "dataset file not found" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", "--help"])
    assert exit_info.value.code == 0 and "--remasking_strategy" in capsys.readouterr().out


def test_cli_entry_point_subprocess(model_and_tokenizer, tmp_path):
    model, tokenizer = model_and_tokenizer
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    script = Path(sys.executable).with_name("trl-diffusion")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trl_diffusion.cli"]
    out = tmp_path / "out"
    result = subprocess.run(
        [*command, "eval", "--model_name_or_path", str(tmp_path / "model"), "--dataset", str(CODE_TESTS),
         "--num_samples", "2", "--max_new_tokens", "4", "--block_length", "4", "--temperature", "1.0",
         "--output_dir", str(out), "--progress", "false", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["num_problems"] == 2 and report["metrics"]["pass@2"] == 0.0
    assert len((out / "model__code_tests_sample.jsonl").read_text().splitlines()) == 4


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_exact_cache_asked_of_a_full_attention_model_is_an_error(family, tmp_path):
    """``--use_cache true`` on LLaDA / Dream (no exact cache) would evaluate uncached without a word; ``prefix`` and
    ``false`` still run."""
    length = {"dream": "max_position_embeddings", "llada": "max_sequence_length"}[family]
    model, tokenizer = tiny_model(family, **{length: 2048}), build_tokenizer()
    with pytest.raises(ValueError, match="use_cache=true is the exact KV cache of block models"):
        evaluate(model=model, tokenizer=tokenizer, dataset=str(GSM8K), use_cache="true", **FAST)
    for cache in ("prefix", "false"):
        report = evaluate(model=model, tokenizer=tokenizer, dataset=str(GSM8K), use_cache=cache, max_problems=2,
                          output_dir=str(tmp_path), **FAST)
        assert report["num_problems"] == 2


def test_length_and_throughput_count_every_sample_and_its_tokens():
    """``avg_length`` is over every sample (an unscored one generated tokens too), ``clipped_ratio`` the share of
    clipped samples, and throughput completion TOKENS (not samples) per second of generation."""
    from types import SimpleNamespace

    from trl_diffusion.eval.evaluate import _metrics, _speed

    def row(index, reward, length, clipped=False):
        return {"index": index, "reward": reward, "correct": None if reward is None else reward == 1.0,
                "length": length, "clipped": clipped, "prediction": "x", "tokens_per_step": 2.0}

    rows = [row(0, 1.0, 4), row(0, 0.0, 8, clipped=True), row(1, None, 30), row(1, 1.0, 6)]
    metrics = _metrics(rows, [SimpleNamespace(task="math")], n=2, ks=[1])
    assert metrics["avg_length"] == pytest.approx((4 + 8 + 30 + 6) / 4)
    assert metrics["clipped_ratio"] == pytest.approx(1 / 4)
    assert metrics["accuracy"] == pytest.approx(2 / 3)
    generated = [row(0, 1.0, 10), row(1, 1.0, 30)]
    speed = _speed(generated, generated, 4.0, 5)
    assert speed == {"tokens_per_step": 2.0, "generation_seconds": 4.0, "throughput_tokens_per_s": 10.0,
                     "num_forward_passes": 5}
    resumed = {**row(2, 1.0, 50), "tokens_per_step": 5.0}  # kept from an interrupted run: not this run's tokens
    assert _speed([resumed, *generated], generated, 4.0, 5) == {**speed, "tokens_per_step": 3.0}
    assert _speed([resumed], [], 0.0, 0)["throughput_tokens_per_s"] is None  # nothing generated: no speed
