"""Token sampling and the choice of which positions to commit: pure functions shared by the sampler and the
trainers (which must score tokens under exactly the distribution the sampler drew them from)."""

from __future__ import annotations

import hashlib
import math
import numbers

import torch
from torch.utils.checkpoint import checkpoint

REMASKING_STRATEGIES = (
    "sequential",
    "low_confidence_static",
    "low_confidence_dynamic",
    "random",
    "topk_margin",
    "entropy",
    "origin",
)

MIN_TEMPERATURE = 1e-5
"""Smallest positive ``temperature`` (and ``alg_temp``) ``generate`` accepts; 0 is greedy. Below it the tempered
distribution is one-hot to float32 precision anyway, and dividing the logits by it can overflow float32 (at about
1e-38 even for logits of order 1: NaN log-probs, or a failing ``torch.multinomial``)."""


def check_sampling_filters(temperature: float, top_k: int | None, top_p: float | None,
                           zero_means: str | None) -> None:
    """Refuse a ``temperature`` / ``top_k`` / ``top_p`` that no distribution can be drawn or scored under: one rule
    for the sampler, the estimators and the trainers' configs. ``zero_means``: what ``temperature=0`` does there
    (``None``: it is refused too)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) or not (
            (temperature == 0 and zero_means is not None) or MIN_TEMPERATURE <= temperature < math.inf):  # NaN: no
        zero = "" if zero_means is None else f"0 ({zero_means}) or "
        raise ValueError(f"temperature must be {zero}a finite number >= {MIN_TEMPERATURE:g}, got {temperature!r}: "
                         "below that the distribution is one-hot to float32 precision and dividing the logits by it "
                         "can overflow (NaN log-probs).")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0):
        raise ValueError(f"top_k must be None or an integer >= 0 (0 or None: no top-k filtering), got {top_k!r}.")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}.")


def checked_cfg_scale(cfg_scale: float | None) -> float:
    """The classifier-free guidance scale as a float (``None``: 0, no guidance): one rule for ``generate()`` and
    ``replay_logprobs``, so a trajectory re-scores with the value it was sampled with. A bool, a string or a
    tensor is refused, as for ``temperature`` (``float()`` read ``True`` as 1.0 and ``"1.5"`` as 1.5)."""
    if cfg_scale is None:
        return 0.0
    if isinstance(cfg_scale, bool) or not isinstance(cfg_scale, numbers.Real) or not 0 <= cfg_scale < math.inf:
        raise ValueError(f"cfg_scale must be None or a finite number >= 0 (0 or None: no guidance), got "
                         f"{cfg_scale!r}.")
    return float(cfg_scale)


def guided_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
                  prompt: torch.Tensor, cfg_scale: float, **forward_kwargs) -> torch.Tensor:
    """The logits a denoising step samples from: the model's, or with classifier-free guidance (``cfg_scale > 0``)
    ``uncond + (cfg_scale + 1) * (cond - uncond)``, ``uncond`` from the same input with the prompt's tokens
    (``prompt``, like ``input_ids``) masked, both in one batched forward. One function for the sampler
    (``denoise.ModelRunner``) and ``replay_logprobs``, so that replay reproduces the sampler's log-probs."""
    if not cfg_scale:
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     output_router_logits=False, **forward_kwargs).logits
    unconditional = input_ids.masked_fill(prompt, model.mask_token_id)
    both = model(input_ids=torch.cat([input_ids, unconditional]),
                 attention_mask=None if attention_mask is None else torch.cat([attention_mask, attention_mask]),
                 position_ids=torch.cat([position_ids, position_ids]), output_router_logits=False,
                 **forward_kwargs).logits
    cond, uncond = both.chunk(2)
    return uncond + (cfg_scale + 1) * (cond - uncond)


def sampling_logits(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    mask_token_id: int | None = None,
    top_p_first: bool = False,
) -> torch.Tensor:
    """Logits of the sampling distribution: the mask token removed (a committed token is never a mask),
    divided by the temperature (0 means greedy and is scored at temperature 1), then top-k and top-p filtered
    (filtered entries become -inf), in that order as SDAR's sampler filters, or top-p first with ``top_p_first``
    as Dream's does (the model's ``top_p_first``): with both set the two orders keep different tokens. Computed in
    fp32."""
    logits = logits.float()
    if mask_token_id is not None:
        logits = logits.clone()
        logits[..., mask_token_id] = float("-inf")
    if temperature and temperature != 1.0:
        logits = logits / temperature
    if top_p_first:
        return _top_k_filtered(_top_p_filtered(logits, top_p), top_k)
    return _top_p_filtered(_top_k_filtered(logits, top_k), top_p)


