"""Contracts of ``DiffusionSFTTrainer`` and ``DiffusionValueTrainer`` / ``DiffusionValueModel`` that no other test
pinned: refusals at construction, the collators' boundaries, where the noise seed comes from, loss normalisation,
what evaluation and training logs report, and the value model's dtype handling. Each test fails when the behaviour
it names is changed."""

import pytest
import torch
from datasets import Dataset
from trl import SFTConfig, SFTTrainer

from trl_diffusion.testing import EOS_ID, MASK_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.trainers.diffusion_losses import count_loss_tokens
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

TOKENIZER = build_tokenizer()
PAIRS = [("What is 12+7?\n", "\\boxed{19}"), ("Hi!\n", "\\boxed{-3}"), ("What is 3+4?\n", "\\boxed{7}")]


def sft_args(tmp_path, **overrides):
    fields = dict(
        output_dir=str(tmp_path),
        report_to=[],
        bf16=False,
        save_strategy="no",
        use_cpu=True,
        max_length=64,
        disable_tqdm=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        max_steps=1,
        logging_steps=1,
    )
    return DiffusionSFTConfig(**{**fields, **overrides})


def prompt_completion(pairs=PAIRS):
    return Dataset.from_list([{"prompt": p, "completion": c} for p, c in pairs])


