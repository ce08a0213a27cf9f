"""Data-parallel evaluation (``accelerate launch -m trl_diffusion.cli eval``): two CPU processes (gloo) share the
samples and give exactly the samples and metrics of one process; refusals reach every process, so none waits."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from trl_diffusion.eval import evaluate
from trl_diffusion.eval.processes import EvalProcesses, check_launch_device, check_same_inputs, describe, merge_runs

ROOT = Path(__file__).resolve().parents[1]
TWO_PROCESSES = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                 "--dynamo_backend", "no"]
EVAL = dict(dataset_name="arithmetic", max_problems=10, num_samples=2, temperature=1.0, batch_size=3)
TIMING = {"generation_seconds", "throughput_tokens_per_s", "num_forward_passes"}  # the batches differ


def launch(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "accelerate.commands.launch", *TWO_PROCESSES, "--main_process_port", str(port),
               *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def flags(config: dict) -> list[str]:
    return [item for name, value in config.items() for item in (f"--{name}", str(value))]


def samples(report: dict) -> dict[tuple[int, int], dict]:
    rows = [json.loads(line) for line in Path(report["samples_file"]).read_text().splitlines()]
    keyed = {(row["index"], row["sample"]): row for row in rows}
    assert len(keyed) == len(rows)  # no sample twice
    return keyed


def test_two_processes_evaluate_the_samples_of_one(tmp_path):
    one = evaluate(**EVAL, output_dir=str(tmp_path / "one"), progress=False)
    done = launch("-m", "trl_diffusion.cli", "eval", *flags(EVAL), "--output_dir", str(tmp_path / "two"))
    assert done.returncode == 0, done.stderr[-4000:]
    two = json.loads(done.stdout)  # printed once: two copies would not parse as one JSON document
    assert two["num_processes"] == 2 and one["num_processes"] == 1
    assert json.loads(Path(two["metrics_file"]).read_text()) == two
    written = samples(two)
    assert written == samples(one) and len(written) == 20  # every sample once, each as one process samples it
    assert [key for key in written] == sorted(written)  # the main process writes them in (problem, sample) order
    assert 0 < one["metrics"]["accuracy"] < 1  # rows paired with the wrong problems would change it
    assert len({row["completion"] for row in written.values()}) > 10  # sampled
    assert {k: v for k, v in two["metrics"].items() if k not in TIMING} == {
        k: v for k, v in one["metrics"].items() if k not in TIMING}
    for name in ("model", "dataset", "sources", "generation", "num_problems"):
        assert two[name] == one[name], name
    assert not list((tmp_path / "two").glob("*.part*"))  # the processes' part files, merged and removed

    # an interrupted run (half its samples written, no metrics) resumed by a launch
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "one", resumed)
    lines = Path(one["samples_file"]).read_text().splitlines()
    (resumed / Path(one["samples_file"]).name).write_text("\n".join(lines[:10]) + '\n{"id": "arithm')  # cut short
    (resumed / Path(one["metrics_file"]).name).unlink()
    done = launch("-m", "trl_diffusion.cli", "eval", *flags(EVAL), "--output_dir", str(resumed), "--resume", "true")
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["num_resumed"] == 10 and report["num_processes"] == 2
    assert samples(report) == samples(one)
    assert {k: v for k, v in report["metrics"].items() if k not in TIMING} == {
        k: v for k, v in one["metrics"].items() if k not in TIMING}


SCRIPT = """
import json, os, sys
from pathlib import Path
from trl_diffusion.launching import leave_launch
from trl_diffusion.eval import evaluate
from trl_diffusion.eval.evaluate import load_model_and_tokenizer, EvalConfig

config, rank = json.loads(sys.argv[1]), int(os.environ["RANK"])
out, found, lines = Path(config.pop("output_dir")), [], {}
rows = [{"question": f"What is {i}+1?", "answer": f"#### {i + 1}"} for i in range(4)]
plain = {**config, "prompt_template": "{question}\\n", "apply_chat_template": False, "max_new_tokens": 8}


def attempt(**kwargs):
    try:
        return evaluate(**kwargs)
    except (ValueError, OSError, RuntimeError) as error:
        found.append(str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}")


