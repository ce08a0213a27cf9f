"""``DiffusionValueTrainer`` reads its trajectories as TraceRL produces them: a completion ends at the stop ids of
the policy's rollouts (TRL's: the tokenizer's EOS and the policy's ``generation_config`` eos ids, which a value model
built with ``from_policy`` lost), and ids are checked (float ids were truncated silently, out-of-vocabulary ids
failed at the first step with a bare IndexError)."""

import pytest
from datasets import Dataset

from trl_diffusion.testing import EOS_ID, IM_END_ID, MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

ROW = dict(prompt_ids=[20, 21, 22], completion_ids=[30, 31, IM_END_ID, 33, 34, 35, 36, 37],
           unmask_step=list(range(8)), reward=1.0)


def value_trainer(tmp_path, value_model, rows):
    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                save_strategy="no")
    return DiffusionValueTrainer(value_model, args=args, train_dataset=Dataset.from_list(rows),
                                 processing_class=build_tokenizer())


def test_a_completion_ends_where_the_policys_rollouts_end(tmp_path):
    policy = tiny_model("sdar")
    policy.generation_config.eos_token_id = [EOS_ID, IM_END_ID]  # an end-of-turn id declared there only
    value_model = DiffusionValueModel.from_policy(policy)
    trainer = value_trainer(tmp_path, value_model, [ROW])
    trained = trainer.data_collator([trainer.train_dataset[0]])["trained_mask"][0]
    assert trained.tolist() == [True] * 3 + [False] * 5  # up to and including <|im_end|>, as TraceRL trains
    value_model.save_pretrained(tmp_path / "value")
    assert DiffusionValueModel.from_pretrained(tmp_path / "value").config.eos_token_id == [EOS_ID, IM_END_ID]


@pytest.mark.parametrize("column,values,message", [
    ("completion_ids", [30.7, 31.2, 32.9, 33.5, 34.0, 35.0, 36.0, 37.0], r"'completion_ids'\[0\] must be an integer"),
    ("completion_ids", [500, 31, 32, 33, 34, 35, 36, 37], r"'completion_ids'\[0\] must be an integer \[0, 128\)"),
    ("prompt_ids", [20, -3, 22], r"'prompt_ids'\[1\] must be an integer \[0, 128\)"),
    ("unmask_step", [0.5, 1.5, 0, 1, 2, 3, 4, 5], r"'unmask_step'\[0\] must be an integer >= -1"),
])
def test_ids_and_steps_that_are_not_what_a_sampler_writes_are_refused(tmp_path, column, values, message):
    with pytest.raises(ValueError, match="row 0: " + message):
        value_trainer(tmp_path, DiffusionValueModel.from_policy(tiny_model("sdar")), [{**ROW, column: values}])


def test_rows_passed_to_evaluate_are_checked_as_the_trainers_own(tmp_path):
    # a dataset with a `prompt_ids` column (an input column) skipped every check in evaluate(): a NaN reward gave
    # eval_loss NaN, an out-of-vocabulary id or a -1 gap ran
    trainer = value_trainer(tmp_path, DiffusionValueModel.from_policy(tiny_model("sdar")), [ROW])
    with pytest.raises(ValueError, match="row 0: 'reward' must be a finite number"):
        trainer.evaluate(Dataset.from_list([{**ROW, "reward": float("nan")}]))
    with pytest.raises(ValueError, match=r"row 0: 'completion_ids'\[1\] must be an integer \[0, 128\)"):
        trainer.evaluate(Dataset.from_list([{**ROW, "completion_ids": [30, 5000, 32, 33, 34, 35, 36, 37]}]))
    assert "eval_loss" in trainer.evaluate(Dataset.from_list([ROW]))


CHAT = [{"role": "user", "content": "In dLLMs the <|MASK|> token is"}]


@pytest.mark.parametrize("column,clean,bad,where", [
    ("prompt", "abc", "Explain <|MASK|> tokens", "prompt"),  # the mask token's string tokenizes to the mask id
    ("prompt", [{"role": "user", "content": "hi"}], CHAT, "prompt"),
    ("prompt_ids", [20, 21], [20, MASK_ID], "prompt"),
    ("completion_ids", ROW["completion_ids"], [30, 31, MASK_ID, 33, 34, 35, 36, 37], "completion_ids"),
])
def test_the_mask_token_in_a_prompt_or_a_committed_token_is_refused_by_row(tmp_path, column, clean, bad, where):
    # a committed token equal to the mask id cannot be told from a masked position: the trainer fit on it silently
    base = {k: v for k, v in ROW.items() if k != "prompt_ids"} | {"prompt_ids": [20, 21]}
    if column == "prompt":
        del base["prompt_ids"]
    rows = [{**base, column: clean}, {**base, column: bad}]
    model = DiffusionValueModel.from_policy(tiny_model("sdar"))
    message = rf"row 1: the {where} hold.*mask token '<\|MASK\|>' \(id {MASK_ID}\)"
    with pytest.raises(ValueError, match=message) as error:
        value_trainer(tmp_path, model, rows)
    assert ("sanitize_control_tokens" in str(error.value)) == (where == "prompt")


