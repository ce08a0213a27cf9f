"""Names given to ``trl-diffusion eval`` mean what they say: a local file called ``arithmetic.jsonl`` is not the
built-in task (it got the task's 16-token, greedy, batch-100 settings and no length warning); runs whose output
files share a name (``runA/checkpoint-100`` and ``runB/checkpoint-100``, ``a/test.jsonl`` and ``b/test.jsonl``) do
not silently replace each other's results; a folder named like a benchmark does not hide it; a config file takes a
flag's alias (``dataset:``), but not beside the flag's own name."""

import json
import shutil
from pathlib import Path

import pytest

from trl_diffusion.cli import main
from trl_diffusion.eval import evaluate, load_eval_problems
from trl_diffusion.testing import build_tokenizer, tiny_model

GSM8K = Path(__file__).parent / "fixtures" / "rewards" / "gsm8k_sample.jsonl"
FAST = dict(block_length=4, denoising_steps=4, progress=False, max_problems=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("runA") / "checkpoint-100"
    tiny_model("sdar", max_position_embeddings=2048).save_pretrained(folder)
    build_tokenizer().save_pretrained(folder)
    return folder


def test_a_file_named_arithmetic_is_not_the_built_in_task(model_dir, tmp_path):
    for name in ("arithmetic.jsonl", "other.jsonl"):
        shutil.copy(GSM8K, tmp_path / name)
    reports = [evaluate(model_name_or_path=str(model_dir), dataset_name=str(tmp_path / name), output_dir="",
                        max_new_tokens=None, **FAST) for name in ("arithmetic.jsonl", "other.jsonl")]
    assert reports[0]["generation"] == reports[1]["generation"]
    assert reports[0]["generation"]["max_new_tokens"] == 128  # the family default, not the task's 16
    assert reports[0]["dataset_name"] == str(tmp_path / "arithmetic.jsonl")


def test_results_of_another_model_or_dataset_are_not_replaced(model_dir, tmp_path):
    out = tmp_path / "eval_results"
    run = dict(output_dir=str(out), max_new_tokens=8, **FAST)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    shutil.copy(GSM8K, tmp_path / "a" / "test.jsonl")
    shutil.copy(GSM8K, tmp_path / "b" / "test.jsonl")
    first = evaluate(model_name_or_path=str(model_dir), dataset_name=str(tmp_path / "a" / "test.jsonl"), **run)
    evaluate(model_name_or_path=str(model_dir), dataset_name=str(tmp_path / "a" / "test.jsonl"), **run)  # re-run
    written = Path(first["metrics_file"]).read_text()
    with pytest.raises(ValueError, match="holds the results of model .* pass another --output_dir"):
        evaluate(model_name_or_path=str(model_dir), dataset_name=str(tmp_path / "b" / "test.jsonl"), **run)
    other = tmp_path / "runB" / "checkpoint-100"
    shutil.copytree(model_dir, other)
    with pytest.raises(ValueError, match="holds the results of model"):
        evaluate(model_name_or_path=str(other), dataset_name=str(tmp_path / "a" / "test.jsonl"), **run)
    assert Path(first["metrics_file"]).read_text() == written  # refused before anything was written


def test_rows_given_directly_do_not_replace_the_results_of_other_rows(model_dir, tmp_path):
    # every set of rows was the dataset "custom": evaluating other rows with the same model silently replaced the
    # first set's results
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    run = dict(model_name_or_path=str(model_dir), output_dir=str(tmp_path), max_new_tokens=4, **FAST)
    first = evaluate(dataset=rows[:2], **run)
    assert first["sources"]["dataset"].startswith("custom:") and first["dataset_name"] == "custom"
    evaluate(dataset=[dict(row) for row in rows[:2]], **run)  # the same rows again: replaced, as documented
    evaluate(dataset=rows[:2], **{**run, "max_problems": 1})  # a slice of them, as of a file: replaced too
    evaluate(dataset=[{**row, 0: "extra"} for row in rows[:2]], **{**run, "output_dir": str(tmp_path / "other")})
    first = evaluate(dataset=rows[:2], **run)
    written = Path(first["metrics_file"]).read_text()
    with pytest.raises(ValueError, match="holds the results of model .* on dataset 'custom:"):
        evaluate(dataset=rows[2:4], **run)
    assert Path(first["metrics_file"]).read_text() == written


def test_a_model_given_as_an_object_is_identified_by_its_weights(model_dir, tmp_path):
    """A fine-tuned model keeps its base model's ``name_or_path``: evaluated as an object into the same output_dir,
    it silently replaced the base model's results (and carried its name); two models built in memory, named
    "model" both, replaced each other's."""
    import torch
    from transformers import AutoModelForCausalLM

    run = dict(dataset_name=str(GSM8K), output_dir=str(tmp_path), max_new_tokens=4, **FAST)
    first = evaluate(model_name_or_path=str(model_dir), **run)
    written = Path(first["metrics_file"]).read_text()
    tuned = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = build_tokenizer()
    again = evaluate(model=tuned, tokenizer=tokenizer, **{**run, "output_dir": str(tmp_path / "objects")})
    assert again["sources"]["model"].startswith("in-memory:SDARForCausalLM:")
    assert evaluate(model=tuned, tokenizer=tokenizer, **{**run, "output_dir": str(tmp_path / "objects")})[
        "sources"] == again["sources"]  # the same weights again: the same model, replaced as documented
    with torch.no_grad():
        next(tuned.parameters()).add_(0.01)
    with pytest.raises(ValueError, match="holds the results of model"):
        evaluate(model=tuned, tokenizer=tokenizer, **run)  # the path-loaded base model's results
    with pytest.raises(ValueError, match="holds the results of model 'in-memory:SDARForCausalLM:"):
        evaluate(model=tuned, tokenizer=tokenizer, **{**run, "output_dir": str(tmp_path / "objects")})
    assert Path(first["metrics_file"]).read_text() == written


def test_an_adapters_state_is_part_of_an_in_memory_models_identity():
    """A LoRA model's base with the adapter on and off are other models (their completions differ); the digest is
    exact (integer sums of the weights' bits), so the same weights get the same identity with any thread count."""
    import torch
    from peft import LoraConfig, get_peft_model

    from trl_diffusion.eval.evaluate import _in_memory_source

    peft_model = get_peft_model(tiny_model("sdar"), LoraConfig(r=4, target_modules=["q_proj"],
                                                                init_lora_weights=False))
    base = peft_model.get_base_model()
    with_adapter = _in_memory_source(base, "model")
    with peft_model.disable_adapter():
        assert _in_memory_source(base, "model") != with_adapter
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert _in_memory_source(base, "model") == with_adapter
    finally:
        torch.set_num_threads(threads)
    # the same adapter weights at another lora_alpha scale them otherwise: another model (its scaling is no parameter)
    torch.manual_seed(0)
    low = get_peft_model(tiny_model("sdar"), LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj"],
                                                         init_lora_weights=False)).get_base_model()
    torch.manual_seed(0)
    high = get_peft_model(tiny_model("sdar"), LoraConfig(r=4, lora_alpha=256, target_modules=["q_proj"],
                                                          init_lora_weights=False)).get_base_model()
    assert all(torch.equal(a, b) for a, b in zip(low.parameters(), high.parameters()))
    assert _in_memory_source(low, "model") != _in_memory_source(high, "model")


