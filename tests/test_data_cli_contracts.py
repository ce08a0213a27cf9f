"""Contracts of the data, command-line, eval-dataset, format-reward, callback and asset helpers that nothing else
pinned down: the arithmetic task's generation and scoring, how local training files are read, which eval rows are
refused, the boxed-format reward, the generation pad fallback, the held-out training curve, the command line's
argument checks and the embedded model's identity."""

import json
from dataclasses import dataclass, field
from types import SimpleNamespace as NS

import pytest
from datasets import Dataset, IterableDataset
from huggingface_hub import constants
from tokenizers.processors import TemplateProcessing
from trl import TrlParser

from trl_diffusion.assets import EMBEDDED_MODEL, check_hub_model_cached, is_embedded_model
from trl_diffusion.callbacks import HELD_OUT_KEY, HeldOutAccuracyCallback, held_out_curve
from trl_diffusion.command_line import UsageError, clear_help, explain_unknown_flags
from trl_diffusion.data import arithmetic_reward, load_training_dataset, make_problems, score_completion
from trl_diffusion.data.arithmetic import generate_completions
from trl_diffusion.data.loading import column_names
from trl_diffusion.eval.datasets import detect_format, load_eval_problems, problems_from_rows
from trl_diffusion.rewards.format_reward import boxed_format_reward, last_boxed_content
from trl_diffusion.scripts.utils import (
    check_script_args,
    embedded_defaults_in_use,
    example_defaults,
    find_reward,
    resume_checkpoint,
)
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer

PROMPTS = [f"What is {a}+{b}?" for a, b in [(1, 2), (47, 35), (90, 9), (12, 88)]]


@pytest.fixture
def datasets_cache(monkeypatch, tmp_path):
    """``datasets`` writes what it reads from a local file under tmp_path, not the user's cache."""
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))


# ------------------------------------------------------------------------------------------- arithmetic task


def test_generate_completions_ignores_a_checkpoints_top_k():
    """SDAR / TraDo checkpoints ship top_k in generation_config; greedy eval must not be filtered by it."""
    tokenizer = build_tokenizer()
    plain = generate_completions(tiny_model("sdar", seed=0), tokenizer, PROMPTS, max_new_tokens=8, block_length=4)
    model = tiny_model("sdar", seed=0)
    model.generation_config.top_k = 1  # an extreme top_k: every confidence becomes 1.0
    assert generate_completions(model, tokenizer, PROMPTS, max_new_tokens=8, block_length=4) == plain


def test_a_bos_adding_tokenizer_gives_plain_prompts_one_bos_and_chat_prompts_none_extra():
    """plain prompts are tokenized as TRL does (with the tokenizer's BOS), chat prompts only by their template."""
    tokenizer = build_tokenizer()
    bos = "<|endoftext|>"
    bos_id = tokenizer.convert_tokens_to_ids(bos)
    tokenizer._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, bos_id)])
    assert tokenizer("hi")["input_ids"][0] == bos_id  # the tokenizer adds a BOS
    model = tiny_model("sdar", seed=0)
    seen, generate = [], model.generate

    def spy(ids, **kwargs):
        seen.append(ids[0].tolist())
        return generate(ids, **kwargs)

    model.generate = spy
    prompt = "What is 1+2?"
    generate_completions(model, tokenizer, [prompt], max_new_tokens=4, block_length=4, chat_template=True)
    generate_completions(model, tokenizer, [prompt], max_new_tokens=4, block_length=4, chat_template=False)
    chat_text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                              add_generation_prompt=True)
    assert seen[0] == tokenizer(chat_text, add_special_tokens=False)["input_ids"]
    assert seen[1] == [bos_id] + tokenizer(prompt + "\n", add_special_tokens=False)["input_ids"]


def test_arithmetic_reward_scores_the_last_assistant_message():
    """a multi-message completion is judged by its final answer, not by a draft in an earlier message."""
    completion = [{"role": "assistant", "content": "Let me think: \\boxed{3}"},
                  {"role": "assistant", "content": "final \\boxed{5}"}]
    assert score_completion(completion, 5) and not score_completion(completion, 3)
    assert arithmetic_reward([completion], ["5"]) == [1.0]


