"""Test helpers for float comparisons and for the discrete choices of ``generate()``.

* ``assert_close_fp32``: two float32 computations of the same quantity that differ only in the order of their
  sums (packed vs one forward per state, cache vs none, batched vs alone) agree to a few units in the last place
  *of the largest magnitude involved*, and how many units depends on the CPU's kernels (AVX2 vs AVX-512, thread
  count). So the tolerance scales with that magnitude and leaves ample room, while any real error (a wrong
  state, mask or position) moves values by 1e-2 or more.
* ``DecisionMargins``: records, for every discrete choice ``generate()`` makes (the greedy token, which
  positions to commit, the dynamic threshold, the sampled token), how far the inputs were from flipping it. A
  test that compares discrete outputs of two float paths asserts a clear margin, so it cannot flip on another
  machine.
"""

from __future__ import annotations

import torch

FP32_REL = 1e-5
"""Relative tolerance for float32 paths that differ in summation order (~80 float32 ulps)."""


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor, where: torch.Tensor | None = None,
                      rel: float = FP32_REL) -> None:
    """``|actual - expected| <= rel * max(1, max |expected|)`` (over ``where`` if given), elementwise."""
    if where is not None:
        actual, expected = actual[where], expected[where]
    assert actual.shape == expected.shape and actual.numel() > 0
    expected = expected.detach().double()
    scale = max(1.0, float(expected.abs().max()))
    error = float((actual.detach().double() - expected).abs().max())
    assert error <= rel * scale, f"max |difference| {error:.3g} > {rel:g} * {scale:.3g}"


class DecisionMargins:
    """Context manager: record how close each discrete decision of ``generate()`` was to flipping.

    * ``token``: greedy (temperature 0) decoding, the log-prob gap between the chosen and the runner-up token
      at every committed position;
    * ``draw``: sampling, the distance (probability mass for inverse-CDF draws, log-score for Gumbel / exponential
      races) between the draw and the nearest point where another token would be taken, at committed positions;
    * ``commit``: ranking strategies, the confidence gap between the last position committed by quota and the
      first one left masked;
    * ``threshold``: ``low_confidence_dynamic``, the distance of every masked position's confidence from the
      threshold.

    ``smallest`` is the minimum over everything recorded (inf when nothing was).
    """

    def __init__(self):
        self.token, self.draw, self.commit, self.threshold = [], [], [], []
        self._last = None

    @property
    def smallest(self) -> float:
        values = self.token + self.draw + self.commit + self.threshold
        return min(values) if values else float("inf")

    def __enter__(self):
        from trl_diffusion.generation import denoise  # where the decoding step calls them

        self._module = denoise
        self._originals = (denoise.sample_tokens, denoise.select_commits)
        denoise.sample_tokens, denoise.select_commits = self._sample_tokens, self._select_commits
        return self

    def __exit__(self, *exc):
        self._module.sample_tokens, self._module.select_commits = self._originals
        return False

    def _sample_tokens(self, logits, temperature, top_k, top_p, generator=None, gumbel_float64=False,
                       mask_token_id=None, noise=None, top_p_first=False):
        states = _generator_states(generator) if noise is None else ("noise", noise)
        tokens, logprobs, log_dist = self._originals[0](logits, temperature, top_k, top_p, generator,
                                                        gumbel_float64, mask_token_id, noise, top_p_first)
        margins = _draw_margins(logits, tokens, log_dist, temperature, top_k, top_p, states, gumbel_float64,
                                mask_token_id, top_p_first)
        self._last = (tokens, margins, temperature)
        return tokens, logprobs, log_dist

    def _select_commits(self, strategy, confidence, masked, quota, threshold=None, alg_temp=None, generator=None,
                        noise=None):
        chosen = self._originals[1](strategy, confidence, masked, quota, threshold, alg_temp, generator, noise)
        tokens, margins, temperature = self._last
        record = self.token if not temperature else self.draw
        record.extend(margins[chosen].tolist())
        if strategy in ("low_confidence_static", "low_confidence_dynamic", "topk_margin", "entropy") and not alg_temp:
            scores = confidence.float()
            for row in range(masked.shape[0]):
                row_quota = quota[row] if torch.is_tensor(quota) and quota.dim() else quota
                k = int(min(int(row_quota), int(masked[row].sum())))
                ranked = scores[row][masked[row]].sort(descending=True).values.double()
                if 0 < k < len(ranked):
                    self.commit.append(float(ranked[k - 1] - ranked[k]))
                if strategy == "low_confidence_dynamic" and len(ranked) > k:
                    self.threshold.extend((ranked[k:] - threshold).abs().tolist())
        return chosen


