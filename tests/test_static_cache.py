"""The static KV cache and the sync-free decode loop: same outputs as the slow paths, no host synchronisation
inside a block, finished rows leaving the batch without changing anything."""

import pytest
import torch
from numerics import assert_close_fp32
from torch.utils._python_dispatch import TorchDispatchMode

from trl_diffusion.estimators import EstimatorSettings, estimate_logprobs
from trl_diffusion.generation import cuda_graphs, denoise, sampler
from trl_diffusion.generation.denoise import BlockSchedule, ModelRunner
from trl_diffusion.generation.sampler import SamplingSettings
from trl_diffusion.generation.sampling import sampling_logits, select_commits, uniform_quota
from trl_diffusion.models.cache import DiffusionCache, StaticDiffusionCache
from trl_diffusion.states import CanvasLayout, attention_mask_from_positions
from trl_diffusion.testing import MASK_ID, left_pad, tiny_model

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44], [50, 51, 52, 53, 54, 55]]
aten = torch.ops.aten



def gen(model, ids, mask, **kw):
    args = dict(max_new_tokens=14, block_length=4, temperature=0.0, stop_token_ids=[], return_dict_in_generate=True)
    if "steps" not in kw:  # Dream's `steps` (whole generation) and `denoising_steps` (per block) exclude each other
        args["denoising_steps"] = 2
    args.update(kw)
    return model.generate(ids, mask, **args)


def row_generators(n, seed=0):
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def assert_same_rollout(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert torch.equal(a.unmask_step, b.unmask_step)
    assert torch.equal(a.denoising_steps, b.denoising_steps)
    torch.testing.assert_close(a.token_logprobs, b.token_logprobs, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------------------
# The cache itself
# ------------------------------------------------------------------------------------------------------------


def test_static_cache_forward_equals_growing_cache(family):
    """A block read against a prefix in the static cache gives the logits the growing cache gives."""
    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None].expand(2, -1)
    block = model.block_size
    prefix_mask = attention_mask_from_positions(pos[:, :8], pos[:, :8], None, block)
    with torch.no_grad():
        growing = DiffusionCache()
        model(ids[:, :8], attention_mask=prefix_mask, position_ids=pos[:, :8], past_key_values=growing,
              store_kv=True)
        expected = model(ids[:, 8:], position_ids=pos[:, 8:], past_key_values=growing).logits
        static = StaticDiffusionCache(16)
        static.place(torch.arange(8), 8)
        model(ids[:, :8], attention_mask=prefix_mask, position_ids=pos[:, :8], past_key_values=static)
        static.place(torch.arange(8, 12), 12)
        got = model(ids[:, 8:], position_ids=pos[:, 8:], past_key_values=static).logits
        assert static.keys[0].shape[2] == 16
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if block is not None:  # SDAR: the cached forward is exact, equal to the full block-causal forward
        torch.testing.assert_close(got, model(ids, position_ids=pos).logits[:, 8:], rtol=1e-5, atol=1e-5)


def test_static_cache_writes_in_place():
    """Committing a block writes its slots in place: the buffers are allocated once and never replaced."""
    model = tiny_model("sdar")
    ids = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(12)[None]
    cache = StaticDiffusionCache(12)
    with torch.no_grad():
        cache.place(torch.arange(8), 8)
        model(ids[:, :8], attention_mask=attention_mask_from_positions(pos[:, :8], pos[:, :8], None, 4),
              position_ids=pos[:, :8], past_key_values=cache)
        buffers = [k.data_ptr() for k in cache.keys]
        before = cache.keys[0][:, :, :8].clone()
        cache.place(torch.arange(8, 12), 12)
        model(ids[:, 8:], position_ids=pos[:, 8:], past_key_values=cache)
    assert [k.data_ptr() for k in cache.keys] == buffers
    assert torch.equal(cache.keys[0][:, :, :8], before)  # the block pass wrote only its own slots
    assert cache.keys[0][:, :, 8:].abs().sum() > 0


def test_static_cache_errors():
    model = tiny_model("sdar")
    ids = torch.tensor([[20, 21, 22, 23]])
    cache = StaticDiffusionCache(8)
    with pytest.raises(RuntimeError, match="place"):
        model(ids, position_ids=torch.arange(4)[None], past_key_values=cache)
    cache.place(torch.arange(4), 4)
    with pytest.raises(ValueError, match="position_ids"):
        model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match="3-D / 4-D"):
        model(ids, attention_mask=torch.ones(1, 4), position_ids=torch.arange(4)[None], past_key_values=cache)
    with pytest.raises(ValueError, match="read window"):
        cache.place(torch.arange(4), 9)


