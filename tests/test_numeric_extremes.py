"""Numerical edge cases: float32 rounding of weighted rewards, huge rewards, constant returns, +inf logits and
LLaDA's Gumbel draw at high temperature. Each case gave a crash or a silently wrong number before."""

import math

import pytest
import torch

from trl_diffusion.generation.sampling import sample_tokens
from trl_diffusion.trainers.tracerl_objective import kept_groups, population_advantages
from trl_diffusion.value.advantages import summarize_value_statistics, value_statistics


def test_accuracy_band_takes_weighted_rewards_that_round_past_one():
    """Four 0/1 rewards weighted 0.4/0.3/0.1/0.2 sum to 1.0000001 in float32 (TRL keeps reward_weights in float32):
    the default filter raised mid-run, printing the range as [0.8, 1]."""
    weights = torch.tensor([0.4, 0.3, 0.1, 0.2])
    rewards = torch.stack([weights.sum(), weights.sum(), weights[:2].sum(), torch.tensor(0.0)])
    assert rewards.max() > 1  # the rounding this test is about
    assert kept_groups(rewards, 2, "accuracy_band", 0.0, 0.99).tolist() == [False, False, True, True]
    # with the band's upper bound at 1, the all-correct group is kept as with exact rewards of 1 (review)
    assert kept_groups(rewards, 2, "accuracy_band", 0.0, 1.0).tolist() == [True] * 4
    with pytest.raises(ValueError, match=r"got rewards in \[0, 1.00999999\]"):
        kept_groups(torch.tensor([0.0, 1.01]), 2, "accuracy_band", 0.0, 1.0)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_huge_rewards_keep_their_advantages(scale):
    """float32 squares of rewards from about 1e19 overflowed: the std was inf and every advantage 0."""
    advantages = population_advantages(torch.tensor([1e20, 0.0, 0.0, 0.0]), 4, scale)
    assert advantages.dtype == torch.float32
    torch.testing.assert_close(advantages, torch.tensor([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3),
                                                         -1 / math.sqrt(3)]))


def _explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    stats = value_statistics(values[None], returns[None], torch.ones(1, values.numel(), dtype=torch.bool))
    return summarize_value_statistics(stats)["explained_variance"]


@pytest.mark.parametrize("constant", [0.3, 1 / 3, 0.7, 123.456])
def test_constant_returns_have_no_explained_variance(constant):
    """The float32 one-pass variance of constant returns of 0.3 was rounding noise above the fixed 1e-12 cutoff: an
    explained variance of -1.3e6 (it broke best-model selection by it)."""
    generator = torch.Generator().manual_seed(0)
    values = constant + 0.1 * torch.randn(65536, generator=generator)
    assert math.isnan(_explained_variance(values, torch.full((65536,), constant)))


def test_explained_variance_of_tiny_returns_is_computed():
    """Returns of 0 or 1e-6 vary (the fixed 1e-12 cutoff called them constant): the float64 two-pass answer."""
    generator = torch.Generator().manual_seed(0)
    returns = (torch.rand(4096, generator=generator) < 0.5).float() * 1e-6
    values = returns + 1e-7 * torch.randn(4096, generator=generator)
    r, v = returns.double(), values.double()
    expected = 1 - (r - v).var(unbiased=False) / r.var(unbiased=False)
    assert _explained_variance(values, returns) == pytest.approx(expected.item(), rel=1e-6)


def test_greedy_takes_the_argmax_of_logits_holding_inf():
    """log_softmax of a row holding +inf (an fp16 overflow) is NaN everywhere, whose argmax was token 0."""
    logits = torch.randn(1, 3, 64)
    logits[0, 1, 50] = torch.inf
    tokens, _, _ = sample_tokens(logits, 0.0, None, None)
    assert tokens[0, 1] == 50
    assert tokens[0, [0, 2]].tolist() == logits[0, [0, 2]].argmax(-1).tolist()


