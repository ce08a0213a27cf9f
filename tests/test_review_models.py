"""Review of the model layer as a transformers / peft user meets it: masks in the releases' formats, LLaDA's
resize and tied head, and the loss under transformers' Trainer with gradient accumulation."""

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from trl_diffusion.states import attention_mask_from_positions
from trl_diffusion.testing import tiny_model

FAMILIES = ["sdar", "llada", "dream"]


@pytest.mark.parametrize("family", FAMILIES)
def test_float_zero_one_mask_means_visibility_as_in_the_releases(family):
    """SDAR's released ``block_diffusion_generate`` passes a float ``tril`` of ones ``[1, Q, K]`` and the released
    models read 1 as "may attend". Taken as an additive bias it would mask nothing."""
    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(12)[None].expand(2, -1)
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[0, :3] = False
    visible = attention_mask_from_positions(positions, positions, valid, model.block_size or 4)  # block-causal
    with torch.no_grad():
        expected = model(ids, attention_mask=visible, position_ids=positions).logits
        for mask in (visible.float(), visible[:, 0].float(), visible.double()):
            torch.testing.assert_close(model(ids, attention_mask=mask, position_ids=positions).logits, expected)
        additive = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))  # still read as a bias
        torch.testing.assert_close(model(ids, attention_mask=additive, position_ids=positions).logits, expected)
        everything = torch.ones(2, 1, 12, 12, dtype=torch.bool)  # every key visible (no block structure)
        torch.testing.assert_close(model(ids, attention_mask=everything.float(), position_ids=positions).logits,
                                   model(ids, attention_mask=everything, position_ids=positions).logits)


def test_llada_attention_bias_is_refused_not_ignored():
    """LLaDA's released forward honours ``attention_bias``; silently dropping it would attend everywhere."""
    model = tiny_model("llada")
    bias = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None]
    with pytest.raises(ValueError, match="attention_bias"):
        model(torch.randint(5, 100, (1, 6)), attention_bias=bias)


@pytest.mark.parametrize("tied", [False, True])
def test_llada_resize_token_embeddings_then_reload(tied, tmp_path):
    """Adding a token to LLaDA resizes ``wte`` and the ``ff_out`` head, and the saved config rebuilds that size."""
    model = tiny_model("llada", weight_tying=tied)
    old = model.config.embedding_size
    model.resize_token_embeddings(old + 8, mean_resizing=False)
    assert model.config.vocab_size == model.config.embedding_size == old + 8
    assert model.get_input_embeddings().weight.shape[0] == old + 8
    if not tied:
        assert model.get_output_embeddings().weight.shape[0] == old + 8
    ids = torch.tensor([[5, old + 7, 9, old, 11]])
    logits = model(ids).logits
    assert logits.shape[-1] == old + 8
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.embedding_size == old + 8
    torch.testing.assert_close(reloaded(ids).logits, logits, rtol=0, atol=0)


def test_llada_weight_tying_builds_and_uses_the_embedding_as_head(tmp_path):
    """``weight_tying`` (the config class's default) has no ``ff_out`` head; logits come from ``wte``."""
    model = tiny_model("llada", weight_tying=True)
    assert "ff_out" not in model.model.transformer
    ids = torch.randint(5, 100, (1, 6))
    hidden = model.model(ids).last_hidden_state
    torch.testing.assert_close(model(ids).logits, hidden @ model.model.transformer.wte.weight.T)
    model.save_pretrained(tmp_path)
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path).eval()(ids).logits,
                               model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_labels_loss_with_num_items_in_batch_is_the_sum_over_it(family):
    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :5] = -100
    out = model(ids, labels=labels)
    logits = model.align_logits(out.logits).double()
    if model.logits_shift:  # Dream: nothing predicts column 0, whose label is not scored
        labels[:, 0] = -100
    token_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                   ignore_index=-100, reduction="none")
    labelled = int(labels.ne(-100).sum())
    assert labelled == (10 if model.logits_shift else 11)
    torch.testing.assert_close(out.loss.double(), token_loss.sum() / labelled, rtol=1e-5, atol=0)
    for count in (40, torch.tensor(40)):
        loss = model(ids, labels=labels, num_items_in_batch=count).loss
        torch.testing.assert_close(loss.double(), token_loss.sum() / 40, rtol=1e-5, atol=0)


def test_trainer_with_gradient_accumulation_takes_the_token_mean_step(tmp_path):
    """transformers' Trainer passes ``num_items_in_batch`` to a forward with ``**kwargs`` and then leaves the loss
    undivided by the accumulation steps. One SGD step (lr 1) over two micro-batches must move the weights by minus
    the gradient of the token-mean loss over both rows (7 + 4 labelled tokens, position 0 included)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 100, (2, 8), generator=generator)
    labels = ids.clone()
    labels[0, 7] = -100
    labels[1, 4:] = -100
    dataset = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})

    reference = tiny_model("sdar").train()
    out = reference(ids, labels=labels)
    logits = reference.align_logits(out.logits)
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                              ignore_index=-100, reduction="sum")
    (total / 11).backward()
    expected_step = -reference.lm_head.weight.grad

    model = tiny_model("sdar").train()
    before = model.lm_head.weight.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=1, gradient_accumulation_steps=2,
                             max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
                             weight_decay=0.0, max_grad_norm=0.0, report_to="none", use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=dataset).train()
    torch.testing.assert_close(model.lm_head.weight.detach() - before, expected_step, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_trainer_label_smoothing_scores_the_logit_that_predicts_each_label(family, tmp_path):
    """transformers' Trainer shifts the labels of label smoothing only for models it lists as causal LMs: Dream's
    logits[i] predicts token i + 1, and unlisted it smoothed each token's own logit (6.28 for 6.40 at epsilon 0.1)."""
    model = tiny_model(family)
    ids = torch.randint(5, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    epsilon = 0.1
    args = TrainingArguments(output_dir=str(tmp_path), label_smoothing_factor=epsilon, report_to="none", use_cpu=True)
    with torch.no_grad():
        loss = Trainer(model=model, args=args).compute_loss(model, {"input_ids": ids, "labels": labels.clone()})
        logits = model.align_logits(model(ids).logits).double()  # logits[i] predicts token i, every family
        scored = labels.clone()
        if model.logits_shift:
            scored[:, 0] = -100  # no logit predicts a causal model's first token
        keep = scored.ne(-100)
        neg_logp = -torch.log_softmax(logits, -1)
        nll = neg_logp.gather(-1, scored.clamp(min=0)[..., None])[..., 0][keep].mean()
        expected = (1 - epsilon) * nll + epsilon * neg_logp.mean(-1)[keep].mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)


def test_tied_llada_refuses_an_offloaded_embedding(tmp_path):
    """Tied LLaDA reads wte's weight as its head outside wte's forward, where accelerate's offload hooks never load it:
    the logits came from the meta placeholder (off by 4e37, no error)."""
    model = tiny_model("llada", weight_tying=True)
    model.save_pretrained(tmp_path / "model")
    names = ["model.transformer.emb_drop", "model.transformer.blocks.0", "model.transformer.blocks.1",
             "model.transformer.ln_f"]
    device_map = {**{name: "cpu" for name in names}, "model.transformer.wte": "disk"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                     offload_folder=str(tmp_path / "offload"))
    ids = torch.randint(5, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), pytest.raises(RuntimeError, match="place 'model.transformer.wte' on an execution device"):
        offloaded(ids)
    device_map["model.transformer.wte"] = "cpu"  # kept in memory: the head reads the real weight
    kept = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map)
    with torch.no_grad():
        torch.testing.assert_close(kept(ids).logits, model(ids).logits)
