"""generate() invariants: committed and prompt tokens are never re-decoded, a row samples the same alone as in a
batch (per-row generators, every cache), LLaDA/Dream prefix and dual caches equal no cache where staleness cannot
arise, LLaDA's classifier-free guidance equals its hand-computed combination, and the default stop ids."""

import pytest
import torch
from numerics import MIN_MARGIN, DecisionMargins, assert_close_fp32

from trl_diffusion.generation.sampling import sampling_logits
from trl_diffusion.states import state_before_step
from trl_diffusion.testing import EOS_ID, MASK_ID, left_pad, tiny_model

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]



def gen(model, ids, mask=None, **kw):
    args = dict(max_new_tokens=12, block_length=4, denoising_steps=2, temperature=0.0, stop_token_ids=[],
                return_dict_in_generate=True)
    args.update(kw)
    return model.generate(ids, mask, **args)


def test_committed_and_prompt_tokens_are_never_decoded_again(family):
    """Every forward of the sampler sees exactly the state before its step: the prompt as given, each token from
    the step after it was committed on (never changed again), masks elsewhere."""
    model = tiny_model(family)
    seen = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].clone()),
                                           with_kwargs=True)
    prompt = torch.tensor([PROMPTS[0]])
    out = gen(model, prompt, temperature=1.0, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.2,
              generator=torch.Generator().manual_seed(0), use_cache=False)
    hook.remove()
    assert len(seen) == int(out.denoising_steps) == out.num_forward_passes  # one forward per step, no cache
    generated = torch.zeros_like(out.sequences, dtype=torch.bool)
    generated[:, prompt.shape[1]:] = True
    for step, canvas in enumerate(seen):
        expected = state_before_step(out.sequences, out.unmask_step, generated, step, MASK_ID)
        assert torch.equal(canvas, expected[:, : canvas.shape[1]]), step  # SDAR sees the blocks up to the current
    assert (out.unmask_step[0, prompt.shape[1]:] >= 0).all()


CACHES = {"sdar": True, "llada": "dual", "dream": "prefix"}
SEEDS = {  # per-row seeds whose draws and commits all have clear margins
    ("sdar", "low_confidence_dynamic"): [3, 4, 5], ("sdar", "random"): [72, 73, 74],
    ("llada", "low_confidence_dynamic"): [0, 1, 2], ("llada", "random"): [0, 1, 2],
    ("dream", "low_confidence_dynamic"): [15, 16, 17], ("dream", "random"): [42, 43, 44],
}


@pytest.mark.parametrize("strategy", ["low_confidence_dynamic", "random"])
def test_a_row_samples_the_same_alone_as_in_a_batch(family, strategy):
    """Sampling with one generator per row, with the family's cache: each row of a left-padded batch equals the
    same prompt generated alone with its own generator (rows finish their blocks at different steps here)."""
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    settings = dict(temperature=1.0, use_cache=CACHES[family], remasking_strategy=strategy, confidence_threshold=0.3)
    seeds = SEEDS[family, strategy]
    with DecisionMargins() as margins:
        batched = gen(model, ids, mask, generator=[torch.Generator().manual_seed(s) for s in seeds], **settings)
    assert margins.smallest > MIN_MARGIN
    width = ids.shape[1]
    for row, prompt in enumerate(PROMPTS):
        alone = gen(model, torch.tensor([prompt]), generator=[torch.Generator().manual_seed(seeds[row])],
                    **settings)
        n = alone.sequences.shape[1] - len(prompt)
        assert batched.sequences[row, width:width + n].tolist() == alone.sequences[0, len(prompt):].tolist(), row
        assert batched.unmask_step[row, width:width + n].tolist() == alone.unmask_step[0, len(prompt):].tolist()
        assert_close_fp32(batched.token_logprobs[row, width:width + n], alone.token_logprobs[0, len(prompt):])
        assert int(batched.denoising_steps[row]) == int(alone.denoising_steps[0])
    if family == "sdar":  # the prompts leave different numbers of masks in the first block
        assert len(set(batched.denoising_steps.tolist())) > 1