@pytest.mark.parametrize("temperature", [100.0, 1000.0, 1e4])
def test_llada_gumbel_draw_at_high_temperature_never_draws_a_filtered_token(temperature):
    """(-log u)^T underflowed to 0 at high T: a filtered entry (the mask token, or outside top-k) read 0/0 = NaN and
    won the argmax (1503 mask tokens of 4096 at T=1000)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4096, 128, generator=generator)
    mask_id = 3
    tokens, logprobs, _ = sample_tokens(logits, temperature, None, None, torch.Generator().manual_seed(1),
                                        gumbel_float64=True, mask_token_id=mask_id)
    assert not (tokens == mask_id).any() and torch.isfinite(logprobs).all()
    assert tokens.unique().numel() > 100  # still a draw over the whole vocabulary, not ties at low ids
    tokens, logprobs, _ = sample_tokens(logits, temperature, 5, None, torch.Generator().manual_seed(1),
                                        gumbel_float64=True, mask_token_id=mask_id)
    top5 = logits.masked_fill(torch.arange(128) == mask_id, -torch.inf).topk(5, -1).indices
    assert (tokens[..., None] == top5).any(-1).all() and torch.isfinite(logprobs).all()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_llada_gumbel_draw_is_the_official_form_at_usual_temperatures(temperature):
    """Where LLaDA's ``argmax(exp(l) / (-log u)^T)`` is well defined, the draw is that, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(2, 64, 256, generator=generator)
    tokens, _, _ = sample_tokens(logits, temperature, None, None, torch.Generator().manual_seed(5),
                                 gumbel_float64=True)
    u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    official = (logits.double().exp() / (-torch.log(u)) ** temperature).argmax(-1)
    assert torch.equal(tokens, official)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_llada_gumbel_draw_of_underflowing_logits_follows_the_tempered_softmax(temperature):
    """Logits near -2000 underflow every ``exp(l)`` of LLaDA's form to 0, so each position falls back to the
    log-space draw ``argmax(l - T log(-log u))``; that draw must still sample softmax(l / T), the distribution the
    sampler's log-probs and the estimators assume (20,000 draws, each frequency within 0.02)."""
    logits = torch.tensor([0.0, -1.0, -1.0, -3.0]) - 2000.0
    assert not logits.double().exp().any()  # the case this test is about
    draws = 20_000
    tokens, _, _ = sample_tokens(logits.expand(draws, 4).clone(), temperature, None, None,
                                 torch.Generator().manual_seed(1), gumbel_float64=True)
    frequencies = torch.bincount(tokens, minlength=4).double() / draws
    expected = torch.softmax(logits.double() / temperature, -1)
    assert (frequencies - expected).abs().max() < 0.02, (frequencies.tolist(), expected.tolist())


@pytest.mark.parametrize("field", ["max_grad_norm", "weight_decay", "adam_epsilon", "adam_beta1", "adam_beta2"])
def test_nan_optimizer_numbers_are_refused_by_every_config(tmp_path, field):
    """transformers takes these unchecked: a NaN weight decay or Adam number makes the weights NaN, a NaN
    max_grad_norm silently turns clipping off (NaN > 0 is False). An infinite max_grad_norm (transformers' own
    "no clipping") stays allowed."""
    from trl_diffusion import DiffusionSFTConfig, DiffusionValueConfig, TraceRLConfig

    common = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": "none"}
    for config in (DiffusionSFTConfig, DiffusionValueConfig, TraceRLConfig):
        with pytest.raises(ValueError, match=f"{field} must be a"):
            config(**common, **{field: math.nan})
        if field == "max_grad_norm":
            assert config(**common, max_grad_norm=math.inf).max_grad_norm == math.inf
        else:
            with pytest.raises(ValueError, match=f"{field} must be a finite number"):
                config(**common, **{field: math.inf})


def test_llada_gumbel_draw_reads_the_logits_not_their_tempered_round_trip():
    """The float64 logits were rebuilt as float32(l / T) * T, which differs from l in most entries for T != 1: at a
    near-tie the draw flipped against LLaDA's on the same uniforms (review). Tie: logit a with u 0.5 against logit 0
    with the u that puts its score between a's two roundings."""
    temperature, flips = 0.3, 0
    for a in torch.linspace(0.5, 8, 200).tolist():
        exact = torch.tensor(a, dtype=torch.float32)
        rounded = (exact / temperature).double() * temperature
        if rounded == exact.double():
            continue
        middle = (math.exp(float(exact)) + math.exp(float(rounded))) / 2 / (-math.log(0.5)) ** temperature
        u = torch.tensor([[[0.5, math.exp(-(1.0 / middle) ** (1 / temperature))]]], dtype=torch.float64)
        logits = torch.tensor([[[float(exact), 0.0]]])
        official = (logits.double().exp() / (-torch.log(u)) ** temperature).argmax(-1)
        tokens, _, _ = sample_tokens(logits, temperature, None, None, gumbel_float64=True, noise=u)
        flips += int(not torch.equal(tokens, official))
    assert flips == 0


