"""The gpu tests' set-ups (``tests/test_gpu.py``, and the sampling one of ``tests/test_static_cache.py``), run on
the CPU in CI: a gpu test whose arguments no longer fit the code (a new default that rejects its inputs, a renamed
flag) fails here instead of in the one short GPU run a session may get. What only a GPU shows (compiled flex
attention, captured CUDA graphs, CUDA vs CPU) stays in the gpu tests themselves."""

import pytest
import test_gpu
import test_static_cache
import torch
from test_cli import load_example
from trl import TrlParser

from trl_diffusion.eval import EvalConfig
from trl_diffusion.scripts.utils import parse_script_args


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(test_gpu, "CUDA", torch.device("cpu"))


def test_bf16_lora_tracerl_steps_set_up(tmp_path, on_the_cpu):
    test_gpu.test_bf16_gradient_checkpointing_lora_tracerl_steps(tmp_path, "sdpa")


def test_recomputed_scoring_forwards_set_up(on_the_cpu):
    test_gpu.test_recomputed_scoring_forwards_on_cuda()


@pytest.mark.parametrize("family", sorted(test_gpu.MOE_CACHES))
def test_moe_on_cuda_set_up(on_the_cpu, family):
    test_gpu.test_moe_on_cuda(family)


@pytest.fixture
def graph_runners_on_the_cpu(monkeypatch):
    test_static_cache._force_graph_runners(monkeypatch)


def test_tracerl_cuda_graph_rollouts_set_up(tmp_path, on_the_cpu, graph_runners_on_the_cpu, monkeypatch):
    test_gpu.test_tracerl_rollouts_replay_cuda_graphs(tmp_path, monkeypatch)


@pytest.fixture
def static_cache_on_the_cpu(monkeypatch):
    monkeypatch.setattr(test_static_cache, "GPU", torch.device("cpu"))


@pytest.mark.parametrize("family,cache", [("sdar", True), ("llada", "dual"), ("dream", "prefix")])
def test_sampling_inside_cuda_graphs_set_up(graph_runners_on_the_cpu, static_cache_on_the_cpu, monkeypatch, family,
                                            cache):
    test_static_cache.test_cuda_graphs_draw_inside_the_graph(family, cache, monkeypatch)


@pytest.mark.parametrize("family,kw", test_static_cache.GRAPH_CASES)
def test_cuda_graphs_equal_eager_set_up(graph_runners_on_the_cpu, static_cache_on_the_cpu, monkeypatch, family, kw):
    test_static_cache.test_cuda_graphs_equal_eager(family, kw, monkeypatch)


def test_tracerl_replays_a_cuda_graph_rollout_set_up(graph_runners_on_the_cpu, static_cache_on_the_cpu, monkeypatch):
    test_static_cache.test_tracerl_replays_a_cuda_graph_rollout(monkeypatch)


@pytest.mark.parametrize(("name", "extra"), test_gpu.EXAMPLE_RUNS)
def test_example_flags_parse(tmp_path, name, extra):
    parse_script_args(load_example(name).make_parser(), ["--output_dir", str(tmp_path), "--use_cpu", "true", *extra])


def test_eval_flags_parse():
    (config,) = TrlParser(dataclass_types=[EvalConfig]).parse_args_and_config(test_gpu.EVAL_FLAGS)
    assert config.max_problems == 16 and config.device == "cuda"
