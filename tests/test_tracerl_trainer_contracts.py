"""TraceRLTrainer contracts no other test pinned: refusals at construction (a config that is not a TraceRLConfig, TRL's
environment_factory, a model that is not a diffusion model, an ``image`` column, value models that do not fit the
policy or the tokenizer), what the rollouts pass to the sampler and cut from its canvas, the warning about identical
rewards, and evaluation: its groups of ``num_generations_eval``, its metrics, and what it leaves of the training state
(optimizer moments, the step the sampler gap is measured at)."""

from __future__ import annotations

import logging

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import Qwen2Config, Qwen2ForCausalLM
from trl import GRPOConfig

from trl_diffusion import DiffusionValueModel
from trl_diffusion.generation import mixin
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import REFERENCE_STATE_NAME, TraceRLTrainer

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]
GAPS = ("rollout/sampler_logp_gap", "rollout/sampler_logp_gap_exact")
TRAINER_ARGUMENTS = ("value_model", "eval_dataset", "train_dataset", "environment_factory")


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def config(tmp_path, **overrides) -> TraceRLConfig:
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none")
    values.update(overrides)
    return TraceRLConfig(**values)


def make_trainer(tmp_path, model=None, reward=distinct_chars, tokenizer=None, **kwargs) -> TraceRLTrainer:
    """A tiny SDAR trainer; keyword arguments TraceRLTrainer takes go to it, the rest to the config."""
    passed = {name: kwargs.pop(name) for name in TRAINER_ARGUMENTS if name in kwargs}
    passed.setdefault("train_dataset", Dataset.from_dict({"prompt": PROMPTS}))
    model = model if model is not None else tiny_model("sdar").train()
    return TraceRLTrainer(model, reward, args=config(tmp_path, **kwargs),
                          processing_class=tokenizer or build_tokenizer(), **passed)


def scripted(values):
    """A reward function returning ``values`` (cut to the number of completions) at every call."""

    def reward(completions, **kwargs):
        return list(values[: len(completions)])

    return reward


# ------------------------------------------------------------------------------------------------ construction
def test_a_config_that_is_not_a_tracerl_config_is_refused_by_name(tmp_path):
    """TRL's own GRPOConfig (which lacks the diffusion fields) is refused with a TypeError naming its class."""
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(TypeError, match="args must be a TraceRLConfig, got GRPOConfig"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=args,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer())


def test_trls_environment_factory_is_refused(tmp_path):
    """TRL's environment_factory (multi-turn environments) is refused like tools and rollout_func."""
    with pytest.raises(ValueError, match="environment_factory .TRL's tool calling / custom rollouts. cannot be used"):
        make_trainer(tmp_path, environment_factory=lambda: None)


def test_a_causal_model_that_is_not_a_diffusion_model_is_refused(tmp_path):
    """A transformers causal LM (no diffusion interface) is refused with a TypeError naming it, after TRL built."""
    tokenizer = build_tokenizer()
    causal = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with pytest.raises(TypeError, match="Qwen2ForCausalLM is not a diffusion model of trl_diffusion"):
        make_trainer(tmp_path, model=causal, tokenizer=tokenizer)


def test_an_image_column_is_refused_as_the_images_column_is(tmp_path):
    """A dataset with TRL's singular ``image`` column is refused at construction, naming the column."""
    data = Dataset.from_dict({"prompt": PROMPTS, "image": [None] * 4})
    with pytest.raises(ValueError, match="the train dataset has an 'image' column: TraceRLTrainer does not support"):
        make_trainer(tmp_path, train_dataset=data)