@pytest.mark.parametrize("family", ["llada", "dream"])
@pytest.mark.parametrize("mode", ["prefix", "dual"])
def test_prefix_and_dual_caches_equal_no_cache_when_nothing_can_go_stale(family, mode):
    """The approximate caches reuse the keys and values of the columns outside the current block (prefix: before
    it; dual: before and after it) for the block's later steps. With one layer those keys and values depend on
    their own tokens only, which do not change during the block, so the result must equal decoding without a
    cache; with two layers they go stale, so the result differs (the cache is really used)."""
    layers = {"llada": "n_layers", "dream": "num_hidden_layers"}[family]
    ids, mask = left_pad(PROMPTS)
    for n_layers in (1, 2):
        model = tiny_model(family, **{layers: n_layers})
        with DecisionMargins() as margins:
            plain = gen(model, ids, mask, denoising_steps=4)
            cached = gen(model, ids, mask, denoising_steps=4, use_cache=mode)
        if n_layers == 1:
            assert margins.smallest > MIN_MARGIN
            assert torch.equal(cached.sequences, plain.sequences)
            assert torch.equal(cached.unmask_step, plain.unmask_step)
            assert_close_fp32(cached.token_logprobs, plain.token_logprobs)
        else:
            committed = plain.unmask_step >= 0
            assert not torch.equal(cached.unmask_step, plain.unmask_step) or \
                (cached.token_logprobs - plain.token_logprobs)[committed].abs().max() > 1e-3
        # one full forward per block, then one forward of the live columns per further step
        assert cached.num_forward_passes == plain.num_forward_passes == 3 * 4


def test_llada_classifier_free_guidance_equals_the_hand_computed_combination():
    """LLaDA's CFG: logits = uncond + (scale + 1) * (cond - uncond), uncond with the prompt masked. Replaying the
    trajectory with that combination gives back the sampler's tokens (greedy) and log-probs."""
    model = tiny_model("llada")
    prompt = torch.tensor([PROMPTS[0]])
    scale = 1.5
    with DecisionMargins() as margins:
        out = gen(model, prompt, cfg_scale=scale)
    assert margins.smallest > MIN_MARGIN
    plain = gen(model, prompt)
    assert not torch.equal(out.sequences, plain.sequences)  # guidance changes the result
    generated = torch.zeros_like(out.sequences, dtype=torch.bool)
    generated[:, prompt.shape[1]:] = True
    unconditional_prompt = torch.full_like(prompt, MASK_ID)
    for step in range(int(out.unmask_step.max()) + 1):
        state = state_before_step(out.sequences, out.unmask_step, generated, step, MASK_ID)
        with torch.no_grad():
            cond = model(state).logits
            uncond = model(torch.cat([unconditional_prompt, state[:, prompt.shape[1]:]], 1)).logits
        log_dist = sampling_logits(uncond + (scale + 1) * (cond - uncond), mask_token_id=MASK_ID).log_softmax(-1)
        now = out.unmask_step == step
        assert torch.equal(log_dist.argmax(-1)[now], out.sequences[now])
        assert_close_fp32(log_dist.gather(-1, out.sequences[..., None]).squeeze(-1)[now], out.token_logprobs[now])


def test_default_stop_ids_come_from_the_generation_config_then_the_model_config(family):
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    free = gen(model, ids, mask, max_new_tokens=16)
    stop = int(free.sequences[0, width + 1])  # row 0 produces it in its first block
    explicit = gen(model, ids, mask, max_new_tokens=16, stop_token_ids=[stop])
    assert (explicit.unmask_step >= 0).sum() < (free.unmask_step >= 0).sum()

    def default_stops(**kw):
        return gen(model, ids, mask, max_new_tokens=16, stop_token_ids=None, **kw).unmask_step

    model.generation_config.eos_token_id = stop  # generation_config first
    assert torch.equal(default_stops(), explicit.unmask_step)
    model.generation_config.eos_token_id = None  # then the model config
    model.config.eos_token_id = stop
    assert torch.equal(default_stops(), explicit.unmask_step)
    model.config.eos_token_id = EOS_ID
    both = gen(model, ids, mask, max_new_tokens=16, stop_token_ids=[EOS_ID, stop]).unmask_step
    assert torch.equal(default_stops(eos_token_id=[EOS_ID, stop]), both)  # the argument wins
    assert torch.equal(default_stops(), gen(model, ids, mask, max_new_tokens=16, stop_token_ids=[EOS_ID]).unmask_step)
