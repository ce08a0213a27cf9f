"""``evaluate(resume=True)`` / ``--resume``: an interrupted evaluation keeps the samples it wrote and generates only
the missing ones, and its report is that of an uninterrupted run; a resume of another evaluation is refused."""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path

import pytest

from trl_diffusion.eval import evaluate

ev = importlib.import_module("trl_diffusion.eval.evaluate")  # the module (the package attribute is the function)
SCORE, LINE = ev.score_completions, ev.sample_line
EVAL = dict(dataset_name="arithmetic", num_samples=2, temperature=1.0, batch_size=3, progress=False)
TIMING = {"generation_seconds", "throughput_tokens_per_s", "num_forward_passes", "tokens_per_step"}


def samples(report: dict) -> dict[tuple[int, int], dict]:
    rows = [json.loads(line) for line in Path(report["samples_file"]).read_text().splitlines()]
    keyed = {(row["index"], row["sample"]): row for row in rows}
    assert len(keyed) == len(rows)
    return keyed


def same_metrics(a: dict, b: dict) -> bool:
    return {k: v for k, v in a["metrics"].items() if k not in TIMING} == {
        k: v for k, v in b["metrics"].items() if k not in TIMING}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """An uninterrupted run of 10 problems."""
    return evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path_factory.mktemp("full")))


class Interrupted(Exception):
    """Stands for whatever ended the run (a lost node, an out-of-memory error, Ctrl-C)."""


def scoring(monkeypatch, fail_at: int | None = None) -> list[int]:
    """Count the samples scored (one entry per batch); raise at batch ``fail_at`` (an interruption)."""
    batches = []

    def counted(problems, *args):
        if len(batches) == fail_at:
            raise Interrupted
        batches.append(len(problems))
        return SCORE(problems, *args)

    monkeypatch.setattr(ev, "score_completions", counted)
    return batches


def test_an_interrupted_run_resumes_to_the_uninterrupted_report(full, tmp_path, monkeypatch):
    path = tmp_path / Path(full["samples_file"]).name
    on_disk = []  # what a killed process would have left (no close, no flush at exit): each batch is flushed
    monkeypatch.setattr(ev, "sample_line", lambda row: on_disk.append(
        path.read_text().count("\n") if path.exists() else 0) or LINE(row))
    with pytest.raises(Interrupted):
        scoring(monkeypatch, fail_at=2)
        evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path))
    assert on_disk == [0, 0, 0, 3, 3, 3]
    monkeypatch.setattr(ev, "sample_line", LINE)
    assert len(path.read_text().splitlines()) == 6 and not path.with_suffix(".metrics.json").exists()
    with path.open("a") as handle:
        handle.write('{"id": "arithmetic/9", "ind')  # a line the interruption cut short
    batches = scoring(monkeypatch)
    resumed = evaluate(**{**EVAL, "batch_size": 4}, max_problems=10, output_dir=str(tmp_path), resume=True)
    assert resumed["num_resumed"] == 6 and sum(batches) == 14  # only the missing samples were generated
    assert samples(resumed) == samples(full) and same_metrics(resumed, full)
    assert 0 < full["metrics"]["accuracy"] < 1
    again = evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path), resume=True)  # nothing left to generate
    assert again["num_resumed"] == 20 and samples(again) == samples(full) and same_metrics(again, full)


def test_a_resume_may_add_problems_and_read_part_files(full, tmp_path, monkeypatch):
    first = evaluate(**EVAL, max_problems=4, output_dir=str(tmp_path))
    path = Path(first["samples_file"])
    rows = path.read_text().splitlines()
    path.write_text("".join(line + "\n" for line in rows[:3]))  # the rest in an interrupted launch's part file
    path.with_name(path.name + ".part1").write_text("".join(line + "\n" for line in rows[3:]) + "not json\n")
    batches = scoring(monkeypatch)
    more = evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path), resume=True)
    assert more["num_resumed"] == 8 and sum(batches) == 12
    assert samples(more) == samples(full) and same_metrics(more, full)
    assert not list(tmp_path.glob("*.part*"))


