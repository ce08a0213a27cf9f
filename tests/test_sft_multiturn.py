"""Multi-turn and user-prepared SFT data: what the trainer refuses or warns about, and what it still accepts.

* ``evaluate`` / ``predict`` of a ``skip_prepare_dataset`` set with mask columns but no labels (TRL's refusal, which
  the diffusion collator hid: every token, the prompt too, was scored);
* ``semi_ar`` on rows with several labelled spans (assistant-only multi-turn), in memory, streamed and evaluated;
* the mask-token message under ``assistant_only_loss`` (no ``sanitize_control_tokens``, which transformers refuses
  there);
* a train dataset that truncation leaves empty;
* ``completion_only_loss=True`` on conversations, where it does nothing.
"""

import numpy as np
import pytest
from datasets import Dataset, IterableDataset
from transformers.utils import logging as hf_logging

from trl_diffusion.testing import MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer, sft_trainer
from trl_diffusion.trainers.diffusion_losses import IGNORE_INDEX

ASSISTANT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TWO_TURNS = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "AAAAAA"},
             {"role": "user", "content": "NEXT"}, {"role": "assistant", "content": "BBBBBB"}]
ONE_TURN = TWO_TURNS[:2]
MENTIONS_TRL_GUARD = "mask columns but no 'labels'"
MENTIONS_SPANS = "needs one labelled span per row"


def tokenizer():
    tok = build_tokenizer()
    tok.chat_template = ASSISTANT_TEMPLATE
    return tok


def config(tmp_path, **kw):
    values = dict(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, max_length=128, max_steps=1,
                  per_device_train_batch_size=2, per_device_eval_batch_size=2, save_strategy="no",
                  disable_tqdm=True, dataset_num_proc=None)
    return DiffusionSFTConfig(**{**values, **kw})


def trainer(tmp_path, train, eval_dataset=None, **kw):
    return DiffusionSFTTrainer(tiny_model("llada"), args=config(tmp_path, **kw), train_dataset=train,
                               eval_dataset=eval_dataset, processing_class=tokenizer())


def conversations(*turns, copies=2):
    return Dataset.from_list([{"messages": messages} for messages in turns for _ in range(copies)])


