"""TraceRLTrainer's guard rails for a first run: the rollout cache under its own name (model configs stay clean),
the completion length checked at construction, a warning when no reward differs for many batches, and a
sampler/trainer gap that is 0 at any shrinkage when the two agree."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from datasets import Dataset
from trl import TrlParser

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


def config(tmp_path, **overrides) -> TraceRLConfig:
    values = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                  max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2, block_length=4,
                  denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none")  # rewards beyond [0, 1]
    values.update(overrides)
    return TraceRLConfig(**values)


def trainer(tmp_path, family="sdar", reward=distinct_chars, model=None, **overrides) -> TraceRLTrainer:
    model = model if model is not None else tiny_model(family).train()
    return TraceRLTrainer(model, reward, args=config(tmp_path, **overrides),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer())


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("prefix", "prefix"), ("dual", "dual"),
                                             ("true", True), ("False", False), ("DUAL", "dual")])
def test_rollout_cache_values(tmp_path, value, expected):
    assert config(tmp_path, rollout_cache=value).rollout_cache == expected


def test_rollout_cache_rejects_unknown_values(tmp_path):
    with pytest.raises(ValueError, match="rollout_cache must be one of"):
        config(tmp_path, rollout_cache="exact-ish")


def test_use_cache_is_read_as_the_old_name_with_a_warning(tmp_path):
    with pytest.warns(FutureWarning, match=re.escape("TraceRLConfig(use_cache='dual') sets the rollout KV cache "
                                                     "under its old name; use rollout_cache='dual'")):
        args = config(tmp_path, use_cache="dual")
    assert args.rollout_cache == "dual" and args.use_cache is False
    parser = TrlParser([TraceRLConfig])
    common = ["--output_dir", str(tmp_path), "--bf16", "false", "--use_cpu", "true"]
    (args,) = parser.parse_args_and_config([*common, "--rollout_cache", "dual"])
    assert args.rollout_cache == "dual" and args.use_cache is False
    with pytest.warns(FutureWarning, match=re.escape("TraceRLConfig(use_cache='prefix') sets the rollout KV cache "
                                                     "under its old name; use rollout_cache='prefix'")):
        (args,) = parser.parse_args_and_config([*common, "--use_cache", "prefix"])
    assert args.rollout_cache == "prefix" and args.use_cache is False


def test_saved_model_config_keeps_a_boolean_use_cache(tmp_path):
    """The Trainer copies ``args.use_cache`` into ``model.config.use_cache``; the rollout cache must not go there."""
    with pytest.warns(FutureWarning, match=re.escape("TraceRLConfig(use_cache='dual') sets the rollout KV cache "
                                                     "under its old name; use rollout_cache='dual'")):
        run = trainer(tmp_path, "llada", use_cache="dual")
    assert run.args.rollout_cache == "dual"
    run.train()
    run.save_model(str(tmp_path / "saved"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved.get("use_cache", False) in (True, False)


def test_completion_longer_than_the_model_fails_at_construction(tmp_path):
    """A one-token prompt must fit with the completion, a block model's rounded up to whole blocks of 4, as
    generate() counts it: 63 + 1 = 64 fits; 60 + 1 = 61 fits too (rounded up to 64: the check added a whole block,
    refusing 60-63); 64 + 1 does not."""
    model = tiny_model("sdar", max_position_embeddings=64).train()
    with pytest.raises(ValueError, match=r"max_completion_length \(64\) leaves no room for a prompt \(rounded up to "
                                         r"whole blocks of block_length\) in the model's 64 positions "
                                         r"\(max_position_embeddings\)"):
        trainer(tmp_path, model=model, max_completion_length=64)
    for fits in (60, 63):
        trainer(tmp_path, model=model, max_completion_length=fits)
        model.generate(torch.tensor([[5]]), max_new_tokens=fits, block_length=4, denoising_steps=4)  # no error
    llada = tiny_model("llada", max_sequence_length=64).train()
    with pytest.raises(ValueError, match=r"model's 64 positions \(max_sequence_length\)"):
        trainer(tmp_path, model=llada, max_completion_length=64)


def test_identical_rewards_for_many_batches_warn(tmp_path, caplog):
    run = trainer(tmp_path, reward=zero_reward, max_steps=3)
    run.identical_rewards_patience = 3
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        run.train()
    warnings = [r.getMessage() for r in caplog.records if "identical rewards" in r.getMessage()]
    assert len(warnings) == 1 and "3 generation batches" in warnings[0] and "EMBEDDED_FORMAT" in warnings[0]


def test_differing_rewards_do_not_warn(tmp_path, caplog):
    run = trainer(tmp_path, max_steps=3)
    run.identical_rewards_patience = 3
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        run.train()
    assert not [r for r in caplog.records if "identical rewards" in r.getMessage()]


def test_own_state_tokens_are_the_first_step_of_each_merged_group(tmp_path):
    run = trainer(tmp_path, "llada", shrinkage=2)
    prompt_mask = torch.ones(2, 3, dtype=torch.long)
    steps = torch.tensor([[0, 1, 2, 3, -1, -1], [0, 0, 1, 2, 2, 3]])
    own = run._own_state_tokens(prompt_mask, steps)
    assert own.tolist() == [[True, False, True, False, False, False], [True, True, False, True, True, False]]
    run.estimator_settings.shrinkage = 1
    assert run._own_state_tokens(prompt_mask, steps).tolist() == (steps >= 0).tolist()


def test_exact_gap_is_zero_when_sampler_and_trainer_agree_at_any_shrinkage(tmp_path):
    """At shrinkage 4 merged states differ from the sampler's, so the full gap is large by design; over tokens
    scored from the sampler's own state the gap is rounding only."""
    run = trainer(tmp_path, "llada", shrinkage=4, max_completion_length=16, block_length=16, denoising_steps=16,
                  remasking_strategy="low_confidence_static", temperature=1.0)
    run.train()
    logs = run.state.log_history[0]
    assert logs["rollout/sampler_logp_gap_exact"] < 1e-4
    assert logs["rollout/sampler_logp_gap"] > 1e-2


