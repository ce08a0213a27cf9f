"""SFT with ``packing`` / ``padding_free``: several documents in one row, none attending to another, each scored
exactly as it is unpacked (same noise, same log-probs, same loss and gradient), on TRL's own packed rows."""

import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32
from test_attention_backends import flex_mask_as_dense
from test_sft import PAIRS, TOKENIZER, config, conversational
from trl import SFTConfig, SFTTrainer

from trl_diffusion.states import AttentionLayout, noisy_clean_attention_layout, noisy_columns
from trl_diffusion.testing import tiny_model
from trl_diffusion.trainers import DiffusionSFTTrainer, diffusion_losses
from trl_diffusion.trainers import sft_trainer as sft_trainer_module
from trl_diffusion.trainers.diffusion_losses import build_objective, count_loss_tokens, sample_generators

pytestmark = pytest.mark.usefixtures("in_tmp_path")  # their trainers write into output_dir="unused"

MORE_PAIRS = PAIRS + [("What is 3+4?", "\\boxed{7}"), ("Say hi.", "hello there friend")]


def text_data():
    """Language-modeling rows: every token is trained on, the first of each document included."""
    return Dataset.from_list([{"text": p + c} for p, c in MORE_PAIRS])


def one_step(family, data, **settings):
    """The first training batch of a trainer and the loss and gradient of one step on it (all data in the batch)."""
    torch.manual_seed(0)
    model = tiny_model(family).train()
    trainer = DiffusionSFTTrainer(model, args=config("unused", per_device_train_batch_size=8, **settings),
                                  train_dataset=data, processing_class=TOKENIZER)
    batch = next(iter(trainer.get_train_dataloader()))
    count = count_loss_tokens(batch["labels"], model.logits_shift)  # what Trainer counts (labels[1:] for Dream)
    loss = trainer.compute_loss(model, batch, num_items_in_batch=count)
    loss.backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return batch, loss, gradient


@pytest.mark.parametrize(("family", "data"), [
    ("sdar", "completion-only"), ("llada", "completion-only"), ("dream", "completion-only"),
    ("sdar", "text"), ("llada", "text"),
])
def test_packed_documents_are_scored_exactly_as_unpacked(family, data):
    """Packed (TRL's BFD: five documents in one or two rows) and padding-free (five in one row) batches give the
    unpacked batch's loss and gradient: each document draws the noise it draws alone and sees only itself. On text
    data every document's first token is trained on, as it is unpacked (TRL's collator drops its label; it is
    restored here). Padding to a multiple of 16 (rows of 64) changes nothing either. Dream on text data: see the
    next test."""
    data = conversational(MORE_PAIRS) if data == "completion-only" else text_data()
    plain, loss, gradient = one_step(family, data)
    for settings in ({"packing": True, "max_length": 128}, {"padding_free": True, "max_length": None},
                     {"packing": True, "max_length": 64, "pad_to_multiple_of": 16}):
        packed, packed_loss, packed_gradient = one_step(family, data, **settings)
        assert packed["document_ids"].max() == 4
        if settings.get("packing"):  # packed rows (of several documents in rows of 128), one row each
            assert packed["input_ids"].shape[0] < (5 if settings["max_length"] == 128 else 6)
            assert "example_lengths" not in packed
            assert packed["input_ids"].shape[1] % settings.get("pad_to_multiple_of", 1) == 0
        else:  # the five examples in one row
            assert packed["input_ids"].shape[0] == 1 and len(packed["example_lengths"]) == 5
        shift = family == "dream"
        assert count_loss_tokens(packed["labels"], shift) == count_loss_tokens(plain["labels"], shift)
        assert_close_fp32(packed_loss, loss)
        assert_close_fp32(packed_gradient, gradient)


