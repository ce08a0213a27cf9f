"""Settings that cost or changed something without a word, and what two red-team rounds found in the checks of this
session and the one before: Dream's released ``steps=512`` on a short generation (512 forward passes for a few
tokens, as Dream's sampler runs them); a ``shrinkage`` that no scorer reads; a chat template that reopens an assistant
turn after the last answer (SFT trained it); a tokenized ``completion_mask`` TRL leaves unapplied; guidance and a
generation config's ``use_cache``; the recipe check of a script run as a module; the examples' tiny-defaults
warning."""

from __future__ import annotations

import pytest
import torch

from trl_diffusion.generation import mixin
from trl_diffusion.testing import tiny_model


@pytest.fixture
def warned(monkeypatch) -> list[str]:
    """The messages of ``generate()``'s ``warning_once`` calls (not deduplicated)."""
    messages: list[str] = []
    monkeypatch.setattr(mixin.logger, "warning_once", messages.append)
    return messages


def test_more_dream_steps_than_tokens_are_named_with_where_they_come_from(warned):
    model = tiny_model("dream")
    model.generation_config.steps, model.generation_config.alg = 64, "origin"  # as Dream's released file (512)
    prompt = torch.tensor([[5, 6, 7, 8]])
    out = model.generate(prompt, max_new_tokens=8, return_dict_in_generate=True)
    assert int(out.num_forward_passes) > 8  # the schedule's steps, most of which commit nothing
    assert warned == ["steps=64 (from the model's generation config) is more than the 8 tokens to generate: the "
                      "steps schedule (Dream's) runs a forward pass per step, so most of them commit no token. Pass "
                      "steps=max_new_tokens (one token a step on average) or fewer to decode in fewer forward passes."]
    warned.clear()
    model.generate(prompt, max_new_tokens=8, steps=16)
    assert len(warned) == 1 and warned[0].startswith("steps=16 is more than the 8 tokens to generate")
    warned.clear()
    out = model.generate(prompt, max_new_tokens=8, steps=8, return_dict_in_generate=True)
    model.generate(prompt, max_new_tokens=8, denoising_steps=8, block_length=8)  # the config's steps are not used
    assert warned == [] and int(out.num_forward_passes) <= 8


def test_a_block_model_is_warned_per_block(warned):
    """SDAR keeps its block: ``steps`` is divided over the blocks, and more steps than a block's tokens idle."""
    model = tiny_model("sdar")  # block_size 4
    prompt = torch.tensor([[5, 6, 7, 8]])
    model.generate(prompt, max_new_tokens=8, steps=8, temperature=0.0)  # 4 steps for each block of 4
    assert warned == []
    model.generate(prompt, max_new_tokens=8, steps=16, temperature=0.0)
    assert len(warned) == 1 and warned[0].startswith("steps=16 is more than the 8 tokens to generate")


@pytest.mark.parametrize("estimator, value_model, warns", [
    ("random_masking", False, True), ("coupled", False, True), ("trajectory", False, False),
    ("random_masking", True, False),  # the value model's states are merged by it
])
def test_a_shrinkage_no_scorer_reads_is_named(tmp_path, caplog, estimator, value_model, warns):
    from datasets import Dataset

    from trl_diffusion.testing import build_tokenizer
    from trl_diffusion.trainers.tracerl_config import TraceRLConfig
    from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
    from trl_diffusion.value import DiffusionValueModel

    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, report_to="none", use_cpu=True, bf16=False, max_steps=1,
                         likelihood_estimator=estimator, shrinkage=4)
    policy = tiny_model("sdar")
    with caplog.at_level("WARNING", logger="trl_diffusion.trainers.tracerl_trainer"):
        TraceRLTrainer(policy, lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["What is 1+2?"] * 4}),
                       processing_class=build_tokenizer(),
                       value_model=DiffusionValueModel.from_policy(tiny_model("sdar")) if value_model else None)
    messages = [r.getMessage() for r in caplog.records if "shrinkage" in r.getMessage()]
    assert messages == ([f"shrinkage=4 has no effect here: it merges the steps of the rollout's trajectory, which "
                         f"likelihood_estimator={estimator!r} does not score (it draws its own masks), and there is "
                         "no value model, whose states it would also merge."] if warns else [])


def llada_tokenizer(folder):
    """LLaDA-8B-Instruct's tokenizer as released (its template, with bos on the first message)."""
    from test_review2_loading import write_llada_tokenizer
    from transformers import AutoTokenizer

    folder.mkdir(exist_ok=True)
    write_llada_tokenizer(folder)
    return AutoTokenizer.from_pretrained(folder)


