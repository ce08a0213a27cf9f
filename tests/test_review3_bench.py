"""Review of the measurement code the one GPU run executes: ``benchmarks/generation.py``, ``benchmarks/training.py``,
``scripts/gpu_check.sh`` and the gpu tests' guards, checked on the CPU (tiny presets; no timing is asserted)."""

import argparse
import json
import types

import torch
from test_generation_benchmark import load_generation_benchmark


def rollout_rows(capsys, preset: str, batches: list[int]) -> list[dict]:
    bench = load_generation_benchmark()
    bench.rollout_table(argparse.Namespace(preset=preset, batch_sizes_table=batches, cuda_graphs="auto"),
                        torch.device("cpu"))
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith('{"')]


def test_rollout_table_runs_the_targets_before_the_slow_uncached_rows(capsys):
    """gpu_check.sh gives the sdar-4b table a time limit and keeps only the rows printed before it: the cached rows
    of every batch size (batch 128 is the issue's target) come first, then the eager baseline, then the uncached
    rows (the slowest; they used to come before the larger batches)."""
    rows = rollout_rows(capsys, "tiny", [1, 4])
    kinds = [("cached" if r["cache"] != "none" else "uncached") + ("" if r["cuda_graphs"] == "auto" else " eager")
             for r in rows]
    assert kinds == ["cached"] * 4 + ["cached eager"] + ["uncached"] * 4
    assert [r["batch"] for r in rows] == [1, 1, 4, 4, 1, 1, 1, 4, 4]


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