def test_make_problems_refuses_a_bool_count():
    """make_problems(True, 0) silently made one problem; a bool is a mistyped flag, not a count."""
    with pytest.raises(ValueError, match="num_train"):
        make_problems(True, 0)
    with pytest.raises(ValueError, match="num_test"):
        make_problems(5, False)


# ------------------------------------------------------------------------------------------- prepared datasets


def test_a_dataset_prepared_with_another_add_eos_token_is_not_reused(tmp_path):
    """rows tokenized without EOS must not be trained as-is by a trainer whose tokenizer appends one."""
    rows = [{"prompt": "abc", "completion": "defghijk"}, {"prompt": "xy", "completion": "zzzzzzz"}]

    def trainer(dataset, tokenizer):
        args = DiffusionSFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True,
                                  save_strategy="no", max_length=64, disable_tqdm=True,
                                  per_device_train_batch_size=2, max_steps=1)
        return DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=dataset, processing_class=tokenizer)

    first = trainer(Dataset.from_list(rows), build_tokenizer())
    other = build_tokenizer()
    other.add_eos_token = True
    assert other("hi")["input_ids"] != build_tokenizer()("hi")["input_ids"]  # it does tokenize differently
    with pytest.raises(ValueError, match="another tokenizer"):
        trainer(first.train_dataset, other)


# ------------------------------------------------------------------------------------------ local training files