def sft(tmp_path, family="llada", tokenizer=TOKENIZER, eval_dataset=None, **overrides):
    return DiffusionSFTTrainer(
        tiny_model(family),
        args=sft_args(tmp_path, **overrides),
        train_dataset=prompt_completion(),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


# ------------------------------------------------------------------------------------ SFT: construction refusals


def test_sft_refuses_a_custom_loss_function(tmp_path):
    """``compute_loss_func`` is refused: the diffusion objective is the loss, a user's function would be ignored."""
    with pytest.raises(ValueError, match="compute_loss_func is not supported"):
        DiffusionSFTTrainer(
            tiny_model("llada"),
            args=sft_args(tmp_path),
            train_dataset=prompt_completion(),
            processing_class=TOKENIZER,
            compute_loss_func=lambda outputs, labels, num_items: 0.0,
        )


def test_sft_refuses_label_smoothing(tmp_path):
    """``label_smoothing_factor`` (accepted by ``DiffusionSFTConfig``, a TrainingArguments field) is refused by the
    trainer: no diffusion objective applies it."""
    with pytest.raises(ValueError, match="label_smoothing_factor is not supported"):
        sft(tmp_path, label_smoothing_factor=0.1)


def test_sft_refuses_a_pad_token_that_is_the_mask_token(tmp_path):
    """A tokenizer whose pad token is the mask token is refused: padding would read as masked positions."""
    tokenizer = build_tokenizer()
    tokenizer.pad_token = tokenizer.mask_token
    with pytest.raises(ValueError, match="the pad token is the mask token"):
        sft(tmp_path, tokenizer=tokenizer)


# ------------------------------------------------------------------------------------------- SFT: the collator


def test_sft_collator_accepts_a_row_of_exactly_max_length_when_padding_with_eos(tmp_path):
    """With ``pad_to_length_with_eos`` the collator refuses rows longer than ``max_length`` only: a row truncated to
    exactly ``max_length`` is collated (to ``max_length`` columns)."""
    trainer = sft(tmp_path, pad_to_length_with_eos=True, max_length=12)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert max(len(row["input_ids"]) for row in rows) == 12
    batch = trainer.data_collator(rows)
    assert batch["input_ids"].shape == (len(rows), 12)


def test_sft_collator_refuses_seq_lengths_that_do_not_sum_to_the_row(tmp_path):
    """A packed row (``seq_lengths``) whose document lengths do not add up to its tokens is refused by name."""
    trainer = sft(tmp_path)
    with pytest.raises(ValueError, match=r"has seq_lengths \[2, 2\] \(sum 4\)"):
        trainer.data_collator([{"input_ids": [10, 11, 12, 13, 14], "seq_lengths": [2, 2], "sample_index": 0}])


# ------------------------------------------------------------------------------------------ SFT: the noise seed


def test_sft_noise_is_seeded_by_data_seed_when_it_is_set(tmp_path):
    """``data_seed`` (when set) seeds the masks instead of ``seed``: seed 0 with data_seed 5 evaluates as seed 5."""
    data = prompt_completion()

    def eval_loss(**seeds):
        return sft(tmp_path, eval_dataset=data, **seeds).evaluate()["eval_loss"]

    by_data_seed = eval_loss(seed=0, data_seed=5)
    assert by_data_seed == pytest.approx(eval_loss(seed=5), rel=1e-6)
    assert by_data_seed != pytest.approx(eval_loss(seed=0), rel=1e-3)


def test_sft_evaluation_noise_does_not_follow_the_training_epoch(tmp_path):
    """Evaluation draws epoch 0's masks whatever pass training is in, so evaluations of the same weights compare."""
    trainer = sft(tmp_path, eval_dataset=prompt_completion())
    before = trainer.evaluate()["eval_loss"]
    trainer.state.epoch = 3.0
    assert trainer.evaluate()["eval_loss"] == pytest.approx(before, rel=1e-6)


def test_sft_packed_and_shuffled_rows_are_trls_in_trls_order(tmp_path):
    """With ``packing`` and ``shuffle_dataset`` the packed rows are TRL's, in the order TRL shuffles them to (after
    packing as well as before)."""
    data = Dataset.from_list([{"prompt": p, "completion": c} for p, c in PAIRS * 4])
    common = dict(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=True,
        bf16=False,
        packing=True,
        max_length=40,
        shuffle_dataset=True,
        seed=3,
    )
    reference = SFTTrainer(
        tiny_model("llada"), args=SFTConfig(**common), train_dataset=data, processing_class=TOKENIZER
    ).train_dataset
    ours = DiffusionSFTTrainer(
        tiny_model("llada"),
        args=sft_args(tmp_path, packing=True, max_length=40, shuffle_dataset=True, seed=3),
        train_dataset=data,
        processing_class=TOKENIZER,
    ).train_dataset
    assert len(ours) > 2
    for column in ("input_ids", "labels", "seq_lengths"):
        assert ours[column] == reference[column]


def test_sft_wrapped_rows_are_seeded_by_where_they_start_in_their_sample(tmp_path):
    """Packed with ``packing_strategy='wrapped'``, each row's noise key is its first token's sample and offset in
    that sample: the rows a long sample is cut into do not all draw that sample's first row's masks."""
    data = Dataset.from_list([{"text": "abcdefghij" * 4}, {"text": "klmnopqrst" * 2}])
    trainer = DiffusionSFTTrainer(
        tiny_model("llada"),
        args=sft_args(tmp_path, packing=True, packing_strategy="wrapped", max_length=16),
        train_dataset=data,
        processing_class=TOKENIZER,
    )
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(rows)
    assert batch["sample_index"].tolist() == [row["sample_index"][0] for row in rows]
    assert batch["sample_offset"].tolist() == [row["sample_offset"][0] for row in rows]
    assert len(set(zip(batch["sample_index"].tolist(), batch["sample_offset"].tolist()))) == len(rows) > 2


def test_sft_unmask_step_column_is_ignored_by_other_objectives(tmp_path):
    """Only ``trajectory`` reads ``unmask_step``: rollout rows kept whole (``remove_unused_columns=False``) train
    with ``random_masking`` as plain prompt/completion rows, their per-completion-token steps unread."""
    rows = [{"prompt": p, "completion": c, "unmask_step": list(range(len(TOKENIZER.encode(c)) + 1))} for p, c in PAIRS]
    trainer = DiffusionSFTTrainer(
        tiny_model("llada"),
        args=sft_args(tmp_path, remove_unused_columns=False),
        train_dataset=Dataset.from_list(rows),
        processing_class=TOKENIZER,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(rows))])
    assert "unmask_step" not in batch and "generated" not in batch
    plain = sft(tmp_path)
    expected = plain.data_collator([plain.train_dataset[i] for i in range(len(rows))])
    assert torch.equal(batch["labels"], expected["labels"])


# ---------------------------------------------------------------------------------------- SFT: loss normalisation


def text_rows(pairs=PAIRS):
    return Dataset.from_list([{"text": p + c} for p, c in pairs])


def test_sft_loss_without_num_items_counts_the_tokens_a_shifted_model_predicts(tmp_path):
    """Called without ``num_items_in_batch`` (a padded eval batch), the loss of a shifted-logits model (Dream) is
    divided by its loss tokens after each row's first (``labels[:, 1:]``), as Trainer counts them in training."""
    trainer = DiffusionSFTTrainer(
        tiny_model("dream"), args=sft_args(tmp_path), train_dataset=text_rows(), processing_class=TOKENIZER
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(PAIRS))])
    assert (batch["labels"][:, 0] != -100).all()  # text rows: the first token has a label nothing predicts
    with torch.no_grad():
        alone = trainer.compute_loss(trainer.model, batch)
        items = count_loss_tokens(batch["labels"], True)
        counted = trainer.compute_loss(trainer.model, batch, num_items_in_batch=items)
    torch.testing.assert_close(alone, counted, rtol=1e-6, atol=0)


