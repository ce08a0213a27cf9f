"""Review round 2 of the diffusion value model and its use in TraceRL: GAE against a slow float64 transcription of
dLLM-RL's definitions, the dtype a value model is trained in, and settings that silently did nothing."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def tracerl(tmp_path, model, value_model, **overrides) -> TraceRLTrainer:
    config = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, report_to="none", block_length=4, denoising_steps=2,
                  save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
                  dynamic_group_filtering="none")
    config.update(overrides)
    return TraceRLTrainer(model, distinct_chars, args=TraceRLConfig(**config),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer(),
                          value_model=value_model)


# ------------------------------------------------------------------------------------------------ dtype


@pytest.fixture
def bf16_checkpoint(tmp_path):
    """A policy checkpoint saved in bfloat16, as released ones are (TraDo, LLaDA, Dream)."""
    path = tmp_path / "policy"
    tiny_model("sdar").to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_a_value_model_path_is_loaded_in_float32_as_trl_loads_the_policy(tmp_path, bf16_checkpoint):
    """The value optimizer is a plain AdamW with no float32 master copy: a bf16 value model loses every update
    below bf16 rounding (one TraceRL step at lr 5e-6 moved 283 of 82,304 backbone weights of the tiny SDAR, 75,605
    in float32). A path used to load in the checkpoint's dtype (bf16), while TRL loads the policy path in float32."""
    trainer = tracerl(tmp_path, bf16_checkpoint, bf16_checkpoint)
    value = trainer.accelerator.unwrap_model(trainer.value_model)
    assert trainer.model.dtype == torch.float32
    assert value.dtype == torch.float32
    # model_init_kwargs' dtype applies to both, as TRL applies it to the policy path
    trainer = tracerl(tmp_path, bf16_checkpoint, bf16_checkpoint, model_init_kwargs={"dtype": "bfloat16"})
    assert trainer.accelerator.unwrap_model(trainer.value_model).dtype == torch.bfloat16


def test_value_trainer_loads_a_path_in_float32(tmp_path, bf16_checkpoint):
    args = DiffusionValueConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
    trainer = DiffusionValueTrainer(bf16_checkpoint, args=args, processing_class=build_tokenizer())
    assert trainer.model.dtype == torch.float32


def test_a_half_precision_value_model_is_warned_about(tmp_path, caplog):
    policy = tiny_model("sdar")
    value = DiffusionValueModel.from_policy(policy).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.trainers.tracerl_trainer"):
        tracerl(tmp_path, policy, value)
    assert "keeps no float32 copy" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_diffusion.trainers.tracerl_trainer"):
        tracerl(tmp_path, policy, DiffusionValueModel.from_policy(policy))
    assert "keeps no float32 copy" not in caplog.text


# ------------------------------------------------------------------------------------------------ examples


@pytest.mark.slow
def test_math_example_saves_the_trained_value_model(tmp_path):
    """`examples/math.py --value_model` trained a value model and dropped it (`save_model` saves the policy and the
    example's default is save_strategy="no"); it is saved beside the policy, ready for `--value_model`."""
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    root = Path(__file__).parent.parent
    out = subprocess.run([sys.executable, str(root / "examples" / "math.py"), "--output_dir", str(tmp_path),
                          "--use_cpu", "true", "--value_model", EMBEDDED_MODEL, "--max_steps", "1",
                          "--per_device_train_batch_size", "8", "--num_generations", "4", "--num_eval", "4"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["value_model"] == f"{tmp_path}/value_model"
    value = DiffusionValueModel.from_pretrained(result["value_model"])
    assert value.config.model_type == "sdar" and value.value_head.weight.shape[0] == 1