def test_a_jsonl_row_of_messages_with_tool_calls_stays_one_row(tmp_path, datasets_cache):
    """an assistant turn with tool_calls and no content is a chat message, not a list of rows to unwrap."""
    row = {"turns": [{"role": "user", "content": "weather?"},
                     {"role": "assistant",
                      "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]}
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(row) + "\n")
    dataset = load_training_dataset(str(path))
    assert len(dataset) == 1 and dataset.column_names == ["turns"]


def test_a_wrapper_with_an_empty_metadata_list_loads_its_rows(tmp_path, datasets_cache):
    """{"rows": [...], "tags": []} wraps two rows; the empty list beside them is metadata, not a rival."""
    data = {"rows": [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "4"}], "tags": []}
    path = tmp_path / "train.json"
    path.write_text(json.dumps(data))
    dataset = load_training_dataset(str(path))
    assert len(dataset) == 2 and dataset.column_names == ["prompt", "completion"]
    assert dataset["completion"] == ["2", "4"]


def test_column_names_of_an_undeclared_stream_are_its_first_examples_keys(datasets_cache):
    """a from_generator stream declares no columns; the trainers' checks must still see its columns."""
    def rows():
        yield {"prompt": "1+1=", "completion": "2"}

    stream = IterableDataset.from_generator(rows)
    assert stream.column_names is None
    assert column_names(stream) == ["prompt", "completion"]
    assert column_names(IterableDataset.from_generator(lambda: iter(()))) == []


# ------------------------------------------------------------------------------------------------ eval datasets


@pytest.mark.parametrize("chat_template, ending", [(False, "?\n"), (True, "?")])
def test_arithmetic_eval_prompts_end_as_the_embedded_model_was_trained(chat_template, ending):
    """plain prompts end with a newline (the prompt_completion format the embedded model learned)."""
    _, problems = load_eval_problems("arithmetic", chat_template=chat_template, max_problems=3)
    assert len(problems) == 3
    assert all(p.prompt.startswith("What is ") and p.prompt.endswith(ending) for p in problems)
    assert not problems[0].prompt.endswith("?\n\n")


def test_stdio_tests_with_mismatched_inputs_and_outputs_are_refused():
    """a row with 2 inputs but 1 output silently dropped a test; the user must hear about the broken row."""
    rows = [{"question": "Echo the number.", "test_method": "stdio", "test_input": ["1\n", "2\n"],
             "test_output": ["1\n"]}]
    with pytest.raises(ValueError, match="2 test inputs but 1 outputs"):
        problems_from_rows(rows)


def test_question_with_test_list_but_no_text_or_prompt_is_an_unknown_format():
    """MBPP needs text/prompt; {question, test_list} was read as MBPP with an empty task description."""
    with pytest.raises(ValueError, match="unknown dataset format"):
        detect_format(["question", "test_list"])
    with pytest.raises(ValueError, match="unknown dataset format"):
        problems_from_rows([{"question": "Write f(x) returning x+1.", "test_list": ["assert f(1) == 2"]}])
    assert detect_format(["text", "test_list"]) == "mbpp" and detect_format(["prompt", "test_list"]) == "mbpp"


def test_max_problems_zero_is_refused():
    """max_problems=0 evaluated nothing and reported an accuracy over no problems."""
    with pytest.raises(ValueError, match="max_problems must be positive, got 0"):
        load_eval_problems("arithmetic", max_problems=0)


# ---------------------------------------------------------------------------------------------- format reward


def test_boxed_with_a_space_before_the_brace_earns_the_boxed_reward():
    r"""LaTeX accepts \boxed {42}; a model writing it must not be scored as unformatted."""
    text = "so the answer is \\boxed {42}"
    assert last_boxed_content(text) == "42"
    assert boxed_format_reward([text]) == [1.0]


# ------------------------------------------------------------------------------------------------- generation


def test_without_a_pad_id_the_pad_is_the_first_stop_id():
    """with no pad id anywhere, finished rows are padded with the stop token, not token 0 (a real token)."""
    model = tiny_model("sdar")
    model.config.pad_token_id = None
    model.generation_config.pad_token_id = None
    settings, _ = model._resolve_settings({"eos_token_id": 7})
    assert settings.stop_token_ids == (7,) and settings.pad_token_id == 7


# ------------------------------------------------------------------------------------------------- callbacks


def curve_callback():
    callback = HeldOutAccuracyCallback(None, None, [], every=2)
    callback.measure = lambda step, announce=True: 0.5  # no model needed
    return callback


def test_the_held_out_curve_keeps_the_final_step():
    """a run of 5 steps measured every 2 must also be measured at its last step (the model it saves)."""
    callback = curve_callback()
    state = NS(global_step=0, log_history=[], is_world_process_zero=True)
    callback.on_train_begin(None, state, None)
    for step in range(1, 6):
        state.global_step = step
        callback.on_step_end(None, state, None)
    callback.on_train_end(None, state, None)
    assert [step for step, _ in held_out_curve(state.log_history)] == [0, 2, 4, 5]


def test_a_resumed_run_does_not_measure_its_start_point_again():
    """a run resumed from checkpoint-4 already holds the curve up to step 4; no duplicate point at 4."""
    callback = curve_callback()
    history = [{"step": 0, HELD_OUT_KEY: 0.1}, {"step": 2, HELD_OUT_KEY: 0.3}, {"step": 4, HELD_OUT_KEY: 0.5}]
    state = NS(global_step=4, log_history=list(history), is_world_process_zero=True)
    callback.on_train_begin(None, state, None)
    assert state.log_history == history


# --------------------------------------------------------------------------------------------------- the cli


@pytest.mark.parametrize("value", ["no", "No", "false", "none", "0", ""])
def test_resume_from_checkpoint_no_means_none(value):
    """--resume_from_checkpoint no must start fresh, not look for a directory named "no"."""
    assert resume_checkpoint(value, "/nonexistent") is None


@pytest.mark.parametrize("value", ["yes", "Yes", "true", "1"])
def test_resume_from_checkpoint_yes_means_the_last_checkpoint(value, tmp_path):
    """--resume_from_checkpoint yes resumes the last checkpoint-* of output_dir, as true does."""
    (tmp_path / "checkpoint-5").mkdir()
    assert resume_checkpoint(value, str(tmp_path)) is True


@pytest.mark.parametrize("name", ["math500", "aime2024", "humaneval", "arithmetic"])
def test_eval_only_benchmark_names_are_refused_as_training_sets(name):
    """an eval benchmark name as dataset_name has no training split; it must fail before anything loads."""
    with pytest.raises(UsageError, match=f"dataset_name '{name}' is a benchmark name"):
        check_script_args([NS(dataset_name=name)])


@pytest.mark.parametrize("flag", ["load_in_8bit", "load_in_4bit"])
def test_quantized_loading_flags_are_refused(flag):
    """the examples cannot load quantized models; a --load_in_8bit silently ignored would train full precision."""
    with pytest.raises(UsageError, match=f"--{flag}: not used by the example scripts"):
        check_script_args([NS(**{flag: True})])


def test_find_reward_refuses_a_class():
    """TRL would call a class with the completions to build it; a reward class is not a reward function."""
    with pytest.raises(UsageError, match="is a class, not a reward function"):
        find_reward("trl_diffusion.rewards.format_reward.ThinkFormatReward")
    assert callable(find_reward("trl_diffusion.rewards.format_reward.think_format_reward"))


@pytest.mark.parametrize("given, expected", [
    ("q_proj", ["q_proj"]),
    ("self_attn.q_proj", ["self_attn.q_proj"]),  # a dotted module name is still a name, not a regex
    ("all-linear", "all-linear"),
    (".*q_proj", ".*q_proj"),
])
def test_a_single_lora_target_module_becomes_a_list(given, expected):
    """peft reads a string as a regex for the whole path; one module name (dots included) must be a list."""
    args = NS(lora_target_modules=given)
    check_script_args([args])
    assert args.lora_target_modules == expected


# ------------------------------------------------------------------------------------------------------ assets


def test_a_config_cached_as_missing_is_not_a_cached_model(monkeypatch, tmp_path):
    """the Hub cache's .no_exist marker for config.json means the model is absent: offline, say so early."""
    cache, commit = tmp_path / "hub", "a" * 40
    repo = cache / "models--someone--tokenizer-only"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / ".no_exist" / commit).mkdir(parents=True)
    (repo / ".no_exist" / commit / "config.json").write_text("")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    with pytest.raises(ValueError, match="someone/tokenizer-only' is not in the local Hugging Face cache"):
        check_hub_model_cached("someone/tokenizer-only")


