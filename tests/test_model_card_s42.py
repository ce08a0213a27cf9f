"""The model card (README.md) the trainers write: the base model without a broken Hub link, a quick start that answers
for a model trained from the embedded tiny model, and PEFT runs with our card and no local path of this machine."""

import json
import re
from types import SimpleNamespace

import peft
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_diffusion
from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.assets import EMBEDDED_FORMAT, EMBEDDED_MODEL
from trl_diffusion.data import make_problems, to_dataset
from trl_diffusion.model_card import OURS, base_model_sentence, policy_quick_start
from trl_diffusion.testing import build_tokenizer, tiny_model

CPU = dict(report_to="none", use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no", max_steps=1,
           per_device_train_batch_size=4, max_length=64, learning_rate=1e-5)


def quick_start(card: str) -> str:
    return re.search(r"## Quick start\n\n```python\n(.*?)```", card, re.S).group(1)


def run_quick_start(card: str) -> str:
    """The card's code, run as written (on the CPU); the text it prints."""
    scope = {}
    exec(quick_start(card).replace('device_map="auto"', 'device_map="cpu"'), scope)
    return scope["output"]["generated_text"]


def embedded_trainer(output_dir, **kwargs):
    train, _ = make_problems(num_train=8, num_test=1, digits=3, seed=0)
    args = DiffusionSFTConfig(output_dir=str(output_dir), **{**CPU, **kwargs.pop("args", {})})
    return DiffusionSFTTrainer(AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL), args=args,
                               processing_class=AutoTokenizer.from_pretrained(EMBEDDED_MODEL),
                               train_dataset=to_dataset(train, EMBEDDED_FORMAT), **kwargs)


def test_embedded_model_card_names_its_base_and_its_quick_start_answers(tmp_path):
    """The card read "a fine-tuned version of [None](https://huggingface.co/None)", and its quick start chatted
    (chat messages) with a model trained on plain prompts: it printed an empty string (or, with TRL's 128 new tokens,
    failed: the embedded model has 128 positions)."""
    trainer = embedded_trainer(tmp_path)
    trainer.train()
    trainer.save_model()
    trainer.create_model_card(model_name="tiny")
    card = (tmp_path / "README.md").read_text()
    assert "[None]" not in card and "huggingface.co/None" not in card
    assert "fine-tuned version of `tiny-sdar-arithmetic`" in card and str(EMBEDDED_MODEL) not in card
    code = quick_start(card)
    assert "import trl_diffusion" in code and '"role"' not in code and "max_new_tokens=16" in code
    assert run_quick_start(card).strip()
    # a model trained from it, as a local base model: named by its folder, its lineage said, no link
    sentence = base_model_sentence(str(tmp_path))
    assert f"a local model (`{tmp_path.name}`), itself trained from `tiny-sdar-arithmetic`" in sentence


def test_local_and_nameless_base_models_have_no_hub_link(tmp_path):
    tiny_model("sdar").save_pretrained(tmp_path / "my-base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "my-base")
    args = DiffusionSFTConfig(output_dir=str(tmp_path / "out"), **CPU)
    local, nameless = ("fine-tuned version of a local model (`my-base`).",
                       "fine-tuned from a model that was not loaded from a saved checkpoint.")
    for policy, expected in ((model, local), (tiny_model("sdar"), nameless)):
        trainer = DiffusionSFTTrainer(policy, args=args, processing_class=build_tokenizer(),
                                      train_dataset=to_dataset(make_problems(4, 1)[0], "conversational"))
        trainer.create_model_card(model_name="tiny")
        card = (tmp_path / "out" / "README.md").read_text()
        assert expected in card and "huggingface.co/None" not in card and str(tmp_path / "my-base") not in card
        assert 'generator([{"role": "user", "content": question}], max_new_tokens=128' in card  # it chats
    trainer.create_model_card(dataset_name="openai/gsm8k")  # TRL's dataset link stays after our sentence
    card = (tmp_path / "out" / "README.md").read_text()
    assert "checkpoint on the [openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k) dataset." in card


def test_a_tokenizer_without_a_chat_template_gets_a_plain_prompt():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    code = policy_quick_start("me/m", {"max_new_tokens": 128},
                              trainer=SimpleNamespace(model=tiny_model("dream"), processing_class=tokenizer))
    assert "generator(prompt, max_new_tokens=128, return_full_text=False)" in code and '"role"' not in code
    embedded = AutoModelForCausalLM.from_pretrained(EMBEDDED_MODEL)  # TraceRL's sampler settings stay, capped
    code = policy_quick_start("me/m", {"max_new_tokens": 64, "block_length": 4},
                              trainer=SimpleNamespace(model=embedded, processing_class=build_tokenizer()))
    assert 'prompt = "What is 123+456?\\n"' in code and "max_new_tokens=16, block_length=4" in code


def test_peft_runs_write_our_card_without_a_local_path(tmp_path):
    """A PEFT run saved without checkpoints left PEFT's empty template as README.md; every adapter card gave the base
    model as an absolute path of this machine (adapter_config.json keeps it: PEFT loads the base from there)."""
    trainer = embedded_trainer(tmp_path / "out", peft_config=peft.LoraConfig(r=4, lora_alpha=8))
    trainer.train()
    trainer.save_model()
    card = (tmp_path / "out" / "README.md").read_text()
    assert OURS in card and "Model Card for Model ID" not in card and "library_name: peft" in card
    assert "fine-tuned version of `tiny-sdar-arithmetic`" in card
    assert str(EMBEDDED_MODEL) not in card and "base_model" not in card
    adapter = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == str(EMBEDDED_MODEL)
    assert run_quick_start(card).strip()  # the adapter folder loads and answers
    trainer.save_model(str(tmp_path / "copy"))  # another folder (a checkpoint's): PEFT's card, no local path
    assert "base_model" not in (tmp_path / "copy" / "README.md").read_text()
    assert trl_diffusion.__version__ in card
