"""Behavioural claims of docs/generation.md and docs/models.md that no other test exercised, each checked against
an exact expected value or a computation written out by hand."""

import pytest
import torch
from numerics import MIN_MARGIN, DecisionMargins, assert_close_fp32
from safetensors.torch import save_file
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM
from transformers.modeling_outputs import BaseModelOutputWithPast

from trl_diffusion import DiffusionCache
from trl_diffusion.states import state_before_step
from trl_diffusion.testing import MASK_ID, TINY_CONFIGS, UNK_ID, left_pad, tiny_model

PROMPT = torch.tensor([[20, 21, 22, 23]])  # one whole SDAR block: every family's completion starts at column 4


def generate(model, ids=PROMPT, mask=None, **kwargs):
    args = dict(max_new_tokens=8, block_length=4, denoising_steps=2, temperature=0.0, stop_token_ids=[],
                return_dict_in_generate=True)
    return model.generate(ids, mask, **{**args, **kwargs})


# ------------------------------------------------------------------------------------------- generation.md


@pytest.mark.parametrize(("family", "expected"), [
    ("sdar", [0, 1, 1, 2, 3, 4, 4, 5, 6]),  # 3 prompt tokens: block 0 holds one mask, then two blocks of 4
    ("llada", [0, 0, 1, 2, 3, 3, 4, 5]),
    ("dream", [0, 0, 1, 2, 3, 3, 4, 5]),
])
def test_sequential_commits_the_leftmost_masks_remainder_first(family, expected):
    """``sequential``: the leftmost masks, block_length / denoising_steps per step, the remainder in the first
    steps (4 masks in 3 steps: 2, 1, 1)."""
    out = generate(tiny_model(family), torch.tensor([[20, 21, 22]]), remasking_strategy="sequential",
                   denoising_steps=3)
    assert out.unmask_step[0, 3:].tolist() == expected


def test_random_commits_the_quota_at_uniformly_chosen_positions():
    """``random``: exactly the static quota per step (8 masks in 3 steps: 3, 3, 2) at positions chosen uniformly,
    whatever the model's confidence (greedy tokens, so only the commit rule draws)."""
    model = tiny_model("llada")
    first_step = torch.zeros(8)
    for seed in range(64):
        out = generate(model, max_new_tokens=8, block_length=8, denoising_steps=3, remasking_strategy="random",
                       generator=torch.Generator().manual_seed(seed))
        steps = out.unmask_step[0, 4:]
        assert torch.bincount(steps).tolist() == [3, 3, 2]
        first_step += (steps == 0).float()
    # each position is committed first 64 * 3/8 = 24 times on average (standard deviation 3.9)
    assert int(first_step.sum()) == 64 * 3
    assert bool((first_step >= 8).all()) and bool((first_step <= 40).all()), first_step.tolist()


def filtered_log_probs(logits: torch.Tensor, top_k: int, top_p: float, top_p_first: bool = False) -> torch.Tensor:
    """The untempered distribution after top-k and top-p filtering, written out: the mask token never, the
    ``top_k`` largest logits, then the most likely tokens up to the first whose cumulative probability reaches
    ``top_p`` (Dream, ``top_p_first``: the top-p set first, then its ``top_k`` largest)."""
    logits = logits.double().clone()
    logits[..., MASK_ID] = float("-inf")

    def top_k_filter(values):
        kth = values.sort(-1, descending=True).values[..., top_k - 1 : top_k]
        return values.masked_fill(values < kth, float("-inf"))

    def top_p_filter(values):
        probs, order = values.softmax(-1).sort(-1, descending=True)
        mass_before = probs.cumsum(-1) - probs
        keep = torch.zeros_like(values, dtype=torch.bool).scatter(-1, order, mass_before < top_p)
        return values.masked_fill(~keep, float("-inf"))

    filtered = top_k_filter(top_p_filter(logits)) if top_p_first else top_p_filter(top_k_filter(logits))
    return filtered.log_softmax(-1)


