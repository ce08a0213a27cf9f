"""Loading and saving checkpoints in the released formats (models.md): local directories with the released
config.json fields (auto_map, architectures, torch_dtype, extras), sharded safetensors with an index,
generation_config.json and tokenizer files built with `tokenizers`, loaded through the Auto classes."""

import json

import pytest
import torch
from numerics import assert_close_fp32
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_diffusion  # noqa: F401  (registers the families)
from trl_diffusion.testing import tiny_model

# Released config.json fields beyond the config class's own (models.md), at tiny sizes.
RELEASED_EXTRAS = {
    "sdar": {
        "architectures": ["SDARForCausalLM"],
        "auto_map": {"AutoConfig": "configuration_sdar.SDARConfig", "AutoModel": "modeling_sdar.SDARModel",
                     "AutoModelForCausalLM": "modeling_sdar.SDARForCausalLM"},
        "attn_implementation": "flex_attention", "debug": False, "ep_size": 1, "fuse_cross_entropy": True,
        "micro_forward": False, "skip_checkpoint": False, "use_deepep": False, "rope_scaling": None,
        "sliding_window": None, "use_cache": False, "torch_dtype": "bfloat16", "transformers_version": "4.52.4",
    },
    "llada": {
        "architectures": ["LLaDAModelLM"],
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
                     "AutoModel": "modeling_llada.LLaDAModelLM"},
        "init_device": "meta", "init_fn": "mitchell", "precision": "amp_bf16", "use_cache": False,
        "transformers_version": "4.46.3",
    },
    "dream": {
        "architectures": ["DreamModel"],
        "auto_map": {"AutoConfig": "configuration_dream.DreamConfig", "AutoModel": "modeling_dream.DreamModel"},
        "use_mrope": False, "rope_scaling": None, "sliding_window": None, "use_cache": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.46.2",
    },
}
# The released generation_config.json files (token ids those of the tiny tokenizer: eos/pad 0).
RELEASED_GENERATION = {
    "sdar": {"bos_token_id": 0, "do_sample": True, "eos_token_id": [2, 0], "pad_token_id": 0, "temperature": 0.6,
             "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"},
    "llada": {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 0, "transformers_version": "4.38.2"},
    "dream": {"_from_model_config": True, "alg": "origin", "alg_temp": None, "bos_token_id": 0, "eos_token_id": 0,
              "eps": 0.001, "mask_token_id": None, "output_history": False, "pad_token_id": 0, "steps": 512,
              "temperature": 0.0, "top_k": None, "top_p": None, "transformers_version": "4.46.2"},
}