def test_sft_row_tokens_normalisation_of_a_shifted_model_leaves_out_the_first_label(tmp_path):
    """``loss_normalization='row_tokens'`` divides a Dream row's loss by its loss tokens after the first (which
    nothing predicts): one row of n labelled tokens evaluates to its ``row_length`` (length 1) loss over n - 1."""
    row = text_rows(PAIRS[:1])
    losses = {}
    for normalization, extra in (("row_tokens", {}), ("row_length", {"loss_normalization_length": 1})):
        trainer = DiffusionSFTTrainer(
            tiny_model("dream"),
            args=sft_args(tmp_path, loss_normalization=normalization, **extra),
            train_dataset=row,
            eval_dataset=row,
            processing_class=TOKENIZER,
        )
        losses[normalization] = trainer.evaluate()["eval_loss"]
    labelled = sum(label != -100 for label in trainer.eval_dataset[0]["labels"])
    assert losses["row_tokens"] * (labelled - 1) == pytest.approx(losses["row_length"], rel=1e-5)


def test_sft_row_normalised_evaluation_after_accumulated_training_is_not_divided_by_the_accumulation_steps(tmp_path):
    """A per-row normalised evaluation loss is not divided by ``gradient_accumulation_steps`` (left set by training):
    with a zero learning rate, the evaluation after a step of two accumulated micro-batches equals the one before."""
    trainer = sft(
        tmp_path,
        eval_dataset=prompt_completion(),
        loss_normalization="row_tokens",
        gradient_accumulation_steps=2,
        learning_rate=0.0,
        per_device_train_batch_size=1,
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    assert trainer.current_gradient_accumulation_steps == 2
    assert trainer.evaluate()["eval_loss"] == pytest.approx(before, rel=1e-6)


def test_sft_evaluation_reports_only_its_own_batches(tmp_path):
    """``evaluate()`` starts from no evaluation metrics: a scoring in eval mode outside it (an interrupted evaluation,
    a ``compute_loss`` call) is not averaged into its entropy, accuracy or scored-token count."""
    trainer = sft(tmp_path, eval_dataset=prompt_completion())
    clean = trainer.evaluate()
    trainer.model.eval()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, trainer.data_collator([trainer.eval_dataset[0]]))
    again = trainer.evaluate()
    for name in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy", "eval_scored_tokens"):
        assert again[name] == pytest.approx(clean[name], rel=1e-6), name


# ----------------------------------------------------------------------------------- SFT: positions and vocabulary


def test_sft_eos_padding_to_exactly_the_models_positions_is_accepted(tmp_path):
    """``pad_to_length_with_eos`` to a ``max_length`` equal to the model's positions fits: built, and collated to
    that width (only a longer one is refused)."""
    trainer = DiffusionSFTTrainer(
        tiny_model("sdar", max_position_embeddings=32),
        args=sft_args(tmp_path, pad_to_length_with_eos=True, max_length=32),
        train_dataset=prompt_completion(),
        processing_class=TOKENIZER,
    )
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["input_ids"].shape == (1, 32)


def test_sft_refuses_at_construction_a_token_id_equal_to_the_embedding_rows(tmp_path):
    """A prepared row holding the id ``rows`` (one past the model's last embedding row) is refused when the trainer
    is built, not at the first step."""
    model = tiny_model("sdar", vocab_size=64)
    rows = Dataset.from_list([{"input_ids": [10, 11, 12, 13]}, {"input_ids": [10, 64, 12, 63]}])
    message = r"1 row\(s\) of the prepared train dataset \(1\): token ids outside \[0, 64\)"
    with pytest.raises(ValueError, match=message):
        DiffusionSFTTrainer(model, args=sft_args(tmp_path), train_dataset=rows, processing_class=TOKENIZER)


# ------------------------------------------------------------------------------------------------- value trainer

ROLLOUTS = [
    dict(prompt="abc", completion_ids=[30, 31, EOS_ID, 33], unmask_step=[0, 0, 1, 1], reward=1.0),
    dict(prompt="What is 2?", completion_ids=[40, 41, 42], unmask_step=[1, 0, -1], reward=-0.5),
    dict(prompt="xy", completion_ids=[50, 51, 52, 53, 54], unmask_step=[2, 0, 1, 0, 2], reward=0.25),
]