def test_a_template_that_opens_an_assistant_turn_after_the_answer_is_found(tmp_path):
    from test_review2_loading import LLADA_CHAT_TEMPLATE, QWEN_CHAT_TEMPLATE

    from trl_diffusion.testing import build_tokenizer
    from trl_diffusion.trainers.sft_trainer import trailing_assistant_header

    assert trailing_assistant_header(build_tokenizer()) is None  # the embedded model's template closes the turn only
    tokenizer = llada_tokenizer(tmp_path)
    assert tokenizer.chat_template == LLADA_CHAT_TEMPLATE
    assert trailing_assistant_header(tokenizer) == "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    tokenizer.chat_template = LLADA_CHAT_TEMPLATE.replace(
        "{{ '<|start_header_id|>assistant", "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant").replace(
        "\\n\\n' }}", "\\n\\n' }}{% endif %}")  # the fix the warning asks for
    assert "add_generation_prompt" in tokenizer.chat_template and trailing_assistant_header(tokenizer) is None
    for template in (QWEN_CHAT_TEMPLATE, "{{ raise_exception('system turn needed') }}",
                     QWEN_CHAT_TEMPLATE + "{{ eos_token }}",  # more than the end of the turn, but no assistant header
                     "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"):
        tokenizer.chat_template = template
        assert trailing_assistant_header(tokenizer) is None, template


CHATML = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
GEMMA = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('roles must alternate') }}{% endif %}"
         "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + m['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}")
VICUNA = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ 'USER: ' + m['content'] + '\\n' }}{% else %}"
          "{{ 'ASSISTANT: ' + m['content'] + '</s>\\n' }}{% endif %}{% endfor %}")
ROLE_TAGS = ("{% for m in messages %}{% set role = 'HUMAN' if m['role'] == 'user' else m['role'] | upper %}"
             "{{ '<role>' + role + '</role>' + m['content'] + '<|role_end|>' }}{% endfor %}")
SYSTEM_FIRST = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn is required') }}{% endif %}"
PHI3 = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}{% endif %}")


@pytest.mark.parametrize("template, header", [
    # the header written whatever add_generation_prompt: found, whatever it is called
    (CHATML + "{{ '<|im_start|>assistant\\n' }}", "<|im_end|>\n<|im_start|>assistant\n"),
    (CHATML + "{{ '<|im_start|>assistant\\n<think>\\n' }}", "<|im_end|>\n<|im_start|>assistant\n<think>\n"),
    (SYSTEM_FIRST + CHATML + "{{ '<|im_start|>assistant\\n' }}", "<|im_end|>\n<|im_start|>assistant\n"),
    (GEMMA + "{{ '<start_of_turn>model\\n' }}", "<end_of_turn>\n<start_of_turn>model\n"),
    (VICUNA + "{{ 'ASSISTANT:' }}", "</s>\nASSISTANT:"),
    (ROLE_TAGS + "{{ '<role>ASSISTANT</role>' }}", "<|role_end|><role>ASSISTANT</role>"),
    # only under add_generation_prompt, or only the end of the turn (an eos included): none
    (CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}", None),
    (GEMMA + "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}", None),
    (SYSTEM_FIRST + CHATML + "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}", None),
    (PHI3, None),
    (CHATML + "{{ '\\n' }}", None),
])
def test_templates_of_other_models(template, header):
    from trl_diffusion.testing import build_tokenizer
    from trl_diffusion.trainers.sft_trainer import trailing_assistant_header

    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    assert trailing_assistant_header(tokenizer) == header


