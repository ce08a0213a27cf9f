"""What a real CUDA-graph capture of the graph runners (``trl_diffusion/generation/cuda_graphs.py``) would trip over,
checked on the CPU where the CI's emulation (``_force_graph_runners``: the capture replaced by an eager call) sees
nothing: no operation inside a captured step may read a value back to the host (``.item()``, ``torch.multinomial``'s
argument checks, boolean indexing, ...) or draw from a host generator (its draw would be frozen into the graph),
and ``GraphRunner._record`` itself (warm-up, undoing it, capture on the side stream, errors) runs against a stand-in
for ``torch.cuda``."""

import contextlib

import pytest
import torch
from test_static_cache import (
    GPU,
    GRAPH_CASES,
    HostSyncCounter,
    _EagerReplay,
    _force_graph_runners,
    _generate,
    _graph_case,
    _graph_runners_used,
    _only_graph_runners,
    assert_same_rollout,
)
from torch.utils._python_dispatch import TorchDispatchMode

from trl_diffusion.generation import cuda_graphs
from trl_diffusion.generation.denoise import Block
from trl_diffusion.testing import MASK_ID

aten = torch.ops.aten

# ------------------------------------------------------------------------------------------------------------
# Nothing inside a captured step is illegal under capture
# ------------------------------------------------------------------------------------------------------------


class IllegalUnderCapture(AssertionError):
    """Not a RuntimeError: the runners' fall-back (``except RuntimeError``) must not swallow it."""


