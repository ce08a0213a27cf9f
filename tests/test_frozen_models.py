"""A model with no trainable parameter "trained": the run logged losses, saved checkpoints and changed no weight.
The usual cause is a PEFT adapter loaded for inference (``PeftModel.from_pretrained(base, path)`` freezes it unless
``is_trainable=True``; transformers freezes the adapter it attaches when loading an adapter folder). Each trainer's
``train()`` now refuses it first, saying how to load the adapter; evaluating a frozen model still works."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()
CPU = dict(use_cpu=True, report_to="none", bf16=False, save_strategy="no", disable_tqdm=True, max_steps=1)
SFT_ROWS = Dataset.from_list([{"prompt": "What is 2+3?", "completion": " 5"}] * 4)
TRAJECTORY = dict(prompt="abc", completion_ids=[30, 31, 32, 33], unmask_step=[0, 0, 1, 1], reward=1.0)
FROZEN_ADAPTER = r"PEFT adapter was loaded for inference .*is_trainable=True"
ATTACHED_ADAPTER = r"PEFT adapter that transformers attached, frozen"
FROZEN_WEIGHTS = r"has no trainable parameter.*every parameter has requires_grad=False"


@pytest.fixture(scope="module")
def adapter_folder(tmp_path_factory):
    """A LoRA adapter of the tiny SDAR model (saved as ``use_peft`` saves one) and the base model's folder."""
    folder = tmp_path_factory.mktemp("adapter")
    tiny_model("sdar").save_pretrained(folder / "base")
    get_peft_model(AutoModelForCausalLM.from_pretrained(folder / "base"),
                   LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).save_pretrained(folder / "adapter")
    return folder


def sft_trainer(tmp_path, model) -> DiffusionSFTTrainer:
    return DiffusionSFTTrainer(model, args=DiffusionSFTConfig(str(tmp_path), learning_rate=1e-2, **CPU),
                               train_dataset=SFT_ROWS, eval_dataset=SFT_ROWS, processing_class=TOKENIZER)


def tracerl_trainer(tmp_path, model, **settings) -> TraceRLTrainer:
    args = TraceRLConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                         dynamic_group_filtering="none", **CPU)
    return TraceRLTrainer(model, lambda completions, **kw: [float(len(c) % 2) for c in completions], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["1+2=", "abc"]}), processing_class=TOKENIZER,
                          **settings)


def test_a_frozen_peft_adapter_is_refused_by_train_and_evaluated(adapter_folder, tmp_path):
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(adapter_folder / "base"),
                                      adapter_folder / "adapter")
    assert not any(parameter.requires_grad for parameter in model.parameters())  # what peft loads by default
    trainer = sft_trainer(tmp_path / "sft", model)
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))  # evaluating a frozen model is fine
    with pytest.raises(ValueError, match=f"DiffusionSFTTrainer's model has no trainable parameter.*{FROZEN_ADAPTER}"):
        trainer.train()
    with pytest.raises(ValueError, match=f"TraceRLTrainer's model has no trainable parameter.*{FROZEN_ADAPTER}"):
        tracerl_trainer(tmp_path / "rl", model).train()
    assert trainer.state.global_step == 0


def test_an_adapter_loaded_trainable_trains(adapter_folder, tmp_path):
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(adapter_folder / "base"),
                                      adapter_folder / "adapter", is_trainable=True)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = sft_trainer(tmp_path, model)
    trainer.train()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    assert changed and all("lora_" in name for name in changed)  # the adapter trained, the base stayed
    trainer.save_model()
    assert (tmp_path / "adapter_model.safetensors").is_file()


def test_an_adapter_transformers_attached_is_refused_by_train(adapter_folder, tmp_path, monkeypatch):
    from transformers.integrations import peft as transformers_peft

    # as with a peft that transformers can save such a model with (0.22 beside transformers 5.24 / 5.25)
    monkeypatch.setattr(transformers_peft, "MIN_PEFT_VERSION", "0.1.0")
    attached = AutoModelForCausalLM.from_pretrained(adapter_folder / "adapter")
    assert attached._hf_peft_config_loaded
    with pytest.raises(ValueError, match=f"has no trainable parameter.*{ATTACHED_ADAPTER}.*is_trainable=True"):
        sft_trainer(tmp_path, attached).train()


def test_a_model_frozen_by_hand_is_refused_by_each_trainer(tmp_path):
    with pytest.raises(ValueError, match=f"DiffusionSFTTrainer's model {FROZEN_WEIGHTS}"):
        sft_trainer(tmp_path / "sft", tiny_model("sdar").requires_grad_(False)).train()
    with pytest.raises(ValueError, match=f"TraceRLTrainer's model {FROZEN_WEIGHTS}"):
        tracerl_trainer(tmp_path / "rl", tiny_model("sdar").requires_grad_(False)).train()
    value = DiffusionValueModel.from_policy(tiny_model("sdar")).requires_grad_(False)
    trainer = DiffusionValueTrainer(value, args=DiffusionValueConfig(str(tmp_path / "value"),
                                                                     per_device_train_batch_size=2, **CPU),
                                    train_dataset=Dataset.from_list([TRAJECTORY] * 2), processing_class=TOKENIZER)
    with pytest.raises(ValueError, match=f"DiffusionValueTrainer's model {FROZEN_WEIGHTS}"):
        trainer.train()
    # TraceRL's value model is only trained: refused at construction (AdamW's "empty parameter list" before)
    with pytest.raises(ValueError, match=f"TraceRLTrainer's value_model {FROZEN_WEIGHTS}"):
        tracerl_trainer(tmp_path / "rl_value", tiny_model("sdar"), value_model=value)


def test_frozen_parts_are_fine_while_something_trains(tmp_path):
    model = tiny_model("sdar")
    for name, parameter in model.named_parameters():
        parameter.requires_grad_("lm_head" in name)
    before = model.model.embed_tokens.weight.detach().clone()
    trainer = sft_trainer(tmp_path, model)
    trainer.train()
    assert trainer.state.global_step == 1 and torch.equal(model.model.embed_tokens.weight, before)