def test_dream_never_masks_a_packed_documents_first_token():
    """Dream's shifted logits cannot predict a document's first token. Packed, it keeps TRL's -100 label there, so it
    is never masked and never a target (unpacked rows of text data mask it as noise: the one difference)."""
    packed, _, _ = one_step("dream", text_data(), packing=True, max_length=128)
    starts = packed["position_ids"] == 0
    assert int(starts.sum()) == 5 and (packed["labels"][starts] == -100).all()
    assert (packed["labels"][~starts & (packed["document_ids"] >= 0)] != -100).all()


def test_without_the_document_rule_packed_documents_would_differ():
    """The equality above is not vacuous: the same packed row scored as one document (attention crossing the
    boundaries) moves the loss."""
    model = tiny_model("sdar")
    torch.manual_seed(0)
    trainer = DiffusionSFTTrainer(model, args=config("unused", packing=True, max_length=128,
                                                     per_device_train_batch_size=8),
                                  train_dataset=text_data(), processing_class=TOKENIZER)
    batch = next(iter(trainer.get_train_dataloader()))
    generators = sample_generators(batch["sample_index"].tolist(), 0, 0, batch["sample_offset"].tolist())
    valid = batch["document_ids"] >= 0
    packed = build_objective("block", batch["input_ids"], batch["labels"], valid, generators,
                             mask_token_id=model.mask_token_id, block_size=model.block_size,
                             position_ids=batch["position_ids"], documents=batch["document_ids"])
    crossing = AttentionLayout(packed.layout.block, packed.layout.copy, packed.layout.valid, None)
    with torch.no_grad():
        kept = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                     attention_mask=packed.layout.dense()).logits
        crossed = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                        attention_mask=crossing.dense()).logits
    scored = packed.targets != -100
    assert (kept[scored] - crossed[scored]).abs().max() > 1e-2


def test_packed_rows_are_trls_and_carry_each_tokens_sample():
    """The packed dataset has TRL's rows (same input_ids, labels, seq_lengths as ``SFTTrainer(packing=True)``) plus,
    for every token, its sample's index and its position in that sample (the noise seed)."""
    data = conversational(MORE_PAIRS * 2)
    common = dict(output_dir="unused", report_to=[], use_cpu=True, bf16=False, packing=True, max_length=100)
    reference = SFTTrainer(tiny_model("llada"), args=SFTConfig(**common), train_dataset=data,
                           processing_class=TOKENIZER).train_dataset
    ours = DiffusionSFTTrainer(tiny_model("llada"), args=config("unused", packing=True, max_length=100),
                               train_dataset=data, processing_class=TOKENIZER).train_dataset
    for column in ("input_ids", "labels", "seq_lengths"):
        assert ours[column] == reference[column]
    assert len(ours) < len(data)
    for row in ours:
        starts = [sum(row["seq_lengths"][:i]) for i in range(len(row["seq_lengths"]))]
        for start, length in zip(starts, row["seq_lengths"]):
            assert row["sample_offset"][start : start + length] == list(range(length))
            assert len(set(row["sample_index"][start : start + length])) == 1
    indices = [row["sample_index"][start] for row in ours
               for start in [sum(row["seq_lengths"][:i]) for i in range(len(row["seq_lengths"]))]]
    assert sorted(indices) == list(range(len(data)))


def test_a_streamed_dataset_is_packed_as_trl_packs_it():
    """An ``IterableDataset`` packs too (TRL supports it): the same rows as TRL's, with the per-token seed columns,
    and it trains."""
    data = conversational(MORE_PAIRS * 2).to_iterable_dataset()
    common = dict(output_dir="unused", report_to=[], use_cpu=True, bf16=False, packing=True, max_length=100)
    reference = SFTTrainer(tiny_model("llada"), args=SFTConfig(**common, max_steps=1), train_dataset=data,
                           processing_class=TOKENIZER).train_dataset
    trainer = DiffusionSFTTrainer(tiny_model("llada"), args=config("unused", packing=True, max_length=100),
                                  train_dataset=data, processing_class=TOKENIZER)
    ours = list(trainer.train_dataset)
    assert [row["input_ids"] for row in ours] == [row["input_ids"] for row in reference]
    assert all(len(row["sample_index"]) == len(row["input_ids"]) for row in ours)
    trainer.train()
    assert trainer.state.global_step == 1


