"""A model saved by TraceRLTrainer carries the rollout sampler in its generation_config.json: ``from_pretrained(saved)
.generate(prompt)`` with no arguments decodes exactly as a rollout with the trained settings (the released configs,
e.g. SDAR's Qwen3 sampling defaults or Dream's ``alg``/``steps``, would otherwise apply), while the policy's
in-memory generation_config, which evaluation during training reads, stays as it was."""

import json
import logging

import peft
import pytest
import torch
import transformers
from datasets import Dataset
from packaging import version
from test_review2_loading import write_released
from transformers import AutoModelForCausalLM, GenerationConfig

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, left_pad

PROMPTS = [[15, 19, 24, 17, 30], [40, 18, 13], [21, 22, 23, 24, 25, 26, 27], [60, 61]]
CPU = dict(report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, gradient_checkpointing=False, seed=0,
           per_device_train_batch_size=4, num_generations=4, dynamic_group_filtering="none")
# per family: rollout settings that differ from the released generation_config.json and from generate()'s defaults
SAMPLERS = {
    "sdar": dict(max_completion_length=8, block_length=4, denoising_steps=2,
                 remasking_strategy="low_confidence_dynamic", confidence_threshold=0.7, temperature=0.7, top_k=5,
                 top_p=0.9, rollout_cache=True),
    "llada": dict(max_completion_length=8, block_length=4, denoising_steps=4, remasking_strategy="random",
                  temperature=1.3, top_k=0, top_p=0.8, rollout_cache="prefix"),
    "dream": dict(max_completion_length=8, block_length=2, denoising_steps=1, remasking_strategy="entropy",
                  temperature=0.8, top_k=10, top_p=1.0, rollout_cache="dual"),
}


def length_reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def released_trainer(tmp_path, family: str, peft_config=None, **overrides) -> TraceRLTrainer:
    """A trainer on a released-format checkpoint of ``family`` (its released generation_config.json included)."""
    write_released(family, tmp_path / "released")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "released")
    args = TraceRLConfig(output_dir=str(tmp_path / "out"), **{**CPU, "save_strategy": "no", **SAMPLERS[family],
                                                               **overrides})
    return TraceRLTrainer(model, length_reward, args=args, processing_class=build_tokenizer(),
                          train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 4}), peft_config=peft_config)


def explicit_rollout_settings(trainer) -> dict:
    """The rollout's sampler as explicit generate() arguments, written out from the config (not from the trainer's
    own helper, which this test checks)."""
    args = trainer.args
    return dict(max_new_tokens=args.max_completion_length, block_length=args.block_length,
                denoising_steps=args.denoising_steps, remasking_strategy=args.remasking_strategy,
                confidence_threshold=args.confidence_threshold, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, use_cache=args.rollout_cache, stop_token_ids=list(trainer.eos_token_ids),
                pad_token_id=trainer.processing_class.pad_token_id)


