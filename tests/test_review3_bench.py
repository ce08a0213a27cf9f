"""Review of the measurement code the one GPU run executes: ``benchmarks/generation.py``, ``benchmarks/training.py``,
``scripts/gpu_check.sh`` and the gpu tests' guards, checked on the CPU (tiny presets; no timing is asserted)."""

import argparse
import contextlib
import importlib.util
import io
import json
import os
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from test_generation_benchmark import load_generation_benchmark

ROOT = Path(__file__).resolve().parents[1]


def rollout_rows(capsys, preset: str, batches: list[int]) -> list[dict]:
    bench = load_generation_benchmark()
    bench.rollout_table(argparse.Namespace(preset=preset, batch_sizes_table=batches, cuda_graphs="auto",
                                           fused_kernels=False),
                        torch.device("cpu"))
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"')]


def test_rollout_table_runs_the_targets_before_the_slow_uncached_rows(capsys):
    """gpu_check.sh gives the sdar-4b table a time limit and keeps only the rows printed before it: the cached rows
    of every batch size (batch 128 is the issue's target) come first, then the eager baseline, then the largest
    batch sampled as TraceRL's rollouts, then the uncached rows (the slowest; they used to come before the larger
    batches)."""
    rows = rollout_rows(capsys, "tiny", [1, 4])
    kinds = [("cached" if r["cache"] != "none" else "uncached") + ("" if r["cuda_graphs"] == "auto" else " eager")
             + ("" if r["sampling"] == "greedy" else " sampled") for r in rows]
    assert kinds == ["cached"] * 4 + ["cached eager", "cached sampled"] + ["uncached"] * 4
    assert [r["batch"] for r in rows] == [1, 1, 4, 4, 1, 4, 1, 1, 4, 4]