def test_an_explicit_training_block_size_still_warns_about_the_rollout_block_length(tmp_path, caplog):
    """A block model rolled out at another block length is warned about also when ``training_block_size`` is set."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            make_trainer(tmp_path, model=tiny_model("sdar", block_size=8).train(), training_block_size=8)
    finally:
        hf_logging.disable_propagation()
    assert "block_size=8, but TraceRL rolls out at block_length=4" in caplog.text


def value_trainer(tmp_path, value_model, tokenizer=None, policy=None):
    return make_trainer(tmp_path, model=policy, tokenizer=tokenizer, value_model=value_model,
                        per_device_train_batch_size=2, num_generations=2,
                        train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"]}))


def test_a_value_model_with_another_mask_token_is_refused_when_the_tokenizer_has_none(tmp_path):
    """With a tokenizer that declares no mask token (LLaDA's released one), the tokenizer check cannot see the value
    model's other mask id: the trainer's own comparison with the policy refuses it."""
    tokenizer = build_tokenizer()
    tokenizer.mask_token = None
    value = DiffusionValueModel.from_policy(tiny_model("sdar", mask_token_id=4))
    with pytest.raises(ValueError, match=r"value model's mask_token_id \(4\) differs from the policy's \(3\)"):
        value_trainer(tmp_path, value, tokenizer=tokenizer)


def test_a_value_model_needs_a_row_for_every_token_of_the_tokenizer(tmp_path):
    """A value model with more rows than the policy but fewer than the tokenizer's tokens is refused."""
    value = DiffusionValueModel.from_policy(tiny_model("sdar", vocab_size=80))
    with pytest.raises(ValueError, match=r"embedding has 80 rows, fewer than the policy's \(64\) or the tokenizer's "
                                         r"\(101 tokens\)"):
        value_trainer(tmp_path, value, policy=tiny_model("sdar", vocab_size=64).train())


def test_disable_dropout_reaches_the_value_model(tmp_path):
    """``disable_dropout=True`` turns off the value model's dropout layers, as TRL does for the policy."""
    dropout = dict(residual_dropout=0.1, embedding_dropout=0.1)
    value = DiffusionValueModel.from_policy(tiny_model("llada", **dropout))
    assert any(m.p > 0 for m in value.modules() if isinstance(m, torch.nn.Dropout))
    trainer = make_trainer(tmp_path, model=tiny_model("llada").train(), value_model=value, disable_dropout=True)
    layers = [m for m in trainer.value_model.modules() if isinstance(m, torch.nn.Dropout)]
    assert layers and all(m.p == 0 for m in layers)


# ------------------------------------------------------------------------------------------------ rollouts
def test_top_k_none_samples_without_top_k_and_not_with_the_checkpoints(tmp_path, monkeypatch):
    """``top_k=None`` (TRL's other "off") reaches ``generate()`` as 0: a None there reads the checkpoint's
    generation config (here top_k 2), which would filter the rollouts."""
    from transformers import GenerationConfig

    model = tiny_model("sdar").train()
    model.generation_config = GenerationConfig(do_sample=True, top_k=2)
    resolved = []
    original = mixin.DiffusionGenerationMixin._resolve_settings

    def spy(self, kwargs, prompt_width=0):
        settings, as_dict = original(self, kwargs, prompt_width)
        resolved.append(settings)
        return settings, as_dict

    monkeypatch.setattr(mixin.DiffusionGenerationMixin, "_resolve_settings", spy)
    trainer = make_trainer(tmp_path, model=model, top_k=None)
    assert trainer._rollout_sampler()["top_k"] == 0
    trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    assert resolved and all(not settings.top_k for settings in resolved)


def test_completions_are_cut_at_max_completion_length_when_the_canvas_is_longer(tmp_path):
    """A block model's canvas is rounded up to whole blocks (8 columns for max_completion_length 6 in blocks of 4)
    and the sampler commits all of it: the completions stop at max_completion_length."""
    trainer = make_trainer(tmp_path, max_completion_length=6)
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    assert output["canvas_ids"].shape[1] == 8 and bool((output["unmask_step"][:, 6:] >= 0).any())
    assert output["completion_ids"].shape[1] == 6
    assert int(output["completion_mask"].gt(0).sum(1).max()) <= 6


def test_identical_rewards_warning_counts_consecutive_flat_batches_only(tmp_path, caplog):
    """A generation batch whose groups' rewards differ restarts the count of flat batches before the warning."""
    trainer = make_trainer(tmp_path)
    trainer.identical_rewards_patience = 2
    flat, varied = torch.zeros(4, 1), torch.tensor([[0.0], [1.0], [0.0], [1.0]])
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        for rewards in (flat, varied, flat):
            trainer._watch_reward_signal(rewards)
        assert "identical rewards" not in caplog.text
        trainer._watch_reward_signal(flat)
    assert "for 2 generation batches in a row every group's completions got identical rewards" in caplog.text


# ------------------------------------------------------------------------------------------------ evaluation
def test_evaluation_batches_do_not_count_towards_the_identical_rewards_warning(tmp_path, caplog):
    """Flat rewards of evaluation rollouts say nothing about the training signal: only training batches count."""
    trainer = make_trainer(tmp_path, reward=scripted([0.0] * 16), per_device_eval_batch_size=4,
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:1]}))
    trainer.identical_rewards_patience = 1
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        metrics = trainer.evaluate()
    assert "eval_reward" in metrics
    assert "identical rewards" not in caplog.text


