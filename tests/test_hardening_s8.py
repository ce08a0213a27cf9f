"""Hardening, session 8: inputs that were accepted and then silently meant something else.

1. LLaDA configs the released modeling code would build differently (or refuse): ``embedding_size < vocab_size``,
   ``layer_norm_with_affine=False``, layer norms with a bias.
2. ``rollout_cache=True`` on a full-attention model (LLaDA / Dream) meant "no cache"; the default is now ``'auto'``.
3. ``--config`` YAML values: a single value for a list field, an int for a bool field.
4. FutureWarnings of transformers 5.24's checkpointing rename triggered by our own calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import traceback
import types
import warnings

import peft
import pytest
import torch
from datasets import Dataset
from test_cli import load_example
from test_examples_families import CODE_ROWS, MATH_ROWS, released, write_jsonl
from transformers import AutoModelForCausalLM, TrainingArguments
from trl import get_peft_config

from trl_diffusion import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.models import LLaDAModelLM
from trl_diffusion.scripts.utils import parse_script_args, run_script
from trl_diffusion.testing import TINY_VOCAB_SIZE, build_tokenizer, tiny_llada_config, tiny_model
from trl_diffusion.value import DiffusionValueModel

RENAMED = "activation_checkpointing" in {f.name for f in dataclasses.fields(TrainingArguments)}
"""transformers >= 5.24: ``activation_checkpointing`` is the field, ``gradient_checkpointing`` its deprecated alias."""
CHECKPOINTING_ON = {"activation_checkpointing": True} if RENAMED else {"gradient_checkpointing": True}
needs_renamed = pytest.mark.skipif(not RENAMED, reason="transformers < 5.24 has no activation_checkpointing")


# ------------------------------------------------------------------------------------------------ 1. LLaDA config
@pytest.mark.parametrize("overrides, message", [
    (dict(vocab_size=TINY_VOCAB_SIZE + 8, embedding_size=TINY_VOCAB_SIZE),
     r"embedding_size \(128\) is smaller than vocab_size \(136\)"),
    (dict(layer_norm_with_affine=False), "layer_norm_with_affine=False"),
    (dict(include_bias=True), "layer norms with a bias"),  # bias_for_layer_norm unset follows include_bias
    (dict(bias_for_layer_norm=True), "layer norms with a bias"),
], ids=["embedding_below_vocab", "norm_without_affine", "include_bias", "bias_for_layer_norm"])
def test_llada_refuses_what_the_release_builds_otherwise(overrides, message):
    """Before: accepted; the model had embedding_size rows for a larger vocabulary (ids past them have no row), or
    weighted, bias-free norms where the release builds weightless or biased ones."""
    config = tiny_llada_config(**overrides)
    with pytest.raises(ValueError, match=message):
        LLaDAModelLM(config)
    with pytest.raises(ValueError, match=message):  # the path from_pretrained / the Auto classes take
        AutoModelForCausalLM.from_config(config)


def test_llada_still_builds_what_the_release_builds():
    assert LLaDAModelLM(tiny_llada_config()).get_input_embeddings().num_embeddings == TINY_VOCAB_SIZE
    padded = LLaDAModelLM(tiny_llada_config(vocab_size=100, embedding_size=TINY_VOCAB_SIZE))  # padded rows: fine
    assert padded.get_output_embeddings().out_features == TINY_VOCAB_SIZE
    unset = LLaDAModelLM(tiny_llada_config(embedding_size=None))
    assert unset.get_input_embeddings().num_embeddings == TINY_VOCAB_SIZE
    biased = LLaDAModelLM(tiny_llada_config(include_bias=True, bias_for_layer_norm=False))  # linear biases only
    assert biased.model.transformer.blocks[0].attn_out.bias is not None


# ------------------------------------------------------------------------------------------- 2. rollout_cache
def example_argv(tmp_path, checkpoint, data, *flags):
    return ["--model_name_or_path", str(checkpoint), "--dataset_name", str(data), "--output_dir",
            str(tmp_path / "out"), "--max_steps", "1", "--per_device_train_batch_size", "4", "--use_cpu", "true",
            "--bf16", "false", "--num_generations", "4", "--max_completion_length", "8", *flags]


@pytest.mark.parametrize("family, name, rows, model_class", [
    ("llada", "math", MATH_ROWS, "LLaDAModelLM"),
    ("dream", "code", CODE_ROWS, "DreamModel"),
])
def test_example_rollout_cache_true_on_full_attention_is_one_line_exit_2(tmp_path, capsys, family, name, rows,
                                                                        model_class):
    """Before: ``--rollout_cache true`` on LLaDA / Dream trained without any cache (only --help said so)."""
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    example = load_example(name)
    with pytest.raises(SystemExit) as exit_info:
        run_script(example.main, example.make_parser(),
                   example_argv(tmp_path, released(family, tmp_path), data, "--rollout_cache", "true"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith(f"{example.make_parser().prog}: error: rollout_cache=True"), err[-3:]
    assert model_class in err[-1] and "'prefix' or 'dual'" in err[-1] and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())  # stopped before training


def test_example_default_rollout_cache_still_trains_llada(tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", MATH_ROWS)
    example = load_example("math")
    run_script(example.main, example.make_parser(), example_argv(tmp_path, released("llada", tmp_path), data))
    assert (tmp_path / "out" / "config.json").exists()


@pytest.mark.parametrize("family, cache", [("sdar", True), ("llada", False), ("dream", False)])
def test_default_rollout_cache_is_auto_per_family(tmp_path, family, cache):
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, block_length=4, denoising_steps=2, use_cpu=True, bf16=False,
                         report_to="none", save_strategy="no", **CHECKPOINTING_ON)
    assert args.rollout_cache == "auto"
    trainer = TraceRLTrainer(tiny_model(family).train(), lambda completions, **kw: [0.0] * len(completions),
                             args=args, train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 4}),
                             processing_class=build_tokenizer())
    assert trainer._rollout_sampler()["use_cache"] is cache  # what the rollouts and saved generation configs get


# ---------------------------------------------------------------------------------------------- 3. YAML values
def parse_math_config(tmp_path, text):
    (tmp_path / "run.yaml").write_text(text)
    return parse_script_args(load_example("math").make_parser(), ["--config", str(tmp_path / "run.yaml")])


def test_config_scalar_for_a_list_field_is_a_one_element_list(tmp_path):
    """Before: ``lora_target_modules: q_proj`` reached peft as the string 'q_proj', a pattern for the whole module
    path that matched no module ("Target modules q_proj not found"); ``reward_weights: 2`` stayed the int 2."""
    _, args, model_args = parse_math_config(tmp_path, "use_peft: true\nlora_target_modules: q_proj\n"
                                                      "reward_weights: 2\n")
    assert model_args.lora_target_modules == ["q_proj"] and args.reward_weights == [2.0]
    lora = peft.get_peft_model(tiny_model("sdar"), get_peft_config(model_args))
    adapted = {name.rsplit(".", 1)[-1] for name, module in lora.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj"}


def test_config_lists_and_peft_shorthands_still_parse(tmp_path):
    _, _, model_args = parse_math_config(tmp_path, "lora_target_modules: [q_proj, v_proj]\n")
    assert model_args.lora_target_modules == ["q_proj", "v_proj"]
    _, _, model_args = parse_math_config(tmp_path, "lora_target_modules: all-linear\n")
    assert model_args.lora_target_modules == "all-linear"  # peft's shorthand, read only as a string
    _, _, model_args = parse_math_config(tmp_path, "lora_target_modules: '.*\\.(q|v)_proj'\n")
    assert model_args.lora_target_modules == ".*\\.(q|v)_proj"  # a pattern stays one


@pytest.mark.parametrize("text, expected", [("bf16: 0\n", False), ("bf16: 1\n", True), ("bf16: 'no'\n", False),
                                            ("bf16: 'Y'\n", True)])
def test_config_bool_is_converted_as_the_command_line_converts_it(tmp_path, text, expected):
    """Before: ``bf16: 0`` / ``bf16: 1`` reached the config as the ints 0 / 1."""
    _, args, _ = parse_math_config(tmp_path, text + "use_cpu: true\n")
    assert args.bf16 is expected


@pytest.mark.parametrize("text, message", [("bf16: maybe\n", "config file: bf16: expected bool, got 'maybe'."),
                                           ("use_peft: 2\n", "config file: use_peft: expected bool, got 2."),
                                           ("bf16: 1.0\n", "config file: bf16: expected bool, got 1.0.")])
def test_config_bool_refuses_other_values_naming_the_field(tmp_path, capsys, text, message):
    with pytest.raises(SystemExit) as exit_info:
        parse_math_config(tmp_path, text)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(message)


# ------------------------------------------------------------------------------- 4. checkpointing FutureWarnings
@contextlib.contextmanager
def future_warnings_by_caller():
    """Yields a list that collects ``(message, caller file)`` for each FutureWarning: the caller is the frame that
    called into the code that warned (e.g. ours calling transformers), not the ``warnings.warn`` line itself."""
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("always")

        def show(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, FutureWarning):
                stack = traceback.extract_stack()
                inside = max(i for i, frame in enumerate(stack) if frame.filename == filename)
                found.append((str(message), stack[inside - 1].filename))

        warnings.showwarning = show
        yield found


def from_our_code(found):
    return [(message, caller) for message, caller in found if "/trl_diffusion/" in caller
            or "/examples/" in caller]


def test_tracerl_with_a_value_model_and_checkpointing_warns_nothing_from_our_calls(tmp_path):
    """Before: the value model was checkpointed through ``gradient_checkpointing_enable``, deprecated by
    transformers 5.24 (a FutureWarning at every trainer construction). TRL's own rollout context still reads and
    toggles the deprecated names (trl/models/utils.py); those are not ours."""
    policy = tiny_model("sdar").train()
    with future_warnings_by_caller() as found:
        args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                             max_completion_length=8, block_length=4, denoising_steps=2, max_steps=1,
                             learning_rate=1e-3, use_cpu=True, bf16=False, report_to="none", save_strategy="no",
                             disable_tqdm=True, dynamic_group_filtering="none", seed=0, **CHECKPOINTING_ON)
        trainer = TraceRLTrainer(policy, lambda completions, **kw: [len(c) / 10 for c in completions], args=args,
                                 train_dataset=Dataset.from_dict({"prompt": ["1+2=", "3+4=", "5+6=", "7+8="]}),
                                 processing_class=build_tokenizer(),
                                 value_model=DiffusionValueModel.from_policy(tiny_model("sdar")))
        trainer.train()
    assert not from_our_code(found), from_our_code(found)
    value_model = trainer.accelerator.unwrap_model(trainer.value_model)
    assert any(getattr(m, "gradient_checkpointing", False) for m in value_model.modules())


def test_sft_with_checkpointing_warns_nothing_from_our_calls(tmp_path):
    data = Dataset.from_list([{"prompt": "What is 1+2?\n", "completion": "\\boxed{3}"}] * 4)
    with future_warnings_by_caller() as found:
        args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, save_strategy="no",
                                  use_cpu=True, max_length=64, disable_tqdm=True, per_device_train_batch_size=2,
                                  max_steps=1, **CHECKPOINTING_ON)
        DiffusionSFTTrainer(tiny_model("llada"), args=args, processing_class=build_tokenizer(),
                            train_dataset=data).train()
    assert not from_our_code(found) and not found, found  # none at all: TRL's SFT does not toggle checkpointing


@pytest.mark.parametrize("name", ["math", "code"])
def test_example_defaults_use_no_deprecated_checkpointing_name(name):
    """Before: the examples' default ``gradient_checkpointing=False`` set the deprecated name: a FutureWarning on
    every run. Checkpointing stays off by default and both names still turn it on."""
    with future_warnings_by_caller() as found:
        _, args, _ = parse_script_args(load_example(name).make_parser(), ["--use_cpu", "true"])
    assert not [message for message, _ in found if "checkpointing" in message], found
    assert getattr(args, "activation_checkpointing", args.gradient_checkpointing) is False
    for flag in ("--gradient_checkpointing", *(["--activation_checkpointing"] if RENAMED else [])):
        _, args, _ = parse_script_args(load_example(name).make_parser(), ["--use_cpu", "true", flag, "true"])
        assert getattr(args, "activation_checkpointing", args.gradient_checkpointing) is True, flag


@needs_renamed
@pytest.mark.parametrize("key", ["every_n_layers", "offload"])
def test_tracerl_refuses_checkpointing_kwargs_grpo_passes_to_torch(tmp_path, key):
    """Before: a TypeError from the first loss (GRPO re-enables checkpointing after each rollout with these kwargs,
    which torch.utils.checkpoint hands to every layer's forward)."""
    with pytest.raises(ValueError, match=f"activation_checkpointing_kwargs \\['{key}'\\] cannot be used with TraceRL"):
        TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none",
                      activation_checkpointing=True, activation_checkpointing_kwargs={key: 2 if key != "offload"
                                                                                      else True})


@needs_renamed
def test_value_model_checkpointing_takes_every_n_layers_as_the_trainer_does():
    from trl_diffusion.trainers.tracerl_trainer import _enable_checkpointing

    model = DiffusionValueModel.from_policy(tiny_model("sdar", num_hidden_layers=4))
    args = types.SimpleNamespace(activation_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": False},
                                 gradient_checkpointing_kwargs=None)
    with future_warnings_by_caller() as found:
        _enable_checkpointing(model, args)
    assert not found, found
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    assert [m.gradient_checkpointing for m in layers] == [True, False, True, False]
    assert layers[0]._gradient_checkpointing_func.keywords == {"use_reentrant": False}
    model.train()
    model(torch.randint(4, 100, (1, 6))).value.sum().backward()  # every_n_layers did not reach a layer's forward
