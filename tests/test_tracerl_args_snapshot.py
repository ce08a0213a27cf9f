"""TraceRLTrainer reads its sampling and scoring fields once, when it is built, after checking them again.

Before: the config's checks ran only in ``TraceRLConfig.__post_init__``, so a field set on the config afterwards
(``args.top_p = None``, ``args.temperature = 0.0``, ``args.repetition_penalty = 1.5``) trained silently; and the
rollout sampler read ``self.args`` at every rollout while the scoring settings were copied at construction, so a
callback changing ``args.temperature`` or ``args.block_length`` made rollouts sample a distribution the trainer
did not score (``sampler_logp_gap_exact`` 1.02 / 1.06 instead of ~1e-6, with the PPO ratio still 1)."""

import math
import warnings

import pytest
from datasets import Dataset
from transformers import TrainerCallback

from trl_diffusion.scripts.utils import checkpointing_off
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]
BASE = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=12, max_steps=1,
            logging_steps=1, report_to="none", learning_rate=0.0, block_length=4, denoising_steps=2,
            save_strategy="no", use_cpu=True, disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none",
            temperature=1.0, **checkpointing_off())


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) / 10 for c in completions]


def make_trainer(args: TraceRLConfig, callbacks=()) -> TraceRLTrainer:
    return TraceRLTrainer(tiny_model("sdar").train(), distinct_chars, args=args, processing_class=build_tokenizer(),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=list(callbacks))


REFUSED = [("top_p", None), ("temperature", 0.0), ("repetition_penalty", 1.5), ("min_p", 0.3),
           ("generation_kwargs", {"no_repeat_ngram_size": 2}), ("denoising_steps", 8),
           ("likelihood_estimator", "exact"), ("scoring_temperature", math.nan)]


@pytest.mark.parametrize("name,value", REFUSED, ids=[name for name, _ in REFUSED])
def test_a_field_set_after_the_config_is_refused_by_the_trainer_as_at_construction(tmp_path, name, value):
    """The trainer re-runs the config's checks: the same error as passing the value to ``TraceRLConfig``."""
    with pytest.raises(ValueError) as at_construction:
        TraceRLConfig(output_dir=str(tmp_path), **{**BASE, name: value})
    args = TraceRLConfig(output_dir=str(tmp_path), **BASE)
    setattr(args, name, value)
    with pytest.raises(ValueError) as at_trainer:
        make_trainer(args)
    assert str(at_trainer.value) == str(at_construction.value)


def test_a_valid_field_set_before_the_trainer_is_what_it_samples_and_scores_with(tmp_path):
    """As scripts/tracerl_arithmetic.py sets ``likelihood_estimator`` on parsed arguments: a valid value set before
    the trainer is built is the one it uses, for the rollouts and the scoring alike."""
    args = TraceRLConfig(output_dir=str(tmp_path), **BASE)
    args.likelihood_estimator, args.temperature, args.block_length = "random_masking", 0.5, 8
    trainer = make_trainer(args)
    sampler = trainer._rollout_sampler()
    assert trainer.estimator_settings.name == "random_masking"
    assert sampler["temperature"] == trainer.estimator_settings.temperature == 0.5
    assert sampler["block_length"] == trainer.estimator_settings.rollout_block_length == 8


def test_check_is_idempotent_and_derives_nothing(tmp_path):
    """``check()`` may run any number of times: a second run changes no field (the canonical forms written at
    construction stay as they are) and warns nothing (the training_block_size warning is construction's)."""
    with pytest.warns(UserWarning, match="training_block_size=6 is not a multiple"):
        args = TraceRLConfig(output_dir=str(tmp_path), **{**BASE, "rollout_cache": "true", "scale_rewards": "false",
                                                          "dynamic_group_filtering": True, "training_block_size": 6,
                                                          "chat_template_kwargs": '{"enable_thinking": false}'})
    before = dict(vars(args))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args.check()
        args.check()
    assert vars(args) == before
    assert (args.rollout_cache, args.scale_rewards, args.dynamic_group_filtering) == (True, "none", "all_equal")
    assert args.chat_template_kwargs == {"enable_thinking": False}


class SetArgs(TrainerCallback):
    """Changes sampling fields on the trainer's arguments before the first step (e.g. a temperature schedule)."""

    def __init__(self, **values):
        self.values = values

    def on_step_begin(self, args, state, control, **kwargs):
        for name, value in self.values.items():
            setattr(args, name, value)


@pytest.mark.parametrize("values", [{"temperature": 0.5}, {"block_length": 8, "denoising_steps": 4}],
                         ids=["temperature", "block_length"])
def test_a_callback_changing_sampling_fields_cannot_split_sampling_from_scoring(tmp_path, values):
    """Rollouts keep the settings the trainer was built with, as its scoring does (TRL copies its sampling fields
    once too): the scored log-probs of each token are the sampler's, to float32 noise."""
    args = TraceRLConfig(output_dir=str(tmp_path), **BASE)
    trainer = make_trainer(args, callbacks=[SetArgs(**values)])
    built = trainer._rollout_sampler()
    trainer.train()
    assert all(getattr(trainer.args, name) == value for name, value in values.items())  # the callback ran
    gaps = [entry["rollout/sampler_logp_gap_exact"] for entry in trainer.state.log_history
            if "rollout/sampler_logp_gap_exact" in entry]
    scale = max(1.0, float(trainer._scoring["sampler_logps"].abs().max()))
    assert gaps and max(gaps) <= 1e-5 * scale  # a split measured 1.02 (temperature) and 1.06 (block_length)
    assert trainer._rollout_sampler() == built
    assert trainer._rollout_generation_config().temperature == 1.0  # what a saved model's config would hold
