"""Bad input fails early with a ValueError naming the field or argument: configs, datasets, generate(), rewards."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from datasets import Dataset, IterableDataset

from trl_diffusion import DiffusionSFTConfig, TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import EOS_ID, TINY_VOCAB_SIZE, build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig

CPU = dict(output_dir="unused", use_cpu=True, bf16=False, report_to="none")
PROMPTS = ["What is 1+2?", "Say hi"]


# ------------------------------------------------------------------------------------------------ configs


@pytest.mark.parametrize(("field", "value"), [
    ("confidence_threshold", 1.5), ("confidence_threshold", -0.1), ("confidence_threshold", math.nan),
    ("prompt_mask_prob", 1.2), ("prompt_mask_prob", -0.5), ("prompt_mask_prob", math.nan),
    ("scoring_token_budget", 0), ("scoring_token_budget", -8),
    ("random_mask_low", 0.0), ("random_mask_high", 1.0), ("coupled_low", math.nan), ("coupled_high", 1.5),
    ("max_completion_length", 0), ("temperature", math.inf), ("temperature", math.nan), ("top_k", -1),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", math.nan),
    ("min_p", 0.1), ("repetition_penalty", 1.2), ("generation_kwargs", {"num_beams": 2}),
    # TRL types num_generations `int | None`, then fails on `% None` (a YAML `null` got a traceback); a temperature
    # below MIN_TEMPERATURE gave NaN log-probs
    ("num_generations", None), ("scoring_temperature", 1e-40),
])
def test_tracerl_config_rejects_out_of_range_fields(field, value):
    with pytest.raises(ValueError, match=field):
        TraceRLConfig(**CPU, **{field: value})


@pytest.mark.parametrize(("low", "high"), [("random_mask_low", "random_mask_high"), ("coupled_low", "coupled_high")])
def test_tracerl_config_rejects_low_above_high(low, high):
    """Both inside (0, 1), only their order is wrong: refused at construction, naming both."""
    with pytest.raises(ValueError, match=f"{low}=0.8, {high}=0.5"):
        TraceRLConfig(**CPU, **{low: 0.8, high: 0.5})


def test_tracerl_config_accepts_the_boundaries():
    config = TraceRLConfig(**CPU, confidence_threshold=0.0, prompt_mask_prob=1.0, scoring_token_budget=None,
                           random_mask_low=0.5, random_mask_high=0.5, top_k=0, top_p=1.0)
    assert config.confidence_threshold == 0.0 and config.scoring_token_budget is None
    assert TraceRLConfig(**CPU, confidence_threshold=1.0, prompt_mask_prob=0.0).confidence_threshold == 1.0


@pytest.mark.parametrize("value", [0, -1])
def test_sft_config_rejects_non_positive_max_length(value):
    with pytest.raises(ValueError, match="max_length"):
        DiffusionSFTConfig(**CPU, max_length=value)
    assert DiffusionSFTConfig(**CPU, max_length=None).max_length is None


def test_value_config_rejects_non_positive_token_budget():
    with pytest.raises(ValueError, match="scoring_token_budget"):
        DiffusionValueConfig(**CPU, scoring_token_budget=0)


# ------------------------------------------------------------------------------------------------ datasets


def tracerl_config(tmp_path, **overrides) -> TraceRLConfig:
    fields = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=1, report_to="none", block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True,
                  bf16=False, disable_tqdm=True, gradient_checkpointing=False, seed=0,
                  dynamic_group_filtering="none")  # rewards beyond [0, 1]
    return TraceRLConfig(**{**fields, **overrides})


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def test_dataset_without_prompt_column_is_refused_at_construction(tmp_path):
    data = Dataset.from_dict({"question": PROMPTS, "answer": ["3", "hi"]})
    with pytest.raises(ValueError, match=r"train dataset has columns \['answer', 'question'\] but no 'prompt'"):
        TraceRLTrainer(tiny_model("sdar"), constant, args=tracerl_config(tmp_path), train_dataset=data,
                       processing_class=build_tokenizer())
    with pytest.raises(ValueError, match="train dataset"):  # passed positionally, as GRPOTrainer allows
        TraceRLTrainer(tiny_model("sdar"), constant, tracerl_config(tmp_path), data,
                       processing_class=build_tokenizer())


def test_eval_and_iterable_datasets_without_prompt_are_refused(tmp_path):
    good = Dataset.from_dict({"prompt": PROMPTS})
    bad = Dataset.from_dict({"text": PROMPTS})
    with pytest.raises(ValueError, match=r"eval 'held_out' dataset has columns \['text'\]"):
        TraceRLTrainer(tiny_model("sdar"), constant, args=tracerl_config(tmp_path), train_dataset=good,
                       eval_dataset={"held_out": bad}, processing_class=build_tokenizer())
    stream = IterableDataset.from_generator(lambda: iter([{"query": p} for p in PROMPTS]))
    with pytest.raises(ValueError, match=r"columns \['query'\]"):
        TraceRLTrainer(tiny_model("sdar"), constant, args=tracerl_config(tmp_path), train_dataset=stream,
                       processing_class=build_tokenizer())


# ------------------------------------------------------------------------------------------------ generate()


@pytest.fixture(scope="module")
def model():
    """A tiny SDAR whose forward fails loudly: every bad input must be refused before the first forward."""
    model = tiny_model("sdar").eval()

    def no_forward(module, args, kwargs):
        raise AssertionError("the model ran a forward on a bad input")

    handle = model.register_forward_pre_hook(no_forward, with_kwargs=True)
    yield model
    handle.remove()


PROMPT = torch.tensor([[10, 11, 12], [13, 14, 15]])
SAMPLING = dict(max_new_tokens=4, block_length=4, denoising_steps=2)


@pytest.mark.parametrize(("message", "input_ids", "kwargs"), [
    ("input_ids", torch.tensor([[10, 11, TINY_VOCAB_SIZE]]), {}),
    ("input_ids", torch.tensor([[10, -1, 12]]), {}),
    ("input_ids", torch.zeros(0, 3, dtype=torch.long), {}),
    ("input_ids", torch.zeros(2, 0, dtype=torch.long), {}),
    ("input_ids", torch.tensor([10, 11, 12]), {}),
    ("input_ids", torch.tensor([[10.0, 11.0]]), {}),
    ("attention_mask", PROMPT, {"attention_mask": torch.ones(2, 4, dtype=torch.long)}),
    ("attention_mask", PROMPT, {"attention_mask": torch.ones(3, dtype=torch.long)}),
    ("temperature", PROMPT, {"temperature": math.nan}),
    ("temperature", PROMPT, {"temperature": math.inf}),
    ("temperature", PROMPT, {"temperature": -1.0}),
    ("top_k", PROMPT, {"top_k": -1}),
    ("top_k", PROMPT, {"top_k": 2.5}),
    ("top_p", PROMPT, {"top_p": 0.0}),
    ("top_p", PROMPT, {"top_p": 1.5}),
    ("max_new_tokens", PROMPT, {"max_new_tokens": 0}),
    ("max_new_tokens", PROMPT, {"max_new_tokens": -4}),
    ("denoising_steps", PROMPT, {"denoising_steps": 0}),
    ("confidence_threshold", PROMPT, {"remasking_strategy": "low_confidence_dynamic", "confidence_threshold": 1.5}),
    ("confidence_threshold", PROMPT, {"remasking_strategy": "low_confidence_dynamic",
                                      "confidence_threshold": math.nan}),
    ("cfg_scale must", PROMPT, {"cfg_scale": -1.0}),
    ("alg_temp", PROMPT, {"alg_temp": math.nan}),
    ("eps", PROMPT, {"eps": 1.0}),
    ("pad_token_id", PROMPT, {"pad_token_id": TINY_VOCAB_SIZE}),
    ("generator", PROMPT, {"generator": [torch.Generator()]}),
])
def test_generate_refuses_bad_input_before_any_forward(model, message, input_ids, kwargs):
    with pytest.raises(ValueError, match=message):
        model.generate(input_ids, **{**SAMPLING, **kwargs})


def test_ids_under_padding_are_not_checked():
    """Only attended ids reach the model, so padding may hold any id (e.g. -100): the output is the same."""
    model = tiny_model("sdar").eval()
    mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    padded = PROMPT.masked_fill(mask == 0, -100)
    expected = model.generate(PROMPT, mask, **SAMPLING, temperature=0.0, return_dict_in_generate=True)
    got = model.generate(padded, mask, **SAMPLING, temperature=0.0, return_dict_in_generate=True)
    assert torch.equal(got.sequences[:, 3:], expected.sequences[:, 3:])
    assert torch.equal(got.unmask_step, expected.unmask_step)


# ------------------------------------------------------------------------------------------------ rewards


def rewards_of(tmp_path, func):
    """The rewards TRL's ``_calculate_rewards`` computes with ``func`` wrapped as TraceRLTrainer wraps it."""
    trainer = TraceRLTrainer(tiny_model("sdar"), func, args=tracerl_config(tmp_path),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer())
    completions = ["3", "hi", "4", "no"]
    return trainer._calculate_rewards([{"prompt": p} for p in PROMPTS * 2], PROMPTS * 2, completions,
                                      [[EOS_ID]] * 4)