@pytest.mark.parametrize("rows, warns", [
    ([{"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]}], True),
    ([{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}], True),
    ([{"prompt": "Q", "completion": "A"}], False),  # no chat template applied
    # ShareGPT rows (TRL converts them to messages): they got no warning
    ([{"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]}], True),
])
def test_sft_on_conversations_names_a_trailing_assistant_header(tmp_path, monkeypatch, rows, warns):
    from datasets import Dataset

    from trl_diffusion.trainers import sft_trainer
    from trl_diffusion.trainers.sft_config import DiffusionSFTConfig

    messages: list[str] = []
    monkeypatch.setattr(sft_trainer.logger, "warning_once", messages.append)
    tokenizer = llada_tokenizer(tmp_path / "tokenizer")
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=64,
                              max_steps=1, per_device_train_batch_size=2, save_strategy="no", dataset_num_proc=None)
    model = tiny_model("llada", vocab_size=264, embedding_size=264, mask_token_id=261, pad_token_id=257,
                       eos_token_id=257)
    trainer = sft_trainer.DiffusionSFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows * 2),
                                              processing_class=tokenizer)
    header = [m for m in messages if "after a conversation's last assistant answer" in m]
    assert len(header) == warns
    row = trainer.train_dataset[0]
    trained = tokenizer.decode([token for token, label in zip(row["input_ids"], row["labels"]) if label != -100])
    # what it says: the trained tokens end with the header (the messages row trains them all)
    assert trained.endswith("A<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n") == warns


def test_a_stream_of_conversations_names_a_trailing_assistant_header(tmp_path, monkeypatch):
    """A stream's rows got no warning (only an in-memory Dataset's first row was read)."""
    from datasets import Dataset

    from trl_diffusion.trainers import sft_trainer
    from trl_diffusion.trainers.sft_config import DiffusionSFTConfig

    messages: list[str] = []
    monkeypatch.setattr(sft_trainer.logger, "warning_once", messages.append)
    rows = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}] * 2
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=64,
                              max_steps=1, per_device_train_batch_size=2, save_strategy="no", dataset_num_proc=None)
    model = tiny_model("llada", vocab_size=264, embedding_size=264, mask_token_id=261, pad_token_id=257,
                       eos_token_id=257)
    sft_trainer.DiffusionSFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows).to_iterable_dataset(),
                                    processing_class=llada_tokenizer(tmp_path / "tokenizer"))
    assert len([m for m in messages if "after a conversation's last assistant answer" in m]) == 1


def test_a_stream_of_chat_prompts_is_refused_by_its_features_for_a_tokenizer_without_a_chat_template(tmp_path):
    from datasets import Dataset

    from trl_diffusion.testing import build_tokenizer
    from trl_diffusion.trainers.tracerl_config import TraceRLConfig
    from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                         max_completion_length=8, report_to="none", use_cpu=True, bf16=False, max_steps=1)
    chat = Dataset.from_dict({"prompt": [[{"role": "user", "content": "What is 1+2?"}]] * 4}).to_iterable_dataset()
    with pytest.raises(ValueError, match="the train dataset's prompts are chat messages, but the tokenizer has no "
                                         "chat template"):
        TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=chat, processing_class=tokenizer)
    text = Dataset.from_dict({"prompt": ["What is 1+2?"] * 4}).to_iterable_dataset()
    undeclared = text.map(lambda row: row)  # features unknown: not read ahead, as before
    assert undeclared.features is None
    for stream in (text, undeclared):
        TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=stream, processing_class=tokenizer)


