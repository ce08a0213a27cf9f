"""Review round 3, what the trainers hand to the user: saved outputs, checkpoints, model cards, callbacks."""

import re
import subprocess
import sys

import pytest
import torch
from datasets import Dataset

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

CPU = dict(report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no")


def quick_start(card: str) -> str:
    return re.search(r"## Quick start\n\n```python\n(.*?)```", card, re.S).group(1)


def run_fresh(code: str) -> str:
    """Run ``code`` in a new interpreter (nothing of trl_diffusion imported unless the code imports it)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def length_reward(completions, **kwargs):
    return [len(c) / 10 for c in completions]


@pytest.mark.slow  # a fresh interpreter
def test_tracerl_card_quick_start_runs_and_samples_as_the_rollouts(tmp_path):
    """TRL's quick start (a bare transformers pipeline) failed on every diffusion checkpoint: the model type is only
    known after `import trl_diffusion`. The card's code now runs as written, with the rollout sampler settings."""
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, block_length=4, denoising_steps=2, temperature=0.7, top_k=5,
                         gradient_checkpointing=False, **CPU)
    trainer = TraceRLTrainer(tiny_model("sdar"), length_reward, args=args, processing_class=build_tokenizer(),
                             train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 4}))
    trainer.save_model()
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    code = quick_start(card)
    assert ("max_new_tokens=8, block_length=4, denoising_steps=2, remasking_strategy='low_confidence_dynamic', "
            "confidence_threshold=0.9, temperature=0.7, top_k=5, top_p=1.0, use_cache=True") in code
    assert "- trl_diffusion: " in card and "2509.06949" in card
    run_fresh(code.replace('device_map="auto"', 'device_map="cpu"'))


@pytest.mark.slow  # a fresh interpreter
def test_value_card_quick_start_loads_the_value_model(tmp_path):
    """A value model's card offered a text-generation pipeline, which cannot load it; it now loads it as a value
    model, and the loaded weights are the trained ones."""
    value = DiffusionValueModel.from_policy(tiny_model("llada", seed=3))
    with torch.no_grad():
        value.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    rows = {"prompt": ["ab"], "completion_ids": [[5, 6]], "unmask_step": [[0, 1]], "reward": [1.0]}
    trainer = DiffusionValueTrainer(value, args=DiffusionValueConfig(output_dir=str(tmp_path), **CPU),
                                    train_dataset=Dataset.from_dict(rows), processing_class=build_tokenizer())
    trainer.save_model()
    trainer.create_model_card(model_name="tiny-value")
    code = quick_start((tmp_path / "README.md").read_text())
    assert "pipeline" not in code
    head = value.value_head.weight.flatten()[:3].tolist()
    out = run_fresh(code + "print(value_model.value_head.weight.flatten()[:3].tolist())\n")
    assert [float(x) for x in out.strip().strip("[]").split(",")] == head


def test_sft_card_quick_start_registers_the_models(tmp_path):
    args = DiffusionSFTConfig(output_dir=str(tmp_path), **CPU)
    trainer = DiffusionSFTTrainer(tiny_model("dream"), args=args, processing_class=build_tokenizer(),
                                  train_dataset=Dataset.from_dict({"prompt": ["1+2="], "completion": ["3"]}))
    trainer.create_model_card(model_name="tiny")
    code = quick_start((tmp_path / "README.md").read_text())
    assert code.index("import trl_diffusion") < code.index("from transformers import pipeline")
    assert "max_new_tokens=128, return_full_text=False" in code
