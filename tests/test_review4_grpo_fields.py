"""Regression tests from a review of TRL's GRPOConfig fields under TraceRLConfig / TraceRLTrainer: each field either
works as in TRL with diffusion rollouts and scoring, or is refused when the config or trainer is built."""

import math

import pytest
import torch
from datasets import Dataset
from transformers import GenerationConfig

from trl_diffusion.generation import mixin
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import GRPO_LOSS_TYPES, TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer


def odd_distinct(completions, **kwargs):
    """A 0/1 reward that differs within groups of the tiny models' completions."""
    return [float(len(set(c)) % 2) for c in completions]


def make_trainer(tmp_path, family="sdar", model=None, **overrides) -> TraceRLTrainer:
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=8,
                  max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
                  dynamic_group_filtering="none")
    config.update(overrides)
    dataset = Dataset.from_dict({"prompt": ["abc", "wxyz1"] * 4})
    model = model if model is not None else tiny_model(family).train()
    return TraceRLTrainer(model, odd_distinct, args=TraceRLConfig(**config), train_dataset=dataset,
                          processing_class=build_tokenizer())


def test_rollouts_follow_the_config_not_the_checkpoints_generation_config(tmp_path, monkeypatch):
    # TraDo's generation_config.json holds Qwen3's top_k 20 / top_p 0.95. TraceRLConfig's top_k=0 / top_p=1.0 (TRL's
    # "off", and dLLM-RL's settings in from_official("trado")) reached generate() as None, which reads the checkpoint's
    # values: rollouts were filtered (here top_k 2: sampler log-prob gap 1.2 instead of 0) although nothing asked
    model = tiny_model("sdar").train()
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.6, top_k=2, top_p=0.95, alg_temp=0.5,
                                               cfg_scale=1.5)
    resolved = []
    original = mixin.DiffusionGenerationMixin._resolve_settings

    def spy(self, kwargs, prompt_width=0):
        settings, as_dict = original(self, kwargs, prompt_width)
        resolved.append(settings)
        return settings, as_dict

    monkeypatch.setattr(mixin.DiffusionGenerationMixin, "_resolve_settings", spy)
    trainer = make_trainer(tmp_path, model=model)
    trainer.train()
    assert resolved
    for settings in resolved:
        assert settings.temperature == 1.0 and not settings.top_k and settings.top_p in (None, 1.0)
        assert not settings.alg_temp and not settings.cfg_scale
    assert trainer.state.log_history[0]["rollout/sampler_logp_gap_exact"] < 1e-4


@pytest.mark.parametrize("normalization", ["step", "max_length"])
def test_top_entropy_quantile_keeps_its_fraction_of_the_trained_tokens(tmp_path, normalization):
    # the completion mask TRL hands to get_high_entropy_mask carries the loss weights; TRL compared entropy * weight
    # with the quantile of the raw entropies, so top_entropy_quantile=0.5 kept 4 of 128 tokens under 'step' weights
    # and none under 'max_length' (1/L_max): the loss was 0 and nothing was learned
    trainer = make_trainer(tmp_path, top_entropy_quantile=0.5, step_normalization=normalization,
                           max_completion_length=16)
    calls = []
    original = trainer.get_high_entropy_mask

    def spy(entropies, mask, threshold):
        kept = original(entropies, mask, threshold)
        calls.append((kept, mask))
        return kept

    trainer.get_high_entropy_mask = spy
    trainer.train()
    assert calls
    for kept, mask in calls:
        trained = mask > 0
        assert not bool((mask[trained] == 1).all())  # the weights are not 0/1: the case that went wrong
        assert not bool((kept & ~trained).any())
        assert int(kept.sum()) >= int(trained.sum()) // 2  # entropy >= the median: at least half of them


@pytest.mark.parametrize("field,value", [("neftune_noise_alpha", 5.0), ("label_smoothing_factor", 0.1),
                                         ("use_liger_kernel", True)])