def test_each_rows_cuda_peak_memory_is_its_own(monkeypatch):
    """On CUDA every row's ``peak_memory_mb`` is the peak of its own generate call: the counter is reset before the
    call (it was never reset, so the eager batch-1 row reported the batch-128 rows' peak)."""
    bench = load_generation_benchmark()
    calls = []
    monkeypatch.setattr(bench.torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(bench.torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    model = types.SimpleNamespace(generate=lambda prompt, **kwargs: calls.append("generate"))
    prompt = types.SimpleNamespace(device=torch.device("cuda"))
    bench.timed_generate(model, prompt)
    assert calls.index("reset") < calls.index("generate") and calls.count("sync") == 2


def _static_cache_gpu_tests_on_the_cpu(monkeypatch):
    import test_static_cache

    test_static_cache._force_graph_runners(monkeypatch)
    monkeypatch.setattr(test_static_cache, "GPU", torch.device("cpu"))
    return test_static_cache


def test_cuda_graph_gpu_tests_fail_when_auto_decodes_eagerly(monkeypatch):
    """The gpu tests comparing ``cuda_graphs="auto"`` with the eager path fail when "auto" quietly picks the eager
    runner (they passed, comparing eager with eager: after any earlier test's failed capture, which makes every
    later call in the process decode eagerly, or if the runner choice stopped picking a graph runner)."""
    import pytest

    from trl_diffusion.generation import cuda_graphs
    from trl_diffusion.generation.denoise import ModelRunner

    tests = _static_cache_gpu_tests_on_the_cpu(monkeypatch)
    family, kw = tests.GRAPH_CASES[1]
    tests.test_cuda_graphs_equal_eager(family, kw, monkeypatch)  # the set-up runs the graph runner
    monkeypatch.setattr(cuda_graphs, "runner_class", lambda settings, device, generator: ModelRunner)
    for run in (lambda: tests.test_cuda_graphs_equal_eager(family, kw, monkeypatch),
                lambda: tests.test_cuda_graphs_draw_inside_the_graph("sdar", True, monkeypatch),
                lambda: tests.test_tracerl_replays_a_cuda_graph_rollout(monkeypatch)):
        with pytest.raises(AssertionError):
            run()


def test_cuda_graph_gpu_tests_do_not_inherit_an_earlier_failed_capture(monkeypatch):
    """A capture that failed in an earlier test leaves ``CAPTURE_FAILED`` set for the process; each gpu test starts
    from a clear flag, so it checks its own captures."""
    from trl_diffusion.generation import cuda_graphs

    tests = _static_cache_gpu_tests_on_the_cpu(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", True)
    tests.test_cuda_graphs_draw_inside_the_graph("llada", "dual", monkeypatch)


def test_training_benchmark_output_keeps_the_records_of_a_run_cut_short(tmp_path, monkeypatch):
    """gpu_check.sh kills the training benchmark at its step's time limit: the JSON file holds every record measured
    before that (it was written only at the end, so a cut run left none)."""

    from test_scored_head import load_training_benchmark

    bench = load_training_benchmark()
    measured = []

    def run_one(mode, shrinkage, backend, *args):
        if measured:
            raise KeyboardInterrupt  # stands in for the outer time limit's signal
        measured.append({"mode": mode, "shrinkage": shrinkage, "attention_backend": backend, "kernels": "eager",
                         "seconds_per_step": 1.0,
                         "processed_tokens_per_s": 2.0, "scored_tokens_per_s": 1.0})
        return measured[-1]

    monkeypatch.setattr(bench, "run_one", run_one)
    output = tmp_path / "training.json"
    monkeypatch.setattr(sys, "argv", ["training.py", "--preset", "tiny", "--backends", "sdpa", "flex",
                                      "--output", str(output)])
    with pytest.raises(KeyboardInterrupt):
        bench.main()
    saved = json.loads(output.read_text())
    assert saved["records"] == measured and saved["table"]["packed s=1 sdpa eager"]["seconds_per_step"] == 1.0


def gpu_check_commands(out: Path) -> dict[str, list[str]]:
    """Each step's command, by step name, as ``gpu_check.sh`` expands it in its tiny (CPU) mode
    (``GPU_CHECK_PRINT=1``: the script prints its steps' commands and runs nothing)."""
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_TINY": "1", "GPU_CHECK_PRINT": "1", "GPU_CHECK_STEPS": "all"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          check=True, timeout=60)
    return {name: shlex.split(command) for name, _, command in (line.partition(": ")
                                                                for line in done.stdout.splitlines())}


def run_step(command: list[str], monkeypatch, capsys) -> str:
    """Run a step's ``python3 SCRIPT ARGS...`` in this process, the script's own ``subprocess.run([python, script,
    ...])`` calls too (training.py and memory.py measure each configuration in a fresh process); return its output."""
    assert command[0] == "python3" and command[1].endswith(".py"), command
    spec = importlib.util.spec_from_file_location(f"step_{Path(command[1]).stem}", ROOT / command[1])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def run(child: list[str], **kwargs) -> subprocess.CompletedProcess:
        assert Path(child[1]).resolve() == (ROOT / command[1]).resolve(), child
        printed = io.StringIO()
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(printed):
            patch.setattr(sys, "argv", child[1:])
            script.main()
        return subprocess.CompletedProcess(child, 0, printed.getvalue(), "")

    if hasattr(script, "subprocess"):
        monkeypatch.setattr(script, "subprocess", types.SimpleNamespace(
            run=run, TimeoutExpired=subprocess.TimeoutExpired))
    monkeypatch.setattr(sys, "argv", command[1:])
    capsys.readouterr()
    script.main()
    return capsys.readouterr().out


def json_lines(text: str, start: str = '{"') -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith(start)]


def test_gpu_check_prints_its_commands_as_bash_expands_them(tmp_path):
    """``GPU_CHECK_PRINT=1``: every step, in the script's order, with the tiny presets and the CPU in tiny mode and
    the SDAR-4B ones on CUDA otherwise; outputs land in $OUT."""
    tiny = gpu_check_commands(tmp_path)
    assert list(tiny) == ["generation", "generation_fused", "training_fused", "training_sdar4b", "generation_profile",
                          "gpu_graph_tests", "gpu_tests", "generation_llada", "flex_probe", "memory_recompute"]
    assert tiny["generation"] == ["python3", "benchmarks/generation.py", "--device", "cpu", "--preset", "tiny"]
    assert tiny["memory_recompute"][-2:] == ["--output", str(tmp_path / "memory_recompute.json")]
    assert "tests/test_gpu.py" in tiny["gpu_tests"] and "tests/test_static_cache.py" not in tiny["gpu_tests"]
    env = {**os.environ, "OUT": str(tmp_path), "GPU_CHECK_TINY": "0", "GPU_CHECK_PRINT": "1",
           "GPU_CHECK_STEPS": "generation_fused memory_recompute"}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          check=True, timeout=60)
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["generation_fused", "memory_recompute"]
    assert "--preset sdar-4b --fused_kernels --batch_sizes_table 1 128" in lines[0]
    assert "--device cuda" in lines[1] and "--dtype bfloat16" in lines[1]
    assert not (tmp_path / "environment.txt").exists()  # nothing imported, nothing installed


@pytest.mark.slow
def test_gpu_check_dry_run_on_the_cpu(tmp_path):
    """``GPU_CHECK_TINY=1 bash scripts/gpu_check.sh`` runs its steps on the CPU (same scripts and flags, tiny presets):
    the pytest steps (their gpu tests are collected, and skip) and the flex probe, each exits 0 and leaves its output;
    the benchmark steps' commands run in this process (test_gpu_check_benchmark_steps_run_in_process)."""
    # the script runs `python`: this interpreter's, also when pytest was started without activating its venv
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    # the steps' limits are sized for the GPU: scaled up here, so that a busy CI machine does not cut a step short
    steps = ["gpu_graph_tests", "gpu_tests", "flex_probe"]
    env = {**os.environ, "PATH": path, "OUT": str(tmp_path), "GPU_CHECK_TINY": "1", "GPU_CHECK_BUDGET": "1200",
           "GPU_CHECK_LIMIT_SCALE": "4", "GPU_CHECK_STEPS": " ".join(steps)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert [line.split(":")[0] for line in summary.splitlines() if ": exit " in line] == steps
    assert summary.count(": exit 0 ") == len(steps), summary
    for log in ("gpu_graph_tests", "gpu_tests"):
        assert " skipped" in (tmp_path / f"{log}.log").read_text() and (tmp_path / f"{log}.xml").is_file()
    probe = json.loads((tmp_path / "flex_probe.json").read_text())
    # on the CPU forward only (flex has no backward there), against SDPA with the dense mask
    assert probe and all(r["length_40"]["ok"] and r["length_40"]["max_abs_out_diff"] < 1e-4 for r in probe), probe
    assert "torch" in (tmp_path / "environment.txt").read_text()


def test_gpu_check_benchmark_steps_run_in_process(tmp_path, monkeypatch, capsys):
    """The benchmark steps' commands, as the script expands them in tiny mode, run here (each exits without error and
    writes what the GPU run reads back): the SDAR and LLaDA generation tables, the profile, the training table and the
    scoring-memory records."""
    commands = gpu_check_commands(tmp_path)
    for step in ("generation", "generation_llada"):
        rows = json_lines(run_step(commands[step], monkeypatch, capsys))
        assert rows and all(r["tokens_per_s"] > 0 for r in rows), step
    profiles = [r["profile"] for r in json_lines(run_step(commands["generation_profile"], monkeypatch, capsys),
                                                 '{"profile"')]
    assert [p["batch"] for p in profiles] == [1, 8] and all(p["top"] for p in profiles)
    run_step(commands["training_sdar4b"], monkeypatch, capsys)
    training = json.loads((tmp_path / "training_sdar4b.json").read_text())
    assert training["records"] and all("error" not in r and r["seconds_per_step"] > 0 for r in training["records"])
    run_step(commands["memory_recompute"], monkeypatch, capsys)
    memory = json.loads((tmp_path / "memory_recompute.json").read_text())["records"]
    assert [r["variant"] for r in memory] == ["checkpointing", "budget_2048_recompute"]
    assert all(r["family"] == "llada" and r["rows"] == 4 for r in memory)  # 32 tokens, 8 merged steps a row


def test_gpu_check_fused_steps_run_the_benchmarks_with_their_flags(tmp_path, monkeypatch, capsys):
    """The generation_fused and training_fused steps' commands (as the script expands them, tiny mode), run in this
    process with the chains compiled by aot_eager (inductor would compile for minutes on a CPU): every row has the
    fused kernels, and the training benchmark measures eager and fused side by side."""
    from trl_diffusion.models import kernels

    aot_eager = kernels.compiled_kernels("aot_eager")
    monkeypatch.setattr(kernels, "compiled_kernels", lambda backend: aot_eager)
    commands = gpu_check_commands(tmp_path)
    assert "--fused_kernels" in commands["generation_fused"]
    rows = json_lines(run_step(commands["generation_fused"], monkeypatch, capsys), '{"batch"')
    assert {r["batch"] for r in rows} == {1, 8} and all(r["fused_kernels"] and r["tokens_per_s"] > 0 for r in rows)

    run_step(commands["training_fused"], monkeypatch, capsys)
    saved = json.loads((tmp_path / "training_fused.json").read_text())
    assert [(r["attention_backend"], r["kernels"]) for r in saved["records"]] == [("sdpa", "eager"), ("sdpa", "fused")]
    assert all(r["seconds_per_step"] > 0 for r in saved["records"])
    assert set(saved["table"]) == {"packed s=1 sdpa eager", "packed s=1 sdpa fused"}