@pytest.mark.parametrize("baseline, expected", [("group_mean", [-1.0, 1.0, 0.0, 0.0]),
                                                ("leave_one_out", [-2.0, 2.0, 0.0, 0.0])])
def test_evaluation_advantages_are_taken_over_groups_of_num_generations_eval(tmp_path, baseline, expected):
    """In evaluation a group is ``num_generations_eval`` completions (2 here, 4 in training): rewards 0, 1 | 1, 1 give
    population z-scores -1, 1 | 0, 0 (leave-one-out: r minus the other one, -1, 1 | 0, 0, scaled alike: x 2)."""
    trainer = make_trainer(tmp_path, reward=scripted([0.0, 1.0, 1.0, 1.0]), num_generations_eval=2,
                           advantage_baseline=baseline)
    trainer.model.eval()
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 2 + [{"prompt": PROMPTS[1]}] * 2)
    torch.testing.assert_close(output["advantages"], torch.tensor(expected))


def test_evaluation_filters_groups_of_num_generations_eval_and_logs_it_as_an_eval_metric(tmp_path):
    """Group filtering in evaluation drops whole groups of ``num_generations_eval`` completions (one of two here) and
    logs the fraction as ``eval_filtered_groups``, not in the training metrics."""
    trainer = make_trainer(tmp_path, reward=scripted([0.0, 1.0, 1.0, 1.0]), num_generations_eval=2,
                           per_device_eval_batch_size=4, dynamic_group_filtering="all_equal",
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}))
    metrics = trainer.evaluate()
    assert metrics["eval_filtered_groups"] == 0.5
    assert "filtered_groups" not in trainer._metrics["train"]


def test_evaluation_token_metrics_describe_the_kept_groups_and_are_nan_when_none_is_kept(tmp_path):
    """Filtering applies to eval groups (eval_loss is training's loss): with every group dropped the token metrics
    have no token to describe (NaN, docs/tracerl.md); without filtering they are TRL's numbers over every
    completion."""
    common = dict(reward=scripted([1.0] * 8), num_generations_eval=4, per_device_eval_batch_size=8,
                  eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}))
    filtered = make_trainer(tmp_path / "band", dynamic_group_filtering="all_equal", **common).evaluate()
    kept = make_trainer(tmp_path / "none", **common).evaluate()
    assert filtered["eval_filtered_groups"] == 1.0 and "eval_filtered_groups" not in kept
    for key in ("eval_entropy", "eval_clip_ratio/region_mean"):
        assert filtered[key] != filtered[key]  # NaN
        assert kept[key] == kept[key] and kept[key] >= 0.0
    assert kept["eval_entropy"] > 0.0


