"""generate(): cache exactness, trajectory replay, batching, remasking quotas, errors."""

import pytest
import torch
from numerics import MIN_MARGIN, DecisionMargins, assert_close_fp32

from trl_diffusion.estimators import replay_logprobs
from trl_diffusion.generation.sampling import sampling_logits
from trl_diffusion.states import attention_mask_from_positions, state_before_step
from trl_diffusion.testing import MASK_ID, left_pad, tiny_model

PROMPTS = [[20, 21, 22, 23, 24, 25, 26], [30, 31, 32], [40, 41, 42, 43, 44]]



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
    with DecisionMargins() as margins:
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
    assert margins.smallest > MIN_MARGIN  # no decision is a near-tie that float noise could flip
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert torch.equal(outs[0].unmask_step, outs[1].unmask_step)
    assert_close_fp32(outs[0].token_logprobs, outs[1].token_logprobs)


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
    assert_close_fp32(replay, out.token_logprobs, committed)


def test_replay_reproduces_sampler_logprobs_of_right_padded_prompts(family):
    """generate() returns ``[prompt as given | completion]``: with right padding, pad columns sit between a prompt
    and its completion, and Dream's shifted logits must come from the last real token, not the pad before."""
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    ids, mask = ids.flip(1), mask.flip(1)  # right-padded (token order reversed: any prompt will do)
    out = gen(model, ids, mask, temperature=1.0, generator=torch.Generator().manual_seed(0))
    replay = replay_logprobs(model, out.sequences, mask, out.unmask_step, block_length=4, temperature=1.0)
    committed = out.unmask_step >= 0
    assert committed.sum() >= 12 * len(PROMPTS)
    assert_close_fp32(replay, out.token_logprobs, committed)


def test_batch_rows_equal_single_prompts(family):
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    with DecisionMargins() as margins:
        batched = gen(model, ids, mask, use_cache=False)
    assert margins.smallest > MIN_MARGIN
    width = ids.shape[1]
    for row, prompt in enumerate(PROMPTS):
        alone = gen(model, torch.tensor([prompt]), None)
        n = alone.sequences.shape[1] - len(prompt)
        assert batched.sequences[row, width : width + n].tolist() == alone.sequences[0, len(prompt) :].tolist()
        assert batched.unmask_step[row, width : width + n].tolist() == alone.unmask_step[0, len(prompt) :].tolist()


def block_of_generated(family, prompt_length, width, block_length):
    """Block of each generated column ``[prompt_length, width)`` of a single unpadded row: SDAR aligns blocks from
    position 0 (its first block holds the prompt tail), LLaDA and Dream from the end of the prompt."""
    cols = torch.arange(prompt_length, width)
    return cols // block_length if family == "sdar" else (cols - prompt_length) // block_length


def test_static_commits_exactly_the_quota_at_every_step_of_every_block(family):
    """Each block's masks are committed ``uniform_quota`` at a time (capped by the masks left), one block after
    the other, every step inside a single block."""
    model = tiny_model(family)
    prompt = PROMPTS[0]  # 7 tokens: SDAR's first block of 8 holds 7 prompt tokens and one mask
    out = gen(model, torch.tensor([prompt]), None, max_new_tokens=16, block_length=8, denoising_steps=3,
              remasking_strategy="low_confidence_static")
    steps = out.unmask_step[0, len(prompt):]
    assert bool((steps >= 0).all())  # no stop tokens: every generated position is committed
    blocks = block_of_generated(family, len(prompt), out.sequences.shape[1], 8)
    expected = []  # tokens committed per step, block by block
    for block in blocks.unique().tolist():
        left = int((blocks == block).sum())
        for quota in (3, 3, 2):  # 8 tokens in 3 steps, the remainder first (LLaDA's get_num_transfer_tokens)
            if left == 0:
                break
            expected.append(min(quota, left))
            left -= expected[-1]
    assert torch.bincount(steps).tolist() == expected
    for step in range(len(expected)):
        assert len(blocks[steps == step].unique()) == 1  # a step commits inside one block
    assert blocks[steps.argsort(stable=True)].diff().ge(0).all()  # blocks are decoded in order
    assert expected[:1] == ([1] if family == "sdar" else [3])  # SDAR: the prompt tail's block has one mask