def test_a_script_run_as_a_module_refuses_another_commands_recipe(tmp_path):
    """``python -m trl_diffusion.scripts.<module>`` (the docs' launch) and a script run by its path define ``main`` in
    ``__main__``: the command is read from the script's file."""
    import importlib.util
    import subprocess
    import sys

    from trl_diffusion.scripts.utils import TRAINING_SCRIPTS, script_command

    for command, module in TRAINING_SCRIPTS.items():
        assert script_command(importlib.import_module(f"trl_diffusion.scripts.{module}").main) == command
    own = tmp_path / "sft.py"  # a user's script of the same name is not the package's
    own.write_text("def main():\n    pass\n")
    spec = importlib.util.spec_from_file_location("own_sft", own)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    assert script_command(loaded.main) is None
    run = subprocess.run([sys.executable, "-m", "trl_diffusion.scripts.tracerl_math", "--config",
                          "diffucoder_7b_coupled_code"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "tracerl_math.py: error: --config diffucoder_7b_coupled_code is a recipe of trl-diffusion code "
        "(examples/code.py), not of trl-diffusion math: run trl-diffusion code --config diffucoder_7b_coupled_code.")


def test_guidance_on_a_model_built_in_memory_runs_without_a_cache():
    """transformers copies ``config.use_cache`` (True) into the generation config of every model it builds: a plain
    guided call was refused as if it asked for a cache. Only the call's ``use_cache`` counts under guidance."""
    model = tiny_model("sdar")
    assert model.generation_config.use_cache is True  # from the model config, not the user
    prompt = torch.tensor([[5, 6, 7, 8]])
    guided = model.generate(prompt, max_new_tokens=4, cfg_scale=1.0, temperature=0.0, return_dict_in_generate=True)
    uncached = model.generate(prompt, max_new_tokens=4, cfg_scale=1.0, temperature=0.0, use_cache=False,
                              return_dict_in_generate=True)
    assert torch.equal(guided.sequences, uncached.sequences)
    assert guided.num_forward_passes == uncached.num_forward_passes
    assert model._resolve_settings({})[0].cache_mode == "exact"  # without guidance the config's True is the cache
    with pytest.raises(ValueError, match=r"runs without a KV cache, which the call asks for: pass use_cache=False"):
        model.generate(prompt, max_new_tokens=4, cfg_scale=1.0, use_cache=True)


def test_assistant_only_loss_trains_no_header_outside_the_generation_blocks(tmp_path, monkeypatch):
    """With ``assistant_only_loss`` only the ``{% generation %}`` blocks are labelled: a header the template appends
    after them is not trained, and nothing is said."""
    from datasets import Dataset

    from trl_diffusion.trainers import sft_trainer
    from trl_diffusion.trainers.sft_config import DiffusionSFTConfig

    messages: list[str] = []
    monkeypatch.setattr(sft_trainer.logger, "warning_once", messages.append)
    tokenizer = llada_tokenizer(tmp_path / "tokenizer")
    header = "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    tokenizer.chat_template = (  # LLaDA's, with its answers in generation blocks (as assistant_only_loss needs)
        "{% for m in messages %}{% if m['role'] == 'assistant' %}" + header + "{% generation %}"
        "{{ m['content'] + '<|eot_id|>' }}{% endgeneration %}{% else %}{{ '<|start_header_id|>' + m['role'] + "
        "'<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endif %}{% endfor %}" + header)
    assert sft_trainer.trailing_assistant_header(tokenizer) is not None
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=64,
                              max_steps=1, per_device_train_batch_size=2, save_strategy="no", dataset_num_proc=None,
                              assistant_only_loss=True)
    model = tiny_model("llada", vocab_size=264, embedding_size=264, mask_token_id=261, pad_token_id=257,
                       eos_token_id=257)
    rows = [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}] * 2
    trainer = sft_trainer.DiffusionSFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows),
                                              processing_class=tokenizer)
    row = trainer.train_dataset[0]
    trained = tokenizer.decode([token for token, label in zip(row["input_ids"], row["labels"]) if label != -100])
    assert trained == "A<|eot_id|>" and not [m for m in messages if "last assistant answer" in m]


@pytest.mark.parametrize("name", ["llada", "dream", "trado"])
def test_the_official_masking_baselines_merge_no_steps(name):
    """dLLM-RL's ``training.shrink`` (8 for LLaDA / Dream) is TraceRL's; its random_masking / coupled methods do not
    read it: the preset for them says 1 (a shrinkage given still wins)."""
    from trl_diffusion.trainers.tracerl_config import OFFICIAL_SETTINGS, TraceRLConfig

    for estimator in ("random_masking", "coupled_pairs"):
        preset = dict(num_processes=1, output_dir="unused", use_cpu=True, likelihood_estimator=estimator)
        assert TraceRLConfig.from_official(name, **preset).shrinkage == 1
        assert TraceRLConfig.from_official(name, **preset, shrinkage=4).shrinkage == 4
    config = TraceRLConfig.from_official(name, num_processes=1, output_dir="unused", use_cpu=True)
    assert config.shrinkage == OFFICIAL_SETTINGS[name]["shrinkage"] == (1 if name == "trado" else 8)


def test_a_model_path_under_an_unknown_users_home_is_one_error():
    from trl_diffusion.assets import resolve_model_path

    with pytest.raises(ValueError, match="no such local directory: ~nosuchuser_s44/model"):
        resolve_model_path("~nosuchuser_s44/model")  # Path.expanduser raised RuntimeError (a traceback)


@pytest.mark.parametrize("value, warned, prompt_trained", [(None, True, True), (True, False, False),
                                                            (False, False, True)])
def test_a_completion_mask_left_unapplied_is_named(tmp_path, caplog, value, warned, prompt_trained):
    """TRL's ``completion_only_loss=None`` decides by the format: tokenized rows' ``completion_mask`` is not applied,
    and their prompt is trained on, which nobody who wrote a completion_mask wants without a word."""
    from datasets import Dataset

    from trl_diffusion.testing import build_tokenizer
    from trl_diffusion.trainers.sft_config import DiffusionSFTConfig
    from trl_diffusion.trainers.sft_trainer import DiffusionSFTTrainer

    rows = [{"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 0, 1, 1]}] * 2
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=16,
                              max_steps=1, per_device_train_batch_size=2, save_strategy="no", dataset_num_proc=None,
                              completion_only_loss=value)
    with caplog.at_level("WARNING", logger="trl_diffusion.trainers.sft_trainer"):
        trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=Dataset.from_list(rows),
                                      processing_class=build_tokenizer())
    found = [r.getMessage() for r in caplog.records if "completion_mask" in r.getMessage()]
    assert found == (["the completions of the train dataset are not singled out: with completion_only_loss unset, "
                      "TRL trains on the completion only (a prompt/completion pair's, or a completion_mask's) when "
                      "the train dataset holds prompt/completion rows, deciding once from it, so every token of "
                      "these rows is trained on (or scored), the prompt too. Set completion_only_loss=True to train "
                      "on the completions only (False trains on every token without this warning)."]
                     if warned else [])
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert bool((batch["labels"][0, :3] != -100).any()) == prompt_trained  # what it says


