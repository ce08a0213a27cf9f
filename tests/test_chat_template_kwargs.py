"""``chat_template_kwargs`` (GRPOConfig's field) reaches every place a conversational prompt is rendered: TraceRL's
rollouts (TRL), the value trainer's prompts and ``trl-diffusion eval``, so a model trained with e.g.
``{"enable_thinking": false}`` (SDAR / TraDo's Qwen3 template) is valued and evaluated on the prompts it saw."""

import pytest
from datasets import Dataset
from trl import TrlParser

from trl_diffusion import DiffusionValueConfig, TraceRLConfig, TraceRLTrainer
from trl_diffusion.eval import EvalConfig
from trl_diffusion.eval.datasets import EvalProblem
from trl_diffusion.eval.evaluate import format_prompt
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value.value_trainer import _prepare_dataset

# the Qwen3 template's switch, reduced to what matters here: enable_thinking=false appends an empty think block
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")
NO_THINKING = {"enable_thinking": False}
PROMPT = [{"role": "user", "content": "What is 1+2?"}]
CPU = dict(output_dir="unused", use_cpu=True, report_to="none")


def tokenizer_with_template():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.mark.parametrize("make", [
    lambda value: TraceRLConfig(**CPU, bf16=False, chat_template_kwargs=value),
    lambda value: DiffusionValueConfig(**CPU, chat_template_kwargs=value),
    lambda value: EvalConfig(chat_template_kwargs=value),
], ids=["tracerl", "value", "eval"])
def test_configs_take_a_dict_or_a_json_object_and_refuse_anything_else(make):
    assert make(None).chat_template_kwargs is None
    assert make(NO_THINKING).chat_template_kwargs == NO_THINKING
    assert make('{"enable_thinking": false}').chat_template_kwargs == NO_THINKING  # as the command line gives it
    for bad in ("enable_thinking=false", "[1]", 3):
        with pytest.raises(ValueError, match="chat_template_kwargs must be"):
            make(bad)
    # arguments the callers pass themselves: a TypeError ("multiple values") inside the first rollout before
    for clash in ({"add_generation_prompt": False}, {"tokenize": False}, {"continue_final_message": True}):
        with pytest.raises(ValueError, match="which the trainers and eval pass to apply_chat_template"):
            make(clash)


def test_value_prompts_are_the_rollouts_prompts(tmp_path):
    """The value trainer renders a conversational prompt exactly as TraceRL's rollouts (TRL's ``_tokenize_prompts``)
    do with the same ``chat_template_kwargs``; without them it would be another prompt."""
    tokenizer = tokenizer_with_template()
    args = TraceRLConfig(**{**CPU, "output_dir": str(tmp_path)}, bf16=False, per_device_train_batch_size=2,
                         num_generations=2, max_completion_length=8, chat_template_kwargs=NO_THINKING)
    trainer = TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                             train_dataset=Dataset.from_dict({"prompt": [PROMPT] * 2}), processing_class=tokenizer)
    rollout_ids = list(trainer._tokenize_prompts([PROMPT])[0][0])
    rows = Dataset.from_dict({"prompt": [PROMPT], "completion_ids": [[5, 6]], "unmask_step": [[0, 1]],
                              "reward": [1.0]})
    config = DiffusionValueConfig(**CPU, chat_template_kwargs='{"enable_thinking": false}')
    value_ids = _prepare_dataset(rows, tokenizer, config.chat_template_kwargs)[0]["prompt_ids"]
    plain_ids = _prepare_dataset(rows, tokenizer)[0]["prompt_ids"]
    assert value_ids == rollout_ids
    assert tokenizer.decode(value_ids).endswith("<think>\n\n</think>\n\n") and plain_ids != value_ids


def test_eval_renders_prompts_with_the_kwargs_from_the_command_line():
    parser = TrlParser(dataclass_types=[EvalConfig])
    (config,) = parser.parse_args_and_config(["--chat_template_kwargs", '{"enable_thinking": false}',
                                              "--apply_chat_template", "true"])
    problem = EvalProblem(id="0", prompt="What is 1+2?", task="math", answer="3")
    tokenizer = tokenizer_with_template()
    text = format_prompt(tokenizer, problem, config)
    assert text == tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True, **NO_THINKING)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not format_prompt(tokenizer, problem, EvalConfig(apply_chat_template=True)).endswith("</think>\n\n")


def test_eval_refuses_the_kwargs_without_the_chat_template(capsys):
    from trl_diffusion.cli import main

    flags = ["--chat_template_kwargs", '{"enable_thinking": false}', "--max_problems", "2", "--progress", "false",
             "--output_dir", ""]
    assert main(["eval", *flags, "--apply_chat_template", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chat_template_kwargs needs the chat template" in err[0], err


def test_tracerl_refuses_them_with_text_prompts(tmp_path):
    """Text prompts never go through the chat template: the kwargs were ignored without a word (eval refused)."""
    args = TraceRLConfig(**{**CPU, "output_dir": str(tmp_path)}, bf16=False, per_device_train_batch_size=2,
                         num_generations=2, max_completion_length=8, chat_template_kwargs=NO_THINKING)

    def build(train, eval_dataset=None):
        return TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                              train_dataset=train, eval_dataset=eval_dataset,
                              processing_class=tokenizer_with_template())

    chats, texts = Dataset.from_dict({"prompt": [PROMPT] * 2}), Dataset.from_dict({"prompt": ["What is 1+2?"] * 2})
    with pytest.raises(ValueError, match=r"the train dataset's prompts are text"):
        build(texts)
    with pytest.raises(ValueError, match=r"the eval dataset's prompts are text"):
        build(chats, texts)
    build(chats, chats)