def test_split_fragments_get_their_own_noise():
    """``bfd_split`` cuts a long sample into fragments; each starts past position 0 of its sample (its
    ``sample_offset``) and so draws fresh noise, not a copy of its sibling's."""
    long_text = [{"text": " ".join(["12+7=19"] * 12)}]
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=config("unused", packing=True, max_length=32,
                                                                  packing_strategy="bfd_split"),
                                  train_dataset=Dataset.from_list(long_text), processing_class=TOKENIZER)
    batch = next(iter(trainer.get_train_dataloader()))
    offsets = batch["sample_offset"].tolist()
    assert len(offsets) >= 3 and len(set(offsets)) == len(offsets) and 0 in offsets
    assert set(batch["sample_index"].tolist()) == {0}
    generators = sample_generators(batch["sample_index"].tolist(), 0, 0, offsets)
    first_draws = [torch.rand(1, generator=g).item() for g in generators]
    assert len(set(first_draws)) == len(first_draws)
    trainer.train()
    assert trainer.state.global_step == 1


def test_padding_free_masks_keep_documents_apart_under_both_backends():
    """Two documents in one row: no query sees a key of the other document, in the dense mask and the flex
    BlockMask alike, and within a document the mask is the unpacked one."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 0]])
    documents = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, -1]])
    valid = documents >= 0
    noisy = noisy_columns(torch.ones_like(valid))
    layouts = [AttentionLayout.plain(positions, valid, None, documents),
               AttentionLayout.plain(positions, valid, 2, documents),
               noisy_clean_attention_layout(positions, valid, 2, noisy, documents)]
    alone = [AttentionLayout.plain(positions[:, :5], valid[:, :5], None),
             AttentionLayout.plain(positions[:, :5], valid[:, :5], 2),
             noisy_clean_attention_layout(positions[:, :5], valid[:, :5], 2)]
    for layout, single in zip(layouts, alone):
        dense = layout.dense()[0, 0]
        with torch.no_grad():
            flex = flex_mask_as_dense(layout)[0, 0]
        real = layout.valid[0]
        assert torch.equal(flex[real], dense[real])
        other = layout.document[0][:, None] != layout.document[0][None, :]
        assert not dense[real][:, real][other[real][:, real]].any()
        first = (layout.document[0] == 0).nonzero().flatten()
        assert torch.equal(dense[first][:, first], single.dense()[0, 0])


@pytest.mark.parametrize("settings", [dict(padding_free=True, max_length=None), dict(packing=True, max_length=100)],
                         ids=["padding_free", "packing"])
def test_eval_with_packing_and_a_cut_batch(monkeypatch, settings):
    """Evaluation runs on packed rows; when a padded last batch holds duplicated samples, only the real examples'
    documents are scored (here the first example of the batch, one sample or one packed row: its loss alone)."""
    data = conversational(MORE_PAIRS * 2)
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=config("unused", per_device_eval_batch_size=8, **settings),
                                  train_dataset=data, eval_dataset=data, processing_class=TOKENIZER)
    assert trainer.evaluate()["eval_loss"] > 0
    batch = next(iter(trainer.get_eval_dataloader()))
    trainer.model.eval()
    monkeypatch.setattr(sft_trainer_module, "real_eval_rows", lambda accelerator, loader, rows: 1)
    with torch.no_grad():
        cut = trainer.compute_loss(trainer.model, batch)
    alone = next(iter(trainer.get_eval_dataloader(trainer.eval_dataset.select([0]))))
    assert alone["input_ids"].shape[0] == 1 and alone["document_ids"].max() >= 0
    monkeypatch.setattr(sft_trainer_module, "real_eval_rows", lambda accelerator, loader, rows: None)
    with torch.no_grad():
        expected = trainer.compute_loss(trainer.model, alone)
    assert_close_fp32(cut, expected)


@pytest.mark.parametrize("objective", ["semi_ar", "trajectory"])
def test_objectives_without_packed_rows_refuse_packing(objective):
    with pytest.raises(ValueError, match="packed rows train with"):
        config("unused", packing=True, diffusion_objective=objective)
    with pytest.raises(ValueError, match="padding_free does not apply"):
        config("unused", padding_free=True, max_length=None, diffusion_objective=objective)
    with pytest.raises(ValueError, match="nothing to pack"):
        config("unused", packing=True, pad_to_length_with_eos=True)


def test_wrapped_packing_trains_full_rows():
    """``packing_strategy="wrapped"`` (TRL: rows cut to max_length regardless of sample boundaries, padded batches)
    trains; each row is one document whose noise is seeded by its first token's sample and position."""
    trainer = DiffusionSFTTrainer(tiny_model("sdar"), args=config("unused", packing=True, max_length=24,
                                                                  packing_strategy="wrapped"),
                                  train_dataset=text_data(), processing_class=TOKENIZER)
    batch = next(iter(trainer.get_train_dataloader()))
    assert "document_ids" not in batch and batch["input_ids"].shape[1] == 24
    assert batch["sample_index"].shape[0] == batch["input_ids"].shape[0]
    trainer.train()
    assert trainer.state.global_step == 1


