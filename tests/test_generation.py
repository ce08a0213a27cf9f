"""generate(): cache exactness, trajectory replay, batching, remasking quotas, errors."""

import pytest
import torch

from trl_diffusion.estimators import replay_logprobs
from trl_diffusion.generation.sampling import sampling_logits, uniform_quota
from trl_diffusion.testing import MASK_ID, tiny_model

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]


def left_pad(prompts, pad=0):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def gen(model, ids, mask, **kw):
    args = dict(
        max_new_tokens=12,
        block_length=4,
        denoising_steps=2,
        temperature=0.0,
        stop_token_ids=[],
        return_dict_in_generate=True,
    )
    args.update(kw)
    return model.generate(ids, mask, **args)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sdar_cache_is_exact(temperature):
    model = tiny_model("sdar")
    ids, mask = left_pad(PROMPTS)
    outs = [
        gen(
            model,
            ids,
            mask,
            use_cache=c,
            temperature=temperature,
            generator=torch.Generator().manual_seed(3),
            remasking_strategy="low_confidence_dynamic",
            confidence_threshold=0.3,
        )
        for c in (False, True)
    ]
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].unmask_step, outs[1].unmask_step)
    torch.testing.assert_close(outs[0].token_logprobs, outs[1].token_logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9), dict(temperature=0.0)]
)
def test_replay_reproduces_sampler_logprobs(family, settings):
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    out = gen(model, ids, mask, generator=torch.Generator().manual_seed(0), **settings)
    replay = replay_logprobs(
        model,
        out.sequences,
        mask,
        out.unmask_step,
        block_length=4,
        temperature=settings["temperature"],
        top_k=settings.get("top_k"),
        top_p=settings.get("top_p"),
    )
    committed = out.unmask_step >= 0
    assert committed.sum() >= 12 * len(PROMPTS)
    assert (replay - out.token_logprobs)[committed].abs().max() <= 1e-5


def test_batch_rows_equal_single_prompts(family):
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    batched = gen(model, ids, mask, use_cache=False)
    width = ids.shape[1]
    for row, prompt in enumerate(PROMPTS):
        alone = gen(model, torch.tensor([prompt]), None)
        n = alone.sequences.shape[1] - len(prompt)
        assert batched.sequences[row, width : width + n].tolist() == alone.sequences[0, len(prompt) :].tolist()
        assert batched.unmask_step[row, width : width + n].tolist() == alone.unmask_step[0, len(prompt) :].tolist()


def test_static_commits_exactly_the_quota(family):
    model = tiny_model(family)
    out = gen(
        model,
        torch.tensor([PROMPTS[0]]),
        None,
        max_new_tokens=16,
        block_length=8,
        denoising_steps=3,
        remasking_strategy="low_confidence_static",
    )
    steps = out.unmask_step[0][out.unmask_step[0] >= 0]
    counts = torch.bincount(steps).tolist()
    quota = uniform_quota(8, 3)
    if family == "sdar":  # first block holds the prompt tail (7 % 8 = 7 tokens), so only one mask there
        assert counts[0] == 1
        counts = counts[1:]
    assert counts[: 2 * len(quota)][-len(quota) :] == quota


def test_dynamic_commits_all_confident_and_at_least_quota(family):
    model = tiny_model(family, seed=1)
    threshold = 0.05
    ids = torch.tensor([PROMPTS[0][:4]])
    out = gen(
        model,
        ids,
        None,
        max_new_tokens=16,
        block_length=8,
        denoising_steps=4,
        remasking_strategy="low_confidence_dynamic",
        confidence_threshold=threshold,
    )
    steps = out.unmask_step[0]
    counts = torch.bincount(steps[steps >= 0])
    assert bool((counts >= 2).all()) or counts[-1] < 2  # quota 2 per step (the last step may have fewer left)
    # every still-masked position of the current block with confidence above the threshold was committed
    valid = torch.ones_like(out.sequences, dtype=torch.bool)
    generated = torch.zeros_like(valid)
    generated[:, ids.shape[1] :] = True
    from trl_diffusion.states import state_before_step

    offset = 0 if family == "sdar" else ids.shape[1]  # SDAR blocks start at position 0, others after the prompt
    block_of = (torch.arange(out.sequences.shape[1]) - offset) // 8
    for step in range(int(steps.max()) + 1):
        state = state_before_step(out.sequences, out.unmask_step, generated, step, MASK_ID)
        logits = model.align_logits(model(state).logits)
        probs = sampling_logits(logits, 0.0, mask_token_id=MASK_ID).softmax(-1).max(-1).values[0]
        current = block_of[steps == step][0]
        masked_here = (state[0] == MASK_ID) & (block_of == current)
        confident = masked_here & (probs > threshold)
        assert bool((steps[confident] == step).all())