class CaptureGuard(TorchDispatchMode):
    """Raises on what a CUDA stream capture forbids or silently gets wrong: host reads (``HostSyncCounter``'s list,
    plus ``torch.multinomial``, whose argument checks call ``.item()``), boolean indexing (data-dependent shapes),
    ``tolist`` / ``cpu`` / ``numpy``, and random draws from an explicit generator (a host generator's draw would be
    frozen into the graph; only the default CUDA generator is graph-safe)."""

    ILLEGAL = HostSyncCounter.SYNCING | {aten.multinomial.default, aten.multinomial.out}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.ILLEGAL:
            raise IllegalUnderCapture(f"{func} inside a captured step")
        if func in HostSyncCounter.INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or [])):
            raise IllegalUnderCapture(f"boolean indexing ({func}) inside a captured step")
        if any(isinstance(a, torch.Generator) for a in (*args, *kwargs.values())):
            raise IllegalUnderCapture(f"{func} draws from an explicit generator inside a captured step")
        return func(*args, **kwargs)

    def __enter__(self):
        self._saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy", "item")}
        for name in self._saved:
            setattr(torch.Tensor, name, _refuse(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._saved.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)


def _refuse(name):
    def method(*args, **kwargs):
        raise IllegalUnderCapture(f"Tensor.{name}() inside a captured step")
    return method


def _guarded_graph_runners(monkeypatch) -> list:
    """The CPU emulation of the graph runners, with every replay of a captured step run under ``CaptureGuard``."""
    _force_graph_runners(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)
    replays = []

    def record(self, body):
        def replay():
            replays.append(1)
            with CaptureGuard():
                body()
        return _EagerReplay(replay)

    monkeypatch.setattr(cuda_graphs.GraphRunner, "_record", record)
    return replays


DRAW_IN_GRAPH_CASES = [  # generator=None and sampling: the default CUDA generator draws inside the graph
    ("sdar", dict(use_cache=True, temperature=1.0)),
    ("sdar", dict(use_cache=True, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2,
                  temperature=1.0, top_k=20)),
    ("dream", dict(use_cache="prefix", denoising_steps=2, temperature=1.0)),
    ("dream", dict(use_cache="dual", steps=10, alg="entropy", temperature=0.5, top_p=0.95)),  # Dream's settings
    ("dream", dict(use_cache="dual", steps=10, alg="origin", temperature=1.0)),
    ("llada", dict(use_cache="dual", temperature=1.0, remasking_strategy="random")),  # LLaDA: float64 Gumbel draw
]


@pytest.mark.parametrize("family,kw", DRAW_IN_GRAPH_CASES + GRAPH_CASES)
def test_captured_steps_do_nothing_illegal_under_capture(monkeypatch, family, kw):
    """Every replayed step (SDAR's exact cache; LLaDA's / Dream's prefix and dual windows), greedy, with per-row
    generators, and with ``generator=None`` sampling, runs no host read and no explicit-generator draw. Before the
    fix, ``generator=None`` sampling on SDAR / Dream called ``torch.multinomial`` inside the graph: on CUDA its
    ``.item()`` checks make the capture fail (warning, eager fall-back, and no graphs for the rest of the process)."""
    model, ids, mask, kw = _graph_case(family, kw)
    replays = _guarded_graph_runners(monkeypatch)
    out = _generate(model, ids, mask, kw, cuda_graphs="auto")
    assert replays
    generated = out.unmask_step >= 0
    assert bool((generated.sum(-1) >= 20).all()) and not bool((out.sequences == MASK_ID).any())
    logprobs = out.token_logprobs[generated]
    assert bool(torch.isfinite(logprobs).all()) and bool((logprobs <= 0).all())


def test_the_guard_sees_multinomial_and_generators():
    """The guard is not blind: ``torch.multinomial``, a draw from an explicit generator, and ``tolist`` raise."""
    probs = torch.tensor([[0.2, 0.8]])
    for call in (lambda: torch.multinomial(probs, 1), lambda: torch.rand(2, generator=torch.Generator()),
                 lambda: probs.tolist(), lambda: probs[probs > 0.5]):
        with pytest.raises(IllegalUnderCapture), CaptureGuard():
            call()
    with CaptureGuard():
        torch.rand(2).uniform_()  # the default generator is fine


def test_draws_inside_the_graph_change_from_call_to_call(monkeypatch):
    """With ``generator=None`` the captured step samples by inverse CDF from uniforms drawn inside the graph (each
    replay draws anew): two calls sample differently."""
    model, ids, mask, kw = _graph_case("sdar", dict(use_cache=True, temperature=1.0))
    _guarded_graph_runners(monkeypatch)
    outs = [_generate(model, ids, mask, kw, cuda_graphs="auto") for _ in range(2)]
    assert not torch.equal(outs[0].sequences, outs[1].sequences)


# ------------------------------------------------------------------------------------------------------------
# GraphRunner._record against a stand-in for torch.cuda
# ------------------------------------------------------------------------------------------------------------


class FakeCuda:
    """Streams, a current stream, synchronize and a ``CUDAGraph`` whose capture executes nothing (the block's state
    is put back at ``capture_end``, as on a GPU where a captured step only records kernels)."""

    def __init__(self, monkeypatch, fail_in_capture=False):
        self.events, self.current, self.capturing = [], "main", False
        self.fail_in_capture, self.runner = fail_in_capture, None
        fake = self

        class Stream:
            def __init__(self, name):
                self.name = name

            def wait_stream(self, other):
                fake.events.append(("wait", self.name, other.name))

        class Graph:
            def capture_begin(self, capture_error_mode="global"):
                fake.events.append(("begin", fake.current))
                fake.capturing = True
                fake.snapshot = [getattr(fake.runner._buf, n).clone() for n in cuda_graphs.STATE]

            def capture_end(self):
                fake.events.append(("end", fake.current))
                fake.capturing = False
                for name, value in zip(cuda_graphs.STATE, fake.snapshot):
                    getattr(fake.runner._buf, name).copy_(value)
                if fake.failed:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

        @contextlib.contextmanager
        def stream(s):
            before, self.current = self.current, s.name
            try:
                yield
            finally:
                self.current = before

        self.failed = False
        self.Graph = Graph
        monkeypatch.setattr(torch.cuda, "device", lambda device=None: contextlib.nullcontext())
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(self.current))
        monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: Stream("side"))
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.events.append(("sync",)))
        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)


def _runner_with_buffers():
    runner = object.__new__(cuda_graphs.ExactCacheGraphRunner)
    tokens = torch.tensor([[5, 6, 7, 8]])
    runner._buf = Block(start=0, end=0, tokens=tokens.clone(), generated=torch.ones_like(tokens, dtype=torch.bool),
                        unmask_step=torch.full_like(tokens, -1), logprobs=torch.zeros(1, 4),
                        steps_taken=torch.zeros(1, dtype=torch.long), active=torch.ones(1, dtype=torch.bool))
    runner._quota = torch.zeros((), dtype=torch.long)
    return runner


def test_record_warms_up_undoes_it_and_captures_on_the_side_stream(monkeypatch):
    fake = FakeCuda(monkeypatch)
    runner = fake.runner = _runner_with_buffers()
    seen = []

    def body():
        seen.append((fake.capturing, fake.current, runner._buf.tokens.clone()))
        runner._buf.tokens.add_(1)
        runner._buf.steps_taken.add_(1)

    graph = cuda_graphs.GraphRunner._record(runner, body)
    assert isinstance(graph, fake.Graph)
    (warm, warm_stream, warm_tokens), (capture, capture_stream, capture_tokens) = seen
    assert (warm, warm_stream, capture, capture_stream) == (False, "side", True, "side")
    assert torch.equal(warm_tokens, capture_tokens)  # the warm-up's writes were undone before the capture
    assert torch.equal(runner._buf.tokens, warm_tokens) and int(runner._buf.steps_taken) == 0
    assert fake.current == "main"
    assert ("wait", "side", "main") in fake.events and fake.events[-1] == ("wait", "main", "side")