def test_a_config_differing_only_in_mask_token_id_is_not_the_embedded_model(tmp_path):
    """another mask token is another model; it must not get the embedded model's plain-prompt defaults."""
    config = json.loads((EMBEDDED_MODEL / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert is_embedded_model(tmp_path)  # the same config is recognised
    config["mask_token_id"] -= 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert not is_embedded_model(tmp_path)


# ------------------------------------------------------------------------------------------ cli help and messages


@dataclass
class Flags:
    max_problems: int = field(default=5, metadata={"help": "How many problems."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})


def test_a_mistyped_flag_with_a_value_gets_a_did_you_mean():
    """--max_problms=1000000 (the = form) must still point the user at --max_problems."""
    parser = clear_help(TrlParser(dataclass_types=[Flags], prog="x"))
    message = "Some specified arguments are not used by the HfArgumentParser: ['--max_problms=1000000']"
    assert "--max_problms=1000000 (did you mean --max_problems?)" in explain_unknown_flags(parser, message)


def test_the_no_flag_of_a_boolean_option_is_explained_in_help():
    """--help must say what --no_progress does instead of repeating --progress's text as if it were its own."""
    help_text = clear_help(TrlParser(dataclass_types=[Flags], prog="x")).format_help()
    assert "Same as --progress false." in help_text


@dataclass
class ExampleArgs:
    model_name_or_path: str = None
    learning_rate: float = 5e-5
    max_length: int = 1024


def test_only_the_examples_own_defaults_are_warned_about():
    """an example default equal to the class default (learning_rate) is no embedded-model setting to warn of."""
    parser = TrlParser(dataclass_types=[ExampleArgs])
    parser.set_defaults(max_length=64)  # the example overrides only max_length for the tiny model
    defaults = example_defaults(parser)
    (parsed,) = parser.parse_args_and_config(args=["--model_name_or_path", "Qwen/Qwen3-0.6B"])
    assert embedded_defaults_in_use(defaults, [parsed]) == ["max_length=64"]