def test_a_negative_max_grad_norm_does_not_flip_the_value_models_gradients(tmp_path, monkeypatch):
    """transformers reads max_grad_norm <= 0 as no clipping; the value step called clip_grad_norm_(params, -1),
    which multiplies every gradient by a negative factor (the value model climbed its own loss) (review)."""
    from datasets import Dataset

    from trl_diffusion import TraceRLConfig, TraceRLTrainer
    from trl_diffusion.testing import build_tokenizer, tiny_model
    from trl_diffusion.value import DiffusionValueModel

    calls = []
    original = torch.nn.utils.clip_grad_norm_

    def recording(params, max_norm, *args, **kwargs):
        calls.append(max_norm)
        return original(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", recording)
    model = tiny_model("sdar").train()
    config = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                           max_completion_length=8, max_steps=1, report_to="none", block_length=4, denoising_steps=2,
                           use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no", max_grad_norm=-1.0,
                           dynamic_group_filtering="none", value_batch_size=1)
    trainer = TraceRLTrainer(model, lambda completions, **kw: [float(len(c)) for c in completions], args=config,
                             train_dataset=Dataset.from_dict({"prompt": ["abc", "xyz"]}),
                             processing_class=build_tokenizer(), value_model=DiffusionValueModel.from_policy(model))
    trainer.train()
    assert trainer._value_batches == 1 and not any(norm <= 0 for norm in calls)


def test_batch_scaled_advantages_divide_by_the_population_std_of_the_batch():
    """``scale_rewards="batch"``: (r - group mean) / the batch's population std around the batch mean (not the spread
    of the within-group deviations); an unscorable (NaN) reward is left out of the statistics and gets 0."""
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0])
    group_means = torch.tensor([0.5, 0.5, 3.5, 3.5])
    expected = (rewards - group_means) / rewards.std(unbiased=False)
    torch.testing.assert_close(population_advantages(rewards, 2, "batch"), expected)
    with_nan = torch.tensor([0.0, 1.0, 2.0, 5.0, float("nan"), 3.0])
    got = population_advantages(with_nan, 2, "batch")
    scored = with_nan[~with_nan.isnan()]
    assert got[4] == 0
    torch.testing.assert_close(got[0], -0.5 / scored.std(unbiased=False))


def test_all_equal_filtering_leaves_unscorable_rewards_out_of_a_negative_group():
    """A group [-1, -1, NaN] is all-equal over its scored rewards (dropped), whatever the sign of the rewards."""
    rewards = torch.tensor([-1.0, -1.0, float("nan"), 2.0, -3.0, float("nan")])
    assert kept_groups(rewards, 3, "all_equal", 0, 1).tolist() == [False] * 3 + [True] * 3


def test_the_accuracy_band_allows_rounding_above_one_and_nothing_more():
    with pytest.raises(ValueError, match="needs rewards in"):
        kept_groups(torch.tensor([1.0001, 0.0, 1.0, 0.0]), 2, "accuracy_band", 0.2, 0.8)
    assert kept_groups(torch.tensor([1.000001, 0.0, 1.0, 0.0]), 2, "accuracy_band", 0.2, 0.8).tolist() == [True] * 4


def test_explained_variance_of_constant_returns_is_nan_despite_rounding():
    """Returns all 0.1 have a float32 variance of rounding size, not 0: the explained variance is undefined (NaN),
    not a huge number from dividing by that rounding."""
    returns = torch.full((1, 1000), 0.1)
    values = torch.rand(1, 1000, generator=torch.Generator().manual_seed(0))
    stats = value_statistics(values, returns, torch.ones_like(returns, dtype=torch.bool))
    assert math.isnan(summarize_value_statistics(stats)["explained_variance"])