def test_an_evaluation_leaves_the_optimizer_moments_of_the_rollout_in_progress(tmp_path):
    """``reset_optimizer_per_rollout`` resets at training rollouts only: an evaluation's rollouts keep AdamW's
    state."""
    trainer = make_trainer(tmp_path, reset_optimizer_per_rollout=True, per_device_eval_batch_size=4,
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:1]}))
    trainer.train()
    assert trainer.optimizer.state
    trainer.evaluate()
    assert trainer.optimizer.state


def test_an_evaluation_does_not_make_a_buffered_rollout_look_fresh(tmp_path):
    """The sampler gap is measured at the optimizer step of a training rollout only: an evaluation's rollouts at the
    next step (which trains on the buffered rollout with moved weights) do not mark that step."""
    trainer = make_trainer(tmp_path, max_steps=2, steps_per_generation=2, eval_strategy="steps", eval_steps=1,
                           per_device_eval_batch_size=4, eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:1]}))
    trainer.train()
    steps = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert any("eval_reward" in entry for entry in trainer.state.log_history)
    assert [bool(set(GAPS) & set(entry)) for entry in steps] == [True, False]


# ------------------------------------------------------------------------------------------------ metrics
def test_sequence_level_low_clip_minimum_over_partly_clipped_kept_rows_is_zero(tmp_path):
    """importance_sampling_level='sequence' with a filtered group: ``clip_ratio/low_min`` is the least low-clip
    indicator of the kept rows, 0 when one of them is not clipped (here the kept group's positive-advantage row)."""
    trainer = make_trainer(tmp_path, reward=scripted([1.0, 1.0, 0.0, 1.0]), num_generations=2,
                           importance_sampling_level="sequence", loss_type="grpo", dynamic_group_filtering="all_equal")
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 2 + [{"prompt": PROMPTS[1]}] * 2)
    assert output["kept_rows"].tolist() == [0.0, 0.0, 1.0, 1.0]
    output["old_per_token_logps"] = torch.zeros_like(output["completion_mask"])  # every ratio below 1 - epsilon
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    trainer.compute_loss(trainer.model, output)
    metrics = trainer._metrics["train"]
    assert metrics["clip_ratio/low_mean"][-1] == 0.5  # the kept row of negative advantage
    assert metrics["clip_ratio/low_min"][-1] == 0.0
    assert metrics["clip_ratio/high_max"][-1] == 0.0