def returning(value, asynchronous=False):
    """A reward function named ``bad_reward`` that returns ``value`` (a callable: value(completions))."""
    if asynchronous:
        async def bad_reward(completions, **kwargs):
            await asyncio.sleep(0)
            return value(completions)
    else:
        def bad_reward(completions, **kwargs):
            return value(completions)
    return bad_reward


BAD_OUTPUTS = {
    "inf": (lambda c: [1.0, math.inf, 0.0, 0.0], "infinite"),
    "-inf": (lambda c: [-math.inf] * len(c), "infinite"),
    "scalar": (lambda c: 1.0, "returned float 1.0"),
    "0-d tensor": (lambda c: torch.tensor(1.0), "returned Tensor"),
    "string": (lambda c: "1010", "returned str"),
    "strings": (lambda c: ["1.0"] * len(c), r"returned '1.0' \(str\) for completion 0"),
    "object": (lambda c: [0.0, 1.0, object(), 0.0], "for completion 2"),
    "dict": (lambda c: {i: 1.0 for i in range(len(c))}, "returned dict"),
    "too short": (lambda c: [1.0] * (len(c) - 1), "returned 3 rewards for 4 completions"),
    "short generator": (lambda c: (1.0 for _ in c[1:]), "returned 3 rewards for 4 completions"),
    "set": (lambda c: {1.0}, "returned set"),
}


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", sorted(BAD_OUTPUTS))
def test_bad_reward_output_names_the_function(tmp_path, case, asynchronous):
    value, message = BAD_OUTPUTS[case]
    with pytest.raises(ValueError, match="bad_reward") as error:
        rewards_of(tmp_path, returning(value, asynchronous))
    assert error.match(message)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_valid_reward_outputs_keep_trl_semantics(tmp_path, asynchronous):
    """None and NaN stay TRL's "not applicable" (NaN); tuples and 1-D tensors are lists of numbers too."""
    rewards = rewards_of(tmp_path, returning(lambda c: [None, math.nan, 1, True], asynchronous))
    assert torch.isnan(rewards[:2, 0]).all() and rewards[2:, 0].tolist() == [1.0, 1.0]
    rewards = rewards_of(tmp_path, returning(lambda c: torch.arange(len(c)) / 2, asynchronous))
    assert rewards[:, 0].tolist() == [0.0, 0.5, 1.0, 1.5]
    assert rewards_of(tmp_path, returning(lambda c: (0.5,) * len(c)))[:, 0].tolist() == [0.5] * 4
    # TRL reads a generator or map object as the list it yields
    rewards = rewards_of(tmp_path, returning(lambda c: (float(i) for i in range(len(c))), asynchronous))
    assert rewards[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert rewards_of(tmp_path, returning(lambda c: map(float, range(len(c)))))[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    values = returning(lambda c: {i: float(i) for i in range(len(c))}.values())
    assert rewards_of(tmp_path, values)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_bad_reward_output_stops_training(tmp_path):
    def scalar_reward(completions, **kwargs):
        return 0.5

    trainer = TraceRLTrainer(tiny_model("sdar").train(), scalar_reward, args=tracerl_config(tmp_path),
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer())
    with pytest.raises(ValueError, match="'scalar_reward' returned float 0.5"):
        trainer.train()