def test_a_failed_capture_reports_the_operation_that_broke_it(monkeypatch):
    """When an operation inside the capture fails, ``capture_end`` still ends it (the stream leaves capture mode and
    the current stream is restored), but the error that reaches the warning is the operation's, not capture_end's
    "operation failed due to a previous error during capture" (which says nothing about the cause)."""
    fake = FakeCuda(monkeypatch)
    runner = fake.runner = _runner_with_buffers()

    def body():
        if fake.capturing:
            fake.failed = True
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing (multinomial)")

    with pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        cuda_graphs.GraphRunner._record(runner, body)
    assert ("end", "side") in fake.events and not fake.capturing and fake.current == "main"


@pytest.mark.parametrize("family,kw", [GRAPH_CASES[1], GRAPH_CASES[3], GRAPH_CASES[6], GRAPH_CASES[7]])
def test_the_real_record_keeps_the_eager_results(monkeypatch, family, kw):
    """The whole decode with the real ``_record`` (warm-up on the side stream, its writes undone, a capture that
    executes nothing; replays run the step) equals the eager loop, rows leaving the batch included: the warm-up's
    other effects (cache slots, noise buffers) do not leak into the results."""
    model, ids, mask, kw = _graph_case(family, kw)
    free = _generate(model, ids, mask, kw)
    kw["stop_token_ids"] = [int(free.sequences[row, ids.shape[1] + 2]) for row in (0, 1)]
    eager = _generate(model, ids, mask, kw)
    record = cuda_graphs.GraphRunner._record  # the real one (_force_graph_runners replaces it)
    _force_graph_runners(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)
    fake, graphs = FakeCuda(monkeypatch), []

    def real_record(self, body):
        fake.runner = self
        graphs.append(record(self, body))
        graphs[-1].replay = body
        return graphs[-1]

    monkeypatch.setattr(cuda_graphs.GraphRunner, "_record", real_record)
    assert_same_rollout(eager, _generate(model, ids, mask, kw, cuda_graphs="auto"))
    assert len(graphs) >= 2 and fake.current == "main"


# ------------------------------------------------------------------------------------------------------------
# GPU (skipped without CUDA): the real capture of what the CPU tests above check
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("error:CUDA-graph capture failed")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,kw", [DRAW_IN_GRAPH_CASES[1], DRAW_IN_GRAPH_CASES[3]])
def test_cuda_graphs_capture_sampling_without_a_generator(monkeypatch, family, kw):
    """SDAR's and Dream's ``generator=None`` sampling is captured (no ``torch.multinomial`` in the graph) and every
    position is decoded with a finite log-prob."""
    model, ids, mask, kw = _graph_case(family, kw, GPU)
    used = _graph_runners_used(monkeypatch)
    out = _generate(model, ids, mask, kw, cuda_graphs="auto")
    assert _only_graph_runners(used)
    generated = out.unmask_step >= 0
    assert not bool((out.sequences == MASK_ID).any())
    assert bool(torch.isfinite(out.token_logprobs[generated]).all())


def test_a_model_spread_over_devices_decodes_eagerly():
    """A model split across devices (device_map) or offloaded would copy between devices or from the host inside a
    captured step: such a model takes the eager runner."""
    from trl_diffusion.testing import tiny_model

    model = tiny_model("sdar")
    assert not cuda_graphs.spread_over_devices(model)
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert cuda_graphs.spread_over_devices(model)
    del model.hf_device_map
    model.lm_head.to("meta")  # an offloaded weight
    assert cuda_graphs.spread_over_devices(model)


def test_generate_takes_the_eager_runner_for_a_spread_model(monkeypatch):
    from trl_diffusion.testing import tiny_model

    recorded = []
    _force_graph_runners(monkeypatch, recorded)
    model, ids = tiny_model("sdar"), torch.tensor([[5, 6, 7]])
    kw = dict(max_new_tokens=8, temperature=0.0, use_cache=True, cuda_graphs="auto", stop_token_ids=[])
    graphed = model.generate(ids, **kw)
    assert recorded  # the graph runner captured
    recorded.clear()
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}
    assert torch.equal(model.generate(ids, **kw), graphed) and not recorded  # eager: nothing captured
