"""``replay_logprobs`` with classifier-free guidance: a trajectory ``generate(cfg_scale > 0)`` sampled is re-scored
under the guided logits it was sampled from (before, replay had no ``cfg_scale`` and scored the unguided model,
off by up to 3.3 nats with nothing to say so)."""

import math

import pytest
import torch
from numerics import assert_close_fp32

from trl_diffusion.estimators import replay_logprobs
from trl_diffusion.testing import left_pad, tiny_model

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]
CFG = 1.5


def guided_rollout(model, **settings):
    """A padded batch decoded with guidance (no KV cache: guidance runs without one), never stopping early."""
    ids, mask = left_pad(PROMPTS)
    out = model.generate(ids, mask, max_new_tokens=8, block_length=4, denoising_steps=2, cfg_scale=CFG,
                         use_cache=False, stop_token_ids=[], return_dict_in_generate=True,
                         generator=torch.Generator().manual_seed(0), **settings)
    return out, mask


@pytest.mark.parametrize("settings", [dict(temperature=0.7), dict(temperature=1.0, top_k=5, top_p=0.9)])
def test_replay_reproduces_guided_sampler_logprobs(family, settings):
    """Replayed at the call's ``cfg_scale``, every committed token's log-prob is the sampler's (to float32 summation
    noise, scaled by the largest magnitude); scored without guidance it is visibly another distribution."""
    model = tiny_model(family)
    out, mask = guided_rollout(model, **settings)
    committed = out.unmask_step >= 0
    assert committed.sum() >= 8 * len(PROMPTS)
    replay = replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4, cfg_scale=CFG, **settings)
    assert_close_fp32(replay, out.token_logprobs, committed)
    unguided = replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4, **settings)
    gap = (unguided - out.token_logprobs)[committed].abs()
    assert not bool(torch.isfinite(gap).all()) or float(gap.max()) > 0.1  # guidance matters in this test


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf, True, "1.5", torch.tensor(1.5)])
def test_generate_and_replay_refuse_the_same_cfg_scales(bad):
    """A NaN scale made every log-prob NaN, a negative one extrapolated away from the prompt: refused by name, by
    one rule for both (generate() read True as 1.0 and "1.5" as 1.5 through float(), which replay refused)."""
    model = tiny_model("llada")
    ids, mask = left_pad(PROMPTS)
    kwargs = dict(max_new_tokens=4, block_length=4, denoising_steps=2, temperature=0.7, stop_token_ids=[])
    with pytest.raises(ValueError, match="cfg_scale must be None or a finite number >= 0"):
        model.generate(ids, mask, cfg_scale=bad, **kwargs)
    out = model.generate(ids, mask, return_dict_in_generate=True, generator=torch.Generator().manual_seed(0),
                         cfg_scale=None, **kwargs)  # None: no guidance, in both
    with pytest.raises(ValueError, match="cfg_scale must be None or a finite number >= 0"):
        replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4, temperature=0.7, cfg_scale=bad)
    replayed = replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4, temperature=0.7,
                               cfg_scale=None)
    assert torch.allclose(replayed, out.token_logprobs, atol=1e-5 * max(1.0, float(out.token_logprobs.abs().max())))
