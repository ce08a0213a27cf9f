"""The masking estimators (``random_masking``, ``coupled``, ``coupled_pairs``, ``mean_field``) score a response the
same alone as in a batch with longer responses, also with a training block larger than the rollout's.

Regression: on block models (SDAR) with ``training_block_size`` 8 over rollout blocks of 4, the right padding of a
batch's shorter canvases fell inside a row's last training block and was shown as mask tokens that the row's real
tokens attended to, so a response's log-probs depended on how long the other responses of its batch were.
dLLM-RL never trains with a training block larger than the rollout's (``TraceRLConfig.from_official``: 4 and 4),
where the fix changes nothing; the checks below pin that too.

Random draws are a separate matter: a row's masks come from its own seed, but per-token draws (and ``mean_field``'s
prompt noise) are laid out over the batch's padded widths, so a narrower batch draws other, equally distributed
masks. The alone-vs-batch checks therefore give the row alone the masks it drew in the batch.
"""

import pytest
import torch
from numerics import assert_close_fp32
from test_official_estimators import fixed_batch, official_row_logps

from trl_diffusion.estimators import EstimatorSettings, draw_masks, estimate_logprobs, likelihood
from trl_diffusion.testing import EOS_ID, tiny_model
from trl_diffusion.trainers.tracerl_config import OFFICIAL_SETTINGS

SHORT = [44, 84, 33, 17, 9, 71]  # SDAR: canvas ends at position 12, inside the training block [8, 16)
LONG = [43, 40, 64, 95, 104, 82, 34]  # SDAR: canvas three columns wider, then it stops early (a stop token)
SEEDS = torch.tensor([5, 6])
ROLLOUT = {  # rollout block 4 for both; SDAR scored with training blocks of 8
    "sdar": dict(max_new_tokens=6, block_length=4, denoising_steps=2),
    "llada": dict(max_new_tokens=8, block_length=4, denoising_steps=2),
}
ESTIMATORS = {  # name: the settings' masking fields (per-token draws, several masks, both layouts of pairs)
    "random_masking": dict(masks_per_response=2),
    "coupled_pairs": dict(random_mask_sampling="per_row", masks_per_response=2),
    "coupled": {},
    "mean_field": {},
}