def test_greedy_takes_the_argmax_scored_under_the_filtered_untempered_distribution(family):
    """Greedy (temperature 0) takes the argmax; its confidence (which positions the static rule commits first)
    and its log-prob are those of the temperature-1 distribution after top-k / top-p filtering (Dream: top-p
    first). LLaDA's confidence is the raw softmax's (no filter, the mask token in it), as its reference samplers'."""
    model = tiny_model(family)
    # top-p first (Dream) acts on the whole vocabulary: 0.27 keeps 3 to 5 of the first step's tokens (cumulative
    # mass at least 0.007 from 0.27), so that top-k cuts some positions and top-p leaves fewer than 4 at others
    top_k, top_p = 4, (0.27 if model.top_p_first else 0.6)
    with DecisionMargins() as margins:
        out = generate(model, top_k=top_k, top_p=top_p, remasking_strategy="low_confidence_static")
    assert margins.smallest > MIN_MARGIN
    generated = torch.zeros_like(out.sequences, dtype=torch.bool)
    generated[:, 4:] = True
    state = state_before_step(out.sequences, out.unmask_step, generated, 0, MASK_ID)
    with torch.no_grad():
        logits = model.align_logits(model(state).logits)[0, 4:8]  # the first block's 4 masks
    log_probs = filtered_log_probs(logits, top_k, top_p, model.top_p_first)
    kept = log_probs.isfinite().sum(-1)
    assert bool((kept <= top_k).all()) and bool((kept < top_k).any())  # both filters act
    first = (out.unmask_step[0, 4:8] == 0).nonzero().flatten()
    assert len(first) == 2  # the quota: 4 masks in 2 steps
    confidence = log_probs.max(-1).values
    if family == "llada":
        confidence = logits.double().softmax(-1).gather(-1, log_probs.argmax(-1)[:, None]).squeeze(-1)
    assert set(first.tolist()) == set(confidence.topk(2).indices.tolist())
    tokens = out.sequences[0, 4 + first]
    assert torch.equal(tokens, log_probs[first].argmax(-1))
    expected = log_probs[first].gather(-1, tokens[:, None]).squeeze(-1)
    assert_close_fp32(out.token_logprobs[0, 4 + first], expected)
    unfiltered = logits[first].double().log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1)
    assert bool(((expected - unfiltered).abs() > 1e-3).all())  # the filter changed what is scored


def test_top_k_zero_or_none_and_top_p_one_do_not_filter(family):
    """``top_k`` 0 or None: no filtering; ``top_p=1.0`` keeps every token (seeded sampling, same draws)."""
    model = tiny_model(family)

    def sample(**kwargs):
        return generate(model, temperature=1.0, generator=torch.Generator().manual_seed(5), **kwargs)

    plain = sample()
    for kwargs in (dict(top_k=0), dict(top_k=None), dict(top_p=1.0), dict(top_k=0, top_p=1.0)):
        out = sample(**kwargs)
        assert torch.equal(out.sequences, plain.sequences), kwargs
        assert torch.equal(out.token_logprobs, plain.token_logprobs), kwargs
    filtered = sample(top_k=2)
    assert not torch.equal(filtered.token_logprobs, plain.token_logprobs)  # filtering does change the scores


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_use_cache_true_leaves_full_attention_models_uncached(family):
    """``use_cache=True`` is SDAR's exact cache; LLaDA / Dream take their approximate caches by name only, so
    ``True`` (in the call or the generation config) decodes exactly as no cache: every forward runs the whole
    canvas, without a cache."""
    model = tiny_model(family)
    calls = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append((kwargs["input_ids"].shape[1], kwargs.get("past_key_values"))),
        with_kwargs=True)
    try:
        plain = generate(model, use_cache=False)
        assert calls and all(width == 12 and cache is None for width, cache in calls)
        calls.clear()
        called = generate(model, use_cache=True)
        assert calls and all(width == 12 and cache is None for width, cache in calls)
        model.generation_config.use_cache = True
        configured = generate(model)
        calls.clear()
        generate(model, use_cache="dual")
        assert any(width < 12 for width, _ in calls)  # the name does turn the approximate cache on
    finally:
        hook.remove()
    for out in (called, configured):
        assert torch.equal(out.sequences, plain.sequences)
        assert torch.equal(out.unmask_step, plain.unmask_step)
        assert out.num_forward_passes == plain.num_forward_passes


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("use_cache", [False, "prefix", "dual"])
def test_the_lm_head_runs_on_the_blocks_columns_only(family, use_cache):
    """generation.md: every forward computes the block's logits only; the LM head over the whole canvas (then
    sliced) was the largest cost of uncached full-attention decoding with a large vocabulary."""
    model = tiny_model(family)
    widths = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda module, args: widths.append(args[0].shape))
    try:
        out = generate(model, use_cache=use_cache)
    finally:
        hook.remove()
    assert len(widths) == out.num_forward_passes and all(shape[:2] == (1, 4) for shape in widths)