def test_a_folder_named_like_a_benchmark_does_not_hide_it(tmp_path, monkeypatch):
    import datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "mydata").mkdir()
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    asked = []
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda path, *args, **kwargs: asked.append(path) or datasets.Dataset.from_list(rows))
    assert load_eval_problems("gsm8k", max_problems=1)[0] == "gsm8k"
    assert asked == ["hf://datasets/openai/gsm8k"]  # the Hub only: load_dataset("openai/gsm8k") reads a folder first
    with pytest.raises(ValueError, match="'mydata' is a folder here: give a file in it"):
        load_eval_problems("mydata")


def test_a_config_file_takes_a_flags_alias(model_dir, tmp_path, capsys):
    config = tmp_path / "eval.yaml"
    config.write_text(f"dataset: {GSM8K}\nmodel_name_or_path: {model_dir}\nmax_problems: 1\nmax_new_tokens: 4\n"
                      "output_dir: ''\nprogress: false\n")
    assert main(["eval", "--config", str(config)]) == 0
    assert json.loads(capsys.readouterr().out)["dataset_name"] == str(GSM8K)


def test_a_config_file_giving_a_flag_and_its_alias_is_one_line(model_dir, tmp_path, capsys):
    """``dataset:`` beside ``dataset_name:`` named one option twice, and whichever key came last was evaluated."""
    config = tmp_path / "eval.yaml"
    config.write_text(f"dataset_name: gsm8k\ndataset: {GSM8K}\nmodel_name_or_path: {model_dir}\n")
    assert main(["eval", "--config", str(config)]) == 2
    assert "config file: dataset and dataset_name name the same option; keep one" in capsys.readouterr().err


def test_the_same_model_and_dataset_from_another_folder_replace_their_results(model_dir, tmp_path, monkeypatch):
    import datasets

    out = tmp_path / "eval_results"
    monkeypatch.chdir(model_dir.parent)
    evaluate(model_name_or_path=model_dir.name, dataset_name=str(GSM8K), output_dir=str(out), max_new_tokens=4,
             **FAST)
    monkeypatch.chdir(model_dir.parent.parent)  # the same folder, named from its parent
    evaluate(model_name_or_path=f"{model_dir.parent.name}/{model_dir.name}", dataset_name=str(GSM8K),
             output_dir=str(out), max_new_tokens=4, **FAST)
    rows = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: datasets.Dataset.from_list(rows))
    hub = dict(model_name_or_path=str(model_dir), output_dir=str(out), max_new_tokens=4, **FAST)
    evaluate(dataset_name="someone/set", dataset_test_split="validation", **hub)
    with pytest.raises(ValueError, match="holds the results of model"):  # another split: other results
        evaluate(dataset_name="someone/set", dataset_test_split="test", **hub)