def test_gap_is_a_token_mean_whatever_the_loss_weights(tmp_path):
    """The gap averages over committed tokens; the loss weights TRL hands around as the completion mask (1/|tau|
    with 'step', 1/L_max with 'max_length', 1 with 'sequence') must not weight it."""
    gaps = []
    for normalization in ("sequence", "step", "max_length"):
        run = trainer(tmp_path / normalization, "llada", shrinkage=2, max_completion_length=16, block_length=16,
                      denoising_steps=16, remasking_strategy="low_confidence_dynamic", confidence_threshold=0.015,
                      temperature=1.0, step_normalization=normalization, loss_type="dapo")
        run.train()
        gaps.append(run.state.log_history[0]["rollout/sampler_logp_gap"])
        assert run.state.log_history[0]["rollout/tokens_per_step"] > 1.2  # steps commit unequal numbers of tokens
    assert gaps[0] > 1e-2
    assert gaps[1] == pytest.approx(gaps[0], rel=1e-6) and gaps[2] == pytest.approx(gaps[0], rel=1e-6)


@pytest.mark.parametrize("name", ["tools", "rollout_func"])
def test_multi_turn_rollouts_are_refused(tmp_path, name):
    """TRL's tools / custom rollouts would replace the diffusion trajectories the trainer scores."""
    with pytest.raises(ValueError, match=name):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path),
                       train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}), processing_class=build_tokenizer(),
                       **{name: [len] if name == "tools" else (lambda *a, **k: None)})


def test_arguments_passed_by_position_are_checked_as_by_keyword(tmp_path):
    """GRPOTrainer's arguments after ``args`` reached TRL unchecked by position: positional tools built and trained
    with the tool schema in every rollout prompt."""
    data = Dataset.from_dict({"prompt": ["a"] * 4})
    # train_dataset, eval_dataset, processing_class, reward_processing_classes, callbacks, optimizers,
    # quantization_config, peft_config, tools
    with pytest.raises(ValueError, match="tools"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, config(tmp_path), data, None, build_tokenizer(), None, None,
                       (None, None), None, None, [len])
    with pytest.raises(ValueError, match="the train dataset has columns \\['text'\\] but no 'prompt' column"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, config(tmp_path), Dataset.from_dict({"text": ["a"]}), None,
                       build_tokenizer())
    with pytest.raises(TypeError, match="at most 14 positional arguments"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, config(tmp_path), *([None] * 12))


MASK_TEXT = "In dLLMs the <|MASK|> token is"  # the test tokenizer's mask token: its text tokenizes to the mask id
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MASK_TEXT}]


def test_prompts_holding_the_mask_token_are_refused_at_construction_by_row(tmp_path):
    # they built and trained, and the run died steps later in generate(), which named no row
    with pytest.raises(ValueError, match=r"train dataset's row\(s\) 2 hold the mask token '<\|MASK\|>' \(id 3\).*"
                                         "sanitize_control_tokens"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path), processing_class=build_tokenizer(),
                       train_dataset=Dataset.from_dict({"prompt": ["a", "b", MASK_TEXT, "c"]}))
    chats = Dataset.from_dict({"prompt": [[{"role": "user", "content": "hi"}], CHAT]})
    with pytest.raises(ValueError, match=r"eval 'hard' dataset's row\(s\) 1 hold"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path), processing_class=build_tokenizer(),
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), eval_dataset={"easy": chats.select([0]),
                                                                                            "hard": chats})