@pytest.mark.parametrize(("family", "threshold"), [("sdar", 0.1), ("llada", 0.1), ("dream", 0.2)])
def test_dynamic_commits_all_confident_and_at_least_quota(family, threshold):
    """At every step: every masked position of the current block above the threshold, and at least the quota
    (2 per step here) or every mask the block has left. The thresholds make both rules decide some step."""
    model = tiny_model(family, seed=1)
    ids = torch.tensor([PROMPTS[0][:4]])
    with DecisionMargins() as margins:
        out = gen(model, ids, None, max_new_tokens=16, block_length=8, denoising_steps=4,
                  remasking_strategy="low_confidence_dynamic", confidence_threshold=threshold)
    assert margins.smallest > MIN_MARGIN  # the confidences recomputed below cannot land on the other side
    steps = out.unmask_step[0]
    generated = torch.zeros_like(out.sequences, dtype=torch.bool)
    generated[:, ids.shape[1] :] = True
    block_of = torch.full_like(steps, -1)
    block_of[ids.shape[1] :] = block_of_generated(family, ids.shape[1], out.sequences.shape[1], 8)
    positions = torch.arange(out.sequences.shape[1])[None]  # SDAR decodes blocks of 8: attention in blocks of 8
    attention = attention_mask_from_positions(positions, positions, None, 8 if family == "sdar" else None)
    quota_decided = threshold_decided = False
    for step in range(int(steps.max()) + 1):
        block = block_of[steps == step].unique()
        assert len(block) == 1
        state = state_before_step(out.sequences, out.unmask_step, generated, step, MASK_ID)
        logits = model.align_logits(model(state, attention_mask=attention).logits)
        probs = sampling_logits(logits, 0.0, mask_token_id=MASK_ID).softmax(-1).max(-1).values[0]
        masked_here = (state[0] == MASK_ID) & (block_of == block)
        confident = masked_here & (probs > threshold)
        committed = int((steps == step).sum())
        assert bool((steps[confident] == step).all())
        assert committed >= min(2, int(masked_here.sum()))
        quota_decided |= int(confident.sum()) < min(2, int(masked_here.sum()))
        threshold_decided |= committed > 2
    assert quota_decided and threshold_decided


def test_sequential_goes_left_to_right():
    out = gen(
        tiny_model("llada"), torch.tensor([PROMPTS[1]]), None, remasking_strategy="sequential", denoising_steps=4
    )
    steps = out.unmask_step[0, 3:]
    assert steps.tolist() == sorted(steps.tolist())


def completion_blocks_of(family, prompt_length, n, block_length=4):
    """Block of completion column ``c`` (``c < n``) of a row whose prompt has ``prompt_length`` tokens."""
    cols = torch.arange(n)
    return (prompt_length + cols) // block_length if family == "sdar" else cols // block_length


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "one_shared_generator"])
def test_each_row_stops_after_the_block_of_its_first_stop_token(family, sampled):
    """For every row: with a stop id that row produces early, the row keeps exactly the tokens it produces without
    stops up to the end of the block holding its first stop token and nothing after; rows that never produce it
    are unchanged. Sampled with one ``torch.Generator`` shared by the rows, stopped rows cannot leave the working
    batch (its random stream covers every row; docs/generation.md): a row riding along must still commit nothing
    after its stop block, and the other rows must draw exactly what they draw without stops."""
    model = tiny_model(family)
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]

    def run(stop_token_ids):
        sampling = dict(temperature=1.0, generator=torch.Generator().manual_seed(3)) if sampled else {}
        return gen(model, ids, mask, max_new_tokens=16, stop_token_ids=stop_token_ids, **sampling)

    free = run([])
    for row in range(len(PROMPTS)):
        stop = int(free.sequences[row, width + 1])  # a token this row produces in its first block
        stopped = run([stop])
        for other, prompt in enumerate(PROMPTS):
            tokens, steps = free.sequences[other, width:], free.unmask_step[other, width:]
            blocks = completion_blocks_of(family, len(prompt), len(tokens))
            hits = ((tokens == stop) & (steps >= 0)).nonzero().flatten()
            keep = blocks <= blocks[hits[0]] if len(hits) else torch.ones_like(blocks, dtype=torch.bool)
            expected_steps = torch.where(keep, steps, torch.full_like(steps, -1))
            assert torch.equal(stopped.unmask_step[other, width:], expected_steps), (row, other)
            kept = expected_steps >= 0
            assert torch.equal(stopped.sequences[other, width:][kept], tokens[kept]), (row, other)
        assert (stopped.unmask_step[row, width:] >= 0).sum() < (free.unmask_step[row, width:] >= 0).sum()