def value_args(tmp_path, **overrides):
    fields = dict(
        output_dir=str(tmp_path),
        bf16=False,
        use_cpu=True,
        report_to="none",
        max_steps=1,
        save_strategy="no",
        per_device_train_batch_size=3,
        per_device_eval_batch_size=3,
        disable_tqdm=True,
        logging_steps=1,
        seed=0,
    )
    return DiffusionValueConfig(**{**fields, **overrides})


def value_model(family="sdar"):
    value = DiffusionValueModel.from_policy(tiny_model(family))
    with torch.no_grad():  # values that are not all 0
        value.value_head.weight.normal_(generator=torch.Generator().manual_seed(0))
    return value


def value_trainer(tmp_path, rows=ROLLOUTS, model=None, eval_dataset=None, **overrides):
    return DiffusionValueTrainer(
        model if model is not None else value_model(),
        args=value_args(tmp_path, **overrides),
        train_dataset=Dataset.from_list(rows),
        eval_dataset=eval_dataset,
        processing_class=TOKENIZER,
    )


def test_value_trainer_refuses_arguments_of_another_config_class(tmp_path):
    """``args`` must be a ``DiffusionValueConfig``: an ``SFTConfig`` (no gamma, shrinkage, budget) is refused."""
    with pytest.raises(TypeError, match="args must be a DiffusionValueConfig, got SFTConfig"):
        DiffusionValueTrainer(
            value_model(),
            args=SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none"),
            train_dataset=Dataset.from_list(ROLLOUTS),
            processing_class=TOKENIZER,
        )


@pytest.mark.parametrize("truncate", [True, False])
def test_value_trained_tokens_stop_at_eos_only_with_truncate_at_eos(tmp_path, truncate):
    """``truncate_at_eos=True`` trains a row up to and including its first EOS; with False every committed token
    is trained, those after an EOS too."""
    trainer = value_trainer(tmp_path, truncate_at_eos=truncate)
    batch = trainer.data_collator([trainer.train_dataset[0]])
    expected = [True, True, True, not truncate]
    assert batch["trained_mask"][0].tolist() == expected


def test_value_evaluate_of_named_sets_checks_them_all_before_evaluating_any(tmp_path):
    """``evaluate({name: dataset})`` prepares every set first: an empty second set is refused by its name before the
    first is evaluated."""
    trainer = value_trainer(tmp_path)
    empty = Dataset.from_dict({column: [] for column in ("prompt", "completion_ids", "unmask_step", "reward")})
    with pytest.raises(ValueError, match="the eval 'b' dataset has no rows"):
        trainer.evaluate({"a": Dataset.from_list(ROLLOUTS), "b": empty})
    assert not any("eval_a_loss" in entry for entry in trainer.state.log_history)


def test_value_evaluation_reports_only_its_own_batches(tmp_path):
    """``evaluate()`` starts from no value statistics: a scoring in eval mode outside it (an interrupted evaluation, a
    ``compute_loss`` call) is not summed into its ``eval_value/`` statistics."""
    trainer = value_trainer(tmp_path)
    clean = trainer.evaluate(Dataset.from_list(ROLLOUTS))
    trainer.model.eval()
    with torch.no_grad():
        trainer.compute_loss(trainer.model, trainer.data_collator([trainer.train_dataset[2]]))
    again = trainer.evaluate(Dataset.from_list(ROLLOUTS))
    for name in ("eval_value/mean", "eval_value/explained_variance"):
        assert again[name] == pytest.approx(clean[name], rel=1e-6), name


def test_value_evaluation_logs_carry_no_training_statistics(tmp_path):
    """An evaluation between two training logs logs only ``eval_value/`` statistics: the training window's
    ``value/`` statistics stay for the training log, which covers both of its steps."""
    rows = ROLLOUTS + [dict(prompt="q", completion_ids=[60, 61], unmask_step=[0, 1], reward=2.0)]
    trainer = value_trainer(
        tmp_path,
        rows=rows,
        eval_dataset=Dataset.from_list(ROLLOUTS),
        max_steps=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        per_device_train_batch_size=2,
    )
    trainer.train()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    training = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(evaluations) == 2 and len(training) == 1
    assert all("eval_value/mean" in entry and "value/mean" not in entry for entry in evaluations)
    assert "value/mean" in training[0] and training[0]["step"] == 2