def test_sanitized_conversational_prompts_holding_the_mask_text_are_taken(tmp_path):
    # transformers' sanitize_control_tokens encodes control tokens written in messages as text; a plain-text prompt
    # is tokenized without the chat template, so it still holds the mask id
    sanitize = {"sanitize_control_tokens": True}
    chats = Dataset.from_dict({"prompt": [CHAT] * 4})
    trainer = TraceRLTrainer(tiny_model("sdar"), zero_reward, args=config(tmp_path, chat_template_kwargs=sanitize),
                             train_dataset=chats, processing_class=build_tokenizer())
    assert trainer._generate_and_score_completions([{"prompt": CHAT}] * 4)["completion_ids"].shape[0] == 4
    with pytest.raises(ValueError, match=r"row\(s\) 0, 1, 2, 3, 4, \.\.\. hold") as caught:
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path, chat_template_kwargs=sanitize),
                       train_dataset=Dataset.from_dict({"prompt": [MASK_TEXT] * 8}),
                       processing_class=build_tokenizer())
    assert "sanitize_control_tokens" not in str(caught.value)  # already set


def test_a_rolled_out_prompt_holding_the_mask_token_is_named(tmp_path):
    # a prompt the construction check did not see (a stream, a dataset passed to evaluate()): generate() named none
    with pytest.raises(ValueError, match=r"a prompt holds the mask token \(id 3\).*: 'In dLLMs the <\|MASK\|> token"):
        trainer(tmp_path)._generate_and_score_completions([{"prompt": "abc"}] * 2 + [{"prompt": MASK_TEXT}] * 2)


def test_batch_scaled_advantages_leave_the_dropped_groups_out(tmp_path):
    """scale_rewards='batch' took the std over the groups dynamic_group_filtering drops: a dropped all-correct group
    beside the kept [0, 1, 0, 1] group scaled its advantages to +-1.1547 instead of +-1 (the kept rewards' std)."""

    def reward(prompts, completions, **kwargs):
        return [1.0 if p == "abc" else float(i % 2) for i, p in enumerate(prompts)]

    run = trainer(tmp_path, reward=reward, scale_rewards="batch", dynamic_group_filtering="accuracy_band",
                  per_device_train_batch_size=8)
    out = run._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4 + [{"prompt": "abc"}] * 4)
    assert out["kept_rows"].tolist() == [1.0] * 4 + [0.0] * 4
    assert out["advantages"].tolist() == pytest.approx([-1.0, 1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0])


def test_a_code_reward_refuses_its_rows_when_the_trainer_is_built(tmp_path):
    """A row the code reward refuses (tests that check nothing) raised only when its batch came up, steps into
    training, naming its index in the batch: the trainer asks the reward to check its datasets when built."""
    from trl_diffusion.rewards import make_code_reward, make_official_code_reward

    tests = [["assert f(1) == 1"], ["assert f(2) == 2"], ["f(3) == 3"], ["assert f(4) == 4"]]
    data = Dataset.from_dict({"prompt": PROMPTS, "tests": tests})
    with pytest.raises(ValueError, match=r"code_execution_reward: row 2 of the train dataset: .*comparison whose "
                                         "result is dropped"):
        TraceRLTrainer(tiny_model("sdar"), make_code_reward(), args=config(tmp_path), train_dataset=data,
                       processing_class=build_tokenizer())
    official = Dataset.from_dict({"prompt": PROMPTS, "test_method": ["function"] * 4, "test_list": tests})
    with pytest.raises(ValueError, match=r"official_code_reward: row 2 of the eval 'b' dataset"):
        TraceRLTrainer(tiny_model("sdar"), make_official_code_reward(), args=config(tmp_path),
                       train_dataset=official.select([0, 1]), eval_dataset={"a": official.select([0]), "b": official},
                       processing_class=build_tokenizer())
    TraceRLTrainer(tiny_model("sdar"), make_code_reward(), args=config(tmp_path), train_dataset=data.select([0, 1, 3]),
                   processing_class=build_tokenizer())  # rows that check build
    from trl_diffusion.rewards import code_execution_reward  # the ready function too (the --reward_funcs name)

    with pytest.raises(ValueError, match=r"code_execution_reward: row 2 of the train dataset"):
        TraceRLTrainer(tiny_model("sdar"), code_execution_reward, args=config(tmp_path),
                       train_dataset=data.with_format("pandas"), processing_class=build_tokenizer())