def test_script_command_sees_through_wrappers():
    import functools

    from trl_diffusion.scripts.sft import main
    from trl_diffusion.scripts.utils import script_command

    @functools.wraps(main)
    def wrapped(*args):
        return main(*args)

    class Callable:
        def __call__(self, *args):
            return main(*args)

    assert script_command(functools.partial(main)) == script_command(wrapped) == "sft"
    assert script_command(Callable()) is None  # no source file of its own: no recipe check, no error


def test_fp16_is_a_mixed_precision_chosen(tmp_path):
    from example_scripts import load_example

    from trl_diffusion.scripts.utils import embedded_defaults_in_use, example_defaults

    tiny_model("sdar").config.save_pretrained(tmp_path)
    parser = load_example("math").make_parser()
    defaults = example_defaults(parser)
    for flags, named in ((["--fp16", "true"], False), ([], True)):
        argv = ["--model_name_or_path", str(tmp_path), "--use_cpu", "true", *flags]
        parsed = parser.parse_args_and_config(args=argv)
        assert ("bf16=False" in embedded_defaults_in_use(defaults, parsed)) == named


def test_guidance_from_a_generation_config_with_a_cache_asked_for_names_both():
    model = tiny_model("sdar")
    model.generation_config.cfg_scale = 1.0  # e.g. a saved generation_config.json
    prompt = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r"the generation config sets cfg_scale=1.0 \(classifier-free guidance, "
                                         r"which runs without a KV cache\) and the call asks for a cache "
                                         r"\(use_cache=True\): pass cfg_scale=0 to decode with the cache"):
        model.generate(prompt, max_new_tokens=4, use_cache=True)
    cached = model.generate(prompt, max_new_tokens=4, use_cache=True, cfg_scale=0, temperature=0.0,
                            return_dict_in_generate=True)
    assert model._resolve_settings({"use_cache": True, "cfg_scale": 0})[0].cache_mode == "exact"
    assert cached.sequences.shape == (1, 8)
    model.generate(prompt, max_new_tokens=4, temperature=0.0)  # guided, without a cache


@pytest.mark.parametrize("train_format, warned", [("text", True), ("prompt_completion", False)])
def test_completions_follow_the_train_sets_format(tmp_path, caplog, train_format, warned):
    """TRL decides ``completion_only_loss=None`` once, from the train set: an eval set of prompt/completion rows beside
    text training rows was scored on its prompt too without a word, and a completion_mask beside prompt/completion
    training rows IS applied (the warning said it was not)."""
    from datasets import Dataset

    from trl_diffusion.testing import build_tokenizer
    from trl_diffusion.trainers.sft_config import DiffusionSFTConfig
    from trl_diffusion.trainers.sft_trainer import DiffusionSFTTrainer

    train = ([{"text": "abcd"}] if train_format == "text" else [{"prompt": "ab", "completion": "cd"}]) * 2
    evals = {"pairs": Dataset.from_list([{"prompt": "ab", "completion": "cd"}] * 2),
             "masked": Dataset.from_list([{"input_ids": [5, 6, 7, 8, 9], "completion_mask": [0, 0, 0, 1, 1]}] * 2)}
    args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=16,
                              max_steps=1, per_device_train_batch_size=2, save_strategy="no", dataset_num_proc=None)
    with caplog.at_level("WARNING", logger="trl_diffusion.trainers.sft_trainer"):
        trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=Dataset.from_list(train),
                                      eval_dataset=evals, processing_class=build_tokenizer())
    found = [r.getMessage() for r in caplog.records if "singled out" in r.getMessage()]
    assert [message.split(" are not")[0] for message in found] == (
        ["the completions of the eval 'pairs' and eval 'masked' datasets"] if warned else [])
    batch = trainer.data_collator([trainer.eval_dataset["masked"][0]])
    assert bool((batch["labels"][0, :3] != -100).any()) == warned  # the prompt is scored exactly when warned