def test_the_mask_id_is_allowed_where_nothing_was_committed_and_sanitized_chat_prompts_pass(tmp_path):
    # a rollout's canvas holds the mask id where the sampler committed nothing (unmask_step -1)
    model = DiffusionValueModel.from_policy(tiny_model("sdar"))
    uncommitted = {**ROW, "completion_ids": [30, 31, 32, 33, MASK_ID, MASK_ID], "unmask_step": [0, 1, 2, 3, -1, -1]}
    value_trainer(tmp_path, model, [uncommitted])
    args = DiffusionValueConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                                save_strategy="no", chat_template_kwargs={"sanitize_control_tokens": True})
    chat = {**{k: v for k, v in ROW.items() if k != "prompt_ids"}, "prompt": CHAT}
    trainer = DiffusionValueTrainer(model, args=args, train_dataset=Dataset.from_list([chat]),
                                    processing_class=build_tokenizer())
    assert MASK_ID not in trainer.train_dataset[0]["prompt_ids"]


@pytest.mark.parametrize("field,value,message", [
    ("learning_rate", float("inf"), "learning_rate must be a finite number >= 0, got inf"),
    ("learning_rate", float("nan"), "learning_rate must be a finite number >= 0, got nan"),
    ("learning_rate", -0.01, "learning_rate must be a finite number >= 0, got -0.01"),
    ("learning_rate", "1e-5", "learning_rate must be a finite number >= 0, got '1e-5'"),  # PyYAML's 1e-5
    ("per_device_train_batch_size", "2", "per_device_train_batch_size must be an integer >= 1, got '2'"),
    ("per_device_train_batch_size", 0, "per_device_train_batch_size must be an integer >= 1, got 0"),
    ("gradient_accumulation_steps", 0, "gradient_accumulation_steps must be an integer >= 1, got 0"),
])
def test_optimization_numbers_are_checked_when_a_config_is_built(field, value, message):
    # learning_rate=inf trained: every weight NaN after the first step, the logged losses still finite
    from trl_diffusion import DiffusionSFTConfig, TraceRLConfig

    for config in (DiffusionValueConfig, DiffusionSFTConfig, TraceRLConfig):
        with pytest.raises(ValueError, match=message):
            config("unused", use_cpu=True, bf16=False, report_to="none", **{field: value})
    assert DiffusionValueConfig("unused", use_cpu=True, bf16=False, report_to="none", learning_rate=0.0)
    # numpy scalars are taken as Python numbers (they did not serialise with the arguments and the trainer state)
    import numpy

    config = DiffusionSFTConfig("unused", use_cpu=True, bf16=False, report_to="none",
                                per_device_train_batch_size=numpy.int64(2), learning_rate=numpy.float32(1e-4))
    assert type(config.per_device_train_batch_size) is int and type(config.learning_rate) is float
    config.to_json_string()


def test_a_value_model_with_peft_adapters_is_refused_by_name(tmp_path):
    """The value model trains in full: wrapped in LoRA it was refused as ``got PeftModel``, which did not say that
    the DiffusionValueModel inside is what both trainers take."""
    from peft import LoraConfig, get_peft_model, inject_adapter_in_model

    from trl_diffusion.trainers.tracerl_config import TraceRLConfig
    from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer

    wrapped = get_peft_model(DiffusionValueModel.from_policy(tiny_model("sdar")),
                             LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(TypeError, match="model is a DiffusionValueModel with PEFT adapters"):
        value_trainer(tmp_path, wrapped, [ROW])
    with pytest.raises(TypeError, match="model is a DiffusionValueModel with PEFT adapters"):
        value_trainer(tmp_path, wrapped.get_base_model(), [ROW])  # adapters injected in place
    injected = inject_adapter_in_model(LoraConfig(r=2, target_modules=["q_proj"]),
                                       DiffusionValueModel.from_policy(tiny_model("sdar")))
    with pytest.raises(TypeError, match="model is a DiffusionValueModel with PEFT adapters"):
        value_trainer(tmp_path, injected, [ROW])
    args = TraceRLConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True, report_to="none", max_steps=1,
                         num_generations=2, per_device_train_batch_size=2, max_completion_length=8, block_length=4)
    with pytest.raises(TypeError, match="value_model is a DiffusionValueModel with PEFT adapters"):
        TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["a", "b"]}), processing_class=build_tokenizer(),
                       value_model=wrapped)
    with pytest.raises(TypeError, match="must be a DiffusionValueModel, got SDARForCausalLM"):
        value_trainer(tmp_path, tiny_model("sdar"), [ROW])
