"""``benchmarks/generation.py``'s rollout tables run (tiny presets) and build the GPU presets' shapes."""

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def load_generation_benchmark():
    spec = importlib.util.spec_from_file_location("generation_benchmark", ROOT / "benchmarks" / "generation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("preset,caches", [("tiny", ["exact", "none"]), ("llada-tiny", ["dual", "prefix", "none"])])
def test_rollout_table_rows(capsys, preset, caches):
    """One row per cache mode and strategy, the eager baseline, the largest batch sampled as TraceRL's rollouts are
    (temperature 1, a generator per row), then the uncached rows (at these batch sizes); every row decodes the whole
    table's tokens, one per step."""
    bench = load_generation_benchmark()
    table = bench.TABLES[preset]
    bench.rollout_table(argparse.Namespace(preset=preset, batch_sizes_table=[4], cuda_graphs="auto",
                                           fused_kernels=False),
                        torch.device("cpu"))
    out = capsys.readouterr().out
    records = [json.loads(line) for line in out.splitlines() if line.startswith('{"')]
    summary = json.loads(out[out.index("\n{\n") + 1:])
    expected = [(cache, strategy, "auto", "greedy") for cache in caches[:-1] for strategy in table["strategies"]]
    expected.append((caches[0], "low_confidence_static", "off", "greedy"))  # the eager baseline
    expected.append((caches[0], "low_confidence_static", "auto", "rollout"))  # before the slow uncached rows
    expected += [("none", strategy, "auto", "greedy") for strategy in table["strategies"]]
    assert [(r["cache"], r["strategy"], r["cuda_graphs"], r["sampling"]) for r in records] == expected
    assert all(r["batch"] == 4 and r["tokens_per_step"] == 1.0 and r["tokens_per_s"] > 0 for r in records)
    assert [r["tokens_per_s"] for r in summary["table"]] == [r["tokens_per_s"] for r in records]
    # one token per step: a forward per new token (the exact cache: and one prefill of the prompt's full blocks)
    assert all(table["new_tokens"] <= r["forward_passes"] <= table["new_tokens"] + 1 for r in records)


def test_generation_presets_have_the_stated_sizes():
    bench = load_generation_benchmark()
    sizes = {}
    for preset in ("sdar-4b", "llada-1.6b"):
        table = bench.TABLES[preset]
        model = bench.build_model(table["family"], table["config"], torch.device("meta"))
        sizes[preset] = sum(p.numel() for p in model.parameters())
        assert model.dtype == torch.float32  # bf16 is for CUDA only
    assert 4.4e9 < sizes["sdar-4b"] < 4.5e9
    assert 1.6e9 < sizes["llada-1.6b"] < 1.7e9


def test_profile_reports_where_a_cached_step_spends_its_time(capsys):
    """``--profile``: one record per batch (the preset's smallest and largest) with the forwards of a two-block
    eager call and its top operators; the kernel count is CUDA's only."""
    bench = load_generation_benchmark()
    bench.profile_table(argparse.Namespace(preset="tiny", fused_kernels=False), torch.device("cpu"))
    records = [json.loads(line)["profile"] for line in capsys.readouterr().out.splitlines()
               if line.startswith('{"profile"')]
    table = bench.TABLES["tiny"]
    assert [r["batch"] for r in records] == [min(table["batches"]), max(table["batches"])]
    for r in records:
        assert r["cache"] == "exact" and r["kernels_per_forward"] is None
        assert r["forwards"] == 2 * table["block"] + 1  # one token per step, and the prompt's prefill
        assert any(op["name"] == "aten::mm" and op["calls"] > 0 for op in r["top"])