def test_value_each_training_log_covers_only_its_own_window(tmp_path):
    """The ``value/`` statistics restart after each log: with a zero learning rate and one rollout per step, each
    step's logged mean value is that rollout's alone (its evaluation), not a running sum over the steps."""
    rows = ROLLOUTS[:2]
    trainer = value_trainer(tmp_path, rows=rows, max_steps=2, per_device_train_batch_size=1, learning_rate=0.0)
    alone = [trainer.evaluate(Dataset.from_list([row]))["eval_value/mean"] for row in rows]
    assert abs(alone[0] - alone[1]) > 1e-3 * max(abs(a) for a in alone)
    trainer.train()
    logged = [entry["value/mean"] for entry in trainer.state.log_history if "loss" in entry]
    assert sorted(logged) == pytest.approx(sorted(alone), rel=1e-5)


def test_value_non_padding_input_tokens_count_whole_canvases(tmp_path):
    """``include_num_input_tokens_seen='non_padding'`` counts each rollout's prompt and whole canvas (its
    never-committed and after-EOS columns too), only the batch padding left out."""
    trainer = value_trainer(tmp_path, include_num_input_tokens_seen="non_padding")
    trainer.train()
    prompts = sum(len(trainer.train_dataset[i]["prompt_ids"]) for i in range(len(ROLLOUTS)))
    canvases = sum(len(row["completion_ids"]) for row in ROLLOUTS)
    assert trainer.state.num_input_tokens_seen == prompts + canvases


def test_value_refuses_a_completion_id_equal_to_the_vocabulary_size(tmp_path):
    """A completion id equal to the model's embedding rows (128) is out of the vocabulary, refused by row and
    column."""
    row = {**ROLLOUTS[0], "completion_ids": [30, 31, 128, 33]}
    with pytest.raises(ValueError, match=r"row 0: 'completion_ids'\[2\] must be an integer \[0, 128\), got 128"):
        value_trainer(tmp_path, rows=[row])


def test_value_mask_token_is_allowed_only_where_nothing_was_committed(tmp_path):
    """The mask id may fill a never-committed canvas column (step -1), as a sampler leaves it; a committed mask id is
    refused."""
    uncommitted = {**ROLLOUTS[1], "completion_ids": [40, 41, MASK_ID]}
    assert value_trainer(tmp_path, rows=[uncommitted]).train_dataset[0]["completion_ids"][-1] == MASK_ID
    committed = {**ROLLOUTS[1], "completion_ids": [40, MASK_ID, 42]}
    with pytest.raises(ValueError, match="row 0: the completion_ids hold"):
        value_trainer(tmp_path, rows=[committed])


def test_value_refuses_an_empty_conversation_as_a_prompt_by_row(tmp_path):
    """A prompt that is an empty conversation is refused by row, as an empty prompt (TRL failed with an
    IndexError)."""
    with pytest.raises(ValueError, match=r"row 0: the prompt is empty \(\[\]\)"):
        value_trainer(tmp_path, rows=[{**ROLLOUTS[0], "prompt": []}])


def test_value_rows_prepared_with_other_chat_template_kwargs_are_prepared_again(tmp_path):
    """``chat_template_kwargs`` is one of the settings a prepared value dataset is kept for: another trainer's rows,
    rendered without the keyword this trainer's template reads, are not used as they are."""
    tokenizer = build_tokenizer()
    tokenizer.chat_template = "{{ hint or '' }}" + tokenizer.chat_template
    chat = Dataset.from_list([{**ROLLOUTS[0], "prompt": [{"role": "user", "content": "abc"}]}])
    plain = DiffusionValueTrainer(
        value_model(), args=value_args(tmp_path), train_dataset=chat, processing_class=tokenizer
    )
    hinted = DiffusionValueTrainer(
        value_model(),
        args=value_args(tmp_path, chat_template_kwargs={"hint": "zz"}),
        train_dataset=chat,
        processing_class=tokenizer,
    )
    assert hinted.train_dataset[0]["prompt_ids"][:2] == tokenizer.encode("zz")
    with pytest.raises(ValueError, match="with other settings"):
        hinted.evaluate(plain.train_dataset)


# --------------------------------------------------------------------------------------------------- value model


def test_value_head_kept_in_float32_reads_a_half_precision_backbone():
    """The hidden states are cast to the head's dtype: a float32 head over a bfloat16 backbone gives float32 values,
    the head applied to the hidden states."""
    value = value_model()
    value.model.to(torch.bfloat16)
    ids = torch.tensor([[20, 21, 22, 23]])
    with torch.no_grad():
        out = value(ids, output_hidden_states=True)
        expected = out.hidden_states[-1].float() @ value.value_head.weight[0]
    assert out.value.dtype == torch.float32
    torch.testing.assert_close(out.value, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