class Warnings(logging.Handler):
    """Collects transformers' warnings (its loggers do not propagate to the root logger)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())

    def __enter__(self):
        logging.getLogger("transformers").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("transformers").removeHandler(self)


def sample(model, seed: int | None, **kwargs) -> torch.Tensor:
    ids, mask = left_pad(PROMPTS)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return model.generate(ids, attention_mask=mask, generator=generator, **kwargs)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_saved_model_samples_as_the_rollouts_without_arguments(tmp_path, family):
    trainer = released_trainer(tmp_path, family)
    policy = trainer.model
    before = policy.generation_config.to_dict()
    with Warnings() as caught:
        trainer.save_model()
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert caught.messages == []
    assert policy.generation_config.to_dict() == before  # training and evaluation read it: unchanged
    explicit = explicit_rollout_settings(trainer)
    for seed in (0, 1):
        expected = sample(policy, seed, **explicit)
        assert torch.equal(sample(loaded, seed), expected)
        # the released config decodes otherwise (at the rollout's length: tokens are compared, not lengths)
        assert not torch.equal(sample(policy, seed, max_new_tokens=explicit["max_new_tokens"]), expected)
    saved = GenerationConfig.from_pretrained(tmp_path / "out")
    saved.validate(strict=True)  # no issue transformers would warn about
    assert saved.do_sample is True and saved.stop_token_ids == explicit["stop_token_ids"]
    assert getattr(saved, "alg", None) is None and getattr(saved, "steps", None) is None


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_greedy_call_decodes_with_the_trained_block_settings(tmp_path, family):
    """TraceRL's rollouts sample (its temperature is > 0), so the saved config samples; a greedy evaluation passes
    temperature=0 (or do_sample=False), which wins over the config, and keeps the trained block settings."""
    trainer = released_trainer(tmp_path, family)
    trainer.save_model()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    # (a generator for LLaDA's `random` commit order; greedy tokens need none)
    expected = sample(trainer.model, 0, **{**explicit_rollout_settings(trainer), "temperature": 0.0})
    assert torch.equal(sample(loaded, 0, temperature=0.0), expected)
    assert torch.equal(sample(loaded, 0, do_sample=False), expected)
    length = trainer.args.max_completion_length  # the released config's blocks, at the same length
    assert not torch.equal(sample(trainer.model, 0, temperature=0.0, max_new_tokens=length), expected)


def test_rollouts_use_the_saved_sampler(tmp_path):
    """The trainer's rollouts and the saved config come from one list of arguments: the rollout's tokens are those
    of the saved model's generate() with the rollout's per-row generators."""
    trainer = released_trainer(tmp_path, "sdar")
    trainer.save_model()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    captured = {}
    generate = trainer.model.generate

    def spy(*args, **kwargs):
        captured.update(kwargs)
        return generate(*args, **kwargs)

    trainer.model.generate = spy
    trainer._generate_single_turn(PROMPTS, None, None, 1)
    rollout_only = {"cuda_graphs", "return_dict_in_generate", "generator"}
    assert {k: v for k, v in captured.items() if k not in rollout_only} == {
        k: getattr(loaded.generation_config, k) for k in captured if k not in rollout_only}


def test_checkpoints_carry_the_sampler_and_training_keeps_the_config(tmp_path):
    trainer = released_trainer(tmp_path, "sdar", max_steps=1, save_strategy="steps", save_steps=1)
    before = trainer.model.generation_config.to_dict()
    trainer.train()
    assert trainer.model.generation_config.to_dict() == before
    saved = json.loads((tmp_path / "out" / "checkpoint-1" / "generation_config.json").read_text())
    assert {k: saved[k] for k in ("block_length", "denoising_steps", "temperature", "top_k", "top_p")} == dict(
        block_length=4, denoising_steps=2, temperature=0.7, top_k=5, top_p=0.9)


def test_opting_out_keeps_the_generation_config(tmp_path):
    trainer = released_trainer(tmp_path, "sdar", save_rollout_generation_config=False)
    trainer.save_model()
    saved = json.loads((tmp_path / "out" / "generation_config.json").read_text())
    assert "block_length" not in saved and (saved["temperature"], saved["top_k"]) == (0.6, 20)  # Qwen3's
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "block_length=4, denoising_steps=2, " in card.split("generator([")[1]  # passed to the pipeline


def test_peft_adapter_folder_carries_the_sampler(tmp_path):
    """peft does not read an adapter folder's generation_config.json; passed to generate() it samples as the
    rollouts did (docs/tracerl.md)."""
    trainer = released_trainer(tmp_path, "sdar", peft_config=peft.LoraConfig(r=4, lora_alpha=8))
    policy = trainer.model
    assert isinstance(policy, peft.PeftModel)
    with torch.no_grad():  # a fresh adapter is the identity
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(generator=torch.Generator().manual_seed(1))
    trainer.save_model()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "released")
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "out")
    config = GenerationConfig.from_pretrained(tmp_path / "out")
    expected = sample(policy, 0, **explicit_rollout_settings(trainer))
    assert torch.equal(sample(loaded, 0, generation_config=config), expected)


def test_only_the_writing_process_writes(tmp_path, monkeypatch):
    trainer = released_trainer(tmp_path, "sdar")
    monkeypatch.setattr(type(trainer.args), "should_save", property(lambda self: False))
    trainer._save(str(tmp_path / "other"))
    written = tmp_path / "other" / "generation_config.json"
    if version.parse(transformers.__version__) >= version.parse("5.24"):
        assert not written.exists()
    else:  # transformers' own _save wrote the policy's config on any process (its save_model asks should_save)
        saved = GenerationConfig.from_pretrained(written.parent).to_diff_dict()
        assert saved == trainer.model.generation_config.to_diff_dict()
        assert saved != trainer._rollout_generation_config().to_diff_dict()


def test_card_names_the_saved_sampler(tmp_path):
    trainer = released_trainer(tmp_path, "sdar")
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "out" / "README.md").read_text()
    call = card.split("generator([")[1].split("\n")[0]
    assert "block_length" not in call  # generation_config.json holds it
    comment = " ".join(line[2:] for line in card.splitlines() if line.startswith("# "))
    assert ("max_new_tokens=8, block_length=4, denoising_steps=2, remasking_strategy='low_confidence_dynamic', "
            "confidence_threshold=0.7, temperature=0.7, top_k=5, top_p=0.9, use_cache=True") in comment