def _top_k_filtered(logits: torch.Tensor, top_k: int | None) -> torch.Tensor:
    """``logits`` with all but the ``top_k`` largest of each row at -inf (ties with the k-th kept)."""
    if top_k is None or not 0 < top_k < logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p_filtered(logits: torch.Tensor, top_p: float | None) -> torch.Tensor:
    """``logits`` with the tokens outside the smallest most-likely set of probability > ``top_p`` at -inf."""
    if top_p is None or top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative > top_p
    drop_sorted[..., 1:] = drop_sorted[..., :-1].clone()
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


SCORING_PIECE_ELEMENTS = 2**25
"""Positions x vocabulary of float32 work ``target_scores`` does at once (128 MiB per float32 tensor)."""


def target_scores(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    mask_token_id: int | None = None,
    entropy: bool = False,
    entropy_grad: bool = True,
    top1: bool = False,
    top_p_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """What the trainers score at ``N`` positions: the log-prob of each target ``[N]`` under the sampling
    distribution of ``logits`` ``[N, V]`` (``sampling_logits``, float32), and optionally its entropy (differentiable
    unless ``entropy_grad=False``) and whether the target is its top-1.

    The float32 work runs on pieces of at most ``SCORING_PIECE_ELEMENTS`` positions x vocabulary and, when
    gradients flow, each piece is recomputed in the backward pass (activation checkpointing), so no float32
    ``[N, V]`` tensor exists whole: at 2,048 targets and a 152k vocabulary one is 1.2 GB, and the log-softmax, its
    input copy and its gradient would each be one. Values and gradients equal the one-piece computation (every
    operation is per position)."""
    settings = (temperature, top_k, top_p, mask_token_id, entropy, entropy_grad, top1, top_p_first)
    rows = max(1, SCORING_PIECE_ELEMENTS // logits.shape[-1])
    if logits.shape[0] <= rows:
        return _piece_scores(logits, targets, *settings)
    recompute = torch.is_grad_enabled() and logits.requires_grad
    pieces = [checkpoint(_piece_scores, piece, piece_targets, *settings, use_reentrant=False) if recompute
              else _piece_scores(piece, piece_targets, *settings)
              for piece, piece_targets in zip(logits.split(rows), targets.split(rows))]
    return tuple(torch.cat(parts) if parts[0] is not None else None for parts in zip(*pieces))


def _piece_scores(logits, targets, temperature, top_k, top_p, mask_token_id, entropy, entropy_grad, top1,
                  top_p_first):
    log_dist = sampling_logits(logits, temperature, top_k, top_p, mask_token_id, top_p_first).log_softmax(-1)
    picked = log_dist.gather(-1, targets[:, None]).squeeze(-1)
    ent = is_top1 = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = log_dist.exp()
            ent = -(probs * log_dist.masked_fill(probs == 0, 0.0)).sum(-1)
    if top1:
        is_top1 = log_dist.detach().argmax(-1) == targets
    return picked, ent, is_top1


Generators = torch.Generator | list[torch.Generator] | None


def stable_seed(*parts: int | str) -> int:
    """A 63-bit seed that depends only on ``parts`` (e.g. the run's seed, a step, a row's index): what keys a per-row
    generator, so that a row's randomness does not depend on its batch, its process or the run's order."""
    digest = hashlib.sha256(":".join(str(part) for part in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def uniform(shape: tuple[int, ...], generator: Generators, device, dtype=torch.float32,
            rows: list[bool] | None = None) -> torch.Tensor:
    """U(0, 1) draws of ``shape``; with one generator per row (a list), row ``i`` comes from ``generator[i]`` only,
    so a row's randomness does not depend on which other rows share its batch (or its process). ``rows`` (for a
    list) says which rows draw; the others get zeros and leave their generator untouched. Each row draws on its
    generator's device: host generators' draws are, on CUDA, copied from pinned memory without blocking (no host
    synchronisation); generators on the target device draw there (no copy: evaluation's, whose LLaDA float64 Gumbel
    noise over the vocabulary is too large to copy every step)."""
    if isinstance(generator, (list, tuple)):
        if len(generator) != shape[0]:
            raise ValueError(f"got {len(generator)} generators for {shape[0]} rows.")
        draws = [torch.rand(shape[1:], generator=g, dtype=dtype, device=g.device) if rows is None or rows[i]
                 else torch.zeros(shape[1:], dtype=dtype, device=g.device) for i, g in enumerate(generator)]
        if torch.device(device).type == "cuda" and all(draw.device.type == "cpu" for draw in draws):
            return torch.stack(draws).pin_memory().to(device, non_blocking=True)
        return torch.stack([draw.to(device) for draw in draws])
    return torch.rand(shape, generator=generator, dtype=dtype, device=device)


def sample_tokens(
    logits: torch.Tensor,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: Generators = None,
    gumbel_float64: bool = False,
    mask_token_id: int | None = None,
    noise: torch.Tensor | None = None,
    top_p_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draw one token per position. Returns ``(tokens, logprobs, log_distribution)``.

    ``logprobs`` is the log-probability of each drawn token under the sampling distribution (what RL uses as
    the behaviour policy). Temperature 0 takes the argmax (no division by zero). ``gumbel_float64`` draws with
    LLaDA's float64 Gumbel-max ``argmax(exp(l) / (-log u)^T)``, an exact sample of the same distribution.
    ``noise``: the uniforms a per-row generator list would draw here (``token_noise_shape``), drawn beforehand.
    ``top_p_first``: the filter order (``sampling_logits``).
    """
    filtered = sampling_logits(logits, temperature, top_k, top_p, mask_token_id, top_p_first)
    log_dist = filtered.log_softmax(-1)
    # the model's logits in float64 (filtered entries -inf, as the tempered distribution filters them), for LLaDA's
    # Gumbel form: taken from the logits themselves, not as (l / T) * T, whose float32 rounding could flip a near-tie
    # against LLaDA's draw; the float32 copy goes before the draw (a full [B, L, V] tensor)
    raw = logits.double().masked_fill_(filtered == -torch.inf, -torch.inf) if temperature and gumbel_float64 else None
    # greedy: the argmax of the logits, as transformers and LLaDA take it (log_softmax of a row holding +inf, an fp16
    # overflow, is NaN everywhere, whose argmax would be token 0)
    greedy = filtered.argmax(-1) if not temperature else None
    del filtered
    if greedy is not None:
        tokens = greedy
    elif gumbel_float64:
        u = uniform(raw.shape, generator, raw.device, torch.float64) if noise is None else noise
        tokens = _gumbel_max(raw, u, temperature)
    elif isinstance(generator, (list, tuple)) or noise is not None:  # inverse CDF with per-row uniforms
        u = uniform(log_dist.shape[:-1], generator, log_dist.device) if noise is None else noise
        cdf = log_dist.exp().cumsum(-1)
        tokens = (cdf < u[..., None] * cdf[..., -1:]).sum(-1).clamp(max=log_dist.shape[-1] - 1)
        tokens = torch.where(torch.isfinite(log_dist.gather(-1, tokens[..., None]).squeeze(-1)), tokens,
                             log_dist.argmax(-1))  # guard against landing on a filtered entry by rounding
    else:
        flat = log_dist.exp().reshape(-1, log_dist.shape[-1])
        tokens = torch.multinomial(flat, 1, generator=generator).view(log_dist.shape[:-1])
    logprobs = log_dist.gather(-1, tokens[..., None]).squeeze(-1)
    return tokens, logprobs, log_dist


def _gumbel_max(raw: torch.Tensor, u: torch.Tensor, temperature: float) -> torch.Tensor:
    """LLaDA's float64 Gumbel-max draw ``argmax(exp(l) / (-log u)^T)`` from ``raw`` logits ``l`` (filtered entries
    -inf) and uniforms ``u``. Where that form breaks down -- a large T underflows ``(-log u)^T`` to 0, so a filtered
    entry (the mask token) reads 0/0 = NaN and wins the argmax, and ties at inf favour low ids; very negative logits
    underflow every ``exp(l)`` to 0 -- the position takes the same draw in log space, ``argmax(l - T log(-log u))``,
    which never picks a filtered entry. Elsewhere the result is LLaDA's, bit for bit. Both are computed for every
    position and chosen with ``torch.where``: no host synchronisation, so that CUDA graphs capture the step (with no
    more float64 ``[B, L, V]`` temporaries at the peak than LLaDA's form alone)."""
    scores = raw.exp().div_(torch.log(u).neg_().pow_(temperature)).masked_fill_(raw == -torch.inf, -torch.inf)
    tokens = scores.argmax(-1)
    best = scores.gather(-1, tokens[..., None]).squeeze(-1)
    del scores
    broken = ~torch.isfinite(best) | (best <= 0)  # argmax picks a NaN wherever there is one
    log_space = torch.log(u).neg_().log_().mul_(-temperature).add_(raw).argmax(-1)
    return torch.where(broken, log_space, tokens)


def token_noise_shape(
    logits_shape: tuple[int, ...], temperature: float, gumbel_float64: bool
) -> tuple[tuple[int, ...], torch.dtype] | None:
    """Shape and dtype of the uniforms ``sample_tokens`` draws with a per-row generator list (None: no draw)."""
    if not temperature:
        return None
    if gumbel_float64:
        return tuple(logits_shape), torch.float64
    return tuple(logits_shape[:-1]), torch.float32


def ranking_inputs(strategy: str, logits: torch.Tensor, tokens: torch.Tensor, token_logprobs: torch.Tensor,
                   log_dist: torch.Tensor, raw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(token log-probs, log-distribution)`` ``confidence_scores`` ranks commits by: the sampling
    distribution's, or with ``raw`` the softmax of the raw ``logits`` (temperature 1, no top-k / top-p, the mask
    token in the normalisation; float32), as LLaDA's samplers rank whatever the temperature (ML-GSAI's
    ``generate.py`` and dLLM-RL's LLaDA rollouts take ``softmax(logits)`` for the confidence, the top-2 margin and
    the entropy). The raw distribution is formed whole only for the strategies that read it."""
    if not raw:
        return token_logprobs, log_dist
    logits = logits.float()
    if strategy in ("topk_margin", "entropy"):
        raw_dist = logits.log_softmax(-1)
        return raw_dist.gather(-1, tokens[..., None]).squeeze(-1), raw_dist
    return logits.gather(-1, tokens[..., None]).squeeze(-1) - logits.logsumexp(-1), log_dist


def confidence_scores(
    strategy: str, logprobs: torch.Tensor, log_dist: torch.Tensor, generator: Generators = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-position confidence used to rank positions for commitment (higher commits first). ``noise``: the
    uniforms the ``random`` strategy would draw, drawn beforehand."""
    if strategy in ("low_confidence_static", "low_confidence_dynamic", "sequential", "origin"):
        return logprobs.exp()
    if strategy == "random":
        return uniform(logprobs.shape, generator, logprobs.device) if noise is None else noise
    if strategy == "topk_margin":
        top2 = torch.topk(log_dist.exp(), 2, dim=-1).values
        return top2[..., 0] - top2[..., 1]
    if strategy == "entropy":
        probs = log_dist.exp()
        return (probs * torch.log(probs + 1e-10)).sum(-1)
    raise ValueError(f"unknown remasking strategy {strategy!r}; choose one of {REMASKING_STRATEGIES}.")


def uniform_quota(block_length: int, steps: int) -> list[int]:
    """Tokens to commit at each step of a block: ``block_length // steps``, the remainder to the first steps."""
    base, extra = divmod(block_length, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def select_commits(
    strategy: str,
    confidence: torch.Tensor,
    masked: torch.Tensor,
    quota: int | torch.Tensor,
    threshold: float | None = None,
    alg_temp: float | None = None,
    generator: Generators = None,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean ``[B, L]`` of positions to commit now. Only masked positions are ever chosen. Runs on the device
    (no host synchronisation).

    ``quota`` (an int, or a tensor broadcastable to ``[B]``): how many to commit (capped by the masks left).
    ``sequential`` takes the leftmost masks; ``low_confidence_dynamic`` takes every mask above ``threshold``, at
    least the quota; other strategies take the ``quota`` most confident masks. With ``alg_temp`` > 0 the quota
    is sampled without replacement with probabilities ``softmax(confidence / alg_temp)`` over the masks (as
    Dream does), by Gumbel-top-k; ``noise`` holds its uniforms when drawn beforehand. ``low_confidence_dynamic``
    still adds every mask whose (unperturbed) confidence exceeds ``threshold``; ``sequential`` has no ranking for
    ``alg_temp`` to act on (``generate`` refuses the pair).
    """
    batch, length = masked.shape
    quota = masked.sum(-1).clamp(max=quota)
    if strategy == "sequential":
        rank = torch.cumsum(masked.long(), dim=-1)
        return masked & (rank <= quota[:, None])
    confidence = confidence.float().masked_fill(~masked, float("-inf"))
    scores = confidence
    if alg_temp:
        u = uniform(masked.shape, generator, masked.device) if noise is None else noise
        gumbel = -torch.log(-torch.log(u.float().clamp_min(torch.finfo(torch.float32).tiny)))
        scores = torch.where(masked, torch.log_softmax(scores / alg_temp, dim=-1) + gumbel, float("-inf"))
    order = torch.argsort(scores, dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length, device=masked.device).expand(batch, -1))
    chosen = masked & (rank < quota[:, None])
    if strategy == "low_confidence_dynamic":
        if threshold is None:
            raise ValueError("low_confidence_dynamic needs a confidence_threshold.")
        # the threshold reads the confidences themselves, not the Gumbel-perturbed scores of an alg_temp draw
        chosen = chosen | (masked & (confidence > threshold))
    return chosen