def no_forward(model):
    """Make any forward of ``model`` fail, so a test can tell a refusal before the forward from one after."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the model ran a forward before the data was refused")
    model.forward = forbidden


# --------------------------------------------------------------------------------------------- skip_prepare


def tokenized_rows():
    """A labelled set and the same rows with a completion_mask instead of labels."""
    tok = tokenizer()
    prompt, completion = tok.encode("<|im_start|>user\nQ?<|im_end|>\n"), tok.encode("A1<|im_end|>")
    ids = prompt + completion
    labelled = Dataset.from_list([{"input_ids": ids, "labels": [IGNORE_INDEX] * len(prompt) + completion}] * 4)
    masked = Dataset.from_list([{"input_ids": ids, "completion_mask": [0] * len(prompt) + [1] * len(completion)}] * 4)
    return labelled, masked


@pytest.mark.parametrize("method", ["evaluate", "predict"])
def test_an_unlabelled_mask_only_set_is_refused_by_evaluate_and_predict(tmp_path, method):
    """TRL refuses it at construction and in ``evaluate``; the diffusion collator hid TRL's collator from the check
    after construction, and every token was scored (96 of 96, of which 12 were completion tokens)."""
    labelled, masked = tokenized_rows()
    sft = trainer(tmp_path, labelled, dataset_kwargs={"skip_prepare_dataset": True})
    no_forward(sft.model)
    name = "eval" if method == "evaluate" else "test"
    with pytest.raises(ValueError, match=f"The {name} dataset has {MENTIONS_TRL_GUARD}"):
        getattr(sft, method)(masked)


def test_a_labelled_skip_prepare_set_still_evaluates(tmp_path):
    labelled, _ = tokenized_rows()
    sft = trainer(tmp_path, labelled, dataset_kwargs={"skip_prepare_dataset": True})
    assert "eval_loss" in sft.evaluate(labelled)
    assert "test_loss" in sft.predict(labelled).metrics


# ------------------------------------------------------------------------------------------------- semi_ar


def test_span_counts():
    labels = [[IGNORE_INDEX, 5, 6, IGNORE_INDEX, 7], [8, 9], [IGNORE_INDEX], [1, IGNORE_INDEX, 2, IGNORE_INDEX, 3]]
    labelled = np.array([label != IGNORE_INDEX for row in labels for label in row])
    offsets = np.concatenate([[0], np.cumsum([len(row) for row in labels])])
    assert sft_trainer._span_counts(labelled, offsets).tolist() == [2, 1, 0, 3]
    # a span ending one row and one starting the next are two spans, one per row
    assert sft_trainer._span_counts(np.array([True, True]), np.array([0, 1, 2])).tolist() == [1, 1]


def semi_ar(**kw):
    return dict(diffusion_objective="semi_ar", semi_ar_block_length=4, assistant_only_loss=True, **kw)


@pytest.mark.parametrize("where", ["train", "eval"])
def test_semi_ar_refuses_multi_turn_assistant_rows_at_construction(tmp_path, where):
    """Several labelled spans: the blocks ran from turn 1 over the later user turn to turn 2, so turn 1 was trained
    seeing the next user turn clean and turn 2's blocks were off the sampler's grid."""
    data = {"train": conversations(ONE_TURN), "eval": conversations(ONE_TURN)}
    data[where] = conversations(ONE_TURN, TWO_TURNS, copies=1)
    with pytest.raises(ValueError, match=MENTIONS_SPANS) as refused:
        trainer(tmp_path, data["train"], data["eval"], **semi_ar())
    message = str(refused.value)
    assert f"the {where} dataset has 1 row(s) with several: 1 (2 spans)" in message
    assert "prompt/completion" in message and "random_masking" in message


def test_semi_ar_accepts_one_assistant_turn_and_prompt_completion_rows(tmp_path):
    trainer(tmp_path, conversations(ONE_TURN), conversations(ONE_TURN), **semi_ar()).train()
    pairs = Dataset.from_list([{"prompt": [TWO_TURNS[0]], "completion": [TWO_TURNS[1]]}] * 2)
    trainer(tmp_path, pairs, diffusion_objective="semi_ar", semi_ar_block_length=4).train()


def test_semi_ar_with_eos_padding_is_checked_before_the_padding(tmp_path):
    """The template's newline after an assistant turn has no label, and the trained-on EOS padding comes after it:
    the data's single span is what counts, not the padded row's two."""
    sft = trainer(tmp_path, conversations(ONE_TURN), **semi_ar(pad_to_length_with_eos=True, max_length=48))
    batch = sft.data_collator([sft.train_dataset[i] for i in range(2)])
    assert (batch["labels"][0] != IGNORE_INDEX).sum() > len(tokenizer().encode("AAAAAA<|im_end|>"))
    sft.train()


def test_semi_ar_refuses_multi_turn_rows_of_a_stream_when_collated(tmp_path):
    rows = [{"messages": ONE_TURN}, {"messages": TWO_TURNS}]
    stream = IterableDataset.from_generator(lambda: iter(rows))
    sft = trainer(tmp_path, stream, **semi_ar())  # construction cannot look into the stream
    with pytest.raises(ValueError, match=MENTIONS_SPANS) as refused:
        next(iter(sft.get_train_dataloader()))
    assert "a batch has 1 row(s) with several: sample_index 1 (2 spans)" in str(refused.value)


def test_semi_ar_refuses_multi_turn_rows_passed_to_evaluate(tmp_path):
    sft = trainer(tmp_path, conversations(ONE_TURN), **semi_ar())
    no_forward(sft.model)
    with pytest.raises(ValueError, match=MENTIONS_SPANS):
        sft.evaluate(conversations(TWO_TURNS))


def test_multi_turn_rows_still_train_with_random_masking(tmp_path):
    trainer(tmp_path, conversations(TWO_TURNS), assistant_only_loss=True,
            diffusion_objective="random_masking").train()


# ------------------------------------------------------------------------------------------------ messages


def with_mask_text():
    return [{"role": "user", "content": "what is <|MASK|>?"}, {"role": "assistant", "content": "a token"}]


def test_the_mask_token_message_under_assistant_only_loss_does_not_offer_sanitize_control_tokens(tmp_path):
    """transformers refuses sanitize_control_tokens with return_assistant_tokens_mask, which assistant_only_loss
    needs: the advice led to another error."""
    with pytest.raises(ValueError, match="mask token") as refused:
        trainer(tmp_path, conversations(with_mask_text()), assistant_only_loss=True)
    message = str(refused.value)
    assert "remove or escape it in the data" in message
    assert "{'sanitize_control_tokens': True}" not in message and "assistant_only_loss=True" in message
    with pytest.raises(ValueError, match="sanitize_control_tokens': True"):  # where it works, it is still offered
        trainer(tmp_path, conversations(with_mask_text()))
    assert MASK_ID == tokenizer().convert_tokens_to_ids("<|MASK|>")


@pytest.mark.parametrize("objective", ["random_masking", "trajectory"])
def test_a_train_dataset_truncation_empties_is_refused_at_construction(tmp_path, objective):
    """TRL drops every row truncation leaves without a label (and so does the trajectory truncation, which cuts the
    recorded steps too); Trainer then failed at train() with "num_samples should be a positive integer value"."""
    data = Dataset.from_list([{"prompt": "a long prompt that fills max_length\n", "completion": "yes",
                               "unmask_step": [0, 1, 2, 3]}] * 3)
    with pytest.raises(ValueError, match="all 3 of its rows were dropped") as refused:
        trainer(tmp_path, data, max_length=8, diffusion_objective=objective)
    assert "max_length=8" in str(refused.value) and "Raise max_length" in str(refused.value)
    with pytest.raises(ValueError, match="the train dataset has no rows"):
        trainer(tmp_path, data.select([]))
    assert len(trainer(tmp_path, data, max_length=48, diffusion_objective=objective).train_dataset) == 3


def test_an_eval_dataset_empty_or_emptied_by_truncation_is_refused(tmp_path):
    """An eval set truncation empties made evaluate() log no eval_loss (metric_for_best_model then failed); an empty
    one failed in TRL with a bare StopIteration, at construction or at evaluate(eval_dataset=...)."""
    fits = Dataset.from_list([{"prompt": "Q\n", "completion": "yes"}] * 2)
    overlong = Dataset.from_list([{"prompt": "a long prompt that fills max_length\n", "completion": "yes"}] * 3)
    with pytest.raises(ValueError, match="the eval dataset is empty after preparation: all 3 of its rows"):
        trainer(tmp_path, fits, eval_dataset=overlong, max_length=8)
    with pytest.raises(ValueError, match="the eval 'hard' dataset is empty after preparation"):
        trainer(tmp_path, fits, eval_dataset={"easy": fits, "hard": overlong}, max_length=8)
    with pytest.raises(ValueError, match="the eval dataset has no rows"):
        trainer(tmp_path, fits, eval_dataset=fits.select([]), max_length=8)
    kept = trainer(tmp_path, fits, eval_dataset=fits, max_length=8)
    assert "eval_loss" in kept.evaluate()
    with pytest.raises(ValueError, match="the eval dataset has no rows"):
        kept.evaluate(fits.select([]))
    with pytest.raises(ValueError, match="the test dataset has no rows"):
        kept.predict(fits.select([]))


def test_an_empty_stream_is_refused_naming_it(tmp_path):
    # TRL read its first row with a bare StopIteration (at construction for train and eval, at evaluate())
    fits = Dataset.from_list([{"prompt": "Q\n", "completion": "yes"}] * 2)
    empty = IterableDataset.from_generator(lambda: iter([]), features=fits.features)
    with pytest.raises(ValueError, match="the train dataset has no rows"):
        trainer(tmp_path, empty)
    with pytest.raises(ValueError, match="the eval dataset has no rows"):
        trainer(tmp_path, fits, eval_dataset=empty)
    with pytest.raises(ValueError, match="the eval 'b' dataset has no rows"):
        trainer(tmp_path, fits, eval_dataset={"a": fits, "b": empty})
    with pytest.raises(ValueError, match="the eval dataset has no rows"):
        trainer(tmp_path, fits).evaluate(empty)


@pytest.mark.parametrize("value,data,warned", [
    (True, "messages", True), (True, "text", True), (None, "messages", False), (False, "messages", False),
    (True, "prompt_completion", False),
])
def test_completion_only_loss_on_language_modeling_data_is_warned_about(tmp_path, caplog, value, data, warned):
    rows = {"messages": [{"messages": ONE_TURN}], "text": [{"text": "some plain text"}],
            "prompt_completion": [{"prompt": "Q", "completion": "A"}]}[data] * 2
    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            trainer(tmp_path, Dataset.from_list(rows), completion_only_loss=value)
    finally:
        hf_logging.disable_propagation()
    found = [r for r in caplog.records if "completion_only_loss=True does nothing" in r.getMessage()]
    assert len(found) == int(warned)
    if warned:
        assert "assistant_only_loss=True" in found[0].getMessage()


def test_a_best_metric_no_eval_set_logs_is_refused_at_construction(tmp_path):
    # transformers logs eval_<set>_loss for a dict of eval sets: "loss" (load_best_model_at_end's default) failed
    # with a KeyError at the first evaluation
    fits = Dataset.from_list([{"prompt": "Q\n", "completion": "yes"}] * 2)
    with pytest.raises(ValueError, match=r"metric_for_best_model='loss' is logged by no evaluation.*'a_loss'"):
        trainer(tmp_path, fits, eval_dataset={"a": fits, "b": fits}, metric_for_best_model="loss",
                eval_strategy="steps")
    trainer(tmp_path, fits, eval_dataset={"a": fits, "b": fits}, metric_for_best_model="eval_b_loss")
    # without an eval_strategy training never looks it up: evaluate() by hand is fine
    trainer(tmp_path, fits, eval_dataset={"a": fits, "b": fits}, metric_for_best_model="loss", eval_strategy="no")