@pytest.mark.parametrize("change, named", [({"temperature": 0.5}, "temperature"), ({"seed": 1}, "seed"),
                                           ({"math_grader": "official"}, "math_grader")])
def test_a_resume_of_another_evaluation_is_refused(full, tmp_path, change, named):
    shutil.copytree(Path(full["samples_file"]).parent, tmp_path, dirs_exist_ok=True)
    with pytest.raises(ValueError, match=f"cannot resume .* other settings .*{named}"):
        evaluate(**{**EVAL, **change}, max_problems=10, output_dir=str(tmp_path), resume=True)


def test_a_resume_without_a_run_card_or_output_dir_is_refused(full, tmp_path):
    shutil.copytree(Path(full["samples_file"]).parent, tmp_path, dirs_exist_ok=True)
    next(tmp_path.glob("*.run.json")).unlink()
    with pytest.raises(ValueError, match="no run card"):
        evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path), resume=True)
    with pytest.raises(ValueError, match="set --output_dir"):
        evaluate(**EVAL, max_problems=10, output_dir="", resume=True)


def test_rows_of_a_problem_that_changed_are_made_again(tmp_path, monkeypatch):
    data = tmp_path / "problems.jsonl"

    def write(questions, wrong=()):
        data.write_text("".join(json.dumps({"question": f"What is {q}?", "answer": f"#### {eval(q) + (q in wrong)}"})
                                + "\n" for q in questions))

    write(["12+30", "7+8", "100-1", "6+6"], wrong=["6+6"])
    config = {**EVAL, "dataset_name": str(data), "output_dir": str(tmp_path / "out"), "max_new_tokens": 16,
              "prompt_template": "{question}\n", "apply_chat_template": False}
    before = samples(evaluate(**config))
    # the file was edited (its path, the dataset's identity, is the same): a question and a gold answer changed
    write(["12+30", "7+8", "100-2", "6+6"])
    batches = scoring(monkeypatch)
    report = evaluate(**config, resume=True)
    assert report["num_resumed"] == 4 and sum(batches) == 4
    after = samples(report)
    assert {key: row for key, row in after.items() if key[0] < 2} == {k: r for k, r in before.items() if k[0] < 2}
    assert all("100-2" in after[2, sample]["prompt"] for sample in (0, 1))
    assert {after[3, sample]["gold"] for sample in (0, 1)} == {"12"} and before[3, 0]["gold"] == "13"


def test_the_run_card_holds_the_dtype_the_weights_were_loaded_in(full, tmp_path):
    shutil.copytree(Path(full["samples_file"]).parent, tmp_path, dirs_exist_ok=True)
    same = evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path), resume=True, dtype="float32")  # auto on a CPU
    assert same["num_resumed"] == 20
    with pytest.raises(ValueError, match="other settings .*dtype: 'torch.float32' -> 'torch.bfloat16'"):
        evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path), resume=True, dtype="bfloat16")


def test_an_interrupted_run_of_another_model_is_not_replaced(tmp_path, monkeypatch):
    from trl_diffusion.assets import EMBEDDED_MODEL, resolve_model_path

    for run in ("runA", "runB"):  # two checkpoints whose files share a name
        shutil.copytree(resolve_model_path(EMBEDDED_MODEL), tmp_path / run / "checkpoint-100")
    with pytest.raises(Interrupted):
        scoring(monkeypatch, fail_at=1)
        evaluate(**EVAL, max_problems=4, model_name_or_path=str(tmp_path / "runA" / "checkpoint-100"),
                 output_dir=str(tmp_path / "out"))
    scoring(monkeypatch)
    with pytest.raises(ValueError, match="runA.* which this run .*runB.* would replace"):
        evaluate(**EVAL, max_problems=4, model_name_or_path=str(tmp_path / "runB" / "checkpoint-100"),
                 output_dir=str(tmp_path / "out"))
    resumed = evaluate(**EVAL, max_problems=4, model_name_or_path=str(tmp_path / "runA" / "checkpoint-100"),
                       output_dir=str(tmp_path / "out"), resume=True)
    assert resumed["num_resumed"] == 3  # the interrupted run's first batch