def _generator_states(generator):
    if generator is None:
        return None
    if isinstance(generator, (list, tuple)):
        return [g.get_state() for g in generator]
    return generator.get_state()


def _restore(states):
    """A generator replaying the recorded draw, or ``("noise", uniforms)`` drawn beforehand by the sampler."""
    if isinstance(states, tuple):
        return states
    if isinstance(states, list):
        return [torch.Generator().set_state(s) for s in states]
    return torch.Generator().set_state(states)


def _draw_margins(logits, tokens, log_dist, temperature, top_k, top_p, states, gumbel_float64, mask_token_id,
                  top_p_first=False):
    """Per position: how far the decision was from picking another token (see ``DecisionMargins``)."""
    from trl_diffusion.generation.sampling import sampling_logits

    if not temperature:
        top2 = log_dist.topk(2, dim=-1).values
        return (top2[..., 0] - top2[..., 1]).double()
    filtered = sampling_logits(logits, temperature, None, None, mask_token_id)
    if top_k is not None and 0 < top_k < filtered.shape[-1]:  # which tokens survive top-k is a decision too
        ranked = filtered.topk(top_k + 1, dim=-1).values.double()
        top_k_gap = ranked[..., top_k - 1] - ranked[..., top_k]
    else:
        top_k_gap = torch.full(tokens.shape, float("inf"), dtype=torch.float64)
    return torch.minimum(top_k_gap, _sampled_margins(logits, tokens, log_dist, temperature, top_k, top_p, states,
                                                     gumbel_float64, mask_token_id, top_p_first))


def _sampled_margins(logits, tokens, log_dist, temperature, top_k, top_p, states, gumbel_float64, mask_token_id,
                     top_p_first=False):
    from trl_diffusion.generation.sampling import sampling_logits, uniform

    if states is None:  # an unseeded draw: nothing to compare across paths
        return torch.full(tokens.shape, float("inf"), dtype=torch.float64)
    generator = _restore(states)
    noise = generator[1] if isinstance(generator, tuple) else None
    if gumbel_float64:
        raw = sampling_logits(logits, temperature, top_k, top_p, mask_token_id, top_p_first).double() * temperature
        u = uniform(raw.shape, generator, raw.device, torch.float64) if noise is None else noise.double()
        score = raw - temperature * torch.log(-torch.log(u))  # log of LLaDA's exp(l) / (-log u)^T
        return _race_margin(score, tokens)
    if isinstance(generator, list) or noise is not None:  # inverse CDF: distance of the draw from the bucket's edges
        u = (uniform(log_dist.shape[:-1], generator, log_dist.device) if noise is None else noise).double()
        cdf = log_dist.double().exp().cumsum(-1)
        target = u * cdf[..., -1]
        upper = cdf.gather(-1, tokens[..., None]).squeeze(-1)
        lower = upper - log_dist.double().exp().gather(-1, tokens[..., None]).squeeze(-1)
        return torch.minimum(target - lower, upper - target)
    # torch.multinomial draws one sample as argmax(p / q), q ~ Exp(1) from the generator (ATen's method)
    flat = log_dist.exp().reshape(-1, log_dist.shape[-1])
    q = torch.empty_like(flat).exponential_(1, generator=generator)
    score = (flat.log().double() - q.double().log()).view(log_dist.shape)
    margins = _race_margin(score, tokens)
    return torch.where(score.argmax(-1) == tokens, margins, torch.zeros_like(margins))  # replica must agree


def _race_margin(score, tokens):
    top2 = score.topk(2, dim=-1).values
    chosen = score.gather(-1, tokens[..., None]).squeeze(-1)
    gap = top2[..., 0] - top2[..., 1]
    return torch.where(chosen == top2[..., 0], gap, torch.zeros_like(gap))


MIN_MARGIN = 1e-4
"""Smallest decision margin a test comparing discrete outputs of two float32 paths accepts: probabilities and
log-probs of these tiny models carry ~1e-7 of float32 noise, so 1e-4 leaves three orders of magnitude."""