def write_shards(state: dict, directory, shards: int = 2) -> None:
    """``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``, as the releases ship them."""
    keys, weight_map = sorted(state), {}
    per = -(-len(keys) // shards)
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].contiguous() for k in keys[i * per:(i + 1) * per]}
        save_file(part, str(directory / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def write_released(family: str, directory, dtype=torch.float32, shards: int = 2, **overrides):
    """A released-format checkpoint of a tiny seeded model; returns the model."""
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_model(family, **overrides)
    config = model.config.to_dict()
    config.pop("dtype", None)
    config.update(RELEASED_EXTRAS[family])
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "generation_config.json").write_text(json.dumps(RELEASED_GENERATION[family]))
    tied = getattr(model.config, "tie_word_embeddings", False)  # a tied release ships no head
    state = {k: v.to(dtype) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    write_shards(state, directory, shards)
    return model


def byte_vocab() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's byte-to-character map), id = byte value."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {chars[b]: b for b in range(256)}


def write_qwen_vocab_files(directory, added: dict[str, int]) -> None:
    """``vocab.json`` + ``merges.txt`` + ``added_tokens.json`` (what Dream ships instead of tokenizer.json)."""
    (directory / "vocab.json").write_text(json.dumps(byte_vocab()))
    (directory / "merges.txt").write_text("#version: 0.2\n")
    (directory / "added_tokens.json").write_text(json.dumps(added))


def added_tokens_decoder(added: dict[str, int], special: set[str]) -> dict:
    return {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                     "special": t in special} for t, i in added.items()}


QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DREAM_ADDED = {"<|endoftext|>": 256, "<|im_start|>": 257, "<|im_end|>": 258, "<|beginoftext|>": 259, "<|mask|>": 260}


def write_dream_tokenizer(directory) -> None:
    """Dream-v0-Instruct-7B's tokenizer files: slow-tokenizer vocab files, ``tokenizer_class: DreamTokenizer``
    with its remote-code ``auto_map``, mask and bos as additional special tokens, pad == eos."""
    write_qwen_vocab_files(directory, DREAM_ADDED)
    config = {
        "add_bos_token": False, "add_prefix_space": False,
        "added_tokens_decoder": added_tokens_decoder(DREAM_ADDED, set(DREAM_ADDED)),
        "additional_special_tokens": ["<|beginoftext|>", "<|mask|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_dream.DreamTokenizer", None]},
        "bos_token": "<|beginoftext|>", "chat_template": QWEN_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "errors": "replace", "mask_token": "<|mask|>", "model_max_length": 131072,
        "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "DreamTokenizer",
        "unk_token": None,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


LLADA_ADDED = {"<|startoftext|>": 256, "<|endoftext|>": 257, "<|start_header_id|>": 258, "<|end_header_id|>": 259,
               "<|eot_id|>": 260, "<|mdm_mask|>": 261}
LLADA_CHAT_TEMPLATE = (  # LLaDA-8B-Instruct's: bos on the first message, the assistant header always appended
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)


def write_tokenizer_json(directory, added: dict[str, int]) -> None:
    """A byte-level BPE ``tokenizer.json`` (no merges) with ``added`` as special added tokens at their ids."""
    backend = Tokenizer(models.BPE(vocab=byte_vocab(), merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    for token, index in sorted(added.items(), key=lambda item: item[1]):
        assert backend.get_vocab_size(with_added_tokens=True) == index
        backend.add_special_tokens([AddedToken(token, normalized=False)])
    backend.save(str(directory / "tokenizer.json"))


def write_llada_tokenizer(directory) -> None:
    """LLaDA-8B-Instruct's tokenizer files: a ``PreTrainedTokenizerFast`` with bos/eos/pad and **no mask token**
    (the mask id comes from config.json's ``mask_token_id``)."""
    write_tokenizer_json(directory, LLADA_ADDED)
    config = {
        "add_bos_token": False, "add_eos_token": False,
        "added_tokens_decoder": added_tokens_decoder(LLADA_ADDED, set(LLADA_ADDED)),
        "bos_token": "<|startoftext|>", "chat_template": LLADA_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
        "eos_token": "<|endoftext|>", "fast_tokenizer": True, "model_input_names": ["input_ids", "attention_mask"],
        "pad_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast", "trust_remote_code": True,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


DREAM_IDS = dict(vocab_size=264, mask_token_id=260, pad_token_id=256, eos_token_id=256, bos_token_id=256)
LLADA_IDS = dict(vocab_size=264, embedding_size=264, mask_token_id=261, pad_token_id=257, eos_token_id=257)


# ------------------------------------------------------------------------------------------ round trips (coverage)


@pytest.mark.parametrize("tied", [False, True])
def test_sharded_released_checkpoint_round_trip(family, tied, tmp_path):
    """Sharded bf16 release with its remote-code files present: dtype="auto" and trust_remote_code=True still give
    our class in bf16 with the released logits; tied checkpoints ship no head. What we save loads back with
    identical logits and keeps the released identity fields (what the released remote code dispatches on)."""
    tie = {"llada": {"weight_tying": tied}}.get(family, {"tie_word_embeddings": tied})
    source = tmp_path / "release"
    model = write_released(family, source, dtype=torch.bfloat16, **tie).to(torch.bfloat16)
    head = {"llada": "model.transformer.ff_out.weight"}.get(family, "lm_head.weight")
    index = json.loads((source / "model.safetensors.index.json").read_text())["weight_map"]
    assert (head in index) is not tied and len(set(index.values())) == 2
    for name in ("configuration", "modeling"):  # the release's remote code, which must not be imported
        (source / f"{name}_{family}.py").write_text("raise ImportError('remote code was imported')\n")
    ids = torch.randint(4, 100, (2, 9))
    loaded = AutoModelForCausalLM.from_pretrained(source, dtype="auto", trust_remote_code=True)
    assert type(loaded) is type(model) and loaded.dtype == torch.bfloat16
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    loaded.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    for field in ("architectures", "auto_map", "model_type", "mask_token_id", "fuse_cross_entropy", "init_fn",
                  "use_mrope"):
        assert saved.get(field) == json.loads((source / "config.json").read_text()).get(field), field
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    assert again.dtype == torch.bfloat16
    torch.testing.assert_close(again(ids).logits, model(ids).logits, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------- generation_config.json


def test_released_dream_generation_config_survives_save_and_trl_changes(tmp_path):
    """Dream's generation_config.json says temperature 0.0 without do_sample. transformers refuses to save that once
    the config is changed (TRL sets generation_config.pad_token_id to the tokenizer's), and the loaded config was
    not even marked unmodified, so a released Dream model could not be saved at all (every trainer checkpoint)."""
    write_released("dream", tmp_path / "dream")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "dream")
    expected = model._resolve_settings({})[0]
    assert expected.temperature == 0.0 and expected.remasking_strategy == "origin"
    model.save_pretrained(tmp_path / "as_loaded")
    model.generation_config.pad_token_id = 4  # what GRPOTrainer does with a tokenizer whose pad differs
    model.save_pretrained(tmp_path / "changed")
    for saved in ("as_loaded", "changed"):
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / saved)
        settings = reloaded._resolve_settings({})[0]
        assert settings.temperature == 0.0 and settings.remasking_strategy == "origin"
        assert settings.denoising_steps == expected.denoising_steps and settings.eps == expected.eps
        assert reloaded._resolve_settings({"temperature": 0.5})[0].temperature == 0.5
    assert reloaded.generation_config.pad_token_id == 4


def test_a_released_sdar_checkpoint_decodes_with_its_exact_cache_by_default(tmp_path):
    """The released SDAR/TraDo files leave ``use_cache`` unset in generation_config.json (and false in config.json):
    ``generate()`` still takes SDAR's exact cache by default (one forward more than the steps, the prefill), with the
    tokens and log-probs of decoding without it; under classifier-free guidance the default is no cache, and only a
    cache asked for is an error. LLaDA / Dream decode without a cache by default."""
    write_released("sdar", tmp_path / "sdar")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "sdar", dtype=torch.float32)  # the release says bf16
    assert model._resolve_settings({})[0].cache_mode == "exact"
    prompt = torch.randint(5, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    greedy = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    cached, uncached = model.generate(prompt, **greedy), model.generate(prompt, use_cache=False, **greedy)
    assert cached.num_forward_passes == uncached.num_forward_passes + 1
    assert torch.equal(cached.sequences, uncached.sequences)
    assert_close_fp32(cached.token_logprobs, uncached.token_logprobs)
    assert model._resolve_settings({"cfg_scale": 1.0})[0].cache_mode == "none"
    with pytest.raises(ValueError, match="classifier-free guidance .* pass use_cache=False"):
        model.generate(prompt, cfg_scale=1.0, use_cache=True, max_new_tokens=4)
    for family in ("llada", "dream"):
        write_released(family, tmp_path / family)
        assert AutoModelForCausalLM.from_pretrained(tmp_path / family)._resolve_settings({})[0].cache_mode == "none"


# ------------------------------------------------------------------------------------------------------ tokenizers


def test_dream_tokenizer_loads_without_remote_code(tmp_path):
    """Dream's tokenizer_config.json names `DreamTokenizer` (remote code, a renamed slow Qwen2 tokenizer);
    AutoTokenizer refused it without trust_remote_code, so `trl-diffusion eval` and the examples could not load
    the Dream recipes' model."""
    directory = tmp_path / "dream"
    write_released("dream", directory, **DREAM_IDS)
    write_dream_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert type(tokenizer).__name__ == "DreamTokenizer"
    assert (tokenizer.mask_token, tokenizer.mask_token_id) == ("<|mask|>", 260)
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 256 and tokenizer.bos_token_id == 259
    assert tokenizer("hi <|im_end|><|mask|>")["input_ids"] == [ord("h"), ord("i"), ord(" "), 258, 260]
    text = tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], add_generation_prompt=True,
                                         tokenize=False)
    assert text == "<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n"
    from trl_diffusion.models import check_tokenizer

    check_tokenizer(tokenizer, AutoModelForCausalLM.from_pretrained(directory))


# ------------------------------------------------------------------------------------------------ wrong checkpoints


def test_llada_moe_checkpoint_is_named_in_the_error(tmp_path):
    """LLaDA-MoE's config.json says model_type "llada" too; the error told the user to set the dense model's OLMo
    options (block_type, rope, ...) in its config, which would only lead to a key-mismatch error. It now loads as
    LLaDA-MoE (tests/test_llada_moe.py), and a checkpoint missing its weights names that class."""
    config = {"model_type": "llada", "architectures": ["LLaDAMoEModelLM"], "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128, "num_experts": 4,
              "num_experts_per_tok": 2, "expert_intermediate_size": 32, "rms_norm_eps": 1e-5, "rope_theta": 50000.0,
              "max_position_embeddings": 4096, "hidden_act": "silu", "qk_layernorm": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": torch.zeros(128, 64)}, str(tmp_path / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match LLaDAMoEModelLM .*missing_keys"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_llada_released_tokenizer_without_mask_token_trains_with_sft(tmp_path):
    """LLaDA's tokenizer declares no mask token (the id is config.json's mask_token_id, as check_tokenizer, TraceRL,
    the value trainer and eval accept); DiffusionSFTTrainer refused it, so LLaDA-8B could not be fine-tuned with
    its own tokenizer (examples/sft.py has no way to set one)."""
    from datasets import Dataset

    from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer

    directory = tmp_path / "llada"
    write_released("llada", directory, **LLADA_IDS)
    write_llada_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    assert tokenizer.mask_token_id is None and tokenizer.convert_tokens_to_ids("<|mdm_mask|>") == 261
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": "1+1?"}],
                               "completion": [{"role": "assistant", "content": "2"}]}] * 2)
    args = DiffusionSFTConfig(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, bf16=False,
                              max_steps=1, per_device_train_batch_size=2, save_strategy="no", disable_tqdm=True,
                              diffusion_objective="random_masking")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    trainer = DiffusionSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    assert trainer.spec.mask_token_id == 261
    trainer.train()
    model.config.mask_token_id = 300  # a mask id the model has no row for is refused
    with pytest.raises(ValueError, match=r"mask_token_id 300 is no row of its input embedding \(\[0, 264\)\)"):
        DiffusionSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
    model.config.mask_token_id = len(tokenizer)  # a row of the model, but no token of the tokenizer
    with pytest.raises(ValueError, match=f"no mask token and the model's mask id {len(tokenizer)} is outside"):
        DiffusionSFTTrainer(model, args=args, train_dataset=data, processing_class=tokenizer)
