"""Numerical parity with the published reference code (expected numbers in tests/data/reference_parity.json,
produced by running the reference modeling and samplers locally; see reference_parity.md)."""

import json
from pathlib import Path

import pytest
import torch
from numerics import MIN_MARGIN, DecisionMargins, assert_close_fp32

from trl_diffusion.testing import MODEL_CLASSES, seeded_fill_, tiny_dream_config, tiny_llada_config, tiny_sdar_config

DATA = json.loads((Path(__file__).parent / "data" / "reference_parity.json").read_text())


def reference_model(family):
    config = {
        "sdar": tiny_sdar_config(
            mask_token_id=127, max_position_embeddings=256, eos_token_id=0, bos_token_id=0, pad_token_id=None
        ),
        "llada": tiny_llada_config(mask_token_id=127, max_sequence_length=256, eos_token_id=1, pad_token_id=1),
        "dream": tiny_dream_config(
            mask_token_id=127, max_position_embeddings=256, pad_token_id=1, eos_token_id=0, bos_token_id=0
        ),
    }[family]
    model = MODEL_CLASSES[family](config)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    assert sorted(shapes.items()) == [(name, shape) for name, shape in DATA["meta"]["state_dict_keys"][family]]
    return seeded_fill_(model, 0).eval()


@pytest.mark.parametrize(
    "case,family", [("sdar_logits", "sdar"), ("llada_logits", "llada"), ("dream_logits", "dream")]
)
def test_logits_match_reference(case, family):
    data = DATA[case]
    ids = torch.tensor(data["input_ids"])
    model = reference_model(family)
    kwargs = {}
    if family == "sdar":
        kwargs = {
            "attention_mask": torch.tensor(data["attention_mask"]),
            "position_ids": torch.tensor(data["position_ids"]),
        }
    logits = model(ids, **kwargs).logits
    assert_close_fp32(logits, torch.tensor(data["logits"]), rel=2e-5)  # stored rounded to 6 decimals; |logits| ~6


@pytest.mark.parametrize("case,family", [("llada_logits_padded", "llada"), ("dream_logits_padded", "dream")])
def test_padded_logits_match_reference(case, family):
    data = DATA[case]
    ids = torch.tensor(data["input_ids"])
    mask = torch.tensor(data.get("attention_mask") or data["attention_mask_2d"])
    kwargs = {"attention_mask": mask}
    if "position_ids" in data:
        kwargs["position_ids"] = torch.tensor(data["position_ids"])
    logits = reference_model(family)(ids, **kwargs).logits
    cols = data["compare_positions"]
    assert_close_fp32(logits[:, cols], torch.tensor(data["logits"])[:, cols], rel=2e-5)


def _check_generation(out, data, prompt_len):
    expected = torch.tensor(data["output_ids"])
    n = expected.shape[1]
    assert out.sequences[:, :n].tolist() == expected.tolist()
    assert out.unmask_step[:, prompt_len:n].tolist() == torch.tensor(data["unmask_step"])[:, prompt_len:].tolist()


@pytest.mark.parametrize(
    "case,strategy", [("sdar_generate_dynamic", "low_confidence_dynamic"), ("sdar_generate_sequential", "sequential")]
)
def test_sdar_sampler_matches_reference(case, strategy):
    data = DATA[case]
    kw = data["kwargs"]
    prompt = torch.tensor(data["prompt"])
    with DecisionMargins() as margins:
        out = reference_model("sdar").generate(
            prompt,
            max_new_tokens=kw["gen_length"],
            block_length=kw["block_length"],
            denoising_steps=kw["denoising_steps"],
            temperature=kw["temperature"],
            top_k=kw["top_k"],
            top_p=kw["top_p"],
            remasking_strategy=strategy,
            confidence_threshold=kw["confidence_threshold"],
            stop_token_ids=kw["stopping_criteria_idx"],
            return_dict_in_generate=True,
        )
    # top_k=1: every confidence is exactly 1.0, so commit ranks are exact ties broken by position (no float in
    # them); the top-1 token and the dynamic threshold are the float decisions
    assert min(margins.draw + margins.threshold) > MIN_MARGIN
    _check_generation(out, data, prompt.shape[1])