def test_training_arguments_the_policy_loss_cannot_apply_are_refused(tmp_path, field, value):
    # both were accepted: NEFTune noised rollouts and scoring independently (tiny LLaDA: sampler log-prob gap 1.64
    # nats instead of 0), and label smoothing changed nothing
    with pytest.raises(ValueError, match=field):
        TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **{field: value})


GRPO_SETTINGS = [*({"loss_type": loss_type} for loss_type in GRPO_LOSS_TYPES),
                 {"loss_type": "grpo", "importance_sampling_level": "sequence"}, {"epsilon_high": 0.28},
                 {"delta": 1.5}, {"scale_rewards": "batch"}, {"scale_rewards": "none"}, {"entropy_coef": 0.01},
                 {"entropy_coef": 0.01, "use_adaptive_entropy": True}, {"top_entropy_quantile": 0.5}]


@pytest.mark.parametrize("setting", GRPO_SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_trls_loss_settings_train_on_diffusion_scores(tmp_path, setting):
    """docs/tracerl.md lists these GRPOConfig fields as working as in TRL: TRL's loss reads the diffusion scores
    (two iterations on one generation batch, so the second has a ratio other than 1 to clip); each step must give a
    finite loss and move the policy."""
    trainer = make_trainer(tmp_path, num_iterations=2, max_steps=2, **setting)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert any(not torch.equal(before[n], p.detach()) for n, p in trainer.model.named_parameters())


def test_mask_truncated_completions_leaves_out_rows_without_a_stop_token(tmp_path):
    """``mask_truncated_completions`` zeroes the loss weights of every completion that reached
    ``max_completion_length`` without a stop token, and only of those (the diffusion loss weights must not undo
    TRL's masking, nor mask a row that stopped). The random tiny model never emits EOS, so a token its first
    rollout drew (row 0's third) is made a stop token too: rows holding it stop, the others are truncated."""
    trainer = make_trainer(tmp_path, mask_truncated_completions=True, max_completion_length=8)
    prompts = [{"prompt": "abc"}] * 4 + [{"prompt": "wxyz1"}] * 4
    drawn = trainer._generate_and_score_completions(prompts)["completion_ids"][0, 2].item()
    trainer.eos_token_ids = [*trainer.eos_token_ids, drawn]
    output = trainer._generate_and_score_completions(prompts)
    pad = trainer.processing_class.pad_token_id
    stopped = torch.tensor([ids[ids != pad][-1].item() in trainer.eos_token_ids for ids in output["completion_ids"]])
    assert stopped.any() and not stopped.all()
    assert torch.equal(output["completion_mask"].sum(1) > 0, stopped)


def test_entropy_bonus_with_group_filtering_is_refused_where_filtered_micro_batches_dilute_it(tmp_path):
    """TRL's entropy bonus is each micro-batch's mean entropy / gradient_accumulation_steps: a micro-batch whose rows
    were all filtered adds 0 yet counts, so under accumulation the bonus shrank with the kept fraction (0.55 of
    entropy_coef at batch 1 x accumulation 8, half the groups filtered). Row-mean losses are refused whatever the
    accumulation (their row rescaling would rescale the bonus); one process without accumulation trains."""
    filtering = {"entropy_coef": 0.01, "dynamic_group_filtering": "all_equal"}
    with pytest.raises(ValueError, match="entropy bonus with group filtering.*gradient_accumulation_steps=2"):
        make_trainer(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4, **filtering)
    with pytest.raises(ValueError, match="entropy bonus with loss_type='grpo'"):
        make_trainer(tmp_path, loss_type="grpo", **filtering)
    # with accumulation the accumulation check speaks first: its advice works, "use loss_type 'tracerl'" would not
    with pytest.raises(ValueError, match="entropy bonus with group filtering.*gradient_accumulation_steps=2"):
        make_trainer(tmp_path, loss_type="grpo", gradient_accumulation_steps=2, per_device_train_batch_size=4,
                     **filtering)
    make_trainer(tmp_path, gradient_accumulation_steps=2, per_device_train_batch_size=4, entropy_coef=0.01)
    make_trainer(tmp_path, use_adaptive_entropy=True, **filtering).train()