def test_sft_benchmark_trains_the_same_tokens_in_every_mode():
    """benchmarks/sft.py compares modes on equal work: every mode trains all samples' tokens once; packed rows (one
    row each, padded to the longest) carry little padding, padding-free batches none."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sft.py"
    spec = importlib.util.spec_from_file_location("sft_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = bench.PRESETS["tiny"]
    expected = sum(p + a for p, a in bench.sample_lengths(shape["samples"], shape["max_length"]))
    records = [bench.measure("sdar", mode, shape, "cpu") for mode in bench.MODES]
    assert [r["real_tokens"] for r in records] == [expected] * 3
    padded, packed, padding_free = records
    assert padded["padding_share"] > 0.3 and packed["padding_share"] < 0.1 and padding_free["padding_share"] == 0
    trajectory = bench.measure_trajectory(shape, "cpu", **shape["trajectory"])
    assert [r["rows"] for r in trajectory] == [2, 2 * 4 * 4]  # one per sample; one per state (4 blocks x 4 steps)
    assert trajectory[0]["loss"] == pytest.approx(trajectory[1]["loss"], rel=1e-4)
    assert set(bench.summarize(records + trajectory)) == {"sdar packed / padded", "sdar padding_free / padded",
                                                          "sdar trajectory: one row per state / packed (seconds)"}


def test_packed_training_step_equals_the_unpacked_one_under_gradient_accumulation():
    """The same SGD step from the same samples: unpacked in one batch, and packed (max_length 64: one or two
    documents a row) split into one packed row per micro-batch with gradient accumulation. Trainer's
    ``num_items_in_batch`` counts the accumulated batch's labels, the first tokens kept in packed rows included."""
    data = text_data()
    deltas, losses = [], []
    for settings in ({"per_device_train_batch_size": 8},
                     {"packing": True, "max_length": 64, "per_device_train_batch_size": 1,
                      "gradient_accumulation_steps": 8}):
        torch.manual_seed(0)
        model = tiny_model("sdar").train()
        trainer = DiffusionSFTTrainer(model, args=config("unused", optim="sgd", learning_rate=0.5, max_grad_norm=0.0,
                                                         **settings),
                                      train_dataset=data, processing_class=TOKENIZER)
        if settings.get("packing"):
            rows = len(trainer.train_dataset)
            assert 1 < rows < len(data)  # some rows hold two documents, and accumulation covers every row
        delta, loss = train_one_step(trainer, model)
        deltas.append(delta)
        losses.append(loss)
    assert_same_step(deltas, losses)


def train_one_step(trainer, model) -> tuple[torch.Tensor, float]:
    """Train (one optimizer step): the change of every parameter, and the logged loss."""
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    delta = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    return delta, trainer.state.log_history[0]["loss"]