def test_a_folder_with_a_hub_ids_path_is_not_read_instead_of_the_hub_dataset(tmp_path, monkeypatch):
    # `load_dataset("HuggingFaceH4/MATH-500")` reads ./HuggingFaceH4/MATH-500 when that folder exists: `math500`
    # evaluated the folder's rows, and the report still named the benchmark
    import datasets

    monkeypatch.chdir(tmp_path)
    (tmp_path / "HuggingFaceH4" / "MATH-500").mkdir(parents=True)
    shutil.copy(GSM8K, tmp_path / "HuggingFaceH4" / "MATH-500" / "test.jsonl")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # no network here: the Hub is unreachable
    for name in ("math500", "HuggingFaceH4/MATH-500"):
        with pytest.raises(ValueError, match="could not load Hub dataset .*a local folder of that name is not read"):
            load_eval_problems(name)


def test_a_json_lines_file_with_a_line_that_is_not_an_object_is_named(tmp_path):
    # a list on line 2 crashed with "AttributeError: 'list' object has no attribute 'items'"; a broken line was
    # reported as "line 1" (each line is parsed alone)
    first = '{"problem": "What is 1+1?", "answer": "2"}'
    cases = {'["a list"]': "line 2 is a list", '"a string"': "line 2 is a str",
             '{"problem": "What is 2+2?", "answer": "4"': "line 2: Expecting"}
    for line, message in cases.items():
        path = tmp_path / "mixed.jsonl"
        path.write_text(f"{first}\n{line}\n{first}\n")
        with pytest.raises(ValueError, match=message):
            load_eval_problems(str(path))


def test_eval_config_names_a_missing_dataset_and_an_output_dir_that_is_a_file(tmp_path):
    from trl_diffusion.eval.evaluate import EvalConfig

    for name in (None, "  "):
        with pytest.raises(ValueError, match="dataset_name must name a dataset"):
            EvalConfig(dataset_name=name)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="output_dir .* is a file, not a folder"):
        EvalConfig(output_dir=str(tmp_path / "afile"))


def test_metrics_over_no_scored_sample_are_none_not_zero():
    # an accuracy of 0.0 over zero scored samples read as "all wrong"
    from trl_diffusion.eval.datasets import EvalProblem
    from trl_diffusion.eval.evaluate import _metrics

    problems = [EvalProblem("0", "What is 1+1?", "math", answer="$$")]
    rows = [{"index": 0, "reward": None, "correct": False, "length": 3, "clipped": False, "prediction": None}] * 2
    metrics = _metrics(rows, problems, 2, [1, 2])
    assert metrics["accuracy"] is None and metrics["pass@1"] is None and metrics["num_unscored"] == 2
    rows = [dict(rows[0], reward=1.0, correct=True), rows[1]]  # one of two scored: no complete problem
    metrics = _metrics(rows, problems, 2, [1])
    assert metrics["accuracy"] == 1.0 and metrics["pass@1"] is None



def test_samples_the_sandbox_could_not_run_are_counted_and_named(monkeypatch, caplog):
    """A sandbox failure (the program never ran) scores 0.0, never a pass the program could provoke; it lowered
    accuracy with nothing in the metrics saying why."""
    import logging

    import trl_diffusion.rewards.sandbox as sandbox
    from trl_diffusion.eval.datasets import EvalProblem
    from trl_diffusion.eval.evaluate import _metrics, score_completions

    problem = EvalProblem("add", "write add", "code", tests=["assert add(1, 2) == 3"])
    good = "```python\ndef add(a, b):\n    return a + b\n```"

    def row(score):
        return {"index": 0, "sample": 0, "length": 1, "clipped": False, **score, "correct": score["reward"] == 1.0}

    ran = _metrics([row(score_completions([problem], [good])[0])], [problem], 1, [1])
    assert ran["accuracy"] == 1.0 and ran["num_sandbox_errors"] == 0
    monkeypatch.setattr(sandbox, "_get_launcher", lambda *args, **kwargs: None)
    failed = score_completions([problem], [good])[0]
    assert failed["status"] == "sandbox_error" and failed["reward"] == 0.0
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.eval.evaluate"):
        metrics = _metrics([row(failed)], [problem], 1, [1])
    assert metrics["accuracy"] == 0.0 and metrics["num_sandbox_errors"] == 1
    assert "1 of 1 samples scored 0.0 because the sandbox could not run their program" in caplog.text