# ------------------------------------------------------------------------------------------------------------
# Generation with the static cache equals the slow paths
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic"])
@pytest.mark.parametrize("sampled", [False, True])
def test_exact_cache_equals_no_cache_padded_with_stops(strategy, sampled):
    """SDAR, a left-padded batch whose rows stop at different blocks (so rows leave the working batch)."""
    model = tiny_model("sdar")
    ids, mask = left_pad(PROMPTS)
    free = gen(model, ids, mask)
    stop = int(free.sequences[1, ids.shape[1] + 5])  # a token row 1 produces in its second block
    kw = dict(remasking_strategy=strategy, confidence_threshold=0.2, stop_token_ids=[stop], max_new_tokens=22)
    if sampled:
        kw.update(temperature=1.0, top_k=20)
    outs = [gen(model, ids, mask, use_cache=cache, generator=row_generators(len(PROMPTS)) if sampled else None,
                **kw) for cache in (False, True)]
    assert_same_rollout(*outs)
    assert (outs[0].unmask_step >= 0).sum(-1).min() < (free.unmask_step >= 0).sum(-1).max()  # someone stopped


def reference_fast_dllm(model, ids, mode, max_new_tokens, block_length, steps):
    """Fast-dLLM prefix / dual cache decoding (greedy, ``low_confidence_static``, unpadded prompts), written
    plainly with the growing ``DiffusionCache``, as the sampler ran it before the static cache: at each block
    start the whole canvas runs once; later steps run the live columns against the keys kept from then."""
    mask_id, shift = model.mask_token_id, int(model.logits_shift)
    batch, prompt = ids.shape
    width = prompt + max_new_tokens
    x = torch.cat([ids, torch.full((batch, max_new_tokens), mask_id)], dim=1)
    unmask = torch.full_like(x, -1)
    logprobs = torch.zeros(x.shape)
    taken = torch.zeros(batch, dtype=torch.long)
    positions = torch.arange(width)[None].expand(batch, -1)
    for start in range(prompt, width, block_length):
        end = min(start + block_length, width)
        live_end = end if mode == "dual" else width
        cache = DiffusionCache()
        first = model(x, position_ids=positions, past_key_values=cache, store_kv=True).logits
        cache.keep_columns(torch.cat([torch.arange(start - shift), torch.arange(live_end, width)]))
        for step, quota in enumerate(uniform_quota(end - start, steps)):
            masked = x[:, start:end] == mask_id
            if not masked.any():
                break
            if step == 0:
                logits = first[:, start - shift: end - shift]
            else:
                live = slice(start - shift, live_end)
                logits = model(x[:, live], position_ids=positions[:, live], past_key_values=cache).logits
                logits = logits[:, : end - start]
            log_dist = sampling_logits(logits, 0.0, mask_token_id=mask_id).log_softmax(-1)
            lp, tokens = log_dist.max(-1)
            confidence = lp.exp().masked_fill(~masked, float("-inf"))
            for row in range(batch):
                k = min(quota, int(masked[row].sum()))
                chosen = torch.argsort(confidence[row], descending=True, stable=True)[:k]
                cols = start + chosen
                x[row, cols], unmask[row, cols], logprobs[row, cols] = tokens[row, chosen], taken[row], lp[row, chosen]
            taken += masked.any(-1)
    return x, unmask, logprobs


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_prefix_and_dual_cache_equal_the_growing_cache_reference(family, mode):
    model = tiny_model(family)
    ids = torch.tensor([PROMPTS[0][:5], PROMPTS[2]])
    with torch.no_grad():
        x, unmask, logprobs = reference_fast_dllm(model, ids, mode, 14, 4, 3)
    out = gen(model, ids, None, use_cache=mode, denoising_steps=3)
    assert torch.equal(out.sequences, x)
    assert torch.equal(out.unmask_step, unmask)
    torch.testing.assert_close(out.token_logprobs, logprobs, rtol=1e-5, atol=1e-5)
    blocks = 4  # 14 new tokens in blocks of 4 (the last holds 2)
    assert out.num_forward_passes == blocks * 3 - 1  # a refresh + 2 live steps per block; the last block needs 2


def planned_forward_passes(out, prompts, width, block_length, block_causal, extra_per_block, extra=0):
    """Forward passes implied by a trajectory: per canvas block, the most denoising steps any row took in it."""
    layout = CanvasLayout([len(p) for p in prompts], 12, block_length, block_causal)
    steps_in_block = {}
    for row in range(len(prompts)):
        for col, step in enumerate(out.unmask_step[row, width:].tolist()):
            if step >= 0:
                block = (layout.gen_start[row] + col - layout.block_starts[0]) // block_length
                steps_in_block.setdefault((block, row), set()).add(step)
    per_block = {}
    for (block, _), steps in steps_in_block.items():
        per_block[block] = max(per_block.get(block, 0), len(steps))
    return sum(per_block.values()) + extra_per_block * len(per_block) + extra


