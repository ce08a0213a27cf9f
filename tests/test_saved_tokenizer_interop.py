"""What our saves write loads in transformers 4, which the released remote code needs, as it loads in transformers 5:
``tokenizer_config.json`` in the releases' format (``additional_special_tokens``, ``PreTrainedTokenizerFast``, an
inline ``chat_template``), ``config.json`` with the releases' ``torch_dtype`` and SDAR's ``fuse_cross_entropy``.
Checked on the written files and by transformers 5 loading them back identically."""

import json

import pytest
from datasets import Dataset
from test_review2_loading import (
    QWEN_CHAT_TEMPLATE,
    added_tokens_decoder,
    write_dream_tokenizer,
    write_llada_tokenizer,
    write_qwen_vocab_files,
    write_tokenizer_json,
)
from transformers import AutoConfig, AutoTokenizer
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.models import carry_tokenizer_code
from trl_diffusion.testing import CHAT_TEMPLATE, build_tokenizer, tiny_model, tiny_sdar_moe_config

# as in SDAR's release: a special token the tokenizer does not name and a plain added token before the mask
SDAR_ADDED = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, "<|box_start|>": 259, "<think>": 260,
              "<|MASK|>": 261}


def write_sdar_tokenizer(directory) -> None:
    """SDAR-*-Chat's tokenizer files: ``Qwen2Tokenizer`` with its remote-code ``auto_map``, the mask named as
    ``mask_token`` and among the additional special tokens."""
    write_qwen_vocab_files(directory, SDAR_ADDED)
    write_tokenizer_json(directory, SDAR_ADDED)
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(SDAR_ADDED, set(SDAR_ADDED) - {"<think>", "<|MASK|>"}),
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|box_start|>", "<|MASK|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_qwen2.Qwen2Tokenizer", None]}, "bos_token": None,
        "chat_template": QWEN_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": "<|endoftext|>",
        "errors": "replace", "mask_token": "<|MASK|>", "model_max_length": 131072, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


WRITERS = {"sdar": write_sdar_tokenizer, "llada": write_llada_tokenizer, "dream": write_dream_tokenizer}
TEXT = "Hi, 1+1=2 <|im_end|><|MASK|><|mask|><|mdm_mask|><think><|box_start|> é\n"
MESSAGES = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": "2"}]


def seen(tokenizer) -> dict:
    """What a tokenizer gives the trainers and the released scripts."""
    return {"ids": tokenizer(TEXT)["input_ids"], "special": tokenizer.all_special_tokens,
            "mask": (tokenizer.mask_token, tokenizer.mask_token_id), "eos": tokenizer.eos_token_id,
            "pad": tokenizer.pad_token_id, "bos": tokenizer.bos_token_id, "padding_side": tokenizer.padding_side,
            "chat": tokenizer.apply_chat_template(MESSAGES, tokenize=False)}


@pytest.mark.parametrize("family", sorted(WRITERS))
def test_saved_tokenizer_config_keeps_the_released_format(tmp_path, family):
    """transformers 5 writes a list of ``extra_special_tokens`` (transformers 4 fails on it), LLaDA's class as
    ``TokenizersBackend`` (unknown to 4) and the template only in ``chat_template.jinja`` (4.46 has none): saved and
    carried, the config has the released keys again, and transformers 5 loads the folder as the release."""
    release, saved = tmp_path / "release", tmp_path / "saved"
    release.mkdir()
    WRITERS[family](release)
    tokenizer = AutoTokenizer.from_pretrained(release)
    tokenizer.save_pretrained(saved)
    carry_tokenizer_code(saved, tokenizer)
    released = json.loads((release / "tokenizer_config.json").read_text())
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert "extra_special_tokens" not in config
    assert config.get("additional_special_tokens") == released.get("additional_special_tokens")
    assert config["tokenizer_class"] == released["tokenizer_class"]  # DreamTokenizer, Qwen2Tokenizer kept
    assert config.get("auto_map") == released.get("auto_map")
    assert config["chat_template"] == (saved / "chat_template.jinja").read_text() == released["chat_template"]
    assert seen(AutoTokenizer.from_pretrained(saved)) == seen(tokenizer)


def test_trainer_saves_write_released_tokenizer_and_model_configs(tmp_path):
    """The trainers' saves go through the rewrite for a tokenizer without an ``auto_map`` too, and write
    ``config.json`` with ``torch_dtype`` beside ``dtype`` and SDAR's ``fuse_cross_entropy``; transformers 5 loads
    both back as they were, without a deprecation warning for ``torch_dtype``."""
    tokenizer, out = build_tokenizer(), tmp_path / "out"
    args = DiffusionSFTConfig(str(out), report_to="none", use_cpu=True, bf16=False, save_strategy="no")
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, processing_class=tokenizer,
                                  train_dataset=Dataset.from_dict({"prompt": ["1+2="], "completion": ["3"]}))
    trainer.save_model()
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert "extra_special_tokens" not in config and "auto_map" not in config
    assert config["additional_special_tokens"] == ["<|im_start|>", "<|im_end|>"]
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["chat_template"] == CHAT_TEMPLATE
    assert seen(AutoTokenizer.from_pretrained(out)) == seen(tokenizer)

    model_config = json.loads((out / "config.json").read_text())
    assert model_config["torch_dtype"] == model_config["dtype"] == "float32"
    assert model_config["fuse_cross_entropy"] is True
    with CaptureLogger(logging.get_logger("transformers")) as captured:
        loaded = AutoConfig.from_pretrained(out)
    assert "torch_dtype" not in captured.out
    assert loaded.to_dict() == trainer.model.config.to_dict() | {"_name_or_path": str(out)}


def test_sdar_configs_carry_fuse_cross_entropy(tmp_path):
    """The released modeling reads ``config.fuse_cross_entropy`` on every forward: configs built here (SDAR-MoE's
    too) write the released value, as does the embedded model; a released value is kept."""
    tiny_sdar_moe_config().save_pretrained(tmp_path / "moe")
    assert json.loads((tmp_path / "moe" / "config.json").read_text())["fuse_cross_entropy"] is True
    assert json.loads((EMBEDDED_MODEL / "config.json").read_text())["fuse_cross_entropy"] is True
    tiny_model("sdar", fuse_cross_entropy=False).save_pretrained(tmp_path / "off")
    assert AutoConfig.from_pretrained(tmp_path / "off").fuse_cross_entropy is False


def test_a_config_saved_with_dtype_auto_writes_no_torch_dtype(tmp_path):
    """transformers 4 reads torch_dtype as getattr(torch, name): a copied "auto" made the config unloadable there."""
    from trl_diffusion.models import SDARConfig

    SDARConfig().save_pretrained(tmp_path / "base")
    AutoConfig.from_pretrained(tmp_path / "base", dtype="auto").save_pretrained(tmp_path / "auto")
    saved = json.loads((tmp_path / "auto" / "config.json").read_text())
    assert saved.get("dtype") == "auto" and "torch_dtype" not in saved