@pytest.mark.parametrize("case", ["llada_generate", "llada_generate_batched"])
def test_llada_sampler_matches_reference(case):
    data = DATA[case]
    kw = data["kwargs"]
    prompt = torch.tensor(data["prompt"])
    mask = torch.tensor(data["attention_mask"]) if data.get("attention_mask") else None
    blocks = kw["gen_length"] // kw["block_length"]
    with DecisionMargins() as margins:
        out = reference_model("llada").generate(
            prompt,
            mask,
            max_new_tokens=kw["gen_length"],
            block_length=kw["block_length"],
            denoising_steps=kw["steps"] // blocks,
            temperature=kw["temperature"],
            remasking_strategy="low_confidence_static",
            stop_token_ids=[],
            return_dict_in_generate=True,
        )
    # the stored reference fixes the inputs; its closest commit is a confidence gap of 1.4e-5 (two probabilities
    # ~0.12, each carrying ~1e-7 of float32 noise): still two orders of magnitude clear
    assert margins.smallest > 1e-5
    _check_generation(out, data, prompt.shape[1])


@pytest.mark.parametrize(
    "case",
    [
        "dream_generate_maskgit_plus",
        "dream_generate_topk_margin",
        "dream_generate_entropy",
        "dream_generate_entropy_steps8",
    ],
)
def test_dream_sampler_matches_reference(case):
    data = DATA[case]
    kw = data["kwargs"]
    prompt = torch.tensor(data["prompt"])
    with DecisionMargins() as margins:
        out = reference_model("dream").generate(
            prompt,
            max_new_tokens=kw["max_new_tokens"],
            steps=kw["steps"],
            alg=kw["alg"],
            temperature=kw["temperature"],
            eps=kw["eps"],
            stop_token_ids=[],
            return_dict_in_generate=True,
        )
    assert margins.smallest > MIN_MARGIN
    _check_generation(out, data, prompt.shape[1])


@pytest.mark.parametrize("strategy", ["low_confidence_static", "topk_margin", "entropy"])
def test_llada_ranks_commits_by_the_raw_softmax_when_sampling(strategy):
    """ML-GSAI's ``generate.py`` and dLLM-RL's LLaDA rollouts draw x0 with the float64 Gumbel race at the
    temperature, but rank commits by ``p = softmax(logits)`` at temperature 1 (the mask token in the softmax):
    ``p[x0]``, the top-2 margin, the entropy (negative here: dLLM-RL's ``neg_entropy`` computes +H, documented).
    The tempered distribution ranked them before: other positions committed (the official LLaDA preset samples at
    0.8). A slow reference of that loop, fed the uniforms our per-row generators draw (per row, ``[block, vocab]``
    float64 per step), commits the same positions and tokens."""
    model = reference_model("llada")
    rows, prompt_len, length, steps, temperature, quota = 16, 6, 8, 4, 0.8, 2
    prompt = torch.randint(5, 100, (rows, prompt_len), generator=torch.Generator().manual_seed(0))
    with DecisionMargins() as margins, torch.no_grad():
        out = model.generate(prompt, max_new_tokens=length, block_length=length, denoising_steps=steps,
                             temperature=temperature, remasking_strategy=strategy, stop_token_ids=[],
                             generator=[torch.Generator().manual_seed(i) for i in range(rows)],
                             return_dict_in_generate=True)
    assert margins.smallest > 1e-6
    generators = [torch.Generator().manual_seed(i) for i in range(rows)]
    x = torch.cat([prompt, torch.full((rows, length), 127)], dim=1)
    unmask_step = torch.full((rows, length), -1)
    for step in range(steps):
        with torch.no_grad():
            logits = model(x).logits[:, prompt_len:].double()
        sampled = logits.clone()
        sampled[..., 127] = float("-inf")  # our sampler never draws the mask token (documented)
        u = torch.stack([torch.rand(logits.shape[1:], generator=g, dtype=torch.float64) for g in generators])
        x0 = (sampled.exp() / (-torch.log(u)) ** temperature).argmax(-1)
        p = logits.softmax(-1)
        if strategy == "low_confidence_static":
            confidence = p.gather(-1, x0[..., None]).squeeze(-1)
        elif strategy == "topk_margin":
            top2 = p.topk(2, dim=-1).values
            confidence = top2[..., 0] - top2[..., 1]
        else:
            confidence = (p * torch.log(p + 1e-10)).sum(-1)
        masked = x[:, prompt_len:] == 127
        confidence = confidence.masked_fill(~masked, float("-inf"))
        for row in range(rows):
            chosen = confidence[row].topk(quota).indices
            x[row, prompt_len + chosen] = x0[row, chosen]
            unmask_step[row, chosen] = step
    assert out.sequences[:, :prompt_len + length].tolist() == x.tolist()
    assert out.unmask_step[:, prompt_len:prompt_len + length].tolist() == unmask_step.tolist()