@pytest.mark.parametrize("family,kw,extra_per_block,extra", [
    ("sdar", dict(use_cache=True, denoising_steps=3), 0, 1),  # one prefill; commits ride on the next block
    ("sdar", dict(use_cache=False, remasking_strategy="sequential", denoising_steps=4), 0, 0),
    ("llada", dict(remasking_strategy="random", denoising_steps=3, temperature=1.0), 0, 0),
    ("dream", dict(use_cache="dual", denoising_steps=3), 0, 0),  # the refresh pass is step 0's forward
])
def test_steps_per_block_are_planned_exactly(family, kw, extra_per_block, extra):
    """For schedule-determined strategies the host plans each block's steps before it runs; the plan must equal
    the steps the rows needed (one more would be a wasted forward, one fewer would leave masks behind). With the
    uniform schedule every step commits a token, so the trajectory shows each block's steps."""
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS[:3])
    out = gen(model, ids, mask, max_new_tokens=12, generator=row_generators(3), **kw)
    assert not bool((out.sequences[:, ids.shape[1]:] == model.mask_token_id).any())
    assert out.num_forward_passes == planned_forward_passes(out, PROMPTS[:3], ids.shape[1], 4,
                                                            model.block_size is not None, extra_per_block, extra)


@pytest.mark.parametrize("kw", [dict(steps=12, alg="entropy"), dict(steps=6, alg="maskgit_plus", use_cache="dual")])
def test_linspace_steps_are_planned_exactly(kw):
    """Dream's schedule can commit nothing at a step (the float32 fractions floor to 0): such steps still run, as
    in Dream's sampler; one prompt alone runs exactly one forward per step it took."""
    model = tiny_model("dream")
    for prompt in PROMPTS[:3]:
        out = gen(model, torch.tensor([prompt]), None, max_new_tokens=12, **kw)
        assert out.num_forward_passes == int(out.denoising_steps)
        assert not bool((out.sequences[:, len(prompt):] == model.mask_token_id).any())


def test_schedule_bound_for_data_dependent_strategies():
    settings = SamplingSettings(max_new_tokens=8, block_length=4, denoising_steps=4,
                                remasking_strategy="low_confidence_dynamic", confidence_threshold=0.9)
    schedule = BlockSchedule(settings)
    assert [schedule.steps_needed(m, 4) for m in range(5)] == [0, 1, 2, 3, 4]  # quota 1 per step: the bound
    settings.denoising_steps = 2
    assert [BlockSchedule(settings).steps_needed(m, 4) for m in range(5)] == [0, 1, 1, 2, 2]
    dream = SamplingSettings(max_new_tokens=8, block_length=8, denoising_steps=4, schedule="linspace",
                             remasking_strategy="origin")
    assert BlockSchedule(dream).steps_needed(1, 8) == 4  # random commits: run the whole schedule


@pytest.mark.parametrize("sampled", [False, True])
def test_finished_rows_leave_the_batch_without_changing_any_row(sampled):
    """Rows that stopped leave the working batch at a block boundary; every row still equals itself decoded
    alone, and later forwards run fewer rows."""
    model = tiny_model("sdar")
    ids, mask = left_pad(PROMPTS)
    kw = dict(max_new_tokens=24, use_cache=True, temperature=1.0 if sampled else 0.0)
    free = gen(model, ids, mask, generator=row_generators(4), **kw)
    stops = [int(free.sequences[0, ids.shape[1] + 2]), int(free.sequences[1, ids.shape[1] + 2])]
    batch_sizes = []
    hook = model.register_forward_pre_hook(lambda m, a, k: batch_sizes.append(k["input_ids"].shape[0]),
                                           with_kwargs=True)
    batched = gen(model, ids, mask, generator=row_generators(4), stop_token_ids=stops, **kw)
    hook.remove()
    assert min(batch_sizes) < len(PROMPTS)
    width = ids.shape[1]
    for row, prompt in enumerate(PROMPTS):
        alone = gen(model, torch.tensor([prompt]), None, generator=row_generators(1, seed=row),
                    stop_token_ids=stops, **kw)
        n = alone.sequences.shape[1] - len(prompt)
        assert batched.sequences[row, width: width + n].tolist() == alone.sequences[0, len(prompt):].tolist()
        assert batched.unmask_step[row, width: width + n].tolist() == alone.unmask_step[0, len(prompt):].tolist()
        torch.testing.assert_close(batched.token_logprobs[row, width: width + n],
                                   alone.token_logprobs[0, len(prompt):], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,kw", [
    ("sdar", dict(use_cache=True)),
    ("llada", dict(use_cache="dual")),
    ("dream", dict(use_cache="prefix", confidence_threshold=0.01)),
])
def test_cpu_probe_stops_finished_blocks_without_changing_the_rollout(family, kw, monkeypatch):
    """On the CPU a data-dependent block stops once no row has a mask left; as on CUDA (no probe) it runs its
    planned bound. Same rollout either way (per-row generators still draw what their plan says), fewer forwards
    with the probe, and for one prompt exactly one forward per step taken."""
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS[:3])
    kw = {**dict(max_new_tokens=16, denoising_steps=4, temperature=1.0, confidence_threshold=0.05,
                 remasking_strategy="low_confidence_dynamic"), **kw}
    probed = gen(model, ids, mask, generator=row_generators(3), **kw)
    with monkeypatch.context() as patch:
        patch.setattr(denoise, "PROBE_DEVICES", ())
        bound = gen(model, ids, mask, generator=row_generators(3), **kw)
    assert_same_rollout(probed, bound)
    assert probed.num_forward_passes < bound.num_forward_passes
    alone = gen(model, ids[:1], mask[:1], generator=row_generators(1), use_cache=False,
                **{k: v for k, v in kw.items() if k != "use_cache"})
    assert alone.num_forward_passes == int(alone.denoising_steps)