def rollout(model, prompts, family):
    """Left-padded prompts and the sampler's completion canvas and trajectory ``[B, C]`` (tokens 10-59 stop)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, mask, return_dict_in_generate=True, remasking_strategy="low_confidence_static",
                         stop_token_ids=list(range(10, 60)), **ROLLOUT[family],
                         generator=[torch.Generator().manual_seed(int(s)) for s in SEEDS[:len(prompts)]])
    return ids, mask, out.sequences[:, width:], out.unmask_step[:, width:]


def settings_for(family, name, training_block=8):
    return EstimatorSettings(name=name, block_size=training_block if family == "sdar" else None,
                             **ESTIMATORS[name])


def row_draws(draws: dict, row: int, width: int, prompt_width: int, masks: int) -> dict:
    """Row ``row``'s draws from a batch, for the row alone: each mask's first ``width`` completion columns, the
    last ``prompt_width`` prompt columns (prompts are left-padded)."""
    out = {}
    for key, value in draws.items():
        if value is None:
            out[key] = None
        elif key == "prompt_noise":
            out[key] = value[row:row + 1, value.shape[1] - prompt_width:]
        elif key == "t":
            out[key] = value[row:row + 1]
        else:
            out[key] = value[row].view(masks, -1)[:, :width].reshape(1, -1)
    return out


@pytest.mark.parametrize("name", list(ESTIMATORS))
@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_a_row_scores_the_same_alone_as_in_a_batch_with_a_longer_row(family, name, monkeypatch):
    model = tiny_model(family, seed=3)
    settings = settings_for(family, name)
    masks = settings.masks_per_response
    with torch.no_grad():
        batch = rollout(model, [SHORT, LONG], family)
        together, _, scored = estimate_logprobs(model, *batch, settings, SEEDS)
        drawn = draw_masks(settings, batch[3] >= 0, SEEDS, batch[0].shape[1])
        for row, prompt in enumerate([SHORT, LONG]):
            alone = rollout(model, [prompt], family)
            width = alone[2].shape[1]
            assert torch.equal(alone[3][0], batch[3][row, :width])  # the sampler's row does not depend on its batch
            assert bool((batch[3][row, width:] < 0).all())  # the rest is padding
            mine = row_draws(drawn, row, width, len(prompt), masks)
            monkeypatch.setattr(likelihood, "draw_masks", lambda *args, mine=mine: mine)
            logps, _, scored_alone = estimate_logprobs(model, *alone, settings, SEEDS[row:row + 1])
            monkeypatch.undo()
            in_batch = together[row].view(masks, -1)[:, :width].reshape(1, -1)
            assert torch.equal(scored_alone, scored[row].view(masks, -1)[:, :width].reshape(1, -1))
            assert bool(scored_alone.any())
            assert_close_fp32(logps, in_batch, scored_alone)


@pytest.mark.parametrize("family", ["sdar", "llada"])
def test_coupled_draws_do_not_depend_on_the_batch_either(family):
    """``coupled`` draws its ratio, then one number per column: the same masks at any width, end to end."""
    model = tiny_model(family, seed=3)
    settings = settings_for(family, "coupled")
    with torch.no_grad():
        together = estimate_logprobs(model, *rollout(model, [SHORT, LONG], family), settings, SEEDS)[0]
        alone = rollout(model, [SHORT], family)
        logps = estimate_logprobs(model, *alone, settings, SEEDS[:1])[0]
    assert_close_fp32(logps[0], together[0, :alone[2].shape[1]])


def test_a_padded_row_equals_dllm_rls_row_for_the_response_alone():
    """SDAR, training block 8 over rollout blocks of 4: each ``random_masking`` mask of the short response, scored in
    the batch, equals dLLM-RL's row for that response alone (its noisy copy per training block, earlier blocks
    clean; the transcription of ``test_official_estimators``)."""
    model = tiny_model("sdar", seed=3)
    settings = settings_for("sdar", "random_masking")
    with torch.no_grad():
        prompt_ids, prompt_mask, completion, steps = rollout(model, [SHORT, LONG], "sdar")
        logps = estimate_logprobs(model, prompt_ids, prompt_mask, completion, steps, settings, SEEDS)[0]
    drawn = draw_masks(settings, steps >= 0, SEEDS, prompt_ids.shape[1])["masked"][0].view(2, -1)
    width = rollout(model, [SHORT], "sdar")[2].shape[1]
    committed = steps[0, :width] >= 0
    for k in range(2):
        half = drawn[k, :width] & committed
        expected = official_row_logps(model, torch.tensor(SHORT), completion[0, :width], committed, half, half, 8)
        assert_close_fp32(logps[0].view(2, -1)[k, :width], expected, half)


def _without_canvas_cut(monkeypatch):
    """The estimators as they were before the fix: every column of the batch canvas in every row."""
    monkeypatch.setattr(likelihood, "rollout_canvas", lambda *args: None)


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_the_official_setting_scores_exactly_as_before(name, monkeypatch):
    """dLLM-RL's TraDo setting trains with the rollout's block (``training_block_size`` = ``block_length`` = 4):
    nothing behind a row's last rollout block is ever seen there, so the canvas cut changes no bit, on sampled
    rollouts and on the official-rows fixture, whose never-committed tail inside a block stays masks."""
    trado = OFFICIAL_SETTINGS["trado"]
    assert trado["training_block_size"] == trado["block_length"] == 4
    model = tiny_model("sdar", seed=3)
    settings = EstimatorSettings(name=name, block_size=4, rollout_block_length=4, **ESTIMATORS[name])
    fixture = fixed_batch()[:4]
    seeds = torch.tensor([11, 12, 13])
    with torch.no_grad():
        batches = [(rollout(model, [SHORT, LONG], "sdar"), SEEDS), (fixture, seeds)]
        now = [estimate_logprobs(model, *batch, settings, row_seeds) for batch, row_seeds in batches]
        _without_canvas_cut(monkeypatch)
        before = [estimate_logprobs(model, *batch, settings, row_seeds) for batch, row_seeds in batches]
    for a, b in zip(now, before):
        assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])


def test_rollout_canvas_ends_with_the_rollout_block_of_the_last_committed_token():
    committed = torch.tensor([[True, True, True, False, False, False, False, False],
                              [True, False, False, False, False, False, False, False],
                              [False] * 8])
    prompt_mask = torch.tensor([[1, 1, 1], [0, 1, 1], [1, 1, 1]])  # completions start at positions 3, 2, 3
    canvas = likelihood.rollout_canvas(committed, prompt_mask, 4)
    assert canvas.long().tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0], [0] * 8]
    assert likelihood.rollout_canvas(committed, prompt_mask, None) is None  # full attention: the whole canvas


@pytest.mark.parametrize("value", [0, -4, 2.0, True, "4"])
def test_rollout_block_length_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="rollout_block_length"):
        EstimatorSettings(name="random_masking", rollout_block_length=value)


def test_tracerl_trainer_scores_with_the_rollouts_block_length(tmp_path):
    """The trainer tells the estimators its rollouts' ``block_length`` (2 here, on a model whose own block is 4):
    falling back to the model's block would keep up to 2 columns past a row's last rollout block."""
    from datasets import Dataset

    from trl_diffusion import TraceRLConfig, TraceRLTrainer
    from trl_diffusion.testing import build_tokenizer

    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                         max_completion_length=8, block_length=2, denoising_steps=2, training_block_size=4,
                         likelihood_estimator="random_masking", report_to="none", use_cpu=True, bf16=False,
                         gradient_checkpointing=False, save_strategy="no")
    trainer = TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                             train_dataset=Dataset.from_dict({"prompt": ["ab"] * 2}),
                             processing_class=build_tokenizer())
    assert trainer.model.config.block_size == 4
    assert trainer.estimator_settings.rollout_block_length == 2