def test_sequential_goes_left_to_right():
    out = gen(
        tiny_model("llada"), torch.tensor([PROMPTS[1]]), None, remasking_strategy="sequential", denoising_steps=4
    )
    steps = out.unmask_step[0, 3:]
    assert steps.tolist() == sorted(steps.tolist())


def test_each_row_stops_at_its_own_stop_token():
    model = tiny_model("sdar")
    ids, mask = left_pad(PROMPTS)
    free = gen(model, ids, mask, max_new_tokens=16)
    stop = int(free.sequences[0, ids.shape[1] + 1])  # a token row 0 produces in its first block
    stopped = gen(model, ids, mask, max_new_tokens=16, stop_token_ids=[stop])
    row0 = stopped.unmask_step[0, ids.shape[1] :]
    assert (row0 >= 0).sum() < (free.unmask_step[0, ids.shape[1] :] >= 0).sum()
    assert stop in stopped.sequences[0, ids.shape[1] :].tolist()


def test_tokens_per_step_and_forward_passes():
    model = tiny_model("sdar")
    out = gen(model, torch.tensor([PROMPTS[0]]), None, max_new_tokens=16, denoising_steps=2, use_cache=False)
    generated = int((out.unmask_step >= 0).sum())
    assert out.tokens_per_step.item() == pytest.approx(generated / out.denoising_steps.item())
    assert out.num_forward_passes == out.denoising_steps.item()
    cached = gen(model, torch.tensor([PROMPTS[0]]), None, max_new_tokens=16, denoising_steps=2, use_cache=True)
    # a prefill of block 0, then one forward per step: a block's first step also writes the previous block's keys
    assert cached.num_forward_passes == cached.denoising_steps.item() + 1


def test_llada_dual_and_prefix_cache_run():
    model = tiny_model("llada")
    ids, mask = left_pad(PROMPTS)
    for mode in ("prefix", "dual"):
        out = gen(model, ids, mask, use_cache=mode)
        assert not bool((out.sequences == MASK_ID).any())


def test_llada_cfg_runs():
    out = gen(tiny_model("llada"), torch.tensor([PROMPTS[0]]), None, cfg_scale=1.0)
    assert (out.unmask_step >= 0).sum() == 12


def test_generation_config_is_read(tmp_path):
    model = tiny_model("sdar")
    model.generation_config.block_length = 4
    model.generation_config.denoising_steps = 4
    model.generation_config.max_new_tokens = 8
    model.generation_config.remasking_strategy = "sequential"
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.generation_config.denoising_steps == 4
    out = loaded.generate(torch.tensor([PROMPTS[0]]), stop_token_ids=[], return_dict_in_generate=True)
    assert int((out.unmask_step >= 0).sum()) == 9  # 7 + 8 rounded up to whole blocks of 4 = 16 -> 9 new
    assert int(out.denoising_steps) == 9  # sequential, 4 steps per block of 4: one token per step


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_length=0), "block_length"),
        (dict(denoising_steps=0), "denoising_steps"),
        (dict(denoising_steps=8, block_length=4), "exceeds block_length"),
        (dict(remasking_strategy="nope"), "unknown remasking_strategy"),
        (dict(max_new_tokens=10_000), "positions"),
    ],
)
def test_errors_before_compute(kwargs, match):
    model = tiny_model("sdar")
    with pytest.raises(ValueError, match=match):
        gen(model, torch.tensor([PROMPTS[0]]), None, **kwargs)


def test_mask_token_in_prompt_is_an_error():
    with pytest.raises(ValueError, match="mask token"):
        gen(tiny_model("dream"), torch.tensor([[20, MASK_ID, 21]]), None)


def test_dynamic_without_threshold_is_an_error():
    from trl_diffusion.generation import SamplingSettings

    settings = SamplingSettings(
        max_new_tokens=8,
        block_length=4,
        denoising_steps=2,
        remasking_strategy="low_confidence_dynamic",
        confidence_threshold=None,
    )
    with pytest.raises(ValueError, match="confidence_threshold"):
        settings.validate()


def test_mask_token_is_never_generated(family):
    model = tiny_model(family)
    head = model.get_output_embeddings() or model.lm_head

    def mask_wins(module, inputs, logits):  # make the mask token the most likely prediction everywhere
        logits = logits.clone()
        logits[..., MASK_ID] = logits.amax(-1) + 50.0
        return logits

    head.register_forward_hook(mask_wins)
    with torch.no_grad():
        canvas = torch.tensor([PROMPTS[0] + [MASK_ID] * 4])
        unfiltered = model.align_logits(model(canvas).logits)[0, -4:]
    assert bool((unfiltered.argmax(-1) == MASK_ID).all())  # without the filter the mask would win
    out = gen(model, torch.tensor([PROMPTS[0]]), None, temperature=1.0)
    assert not bool((out.sequences == MASK_ID).any())
    assert int((out.unmask_step >= 0).sum()) >= 12