def test_alg_temp_samples_the_quota_without_replacement():
    """Dream's ``alg_temp``: exactly the quota, only masked positions, first pick ~ softmax(confidence / T)."""
    confidence = torch.tensor([[0.9, 0.5, 0.1, 0.7]])
    masked = torch.tensor([[True, True, True, False]])
    generator = torch.Generator().manual_seed(0)
    firsts = torch.zeros(4)
    for _ in range(4000):
        one = select_commits("low_confidence_static", confidence, masked, 1, alg_temp=0.5, generator=generator)
        two = select_commits("low_confidence_static", confidence, masked, 2, alg_temp=0.5, generator=generator)
        assert int(one.sum()) == 1 and int(two.sum()) == 2 and not bool((two & ~masked).any())
        firsts += one[0].float()
    expected = torch.softmax(torch.tensor([0.9, 0.5, 0.1]) / 0.5, -1)
    torch.testing.assert_close(firsts[:3] / 4000, expected, rtol=0, atol=0.03)  # ~4 standard errors


# ------------------------------------------------------------------------------------------------------------
# No host synchronisation inside a block
# ------------------------------------------------------------------------------------------------------------


class HostSyncCounter(TorchDispatchMode):
    """Counts operations that make the host wait for the device on CUDA (reading a value: ``item``/``bool``/
    ``int``/``tolist``; output shapes that depend on values: ``nonzero``, boolean indexing, ``unique``, ...), so
    that a CPU run shows where a CUDA run would stall. Each model forward starts a new gap: ``gaps[i]`` counts the
    events before forward ``i`` (and ``tail`` those after the last one)."""

    SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
               aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.equal.default,
               aten.is_nonzero.default, aten.bincount.default, aten.repeat_interleave.Tensor}
    INDEXING = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}

    def __init__(self, model):
        super().__init__()
        self.model, self.gaps, self.tail = model, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.SYNCING or (func in self.INDEXING and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))):
            self.tail += 1
        return func(*args, **kwargs)

    def _forward_started(self, *args):
        self.gaps.append(self.tail)
        self.tail = 0

    def _tolist(self, tensor):
        self.tail += 1
        return self._original_tolist(tensor)

    def __enter__(self):
        self._hook = self.model.register_forward_pre_hook(self._forward_started)
        self._original_tolist = torch.Tensor.tolist
        torch.Tensor.tolist = lambda t: self._tolist(t)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._original_tolist
        self._hook.remove()
        return super().__exit__(*exc)


SYNC_CASES = [  # (family, generate arguments, stop tokens or not)
    ("sdar", dict(use_cache=True), False),
    ("sdar", dict(use_cache=True, remasking_strategy="low_confidence_dynamic", temperature=1.0, top_p=0.9), True),
    ("sdar", dict(use_cache=False, remasking_strategy="random", temperature=1.0, rows=True), True),
    ("llada", dict(use_cache="dual", remasking_strategy="low_confidence_dynamic"), True),
    ("llada", dict(cfg_scale=1.0, temperature=1.0, rows=True), False),
    ("llada", dict(use_cache="prefix"), False),
    ("dream", dict(steps=12, alg="entropy", alg_temp=0.5, temperature=0.5, rows=True), True),
    ("dream", dict(steps=12, alg="origin", temperature=1.0, use_cache="dual"), False),
]