def test_sequences_after_a_stop_are_the_pad_token_and_never_committed(family):
    """``sequences``: the left-padded prompt as given, then the completion right-padded with the pad token (the
    call's ``pad_token_id``, else the model's); ``unmask_step`` is -1 on prompt, padding and the positions left
    after a stop, whose ``token_logprobs`` are 0."""
    model = tiny_model(family, pad_token_id=7)
    ids, mask = left_pad([[20, 21, 22, 23], [30, 31]], pad_id=9)
    free = generate(model, ids, mask, max_new_tokens=12)
    stop = int(free.sequences[0, 4])  # the first completion token of row 0
    for pad, kwargs in ((7, {}), (UNK_ID, dict(pad_token_id=UNK_ID))):
        out = generate(model, ids, mask, max_new_tokens=12, stop_token_ids=[stop], **kwargs)
        assert torch.equal(out.sequences[:, :4], ids)  # the prompt as given, its padding included
        assert bool((out.unmask_step[:, :4] == -1).all()) and bool((out.token_logprobs[:, :4] == 0).all())
        left = out.unmask_step[0, 4:] == -1
        assert int(left.sum()) > 0  # row 0 stopped before its last block
        assert bool((out.sequences[0, 4:][left] == pad).all())
        assert bool((out.token_logprobs[0, 4:][left] == 0).all())
        committed = ~left
        assert torch.equal(out.sequences[0, 4:][committed], free.sequences[0, 4:][committed])


def test_max_new_tokens_wins_over_max_length_in_the_same_call():
    """``max_length`` counts the prompt, as in transformers; with both in one call ``max_new_tokens`` wins."""
    model = tiny_model("dream")
    assert generate(model, max_new_tokens=4, max_length=16).sequences.shape == (1, 8)
    assert generate(model, max_new_tokens=None, max_length=12).sequences.shape == (1, 12)


# ----------------------------------------------------------------------------------------------- models.md


def test_diffusion_interface_values(family):
    """``block_size``: SDAR's config.block_size, None for LLaDA / Dream; ``attention_kind``: "block_causal" or
    "full"; ``logits_shift``: Dream only."""
    model = tiny_model(family, **({"block_size": 8} if family == "sdar" else {}))
    assert model.block_size == (8 if family == "sdar" else None)
    assert model.attention_kind == ("block_causal" if family == "sdar" else "full")
    assert model.logits_shift is (family == "dream")
    assert model.mask_token_id == MASK_ID


def test_every_auto_class_gives_the_model_with_its_lm_head(family):
    """``AutoModel``, ``AutoModelForCausalLM`` and ``AutoModelForMaskedLM`` all build the table's class."""
    config = TINY_CONFIGS[family]()
    expected = type(tiny_model(family))
    for auto in (AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM):
        assert type(auto.from_config(config)) is expected, auto.__name__


def test_default_position_ids_continue_after_the_cache(family):
    """``position_ids`` default to ``past + 0..L-1``: a pass after a cache of 8 tokens reads positions 8..11. The
    output hands the cache back as ``out.cache`` (``out.past_key_values`` before transformers 5.24)."""
    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cache = DiffusionCache()
        out = model(ids[:, :8], past_key_values=cache, store_kv=True)
        name = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
        assert out[name] is cache and cache.get_seq_length() == 8
        default = model(ids[:, 8:], past_key_values=cache).logits
        explicit = model(ids[:, 8:], past_key_values=cache, position_ids=torch.arange(8, 12)[None]).logits
        restarted = model(ids[:, 8:], past_key_values=cache, position_ids=torch.arange(4)[None]).logits
        full = model(ids).logits[:, 8:]
    assert torch.equal(default, explicit)
    assert not torch.allclose(default, restarted, atol=1e-3)  # the positions matter
    if family == "sdar":  # block-causal: the last block sees nothing after it, so the cached pass is the full one
        assert_close_fp32(default, full)


def test_a_mask_of_the_wrong_shape_names_the_expected_shape(family):
    model = tiny_model(family)
    with pytest.raises(ValueError, match=r"expected \[B, 1, 8, 8\] or \[B, 8, 8\]"):
        model(torch.randint(5, 100, (1, 8)), attention_mask=torch.ones(1, 8, 5, dtype=torch.bool))


def test_a_checkpoint_with_other_keys_is_an_error_listing_them(tmp_path):
    """A checkpoint whose keys don't match the class is a ValueError listing the missing and unexpected keys, never
    a silently re-initialised weight."""
    model = tiny_model("sdar")
    state = model.state_dict()
    missing = "model.layers.1.mlp.down_proj.weight"
    state = {k: v.contiguous() for k, v in state.items() if k != missing}
    state["model.layers.1.mlp.renamed_proj.weight"] = torch.zeros(2)
    model.config.save_pretrained(tmp_path)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(error.value)
    assert "missing_keys" in message and missing in message
    assert "unexpected_keys" in message and "model.layers.1.mlp.renamed_proj.weight" in message
