"""Review of the TRL fields a user sets on DiffusionSFTConfig / DiffusionValueConfig: each test guards a field that
was accepted and then silently ignored or silently wrong with the diffusion objectives."""

import pytest
from datasets import Dataset

from trl_diffusion.testing import EOS_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.value import DiffusionValueConfig

PAIRS = [("What is 12+7?\n", "\\boxed{19}"), ("Hi!\n", "\\boxed{-3}"), ("What is 3+4?\n", "\\boxed{7}")]


def sft_args(tmp_path, **kw):
    defaults = dict(output_dir=str(tmp_path), report_to=[], bf16=False, save_strategy="no", use_cpu=True,
                    max_length=64, disable_tqdm=True, per_device_train_batch_size=2, max_steps=1,
                    gradient_checkpointing=False, logging_steps=1)
    return DiffusionSFTConfig(**{**defaults, **kw})


def prompt_completion():
    return Dataset.from_list([{"prompt": p, "completion": c} for p, c in PAIRS])


def test_eval_packing_packs_the_eval_set_and_keeps_its_eval_loss(tmp_path):
    """eval_packing=True packs the eval set (TRL packs it even with packing=False): the three samples become one row
    whose documents attended to each other under full attention before documents were kept apart (it was refused
    then). Now the packed eval set gives the unpacked eval_loss (same noise, same per-document attention)."""
    losses = {}
    for eval_packing in (False, True):
        trainer = DiffusionSFTTrainer(tiny_model("llada"), args=sft_args(tmp_path, eval_packing=eval_packing),
                                      train_dataset=prompt_completion(), eval_dataset=prompt_completion(),
                                      processing_class=build_tokenizer())
        assert len(trainer.eval_dataset) == (1 if eval_packing else len(PAIRS))
        losses[eval_packing] = trainer.evaluate()["eval_loss"]
    assert losses[True] == pytest.approx(losses[False], rel=1e-5)


def test_value_config_refuses_label_smoothing(tmp_path):
    """DiffusionValueTrainer's loss is 0.5 (V - R)^2: label_smoothing_factor=0.3 was accepted and changed nothing
    (same loss and weights as 0.0 after a step)."""
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        DiffusionValueConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=0.3)
    DiffusionValueConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, label_smoothing_factor=0.0)


def tokenized_rows(with_steps=False):
    tokenizer = build_tokenizer()
    rows = []
    for p, c in PAIRS:
        prompt, completion = tokenizer.encode(p), tokenizer.encode(c) + [EOS_ID]
        row = {"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion}
        if with_steps:  # per completion token, as the prepared path takes it
            row["unmask_step"] = list(range(len(completion)))
        rows.append(row)
    return rows


SKIP = {"skip_prepare_dataset": True}


@pytest.mark.parametrize("field", [dict(overlong_policy="error"), dict(pad_to_length_with_eos=True)])
def test_skip_prepare_dataset_rows_longer_than_max_length_are_refused(tmp_path, field):
    """skip_prepare_dataset skips TRL's truncation and our length check: overlong_policy='error' let 25-token rows
    through max_length=8, and pad_to_length_with_eos gave a 25-wide batch instead of the fixed 8-token canvas."""
    args = sft_args(tmp_path, max_length=8, dataset_kwargs=SKIP, **field)
    trainer = DiffusionSFTTrainer(tiny_model("llada"), args=args, train_dataset=Dataset.from_list(tokenized_rows()),
                                  processing_class=build_tokenizer())
    with pytest.raises(ValueError, match="longer than max_length=8"):
        next(iter(trainer.get_train_dataloader()))
    fits = DiffusionSFTTrainer(tiny_model("llada"), args=sft_args(tmp_path, max_length=32, dataset_kwargs=SKIP,
                                                                  **field),
                               train_dataset=Dataset.from_list(tokenized_rows()), processing_class=build_tokenizer())
    batch = next(iter(fits.get_train_dataloader()))  # rows that fit still collate
    if "pad_to_length_with_eos" in field:
        assert batch["input_ids"].shape[1] == 32


def test_skip_prepare_dataset_unmask_step_must_cover_every_position(tmp_path):
    """Prepared rows get unmask_step spread over the sequence; skipped rows are used as given. A per-completion-token
    column (the prepared path's format) landed on the prompt's positions and failed in the loss with 'some
    completion tokens have no recorded unmask_step'; the error now says what the column must hold."""
    args = sft_args(tmp_path, diffusion_objective="trajectory", dataset_kwargs=SKIP)
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=Dataset.from_list(tokenized_rows(True)),
                                  processing_class=build_tokenizer())
    with pytest.raises(ValueError, match="one per position of input_ids"):
        next(iter(trainer.get_train_dataloader()))
    full = [{**row, "unmask_step": [-1] * (len(row["input_ids"]) - len(row["unmask_step"])) + row["unmask_step"]}
            for row in tokenized_rows(True)]
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=Dataset.from_list(full),
                                  processing_class=build_tokenizer())
    trainer.train()
    assert trainer.state.log_history[0]["loss"] > 0


def test_use_liger_kernel_is_refused(tmp_path):
    """Liger maps model types to kernels and has none for sdar / llada / Dream: use_liger_kernel=True patched
    nothing (liger only logs it) and the diffusion loss never used a fused cross-entropy."""
    with pytest.raises(ValueError, match="use_liger_kernel"):
        sft_args(tmp_path, use_liger_kernel=True)
    with pytest.raises(ValueError, match="use_liger_kernel"):
        DiffusionValueConfig(output_dir=str(tmp_path), report_to=[], use_cpu=True, use_liger_kernel=True)