@pytest.fixture
def as_on_cuda(monkeypatch):
    """Run the decode loop as on CUDA: no per-step probe of whether a data-dependent block is done (on the CPU
    that probe is free, so the loop makes it there)."""
    monkeypatch.setattr(denoise, "PROBE_DEVICES", ())


@pytest.mark.parametrize("family,kw,stops", SYNC_CASES)
def test_no_host_sync_inside_a_block(family, kw, stops, as_on_cuda):
    """Between two forwards of the decode loop the host reads nothing back from the device, except once per
    block for the per-row stop flags when there are stop tokens. (Fails on a loop that checks for remaining
    masks with ``bool(tensor)`` after every step.)"""
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS[:3])
    kw = dict(kw)
    generator = row_generators(3) if kw.pop("rows", False) else torch.Generator().manual_seed(0)
    stop_ids = [int(gen(model, ids, mask, max_new_tokens=4).sequences[0, -1])] if stops else []
    counter = HostSyncCounter(model)
    with counter:
        per_block = {} if "steps" in kw else dict(denoising_steps=3)  # Dream's steps=12: 3 per block of 4
        out = gen(model, ids, mask, max_new_tokens=16, generator=generator, stop_token_ids=stop_ids, **per_block, **kw)
    blocks = len(CanvasLayout([len(p) for p in PROMPTS[:3]], 16, 4, model.block_size is not None).block_starts)
    loop_gaps = counter.gaps[1:]  # gap 0 holds the setup (lengths, canvas layout) before the first forward
    assert len(loop_gaps) >= 2 * blocks  # several forwards per block: there are in-block gaps to check
    syncing = sum(1 for g in loop_gaps if g)
    if stops:
        assert syncing <= blocks and max(loop_gaps) <= 1
    else:
        assert syncing == 0
    assert (out.unmask_step >= 0).any()


def test_no_host_sync_inside_run_block(as_on_cuda):
    """Stricter, for this implementation: nothing inside ``ModelRunner.run_block`` syncs, stops or not."""
    model = tiny_model("sdar")
    ids, mask = left_pad(PROMPTS)
    counter = HostSyncCounter(model)
    inside = []
    original = ModelRunner.run_block

    def counted(self, *args, **kwargs):
        before = counter.tail + sum(counter.gaps)
        original(self, *args, **kwargs)
        inside.append(counter.tail + sum(counter.gaps) - before)

    ModelRunner.run_block = counted
    try:
        with counter:
            gen(model, ids, mask, use_cache=True, remasking_strategy="low_confidence_dynamic",
                confidence_threshold=0.3, stop_token_ids=[60, 61], temperature=1.0,
                generator=row_generators(len(PROMPTS)))
    finally:
        ModelRunner.run_block = original
    assert len(inside) >= 4 and sum(inside) == 0


def test_host_sync_counter_sees_syncs():
    """The counter is not blind: a ``bool(tensor)`` and a boolean index between forwards are counted."""
    model = tiny_model("sdar")
    ids = torch.tensor([[20, 21, 22, 23]])
    counter = HostSyncCounter(model)
    with counter, torch.no_grad():
        model(ids)
        _ = bool(ids.eq(3).any()), ids[ids > 21], ids.tolist()
        model(ids)
    assert counter.gaps == [0, 3]


# ------------------------------------------------------------------------------------------------------------
# GPU: the captured fast path equals the eager path (run where CUDA is available)
# ------------------------------------------------------------------------------------------------------------


GRAPH_CASES = [  # (family, generate arguments): every cache mode a graph runner replays, greedy and sampled
    ("sdar", dict(use_cache=True)),
    ("sdar", dict(use_cache=True, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2,
                  temperature=1.0, rows=True)),
    ("sdar", dict(use_cache=True, remasking_strategy="random", alg_temp=0.5, temperature=0.7, rows=True)),
    ("sdar", dict(use_cache=True, steps=10, alg="topk_margin", temperature=0.0)),  # Dream's linspace schedule
    ("llada", dict(use_cache="dual")),
    ("llada", dict(use_cache="dual", remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2,
                   temperature=1.0, rows=True)),
    ("llada", dict(use_cache="prefix", denoising_steps=4, remasking_strategy="low_confidence_dynamic",
                   confidence_threshold=0.2, temperature=1.0, rows=True)),
    ("dream", dict(use_cache="dual", steps=10, alg="entropy", alg_temp=0.5, temperature=0.5, rows=True)),
    ("dream", dict(use_cache="dual", steps=10, alg="origin", temperature=1.0, rows=True)),
    ("dream", dict(use_cache="prefix", steps=15, alg="maskgit_plus", temperature=0.0)),
]