def test_dream_filters_top_p_before_top_k_in_sampling_and_scoring():
    """Dream's ``sample_tokens`` (and dLLM-RL's Dream rollouts) apply top-p, then top-k; SDAR's applies top-k first.
    With both set the orders keep different tokens (the official Dream TraceRL preset sets top_p 0.9, top_k 50):
    the sampler drew from, and the estimators scored, SDAR's order for every family."""
    from trl_diffusion.estimators import replay_logprobs
    from trl_diffusion.generation.sampling import sampling_logits
    from trl_diffusion.testing import tiny_model

    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    top_k_first = sampling_logits(probs.log(), 1.0, 2, 0.5).softmax(-1)
    top_p_first = sampling_logits(probs.log(), 1.0, 2, 0.5, top_p_first=True).softmax(-1)
    assert torch.allclose(top_k_first, torch.tensor([[1.0, 0, 0, 0]]))
    assert torch.allclose(top_p_first, torch.tensor([[4 / 7, 3 / 7, 0, 0]]))

    model = tiny_model("dream").eval()
    assert model.top_p_first and not tiny_model("sdar").top_p_first and not tiny_model("llada").top_p_first
    prompt = torch.randint(5, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    kw = dict(temperature=0.8, top_k=5, top_p=0.6)
    out = model.generate(prompt, max_new_tokens=8, block_length=8, denoising_steps=4, stop_token_ids=[],
                         generator=[torch.Generator().manual_seed(i) for i in range(4)],
                         return_dict_in_generate=True, **kw)
    committed = out.unmask_step[:, 6:] >= 0
    # the tokens of the first step, scored by hand in Dream's order from the first canvas
    with torch.no_grad():
        first = model.align_logits(model(torch.cat([prompt, torch.full((4, 8), model.mask_token_id)], 1)).logits)
    filtered = first[:, 6:].float().masked_fill(
        torch.arange(first.shape[-1]) == model.mask_token_id, float("-inf")) / 0.8
    kept = filtered.softmax(-1).sort(-1, descending=True)
    outside_p = (kept.values.cumsum(-1) - kept.values) > 0.6  # Dream's top-p: drop once the mass before is > p
    filtered = filtered.scatter(-1, kept.indices, filtered.gather(-1, kept.indices).masked_fill(outside_p, -torch.inf))
    filtered = filtered.masked_fill(filtered < filtered.topk(5, -1).values[..., -1:], float("-inf"))
    expected = filtered.log_softmax(-1).gather(-1, out.sequences[:, 6:, None]).squeeze(-1)
    at_first = out.unmask_step[:, 6:] == 0
    assert_close_fp32(out.token_logprobs[:, 6:], expected, where=at_first)
    replay = replay_logprobs(model, out.sequences, torch.ones_like(prompt), out.unmask_step, **kw)
    assert_close_fp32(replay[:, 6:], out.token_logprobs[:, 6:], where=committed)


@pytest.mark.parametrize(("vocabulary", "top_p", "count"), [(4, 0.5, 3), (4, 0.25, 2), (8, 0.5, 5), (8, 0.75, 7)])
def test_top_p_keeps_the_token_whose_preceding_mass_equals_p(vocabulary, top_p, count):
    """SDAR's and Dream's ``top_p_logits`` drop a token only once the probability mass before it (most likely first)
    is strictly greater than ``top_p``: with uniform logits a boundary lands exactly on ``top_p`` (4 tokens, 0.5:
    0.25 + 0.25), and that next token is kept (3 tokens, not 2). Reference: a plain loop over the sorted tokens."""
    from trl_diffusion.generation.sampling import sampling_logits

    def reference_kept(probs):
        kept, before = 0, 0.0
        for p in sorted(probs, reverse=True):
            if kept and before > top_p:
                break
            kept, before = kept + 1, before + p
        return kept

    logits = torch.zeros(1, vocabulary)
    kept = torch.isfinite(sampling_logits(logits, 1.0, None, top_p)).sum().item()
    assert kept == reference_kept([1 / vocabulary] * vocabulary) == count