def assert_same_step(deltas: list[torch.Tensor], losses: list[float]) -> None:
    """Two runs took the same (non-trivial) SGD step and logged the same loss."""
    assert deltas[0].abs().max() > 1e-4
    assert_close_fp32(deltas[1], deltas[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-4)


def slow_random_mask(labels, valid, generators, eps, high, documents, per_token):
    """The obvious version: for each document, its real tokens by a comparison over the whole row, the draws made
    over the whole row (the implementation before the per-document columns)."""
    ratios, uniforms, token_ratios = {}, torch.ones(labels.shape), torch.ones(labels.shape)
    for row in range(labels.shape[0]):
        for document in torch.unique(documents[row][documents[row] >= 0]).tolist():
            where = valid[row] & (documents[row] == document)
            if per_token:
                probabilities, row_uniforms = diffusion_losses.draw_token_noise(generators[document], where)
                token_ratios[row][where] = diffusion_losses.mask_ratio(probabilities, eps, high)[where]
            else:
                ratio, row_uniforms = diffusion_losses.draw_noise(generators[document], 1, where)
                ratios[document] = diffusion_losses.mask_ratio(ratio[0], eps, high)
            uniforms[row][where] = row_uniforms[where]
    if not per_token:
        token_ratios = documents.clone().float().apply_(lambda d: ratios.get(int(d), 1.0))
    masked = (labels != -100) & (uniforms < token_ratios)
    return masked, token_ratios


@pytest.mark.parametrize("per_token", [False, True])
def test_packed_random_masks_equal_the_per_document_row_scan(per_token):
    """``_random_mask`` finds each document's columns with one sort per row (a row of 64k padding-free tokens took
    339 ms with a pass over the row per document, 44 ms now): the same draws on the same tokens, on random packed
    rows with padding, documents with no real token and unpacked rows."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(60):
        batch, length = int(torch.randint(1, 4, (), generator=rng)), int(torch.randint(1, 40, (), generator=rng))
        documents, count = torch.full((batch, length), -1), 0
        for row in range(batch):
            column = 0
            while column < length and torch.rand((), generator=rng) > 0.15:
                size = int(torch.randint(1, 12, (), generator=rng))
                documents[row, column:column + size] = count
                count, column = count + 1, column + size
        if trial % 4 == 0 or count == 0:  # unpacked: one document per row
            documents, count = torch.arange(batch)[:, None].expand(batch, length).clone(), batch
        valid = (torch.rand(batch, length, generator=rng) < 0.8) & (documents >= 0)
        labels = torch.where(torch.rand(batch, length, generator=rng) < 0.7, 1, -100)
        seeds = torch.randint(0, 2**30, (count,), generator=rng).tolist()
        masked, ratio = diffusion_losses._random_mask(
            torch.zeros(batch, length, dtype=torch.long), labels, valid,
            [torch.Generator().manual_seed(s) for s in seeds], 0.1, 0.9, documents, per_token)
        expected_masked, expected_ratio = slow_random_mask(
            labels, valid, [torch.Generator().manual_seed(s) for s in seeds], 0.1, 0.9, documents, per_token)
        real = documents >= 0
        assert torch.equal(masked, expected_masked) and torch.equal(ratio[real], expected_ratio[real])


def test_documents_of_a_packed_row_with_one_sample_index_get_their_own_noise_keys():
    """A packed row with one scalar ``sample_index`` (rows packed before they reach the trainer): each document's
    noise key is (index, its start), so two documents of equal length do not draw the same masks."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from trl_diffusion.trainers.sft_trainer import DiffusionDataCollator, document_noise_key

    assert document_noise_key([1, 2, 3, 4, 5], 7, None, 3, 2) == (7, 3)
    collator = DiffusionDataCollator(DataCollatorForLanguageModeling(pad_token_id=2), 99, 2, None, padding_free=True)
    batch = collator([{"input_ids": [10, 11, 12, 13, 14], "seq_lengths": [2, 3], "sample_index": 7}])
    assert batch["sample_index"].tolist() == [7, 7] and batch["sample_offset"].tolist() == [0, 2]