GPU = torch.device("cuda")
"""Where the gpu tests below run; ``tests/test_gpu_setups.py`` runs their set-ups on the CPU."""


def _graph_case(family, kw, device="cpu"):
    """Model, prompts and generate arguments of a ``GRAPH_CASES`` entry (20 new tokens: five blocks)."""
    model = tiny_model(family).to(device)
    ids, mask = (t.to(device) for t in left_pad(PROMPTS))
    kw = dict(kw, max_new_tokens=20)
    if kw.pop("rows", False):
        kw["generator"] = lambda: row_generators(len(PROMPTS))
    return model, ids, mask, kw


def _graph_runners_used(monkeypatch) -> list[type]:
    """The runner classes ``generate`` picks from here on (a gpu test asserts they are graph runners). Clears the
    process-wide flag a failed capture sets: otherwise ``cuda_graphs="auto"`` would decode eagerly in every test
    after the first failure, and a test comparing it with the eager path would pass on eager vs eager."""
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)
    used, choose = [], sampler.runner_class

    def spy(settings, device, generator):
        used.append(choose(settings, device, generator))
        return used[-1]

    monkeypatch.setattr(sampler, "runner_class", spy)
    return used


def _only_graph_runners(used: list[type]) -> bool:
    return bool(used) and all(issubclass(runner, cuda_graphs.GraphRunner) for runner in used)


def _generate(model, ids, mask, kw, **more):
    args = {**kw, **more}
    if callable(args.get("generator")):
        args["generator"] = args["generator"]()  # fresh per-row generators for every run
    return gen(model, ids, mask, **args)


@pytest.mark.filterwarnings("error:CUDA-graph capture failed")  # a fallback would compare eager with eager
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,kw", GRAPH_CASES)
def test_cuda_graphs_equal_eager(family, kw, monkeypatch):
    model, ids, mask, kw = _graph_case(family, kw, GPU)
    eager = _generate(model, ids, mask, kw, cuda_graphs="off")
    used = _graph_runners_used(monkeypatch)
    assert_same_rollout(eager, _generate(model, ids, mask, kw, cuda_graphs="auto"))
    assert _only_graph_runners(used)


@pytest.mark.filterwarnings("error:CUDA-graph capture failed")  # a fallback would compare eager with eager
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family,cache", [("sdar", True), ("llada", "dual"), ("llada", "prefix"), ("dream", "dual")])
@pytest.mark.parametrize("graphs", ["off", "auto"])
def test_cuda_run_block_does_not_synchronise(family, cache, graphs, monkeypatch):
    """On CUDA, torch's sync debug mode raises on any synchronising call inside a block, from the third block on
    (the first ones also initialise CUDA libraries) and except while a graph is captured (capturing synchronises;
    the prefix cache captures in every block)."""
    model = tiny_model(family).to("cuda")
    ids, mask = (t.cuda() for t in left_pad(PROMPTS))
    settings = SamplingSettings(max_new_tokens=32, block_length=4, denoising_steps=3, cache_mode=
                                "exact" if cache is True else cache, cuda_graphs=graphs)
    runner = cuda_graphs.runner_class(settings, ids.device, None)
    assert (runner is ModelRunner) == (graphs == "off")
    original, original_record, blocks, captures = runner.run_block, cuda_graphs.GraphRunner._record, [], []

    def strict(self, *args, **kwargs):
        blocks.append(1)
        torch.cuda.set_sync_debug_mode("error" if len(blocks) > 2 else "default")
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def record(self, body):
        captures.append(1)
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return original_record(self, body)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(runner, "run_block", strict)
    monkeypatch.setattr(cuda_graphs.GraphRunner, "_record", record)
    gen(model, ids, mask, use_cache=cache, cuda_graphs=graphs, max_new_tokens=32, temperature=1.0,
        denoising_steps=3, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2,
        generator=row_generators(len(PROMPTS)))
    assert len(blocks) > 4 and (len(captures) > 0) == (graphs == "auto")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("error:CUDA-graph capture failed")