def test_sequence_level_clip_ratios_with_a_value_model_are_token_means_over_the_kept_rows(tmp_path):
    """With a value model the advantages are per token, so TRL's clip ratios are token means over the loss weights
    even at importance_sampling_level='sequence' (a filtered group's tokens weigh nothing), not per-row means."""
    trainer = make_trainer(tmp_path, reward=scripted([1.0, 1.0, 0.0, 1.0]), num_generations=2,
                           importance_sampling_level="sequence", loss_type="grpo", dynamic_group_filtering="all_equal",
                           value_model=DiffusionValueModel.from_policy(tiny_model("sdar")))
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 2 + [{"prompt": PROMPTS[1]}] * 2)
    output["old_per_token_logps"] = torch.zeros_like(output["completion_mask"])  # every ratio below 1 - epsilon
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    trainer.compute_loss(trainer.model, output)
    weights, negative = output["completion_mask"].double(), (output["advantages"] < 0).double()
    expected = float((weights * negative).sum() / weights.sum())
    assert 0.0 < expected < 1.0 and output["kept_rows"].tolist() == [0.0, 0.0, 1.0, 1.0]
    assert trainer._metrics["train"]["clip_ratio/low_mean"][-1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("bias_correction", [False, True])
def test_summed_kl_of_a_micro_batch_takes_trls_normaliser_and_bias_correction(tmp_path, bias_correction):
    """``kl_weighting='row_sum'``: sum(k3 x kl_weights) over TRL's tracerl / dapo normaliser for one micro-batch of a
    generation batch split in ``steps_per_generation`` (rows / processes x accumulation / steps_per_generation: half of
    the generation batch's 4 rows here; all of them in evaluation), times pi / pi_old with
    ``use_bias_correction_kl``."""
    trainer = make_trainer(tmp_path, per_device_train_batch_size=2, num_generations=2, steps_per_generation=2,
                           beta=0.1, kl_weighting="row_sum", use_bias_correction_kl=bias_correction)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    logps = torch.full((2, 3), -1.0)
    inputs = {"scored_logps": logps, "ref_per_token_logps": torch.zeros(2, 3), "old_per_token_logps": logps - 1.0,
              "completion_mask": torch.ones(2, 3), "kl_weights": torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
              "num_items_in_batch": torch.tensor(4.0)}
    k3 = torch.e - 2.0  # exp(1) - 1 - 1 per token
    factor = torch.e if bias_correction else 1.0
    assert trainer._summed_kl(inputs).item() == pytest.approx(3 * k3 * factor / 2, rel=1e-6)
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(k3 * factor, rel=1e-6)
    trainer.model.eval()  # evaluation accumulates nothing: the whole batch's rows
    assert trainer._summed_kl(inputs).item() == pytest.approx(3 * k3 * factor / 4, rel=1e-6)
    # every group filtered: no weight and no training row, a KL term of 0 (not 0 / 0)
    filtered = {**inputs, "completion_mask": torch.zeros(2, 3), "kl_weights": torch.zeros(2, 3),
                "num_items_in_batch": torch.tensor(0.0)}
    assert trainer._summed_kl(filtered).item() == 0.0


def test_an_evaluation_restores_pythons_and_numpys_random_states(tmp_path):
    """A reward function drawing from ``random`` / ``numpy.random`` in evaluation leaves the training run's streams
    as they were: ``evaluate()`` restores both global states (and torch's) after it."""
    import random

    import numpy as np

    def noisy(completions, **kwargs):
        return [random.random() + float(np.random.rand()) for _ in completions]

    trainer = make_trainer(tmp_path, reward=noisy, per_device_eval_batch_size=4,
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:1]}))
    random.seed(1)
    np.random.seed(1)
    python, numpy_state = random.getstate(), np.random.get_state()
    trainer.evaluate()
    assert random.getstate() == python
    restored = np.random.get_state()
    assert restored[0] == numpy_state[0] and np.array_equal(restored[1], numpy_state[1])
    assert restored[2:] == numpy_state[2:]


def test_an_evaluation_starts_without_the_metrics_of_one_that_failed(tmp_path):
    """An evaluation that raised part-way (a reward function failing at its second batch) leaves metrics behind: the
    next evaluation reports its own rows only."""
    calls = []

    def failing_then_zero(completions, **kwargs):
        calls.append(len(completions))
        if len(calls) == 2:
            raise RuntimeError("scorer unavailable")
        return [1.0 if len(calls) == 1 else 0.0] * len(completions)

    trainer = make_trainer(tmp_path, reward=failing_then_zero, per_device_eval_batch_size=4,
                           eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:2]}))
    with pytest.raises(RuntimeError, match="scorer unavailable"):
        trainer.evaluate()
    assert trainer.evaluate()["eval_reward"] == 0.0


# ------------------------------------------------------------------------------------------------ value model
def test_an_evaluation_does_not_train_the_value_model(tmp_path):
    """Evaluation rollouts get GAE advantages from the value model but never update it, nor count as its batches."""
    trainer = make_trainer(tmp_path, value_model=DiffusionValueModel.from_policy(tiny_model("sdar")),
                           per_device_eval_batch_size=4, eval_dataset=Dataset.from_dict({"prompt": PROMPTS[:1]}))
    before = [p.detach().clone() for p in trainer.value_model.parameters()]
    metrics = trainer.evaluate()
    assert any(key.startswith("eval_value/") for key in metrics)
    assert "eval_value/loss" not in metrics and trainer._value_batches == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.value_model.parameters(), strict=True))
    assert not trainer.value_optimizer.state