first = attempt(dataset=rows, **plain, output_dir=str(out / "rows"))  # a finished run
samples = Path(first["samples_file"])
attempt(dataset=rows, **{**plain, "max_new_tokens": 100000}, output_dir=str(out / "rows"))  # refused by all
# the second process has the rows in another order: both refuse before generating
attempt(dataset=rows[::-1] if rank else rows, **plain, output_dir=str(out / "rows"))
lines["after_refusals"] = len(samples.read_text().splitlines())  # before the main process replaced its files
lines["metrics_kept"] = samples.with_suffix(".metrics.json").is_file()
attempt(**config, output_dir=str(out))  # the main process cannot lock the output files: both refuse
(out / "odd" / "tiny-sdar-arithmetic__arithmetic.lock").mkdir(parents=True, exist_ok=True)
attempt(**config, output_dir=str(out / "odd"))  # an OSError on the main process only: raised everywhere
model, tokenizer = load_model_and_tokenizer(EvalConfig(device="cpu"))
if rank == 1:  # fails in its first batch: the other process must not wait for its rows
    model.generate = lambda *args, **kwargs: (_ for _ in ()).throw(ValueError("out of room"))
attempt(dataset=rows, model=model, tokenizer=tokenizer, **plain, output_dir="")
model.__dict__.pop("generate", None)
again = attempt(dataset=rows, model=model, tokenizer=tokenizer, **plain, output_dir="")  # the group still works
lines["again"] = again["metrics"]["accuracy"] == first["metrics"]["accuracy"] and again["num_processes"]
Path(out, f"found{rank}.json").write_text(json.dumps({"found": found, **lines}))
leave_launch(wait=True)
"""


def test_a_refusal_or_an_error_reaches_every_process(tmp_path):
    script = tmp_path / "refusals.py"
    script.write_text(SCRIPT)
    config = {**EVAL, "max_problems": 2, "output_dir": str(tmp_path / "out"), "progress": False}
    lock = tmp_path / "out" / "tiny-sdar-arithmetic__arithmetic.lock"  # what the evaluation locks: another run
    lock.parent.mkdir()
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = launch(str(script), json.dumps(config))
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in (0, 1):  # each process raised every error, then went on
        result = json.loads((tmp_path / "out" / f"found{rank}.json").read_text())
        found = result["found"]
        assert len(found) == 5, found
        assert "do not fit the model's" in found[0]
        assert "the processes of this launch evaluate different problems:" in found[1]
        assert "another evaluation is writing" in found[2]
        assert result["after_refusals"] == 4 and result["metrics_kept"]  # the finished run's files are intact
        assert found[3].startswith("IsADirectoryError" if rank == 0 else
                                   "RuntimeError: process 0 of this launch failed: IsADirectoryError"), found[3]
        assert found[4] == "out of room" if rank == 1 else "process 1 of this launch failed: ValueError: out of room"
        assert result["again"] == 2


def test_a_launch_pinned_to_one_gpu_is_refused_before_it_joins(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # joining the group would wait for a second process forever
    with pytest.raises(ValueError, match="all 2 processes of this launch on one GPU"):
        evaluate(dataset=[{"question": "1+1?", "answer": "#### 2"}], model=object(), tokenizer=object(),
                 device="cuda:0", output_dir="", progress=False)
    for device in (None, "cpu", "cpu:0", "cuda"):
        check_launch_device(device, 2)
    check_launch_device("cuda:1", 1)


def test_shards_inputs_and_merged_runs():
    work = list(range(7))
    shards = [EvalProcesses(rank, 3).shard(work) for rank in range(3)]
    assert shards == [[0, 3, 6], [1, 4], [2, 5]]
    check_same_inputs([{"model": "a", "problems": "p"}] * 3)
    with pytest.raises(ValueError, match="different model and problems"):
        check_same_inputs([{"model": "a", "problems": "p"}, {"model": "b", "problems": "q"}])
    rows = [[{"index": 1, "sample": 0}, {"index": 0, "sample": 1}], [{"index": 0, "sample": 0}]]
    merged, seconds, passes = merge_runs([(rows[0], 2.0, 10), (rows[1], 3.5, 7)])
    assert [(r["index"], r["sample"]) for r in merged] == [(0, 0), (0, 1), (1, 0)]
    assert (seconds, passes) == (3.5, 17)


def test_an_error_that_cannot_be_printed_is_still_described():
    """What a process tells the others of its error: were ``str`` to fail there, the others would wait forever."""

    class Mute(Exception):
        def __str__(self):
            raise RuntimeError("no str")

    assert describe(ValueError("out of room")) == "out of room"
    assert describe(Mute("x")) == "Mute('x')"