@pytest.mark.parametrize("family,cache", [("sdar", True), ("llada", "dual"), ("dream", "prefix")])
def test_cuda_graphs_draw_inside_the_graph(family, cache, monkeypatch):
    """``generator=None`` and sampling: the default CUDA generator draws inside the graph (not the eager stream, so
    no token comparison). Every position is decoded with a finite log-prob <= 0, and two calls sample differently
    (the graph's random offsets advance)."""
    model = tiny_model(family).to(GPU)
    ids, mask = (t.to(GPU) for t in left_pad(PROMPTS))
    torch.manual_seed(0)
    used = _graph_runners_used(monkeypatch)
    outs = [gen(model, ids, mask, use_cache=cache, cuda_graphs="auto", temperature=1.0, max_new_tokens=16,
                denoising_steps=2) for _ in range(2)]
    assert _only_graph_runners(used)
    for out in outs:
        generated = out.unmask_step >= 0
        assert bool((generated.sum(-1) >= 16).all()) and not bool((out.sequences == MASK_ID).any())
        logprobs = out.token_logprobs[generated]
        assert bool(torch.isfinite(logprobs).all()) and bool((logprobs <= 0).all())
    assert not torch.equal(outs[0].sequences, outs[1].sequences)


class _EagerReplay:
    """Stands in for a captured CUDA graph on CPU: ``replay`` runs the recorded function eagerly."""

    def __init__(self, fn):
        self.replay = fn


@pytest.mark.parametrize("family,kw", GRAPH_CASES)
def test_graph_runner_buffers_equal_eager(monkeypatch, family, kw):
    """Everything of the CUDA-graph runners except the capture itself, on CPU: the steps (SDAR: a plain one, and a
    first one that also commits the previous block; LLaDA/Dream: an eager first step that refreshes the dual cache,
    then replays) run on fixed buffers copied in and out per block, read the whole cache through a mask, take the
    quota or Dream's fraction from a device buffer and per-row uniforms from noise buffers refilled before each
    replay; rows leaving the batch resize them (and the graphs are captured again)."""
    model, ids, mask, kw = _graph_case(family, kw)
    free = _generate(model, ids, mask, kw)
    stops = [int(free.sequences[row, ids.shape[1] + 2]) for row in (0, 1)]  # two rows stop after their 1st block
    eager = _generate(model, ids, mask, kw, stop_token_ids=stops)
    recorded = []
    _force_graph_runners(monkeypatch, recorded)
    graphed = _generate(model, ids, mask, kw, stop_token_ids=stops, cuda_graphs="auto")
    assert_same_rollout(eager, graphed)
    assert eager.num_forward_passes == graphed.num_forward_passes
    assert len(recorded) >= 2 and recorded[0][0] == 4 and recorded[-1][0] < 4  # recaptured after rows left
    if kw.get("use_cache") == "prefix":  # the window shrinks: each of the five blocks captures its own graph
        assert len(recorded) == 5


def _force_graph_runners(monkeypatch, recorded=None):
    """Use the graph runners CUDA would use, on the CPU, with each capture replaced by an eager call."""
    def record(self, body):
        if recorded is not None:
            recorded.append(self._shape)
        return _EagerReplay(body)

    monkeypatch.setattr(cuda_graphs.GraphRunner, "_record", record)
    monkeypatch.setattr(sampler, "runner_class", lambda settings, device, generator: cuda_graphs.runner_class(
        settings, torch.device("cuda"), generator))


@pytest.mark.parametrize("family,kw", [GRAPH_CASES[1], GRAPH_CASES[6], GRAPH_CASES[8]])  # exact, prefix, dual
@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_failed_capture_falls_back_to_the_eager_loop(monkeypatch, family, kw, fail_at):
    """A capture that raises (the first one, or a later one mid-rollout) warns, finishes the rollout eagerly with
    the eager results, and later calls decode eagerly without trying again."""
    model, ids, mask, kw = _graph_case(family, kw)
    free = _generate(model, ids, mask, kw)
    kw["stop_token_ids"] = [int(free.sequences[row, ids.shape[1] + 2]) for row in (0, 1)]  # the dual cache's
    eager = _generate(model, ids, mask, kw)  # second capture comes when these two rows leave the batch
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)
    _force_graph_runners(monkeypatch)
    captures = []

    def record(self, body):
        captures.append(1)
        if len(captures) > fail_at:
            raise RuntimeError("capture failed for the test")
        return _EagerReplay(body)

    monkeypatch.setattr(cuda_graphs.GraphRunner, "_record", record)
    with pytest.warns(UserWarning, match="CUDA-graph capture failed"):
        graphed = _generate(model, ids, mask, kw, cuda_graphs="auto")
    assert_same_rollout(eager, graphed)
    assert eager.num_forward_passes == graphed.num_forward_passes and len(captures) == fail_at + 1
    assert cuda_graphs.CAPTURE_FAILED
    settings = SamplingSettings(max_new_tokens=8, block_length=4, denoising_steps=2, cache_mode="exact",
                                cuda_graphs="auto")
    assert cuda_graphs.runner_class(settings, torch.device("cuda"), None) is ModelRunner