@pytest.mark.parametrize("prompts, rows", [
    (["abc", None, "x", ""], r"row\(s\) 1, 3 are missing \(None\) or empty \(2 row\(s\)\)"),
    ([[{"role": "user", "content": "abc"}], None, [], [{"role": "user", "content": "y"}]], r"row\(s\) 1, 2 are"),
    ([None] * 4, r"row\(s\) 0, 1, 2, 3 are"),
])
def test_missing_or_empty_prompts_are_refused_at_construction_by_row(tmp_path, prompts, rows):
    # each failed only when its batch was rolled out, with a tokenizer TypeError or "a prompt is empty" naming no row
    with pytest.raises(ValueError, match=r"the prompts of the train dataset's " + rows):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path), processing_class=build_tokenizer(),
                       train_dataset=Dataset.from_dict({"prompt": prompts}))
    shuffled = Dataset.from_dict({"prompt": ["abc", "", "x", "y"]}).select([1, 0, 2, 3])  # the dataset's own order
    with pytest.raises(ValueError, match=r"eval dataset's row\(s\) 0 are"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path), processing_class=build_tokenizer(),
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), eval_dataset=shuffled)


@pytest.mark.parametrize("prompts, held", [([1, 2, 3, 4], "int64"), ([["a", "b"]] * 4, "list<item: string>")])
def test_a_prompt_column_of_neither_text_nor_messages_is_refused(tmp_path, prompts, held):
    # a list of strings is no conversation: training ran, on whatever the tokenizer made of the lists
    with pytest.raises(ValueError, match=f"'prompt' column holds {held} values"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=config(tmp_path), processing_class=build_tokenizer(),
                       train_dataset=Dataset.from_dict({"prompt": prompts}))


def test_bnpo_with_group_filtering_needs_one_micro_batch_per_step(tmp_path):
    # a micro-batch whose groups were all filtered added 0 yet counted in bnpo's division by the accumulation
    # steps: half the gradient with half the micro-batches filtered
    with pytest.raises(ValueError, match=r"loss_type='bnpo' with group filtering .*gradient_accumulation_steps=2"):
        trainer(tmp_path, loss_type="bnpo", dynamic_group_filtering="all_equal", gradient_accumulation_steps=2)
    trainer(tmp_path, loss_type="bnpo", dynamic_group_filtering="none", gradient_accumulation_steps=2)
    trainer(tmp_path, loss_type="bnpo", dynamic_group_filtering="all_equal")  # one micro-batch per step


def test_chat_prompts_stored_as_a_fixed_size_list_are_taken(tmp_path):
    from datasets import Features, List, Value

    messages = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    features = Features({"prompt": List({"role": Value("string"), "content": Value("string")}, length=1)})
    dataset = Dataset.from_dict({"prompt": messages}, features=features)  # Arrow fixed_size_list
    TraceRLTrainer(tiny_model("sdar"), zero_reward, args=config(tmp_path), processing_class=build_tokenizer(),
                   train_dataset=dataset)


def test_models_an_earlier_bf16_trainer_prepared_run_in_float32_again(tmp_path):
    """accelerate wraps a prepared model's forward in autocast on the object itself, and the wrapper outlived that
    trainer: a value model warm-started with DiffusionValueConfig's default bf16 and handed over in memory ran in
    bf16 inside TraceRLTrainer(bf16=False) (values 0.3 off a float32 copy), the policy likewise."""
    import copy

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from trl_diffusion.value import DiffusionValueModel

    policy = tiny_model("sdar").train()
    value = DiffusionValueModel.from_policy(policy)
    torch.nn.init.normal_(value.value_head.weight)  # a head that reads the hidden states (zero at start)
    policy_copy, value_copy = copy.deepcopy(policy).eval(), copy.deepcopy(value).eval()
    AcceleratorState._reset_state(True)  # the process's state holds the earlier trainers' precision
    try:
        earlier = Accelerator(mixed_precision="bf16", cpu=True)
        for module in (policy, value):
            earlier.prepare_model(module)
            assert "_original_forward" in module.__dict__
    finally:
        AcceleratorState._reset_state(True)
    TraceRLTrainer(policy, zero_reward, args=config(tmp_path), processing_class=build_tokenizer(),
                   train_dataset=Dataset.from_dict({"prompt": PROMPTS}), value_model=value)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    policy.eval()
    value.eval()
    with torch.no_grad():
        for module, reference in ((policy, policy_copy), (value, value_copy)):
            assert "_original_forward" not in module.__dict__
            out, expected = module(input_ids=ids)[0], reference(input_ids=ids)[0]
            assert out.dtype == torch.float32
            assert torch.allclose(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