def test_value_model_takes_one_step_when_a_generation_batch_spans_several_optimizer_steps(tmp_path):
    """With ``steps_per_generation`` below ``gradient_accumulation_steps`` (several generation batches per policy
    step) and no ``value_batch_size``, the value model still takes one step per generation batch."""
    trainer = make_trainer(tmp_path, value_model=DiffusionValueModel.from_policy(tiny_model("sdar")),
                           per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=1,
                           value_batch_size=None, reward=scripted([0.0, 1.0, 1.0, 0.0]))
    before = [p.detach().clone() for p in trainer.value_model.parameters()]
    trainer.train()
    assert trainer._value_batches == 2 and "value/loss" in trainer.state.log_history[0]
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.value_model.parameters(), strict=True))


# ------------------------------------------------------------------------------------------------ saving
def test_a_policy_built_in_memory_saves_the_rollout_sampler_where_from_pretrained_reads_it(tmp_path):
    """A policy built in memory has a generation config derived from its model config; the saved copy is marked as
    not derived, so ``GenerationConfig.from_pretrained`` keeps the diffusion sampler fields written into it."""
    from transformers import GenerationConfig

    trainer = make_trainer(tmp_path, denoising_steps=3, temperature=0.7, top_k=5)
    assert trainer.model.generation_config._from_model_config
    trainer.save_model(str(tmp_path / "saved"))
    loaded = GenerationConfig.from_pretrained(tmp_path / "saved")
    assert (loaded.block_length, loaded.denoising_steps, loaded.temperature, loaded.top_k) == (4, 3, 0.7, 5)
    assert trainer.model.generation_config._from_model_config  # the policy's own config is left as it was


@pytest.mark.parametrize("strategy", ["low_confidence_static", "low_confidence_dynamic"])
def test_the_card_names_the_confidence_threshold_only_for_the_dynamic_strategy(tmp_path, strategy):
    """The card's quick start passes the rollout sampler; ``confidence_threshold`` is named only where the remasking
    strategy reads it."""
    trainer = make_trainer(tmp_path, remasking_strategy=strategy, confidence_threshold=0.7,
                           save_rollout_generation_config=False)
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    call = card.split("generator([")[1].split("\n")[0]
    assert f"remasking_strategy={strategy!r}" in call
    assert ("confidence_threshold=0.7" in call) == (strategy == "low_confidence_dynamic")


def test_save_only_model_checkpoints_hold_the_value_model_weights_only_and_the_best_model_reads_them(tmp_path):
    """``save_only_model=True`` saves the value model's weights but, as transformers does for the policy, neither its
    optimizer nor the synced reference; ``load_best_model_at_end`` still restores the value model from such a
    checkpoint. A full checkpoint holds all of them."""
    for only_model in (True, False):
        out = tmp_path / str(only_model)
        trainer = make_trainer(out, value_model=DiffusionValueModel.from_policy(tiny_model("sdar")),
                               save_strategy="steps", save_steps=1, save_only_model=only_model, beta=0.1,
                               kl_reference="reference_model", sync_ref_model=True, ref_model_sync_steps=1)
        trainer.train()
        checkpoint = out / "checkpoint-1"
        assert (checkpoint / "value_model").is_dir()
        for name in ("value_state.pt", "optimizer.pt", REFERENCE_STATE_NAME):
            assert (checkpoint / name).exists() == (not only_model), name
    best = tmp_path / "True" / "checkpoint-1"
    saved = load_file(best / "value_model" / "model.safetensors")
    value = trainer.accelerator.unwrap_model(trainer.value_model)
    with torch.no_grad():
        for p in value.parameters():
            p.add_(1.0)
    trainer.state.best_model_checkpoint = str(best)
    trainer._load_best_model()
    assert all(torch.equal(p, saved[name]) for name, p in value.named_parameters())


