"""A PEFT adapter folder (what ``--use_peft`` saves) given as the model to train. transformers loads it with the
adapter attached and, with peft < 0.22, cannot save the result: the run trained and then failed at its save
("The version of PEFT you are using is not compatible"); TRL cannot load the folder's path at all (no config.json).
The examples now train the adapter's merged model; the trainers refuse the path, and an attached adapter that
transformers could not save, before training, saying how to load the adapter with peft instead (an attached
adapter transformers can save is frozen, which ``train()`` refuses: tests/test_frozen_models.py)."""

from __future__ import annotations

import pytest
import torch
from example_scripts import load_example
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.command_line import UsageError
from trl_diffusion.models import common
from trl_diffusion.scripts.utils import load_pretrained, run_script

CPU = dict(use_cpu=True, report_to="none")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A LoRA adapter on the embedded model whose B matrices are not zero (so it changes the model), saved with the
    tokenizer as a trainer saves it."""
    folder = tmp_path_factory.mktemp("outputs") / "math"
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(EMBEDDED_MODEL).save_pretrained(folder)
    return folder


def test_examples_load_an_adapter_as_its_merged_model(adapter, tmp_path):
    model, _ = load_pretrained(ModelConfig(model_name_or_path=str(adapter)))
    assert not getattr(model, "_hf_peft_config_loaded", False) and not any("lora" in n for n, _ in
                                                                             model.named_parameters())
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    attached = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL), adapter)
    expected = attached.eval()(input_ids=ids).logits
    base = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL).eval()(input_ids=ids).logits
    merged = model.eval()(input_ids=ids).logits
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the model ...
    torch.testing.assert_close(merged, expected, rtol=1e-4, atol=1e-4)  # ... and the merged model is it
    model.save_pretrained(tmp_path / "saved")  # what failed
    with pytest.raises(UsageError, match="is a PEFT adapter: with --use_peft"):
        load_pretrained(ModelConfig(model_name_or_path=str(adapter), use_peft=True))


def test_sft_example_trains_and_saves_from_an_adapter(adapter, tmp_path):
    # the merged model came back frozen (peft loads adapters for inference): with activation checkpointing on the run
    # "trained" without changing a weight; without it the backward pass failed
    model, _ = load_pretrained(ModelConfig(model_name_or_path=str(adapter)))
    assert all(parameter.requires_grad for parameter in model.parameters())
    example = load_example("sft")
    run_script(example.main, example.make_parser(), [
        "--model_name_or_path", str(adapter), "--max_steps", "1", "--num_eval", "4", "--max_train_samples", "32",
        "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--report_to", "none"])
    assert (tmp_path / "out" / "config.json").is_file() and (tmp_path / "out" / "model.safetensors").is_file()
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    changed = [name for name, weight in trained.state_dict().items()
               if not torch.equal(weight, model.state_dict()[name])]
    assert changed  # one step moved the weights


def test_the_check_refuses_exactly_what_transformers_cannot_save(adapter, tmp_path):
    """With the installed transformers and peft (5.24 / 5.25 with peft 0.21: refused; with peft 0.22, and 5.20-5.23,
    which ask for peft 0.20: saved): the trainers' check refuses an attached adapter exactly when saving it fails."""
    attached = AutoModelForCausalLM.from_pretrained(adapter)
    assert attached._hf_peft_config_loaded
    try:
        attached.save_pretrained(tmp_path / "saved")
        saves = True
    except ValueError as error:
        assert "version of PEFT" in str(error)
        saves = False
    try:
        common.check_adapter_saveable(attached, "DiffusionSFTTrainer")
        accepted = True
    except ValueError:
        accepted = False
    assert accepted == saves


def test_trainers_refuse_an_attached_adapter_before_training(adapter, tmp_path, monkeypatch):
    from transformers.integrations import peft as transformers_peft

    monkeypatch.setattr(transformers_peft, "MIN_PEFT_VERSION", "99.0.0")  # as transformers 5.24 with peft 0.21
    attached = AutoModelForCausalLM.from_pretrained(adapter)
    sft = DiffusionSFTConfig(str(tmp_path / "sft"), **CPU)
    rl = TraceRLConfig(str(tmp_path / "rl"), per_device_train_batch_size=4, num_generations=4, **CPU)
    prompts = [{"prompt": "1+1="}] * 4
    for make in (lambda m: DiffusionSFTTrainer(m, args=sft, train_dataset=[{"prompt": "a", "completion": "b"}]),
                 lambda m: TraceRLTrainer(m, lambda completions, **kw: [0.0] * len(completions), args=rl,
                                          train_dataset=prompts)):
        for model in (str(adapter), adapter, attached):
            with pytest.raises(ValueError, match="merge_and_unload"):
                make(model)


def test_an_attached_adapter_is_accepted_when_transformers_can_save_it(adapter, monkeypatch):
    from transformers.integrations import peft as transformers_peft

    attached = AutoModelForCausalLM.from_pretrained(adapter)
    monkeypatch.setattr(transformers_peft, "MIN_PEFT_VERSION", "0.1.0")
    common.check_adapter_saveable(attached, "DiffusionSFTTrainer")  # no error (train() refuses it frozen)
    monkeypatch.setattr(transformers_peft, "MIN_PEFT_VERSION", "99.0.0")
    with pytest.raises(ValueError, match=r"needs peft >= 99\.0\.0"):
        common.check_adapter_saveable(attached, "DiffusionSFTTrainer")
    common.check_adapter_saveable(str(EMBEDDED_MODEL), "DiffusionSFTTrainer")  # a model folder: nothing to check


def test_an_adapter_folder_path_is_refused_whatever_peft(adapter, monkeypatch):
    # TRL loads a model path through its config.json, which an adapter folder lacks: with a peft new enough for
    # transformers to save an attached adapter (0.22), the path failed in TRL with "Unrecognized model ... Should have
    # a `model_type` key in its config.json"
    from transformers.integrations import peft as transformers_peft

    monkeypatch.setattr(transformers_peft, "MIN_PEFT_VERSION", "0.1.0")
    refusal = (r"is a PEFT adapter folder \(adapter_config\.json\), not a model: pass "
               r"peft\.PeftModel\.from_pretrained\(base_model, path, is_trainable=True\)")
    for model in (str(adapter), adapter):
        with pytest.raises(ValueError, match=refusal):
            common.check_adapter_saveable(model, "DiffusionSFTTrainer")
    with pytest.raises(ValueError, match="is a PEFT adapter folder"):
        DiffusionSFTTrainer(str(adapter), args=DiffusionSFTConfig("unused", **CPU),
                            train_dataset=[{"prompt": "a", "completion": "b"}])