def _replay_matches_the_sampler(model, ids, mask, out):
    """TraceRL's trajectory estimate of a rollout equals the log-probs the sampler recorded."""
    width = ids.shape[1]
    completion, steps = out.sequences[:, width:], out.unmask_step[:, width:]
    settings = EstimatorSettings(block_size=model.block_size, temperature=1.0)
    logps, _, scored = estimate_logprobs(model, ids, mask, completion, steps, settings)
    assert bool(scored.equal(steps >= 0)) and bool(scored.any())
    assert_close_fp32(logps, out.token_logprobs[:, width:], scored)


def test_tracerl_replays_a_graph_runner_rollout(monkeypatch):
    """A rollout of the (CPU-run) graph runner, sampled with per-row generators and the exact cache, is scored by
    TraceRL's trajectory estimator exactly as the sampler scored it."""
    _force_graph_runners(monkeypatch)
    model = tiny_model("sdar")
    ids, mask = left_pad(PROMPTS)
    out = gen(model, ids, mask, use_cache=True, cuda_graphs="auto", temperature=1.0, max_new_tokens=16,
              remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2,
              generator=row_generators(len(PROMPTS)))
    _replay_matches_the_sampler(model, ids, mask, out)


@pytest.mark.filterwarnings("error:CUDA-graph capture failed")  # a fallback would compare eager with eager
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_tracerl_replays_a_cuda_graph_rollout(monkeypatch):
    model = tiny_model("sdar").to(GPU)
    ids, mask = (t.to(GPU) for t in left_pad(PROMPTS))
    used = _graph_runners_used(monkeypatch)
    out = gen(model, ids, mask, use_cache=True, cuda_graphs="auto", temperature=1.0, max_new_tokens=16,
              remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2,
              generator=row_generators(len(PROMPTS)))
    assert _only_graph_runners(used)
    _replay_matches_the_sampler(model, ids, mask, out)


def _settings(**kw):
    return SamplingSettings(**{**dict(max_new_tokens=8, block_length=4, denoising_steps=2, cache_mode="exact",
                                      cuda_graphs="auto"), **kw})


@pytest.mark.parametrize("kw,generator,expected", [
    (dict(), None, "ExactCacheGraphRunner"),
    (dict(cache_mode="dual"), None, "WindowCacheGraphRunner"),
    (dict(cache_mode="dual", schedule="linspace", remasking_strategy="origin"), "rows", "WindowCacheGraphRunner"),
    (dict(cache_mode="prefix"), None, "WindowCacheGraphRunner"),
    (dict(temperature=1.0), "rows", "ExactCacheGraphRunner"),
    (dict(temperature=1.0), None, "ExactCacheGraphRunner"),  # the default CUDA generator draws inside the graph
    (dict(temperature=0.0), "one", "ExactCacheGraphRunner"),  # one generator, but greedy: nothing is drawn
    (dict(temperature=1.0), "one", "ModelRunner"),  # one generator that draws: its stream must match the eager one
    (dict(cuda_graphs="off"), None, "ModelRunner"),
    (dict(cache_mode="none"), None, "ModelRunner"),
    (dict(cache_mode="none", cfg_scale=1.0), None, "ModelRunner"),
])
def test_graph_runner_choice(kw, generator, expected):
    """Which runner ``cuda_graphs="auto"`` uses on CUDA (and never off CUDA)."""
    generator = {"rows": row_generators(2), "one": torch.Generator(), None: None}[generator]
    assert cuda_graphs.runner_class(_settings(**kw), torch.device("cuda"), generator).__name__ == expected
    assert cuda_graphs.runner_class(_settings(**kw), torch.device("cpu"), generator) is ModelRunner


def test_cuda_graphs_default_is_auto(monkeypatch):
    """``generate()`` replays CUDA graphs by default (measured on an H200 on 2026-12-04: the graph tests passed, 6.8x
    the eager batch-1 speed); a generation config's ``cuda_graphs`` and the call's override it."""
    seen = []
    choose = sampler.runner_class
    monkeypatch.setattr(sampler, "runner_class",
                        lambda settings, *args: seen.append(settings.cuda_graphs) or choose(settings, *args))
    model = tiny_model("sdar")
    ids = torch.tensor([[11, 12, 13]])
    model.generate(ids, max_new_tokens=4)
    model.generation_config.cuda_graphs = "off"
    model.generate(ids, max_new_tokens=4)
    model.generate(ids, max_new_tokens=4, cuda_graphs="auto")
    assert seen == ["auto", "off", "auto"]
    assert SamplingSettings(max_new_tokens=4, block_length=4, denoising_steps=4).cuda_graphs == "auto"