def test_a_stop_id_in_the_prompt_part_of_a_block_does_not_stop_the_row():
    """SDAR's blocks are aligned to the whole sequence, so a prompt of 6 tokens shares its second block ([24, 25,
    gen, gen]) with the completion. Only generated tokens can stop a row: a stop id the prompt holds there (an end
    of turn in a chat template, say) and the row never generates must change nothing, not end the row after its
    first block."""
    model = tiny_model("sdar")
    prompt = torch.tensor([[20, 21, 22, 23, 24, 25]])
    free = gen(model, prompt, None)
    assert 25 not in free.sequences[0, prompt.shape[1]:].tolist()  # the stop id below is never generated
    stopped = gen(model, prompt, None, stop_token_ids=[25])
    assert torch.equal(stopped.sequences, free.sequences)
    assert torch.equal(stopped.unmask_step, free.unmask_step)


def test_tokens_per_step_and_forward_passes():
    model = tiny_model("sdar")
    out = gen(model, torch.tensor([PROMPTS[0]]), None, max_new_tokens=16, denoising_steps=2, use_cache=False)
    generated = int((out.unmask_step >= 0).sum())
    assert out.tokens_per_step.item() == pytest.approx(generated / out.denoising_steps.item())
    assert out.num_forward_passes == out.denoising_steps.item()
    cached = gen(model, torch.tensor([PROMPTS[0]]), None, max_new_tokens=16, denoising_steps=2, use_cache=True)
    # a prefill of block 0, then one forward per step: a block's first step also writes the previous block's keys
    assert cached.num_forward_passes == cached.denoising_steps.item() + 1


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


def test_generate_restores_every_submodule_mode_after_success_and_error(family):
    """generate() decodes in eval mode, then gives each module its own mode back: a submodule the caller keeps in
    eval mode (a frozen block, dropout off) stays so, also when generation raises."""
    model = tiny_model(family).train()
    frozen = next(module for module in model.modules() if module is not model and list(module.children()))
    frozen.eval()
    modes = {name: module.training for name, module in model.named_modules()}
    seen = []
    gen(model, torch.tensor([PROMPTS[0]]), None, max_new_tokens=4)
    assert {name: module.training for name, module in model.named_modules()} == modes

    def fail(module, inputs, output):
        seen.append(module.training)
        raise RuntimeError("out of memory")

    model.get_output_embeddings().register_forward_hook(fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        gen(model, torch.tensor([PROMPTS[0]]), None, max_new_tokens=4)
    assert seen == [False]  # decoded in eval mode
    assert {name: module.training for name, module in model.named_modules()} == modes


def test_generate_restores_modes_through_train_overrides():
    """Modes come back through train(), so overrides run (peft's DoRA clears its weight cache in train(True)): set
    as attributes, a cache built during generation outlived it."""
    model = tiny_model("sdar").train()
    child = model.get_output_embeddings()
    calls = []
    original = child.train

    def train(mode=True):
        calls.append(mode)
        return original(mode)

    child.train = train
    gen(model, torch.tensor([PROMPTS[0]]), None, max_new_tokens=4)
    assert calls[-1] is True and child.training


def test_held_out_accuracy_keeps_each_module_mode():
    """evaluate_accuracy put the root's mode back over every module (model.train(was_training)): a frozen block came
    back in train mode after each held-out evaluation."""
    from trl_diffusion.data import evaluate_accuracy, make_problems
    from trl_diffusion.testing import build_tokenizer

    model = tiny_model("sdar").train()
    frozen = next(module for module in model.modules() if module is not model and list(module.children()))
    frozen.eval()
    modes = {name: module.training for name, module in model.named_modules()}
    _, test = make_problems(0, 2, seed=0)
    evaluate_accuracy(model, build_tokenizer(), test, chat_template=False, max_new_tokens=4, block_length=4)
    assert {name: module.training for name, module in model.named_modules()} == modes