def test_value_updates_start_from_cleared_gradients(tmp_path):
    """Gradients a value update interrupted by an exception left on the value model do not enter the next update."""
    models = []
    for leftover in (False, True):
        value = DiffusionValueModel.from_policy(tiny_model("sdar"))
        trainer = make_trainer(tmp_path / str(leftover), value_model=value, reward=scripted([0.0, 1.0, 1.0, 0.0]),
                               value_learning_rate=1e-2)
        if leftover:
            for p in trainer.value_model.parameters():
                p.grad = torch.ones_like(p)
        trainer.train()
        models.append(torch.cat([p.detach().flatten() for p in trainer.value_model.parameters()]))
    initial = DiffusionValueModel.from_policy(tiny_model("sdar")).parameters()
    initial = torch.cat([p.detach().flatten() for p in initial])
    assert (models[0] - initial).abs().max() > 0
    torch.testing.assert_close(models[1], models[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["sapo", "luspo"])
def test_sapo_and_luspo_leave_filtered_rows_out_of_their_row_mean(tmp_path, loss_type):
    """TRL's sapo and luspo average over the rows of a micro-batch: with one of two groups filtered, the loss is that
    of the kept group's rows alone (the filtered rows do not halve it)."""
    trainer = make_trainer(tmp_path, reward=scripted([1.0, 1.0, 0.0, 1.0]), num_generations=2, loss_type=loss_type,
                           dynamic_group_filtering="all_equal")
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 2 + [{"prompt": PROMPTS[1]}] * 2)
    output["old_per_token_logps"] = torch.zeros_like(output["completion_mask"])  # ratios away from 1: a loss
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    full = trainer.compute_loss(trainer.model, output)
    alone = {name: value[2:] if torch.is_tensor(value) and value.dim() else value for name, value in output.items()}
    alone["kept_row_scale"] = torch.tensor(1.0)
    kept = trainer.compute_loss(trainer.model, alone)
    assert output["kept_rows"].tolist() == [0.0, 0.0, 1.0, 1.0] and kept.abs() > 1e-3
    torch.testing.assert_close(full, kept, rtol=1e-5, atol=1e-7)


def test_a_batch_without_its_trajectories_is_refused_when_scored(tmp_path):
    """The trainer scores the trajectories attached to the batch: a batch of other rows is refused, not scored with
    another batch's trajectories."""
    trainer = make_trainer(tmp_path)
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"].gt(0).long()], 1)
    width = output["completion_ids"].shape[1]
    with pytest.raises(RuntimeError, match="scores completions from their recorded trajectories; none are attached"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids[:2], mask[:2], width)


def test_the_sampler_gap_is_taken_over_the_tokens_in_the_loss_only(tmp_path):
    """``rollout/sampler_logp_gap`` averages |trainer log-prob - sampler log-prob| over committed tokens that are in
    the loss: tokens of rows ``mask_truncated_completions`` leaves out, or after a stop token, do not count."""
    trainer = make_trainer(tmp_path, model=tiny_model("llada").train(), mask_truncated_completions=True,
                           scoring_temperature=0.5)
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    stash, score = {}, trainer._get_per_token_logps_and_entropies

    def keep(*args, **kwargs):
        result = score(*args, **kwargs)
        stash.setdefault("logps", result[0])
        return result

    trainer._get_per_token_logps_and_entropies = keep
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    trainer.compute_loss(trainer.model, output)
    width = stash["logps"].shape[1]
    committed = output["unmask_step"][:, :width] >= 0
    trained = committed & (output["completion_mask"] > 0)
    gap = (stash["logps"].detach() - output["sampler_logps"][:, :width]).abs()
    assert trained.any() and (committed & ~trained).any()
    expected = float(gap[trained].mean())
    assert abs(float(gap[committed].mean()) - expected) > 1e-3  # the tokens out of the loss would move it
    assert trainer._metrics["train"]["rollout/sampler_logp_gap"][-1] == pytest.approx(expected, rel=1e-5)
