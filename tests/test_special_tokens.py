"""Special tokens in prompts and data: text holding the mask token's string (refused up front, naming the rows),
transformers' ``sanitize_control_tokens`` in eval, BOS on plain prompts, and tokenizers without EOS or pad."""

import pytest
from datasets import Dataset
from tokenizers import processors

from trl_diffusion.data import evaluate_accuracy, generate_completions, make_problems
from trl_diffusion.eval.datasets import EvalProblem
from trl_diffusion.eval.evaluate import EvalConfig, evaluate, format_prompt, tokenize_prompt
from trl_diffusion.testing import MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer

EVAL = dict(max_new_tokens=4, batch_size=1, progress=False, output_dir=None)
MASKED_PROMPT = "What does <|MASK|> mean? 1+2"


def spied(model, seen: list):
    """``model`` whose ``generate`` records the real prompt ids of each row."""
    generate = model.generate

    def spy(ids, attention_mask=None, **kwargs):
        seen.extend(row[mask.bool()].tolist() for row, mask in zip(ids, attention_mask))
        return generate(ids, attention_mask=attention_mask, **kwargs)

    model.generate = spy
    return model


def bos_tokenizer():
    """The test tokenizer with a BOS its post-processor adds (add_special_tokens=True), as Llama's does."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens({"bos_token": "<|bos|>"})
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tokenizer.bos_token_id)])
    return tokenizer


def problems(*prompts: str) -> list[EvalProblem]:
    return [EvalProblem(id=f"p{i}", prompt=p, task="math", answer="3") for i, p in enumerate(prompts)]


@pytest.mark.parametrize("chat", [True, False])
def test_eval_refuses_a_prompt_holding_the_mask_token_before_generating(chat):
    # generate() refused it mid-run, after the earlier batches' work, naming no problem
    seen = []
    model = spied(tiny_model("sdar"), seen)
    with pytest.raises(ValueError, match=r"1 of 3 prompts hold the mask token '<\|MASK\|>' \(id 3\).*'p2'") as error:
        evaluate(model=model, tokenizer=build_tokenizer(), dataset=problems("1+2?", "2+1?", MASKED_PROMPT),
                 apply_chat_template=chat, **EVAL)
    assert not seen  # nothing generated
    assert ("sanitize_control_tokens" in str(error.value)) == chat  # the fix of chat prompts


def test_eval_takes_sanitize_control_tokens():
    # transformers' "sanitize_control_tokens=True requires tokenize=True": eval rendered, then re-tokenized the text
    seen = []
    report = evaluate(model=spied(tiny_model("sdar"), seen), tokenizer=build_tokenizer(),
                      dataset=problems(MASKED_PROMPT), apply_chat_template=True,
                      chat_template_kwargs={"sanitize_control_tokens": True}, **EVAL)
    assert report["metrics"]["num_scored"] == 1
    assert MASK_ID not in seen[0]  # the user's "<|MASK|>" is text
    tokenizer = build_tokenizer()
    assert tokenizer.decode(seen[0]) == format_prompt(tokenizer, problems(MASKED_PROMPT)[0],
                                                      EvalConfig(apply_chat_template=True))


@pytest.mark.parametrize("config", [
    dict(apply_chat_template=True),
    dict(apply_chat_template=True, system_prompt="Be brief.", start_with_think=True,
         chat_template_kwargs={"enable_thinking": False}),
    dict(apply_chat_template=False),
    dict(apply_chat_template=False, start_with_think=True),
])
def test_eval_prompt_ids_are_those_of_the_rendered_text(config):
    """Chat prompts tokenized by apply_chat_template(tokenize=True) get the ids the rendered text got (no special
    tokens added: the template writes them); plain prompts get the tokenizer's (BOS), as TRL's trainers give them."""
    config = EvalConfig(**config)
    tokenizer = bos_tokenizer()
    problem = problems("What is 1+2?")[0]
    text = format_prompt(tokenizer, problem, config)
    expected = tokenizer(text, add_special_tokens=not config.apply_chat_template)["input_ids"]
    assert tokenize_prompt(tokenizer, problem, config) == expected
    assert (expected[0] == tokenizer.bos_token_id) == (not config.apply_chat_template)


def test_held_out_accuracy_tokenizes_plain_prompts_as_training_does():
    # plain prompts lost the BOS that TRL's SFT / GRPO and `trl-diffusion eval` give them
    tokenizer, seen = bos_tokenizer(), []
    model = spied(tiny_model("sdar", vocab_size=128), seen)
    generate_completions(model, tokenizer, ["1+2=", "12+3="], chat_template=False, max_new_tokens=4)
    assert seen == [tokenizer(text)["input_ids"] for text in ("1+2=\n", "12+3=\n")]
    assert seen[0][0] == tokenizer.bos_token_id
    generate_completions(model, tokenizer, ["1+2="], max_new_tokens=4)  # the chat template writes its own tokens
    assert tokenizer.bos_token_id not in seen[-1]


def test_held_out_accuracy_needs_no_pad_token():
    # transformers' "Asking to pad but the tokenizer does not have a padding token"; eval pads with the model's
    _, test = make_problems(0, 3, seed=0)
    settings = dict(chat_template=False, max_new_tokens=4, block_length=4)
    no_pad = build_tokenizer()
    no_pad.pad_token = None
    model = tiny_model("sdar")
    assert evaluate_accuracy(model, no_pad, test, **settings) == evaluate_accuracy(model, build_tokenizer(), test,
                                                                                   **settings)
    assert generate_completions(model, no_pad, [p.prompt for p in test], **settings) == \
        generate_completions(model, build_tokenizer(), [p.prompt for p in test], **settings)
    # generate()'s own arguments (FSDP / ZeRO-3's synced_gpus) do not reach the pad id's resolution
    assert generate_completions(model, no_pad, [test[0].prompt], synced_gpus=False, **settings) == \
        generate_completions(model, build_tokenizer(), [test[0].prompt], **settings)


def sft_args(tmp_path, **kw):
    return DiffusionSFTConfig(**{**dict(output_dir=str(tmp_path), report_to=[], bf16=False, save_strategy="no",
                                        use_cpu=True, max_length=64, disable_tqdm=True, max_steps=1), **kw})


def test_sft_refuses_data_holding_the_mask_token_at_construction(tmp_path):
    # the collator refused it at the first batch holding the row, naming no row
    rows = [{"prompt": "1+1=", "completion": "2"}] * 3 + [{"prompt": "Which token masks?", "completion": "<|MASK|>."},
                                                          {"prompt": "<|MASK|> is", "completion": "the mask"}]
    with pytest.raises(ValueError, match=r"mask token '<\|MASK\|>' \(id 3\) in 2 row\(s\): 3 \(completion\), "
                                         r"4 \(prompt\)"):
        DiffusionSFTTrainer(tiny_model("sdar"), args=sft_args(tmp_path), train_dataset=Dataset.from_list(rows),
                            processing_class=build_tokenizer())
    with pytest.raises(ValueError, match=r"the eval dataset .* 0 \(completion\)"):
        DiffusionSFTTrainer(tiny_model("sdar"), args=sft_args(tmp_path), train_dataset=Dataset.from_list(rows[:1]),
                            eval_dataset=Dataset.from_list(rows[3:4]), processing_class=build_tokenizer())
    # the fix the message suggests for conversational rows
    chat = [{"prompt": [{"role": "user", "content": "Which token masks?"}],
             "completion": [{"role": "assistant", "content": "It is <|MASK|>."}],
             "chat_template_kwargs": {"sanitize_control_tokens": True}}]
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=sft_args(tmp_path), train_dataset=Dataset.from_list(chat),
                                  processing_class=build_tokenizer())
    assert MASK_ID not in trainer.train_dataset[0]["input_ids"]


def test_sft_eos_padding_needs_an_eos_token(tmp_path):
    # "Could not infer dtype of NoneType" inside TRL's collator at the first step
    tokenizer = build_tokenizer()
    tokenizer.eos_token = None
    rows = [{"input_ids": [20, 21, 22, 23], "completion_mask": [0, 0, 1, 1]}]
    args = sft_args(tmp_path, max_length=16, pad_to_length_with_eos=True, diffusion_objective="random_masking")
    with pytest.raises(ValueError, match="pad_to_length_with_eos pads with the EOS token, but the tokenizer has none"):
        DiffusionSFTTrainer(tiny_model("llada"), args=args, train_dataset=Dataset.from_list(rows),
                            processing_class=tokenizer)


def test_eval_think_prompt_ids_are_those_of_the_whole_rendered_text():
    """An ordinary (not added) "<think>" tokenized apart and appended gave ids the whole text does not have: with a
    SentencePiece-style tokenizer '[/INST]<think>' became '[/INST]', '▁<think>' (a space the model never saw)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    corpus = ["[INST] What is 1+2? [/INST]<think> 3 </think>", "hello <think> world"] * 100
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "</s>", "<m>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>", mask_token="<m>")
    tokenizer.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    problem = problems("What is 1+2?")[0]
    config = EvalConfig(apply_chat_template=True, start_with_think=True)
    ids = tokenize_prompt(tokenizer, problem, config)
    assert ids == tokenizer(format_prompt(tokenizer, problem, config), add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == format_prompt(tokenizer, problem, config)
    with pytest.raises(ValueError, match="needs '<think>' as an added token"):
        tokenize_prompt(tokenizer, problem, EvalConfig(apply_chat_template=True, start_with_think=True,
                                                       chat_template_kwargs={"sanitize_control_tokens": True}))
    tokenizer.add_tokens(["<think>"])  # added: one token whatever precedes it, after the template's own ids
    ids = tokenize_prompt(tokenizer, problem, config)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<think>")
    assert ids == tokenizer(format_prompt(tokenizer, problem, config), add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("preset", ["dllm_rl_sdar", "dllm_rl_sdar_think", "dllm_rl_llada"])
def test_start_with_think_with_a_whole_prompt_preset_says_to_drop_it(preset):
    """The advice was "pass prompt_template='dllm_rl_sdar_think' instead", which with start_with_think still set
    raised the same error again (and named an SDAR preset for LLaDA)."""
    from trl_diffusion.eval.evaluate import _resolve_chat_template

    with pytest.raises(ValueError, match=f"prompt_template='{preset}' does not go through: drop start_with_think"):
        _resolve_chat_template(EvalConfig(prompt_template=preset, start_with_think=True), None)
    assert _resolve_chat_template(EvalConfig(prompt_template=preset), None) is False  # dropping it is enough