def test_part_files_are_found_by_their_exact_name_and_the_card_comes_last(tmp_path, monkeypatch):
    from trl_diffusion.eval import resume

    odd, other = tmp_path / "m[1]__arithmetic.jsonl", tmp_path / "m1__arithmetic.jsonl"
    for path in (resume.part_path(odd, 0), resume.part_path(other, 0)):
        path.write_text("{}\n")
    assert resume.part_paths(odd) == [resume.part_path(odd, 0)]  # "[1]" is no glob character class here
    resume.write_card(other, {"run": "A"})
    monkeypatch.setattr(resume, "part_paths", lambda path: (_ for _ in ()).throw(OSError("stopped here")))
    with pytest.raises(OSError):  # a run stopped while it cleared the earlier run's part files ...
        resume.start_files(other, {"run": "B"}, [])
    assert json.loads(resume.card_path(other).read_text()) == {"run": "A"}  # ... left them beside their own card


def test_a_line_cut_inside_a_character_is_dropped(full, tmp_path):
    shutil.copytree(Path(full["samples_file"]).parent, tmp_path, dirs_exist_ok=True)
    path = tmp_path / Path(full["samples_file"]).name
    path.with_suffix(".metrics.json").unlink()
    with path.open("ab") as handle:
        handle.write('{"id": "arithmetic/9", "completion": "×'.encode()[:-1])  # half of a two-byte character
    resumed = evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path), resume=True)
    assert resumed["num_resumed"] == 20 and samples(resumed) == samples(full)


def test_weights_saved_again_in_place_are_another_run(tmp_path):
    import torch

    from trl_diffusion.assets import EMBEDDED_MODEL, resolve_model_path

    folder = tmp_path / "final"
    shutil.copytree(resolve_model_path(EMBEDDED_MODEL), folder)
    config = {**EVAL, "max_problems": 2, "model_name_or_path": str(folder), "output_dir": str(tmp_path / "out")}
    evaluate(**config)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    model.save_pretrained(folder)  # a later training step written over the same folder
    with pytest.raises(ValueError, match="other settings .*weights: "):
        evaluate(**config, resume=True)


def test_a_resume_reads_settings_as_resolved_and_paths_as_resolved(full, tmp_path, monkeypatch):
    import trl_diffusion
    from trl_diffusion.eval.evaluate import EvalConfig, load_model_and_tokenizer

    shutil.copytree(Path(full["samples_file"]).parent, tmp_path / "out", dirs_exist_ok=True)
    again = evaluate(**EVAL, max_problems=10, output_dir=str(tmp_path / "out"), resume=True,
                     max_new_tokens=16, block_length=4)  # the task's and the model's own values, spelled out
    assert again["num_resumed"] == 20
    model, tokenizer = load_model_and_tokenizer(EvalConfig(device="cpu"))
    given = {**EVAL, "max_problems": 2, "output_dir": str(tmp_path / "objects")}
    package = Path(trl_diffusion.__file__).parent
    monkeypatch.chdir(package)
    evaluate(model=model, tokenizer=tokenizer, model_name_or_path="assets/tiny-sdar-arithmetic", **given)
    monkeypatch.chdir(package.parent)  # the same folder named from another directory
    resumed = evaluate(model=model, tokenizer=tokenizer, **given, resume=True,
                       model_name_or_path="trl_diffusion/assets/tiny-sdar-arithmetic")
    assert resumed["num_resumed"] == 4