def test_dataset_text_field_names_the_text_column(tmp_path):
    """A language-modelling dataset whose text column is not ``text``: trained with ``dataset_text_field``, refused
    (naming the columns) without it."""
    tokenizer = build_tokenizer()
    dataset = Dataset.from_list([{"content": p + c} for p, c in PAIRS])
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=sft_args(tmp_path, dataset_text_field="content"),
                                  train_dataset=dataset, processing_class=tokenizer)
    assert trainer.train_dataset[0]["input_ids"][:-1] == tokenizer.encode(PAIRS[0][0] + PAIRS[0][1])
    trainer.train()
    assert trainer.state.log_history[0]["loss"] > 0
    with pytest.raises(ValueError, match=r"has columns \['content'\], none of which SFT can train on"):
        DiffusionSFTTrainer(tiny_model("sdar"), args=sft_args(tmp_path), train_dataset=dataset,
                            processing_class=tokenizer)


def test_truncation_mode_keep_end_keeps_the_last_tokens_and_their_labels(tmp_path):
    tokenizer = build_tokenizer()
    full = tokenizer.encode(PAIRS[0][0] + PAIRS[0][1]) + [EOS_ID]
    args = sft_args(tmp_path, max_length=6, truncation_mode="keep_end")
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=args, train_dataset=prompt_completion(),
                                  processing_class=tokenizer)
    row = trainer.train_dataset[0]
    assert row["input_ids"] == full[-6:] and row["labels"] == full[-6:]  # the completion's end: every token scored


def test_pad_to_multiple_of_pads_the_batch_and_scores_no_padding(tmp_path):
    trainer = DiffusionSFTTrainer(tiny_model("llada"), args=sft_args(tmp_path, pad_to_multiple_of=16),
                                  train_dataset=prompt_completion(), processing_class=build_tokenizer())
    rows = [trainer.train_dataset[i] for i in range(2)]
    batch = trainer.data_collator(rows)
    longest = max(len(r["input_ids"]) for r in rows)
    assert batch["input_ids"].shape[1] == -(-longest // 16) * 16 > longest
    assert int(batch["attention_mask"].sum()) == sum(len(r["input_ids"]) for r in rows)
    assert int(batch["labels"].ne(-100).sum()) == sum(sum(label != -100 for label in r["labels"]) for r in rows)


def test_skip_prepare_dataset_labels_other_than_the_input_ids_are_refused(tmp_path):
    """The diffusion objectives read labels as a mask (-100: not trained) and predict the input ids: labels holding
    other values (shifted labels, other targets) gave exactly the loss of labels equal to the input ids."""
    rows = tokenized_rows()
    shifted = [{**row, "labels": row["labels"][1:] + [-100]} for row in rows]
    args = sft_args(tmp_path, dataset_kwargs=SKIP)
    trainer = DiffusionSFTTrainer(tiny_model("llada"), args=args, train_dataset=Dataset.from_list(shifted),
                                  processing_class=build_tokenizer())
    with pytest.raises(ValueError, match=r"row 0 of a batch has labels other than its input_ids \(or -100\)"):
        next(iter(trainer.get_train_dataloader()))
    shorter = [{**row, "labels": row["labels"][:-1]} for row in rows]
    with pytest.raises(ValueError, match="labels other than its input_ids"):
        trainer.evaluate(Dataset.from_list(shorter))
    DiffusionSFTTrainer(tiny_model("llada"), args=args, train_dataset=Dataset.from_list(rows),
                        processing_class=build_tokenizer()).train()  # labels = input ids or -100: trains


def test_what_trl_would_ignore_in_prompt_completion_rows_is_refused(tmp_path):
    """TRL 1.16 writes formatting_func's text to 'text' and then tokenizes prompt / messages rows instead (the
    function's text was ignored), and appends the EOS token to a 'text' column before a 'completion' one (the
    completions trained without EOS)."""
    def build(rows, **kwargs):
        return DiffusionSFTTrainer(tiny_model("llada"), args=sft_args(tmp_path), train_dataset=Dataset.from_list(rows),
                                   processing_class=build_tokenizer(), **kwargs)

    with pytest.raises(ValueError, match=r"formatting_func writes the 'text'.*\['prompt'\], which TRL tokenizes"):
        build([{"prompt": p, "completion": c} for p, c in PAIRS], formatting_func=lambda row: "ZZ")
    with pytest.raises(ValueError, match=r"both 'text' \(dataset_text_field\) and 'completion'"):
        build([{"prompt": p, "completion": c, "text": "raw"} for p, c in PAIRS])
    # conversational pairs get their end of turn from the chat template, whatever a text column holds
    build([{"prompt": [{"role": "user", "content": p}], "completion": [{"role": "assistant", "content": c}],
            "text": "raw"} for p, c in PAIRS])
    trainer = build([{"prompt": p, "completion": c} for p, c in PAIRS])
    assert trainer.train_dataset[0]["input_ids"][-1] == EOS_ID  # the completion ends with EOS
    build([{"text": p + c} for p, c in PAIRS], formatting_func=lambda row: row["text"])  # what it is for
