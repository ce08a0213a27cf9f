"""``scoring_token_budget`` of ``DiffusionSFTTrainer``: the rows an objective builds, cut into several forwards (each
back-propagated before the next), give the loss, gradient, metrics and eval loss of one forward."""

import re

import pytest
import torch
from test_sft_value_combos import SMALL, TOKENIZER, conversational, sft_config, trajectories

from trl_diffusion.states import AttentionLayout
from trl_diffusion.testing import MASK_ID, tiny_model, tiny_moe_model
from trl_diffusion.trainers import DiffusionSFTTrainer
from trl_diffusion.trainers.diffusion_losses import (
    ScoringBatch,
    build_objective,
    diffusion_loss,
    sample_generators,
    split_rows,
)
from trl_diffusion.trainers.sft_trainer import _check_token_budget

CASES = {  # (family, data, settings): each builds several rows per micro-batch, with padding and layouts
    "llada-semi-ar-row-masked": ("llada", conversational, dict(
        diffusion_objective="semi_ar", semi_ar_block_length=2, mask_ratio_sampling="per_token",
        mask_ratio_range=[0.1, 0.9], loss_weighting="none", loss_normalization="row_masked")),
    "sdar-block": ("sdar", conversational, {}),
    "dream-trajectory": ("dream", trajectories, dict(diffusion_objective="trajectory")),
    "sdar-trajectory-packed": ("sdar", trajectories, dict(diffusion_objective="trajectory", trajectory_shrinkage=2)),
    "dream-semi-ar-lora-checkpointing": ("dream", conversational, dict(
        diffusion_objective="semi_ar", semi_ar_block_length=2, gradient_checkpointing=True)),
}
METRICS = ("loss", "mean_token_accuracy", "entropy", "scored_tokens")


def one_step(tmp_path, family, data, settings, budget):
    """Train one SGD step (2 samples x 2 accumulation steps) from the same weights: the logged metrics, the eval
    loss before the step, the parameter change and how many forwards the model ran in training, and its backbone
    (which a recomputation in the backward pass runs again). With ``gradient_checkpointing`` in ``settings``, a
    LoRA adapter trains."""
    torch.manual_seed(0)
    model = tiny_model(family, **SMALL[family]).train()
    peft = {}
    if settings.get("gradient_checkpointing"):
        from peft import LoraConfig

        peft["peft_config"] = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    args = sft_config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      scoring_token_budget=budget, **settings)
    trainer = DiffusionSFTTrainer(model, args=args, train_dataset=data().select(range(4)),
                                  eval_dataset=data(), processing_class=TOKENIZER, **peft)
    eval_loss = trainer.evaluate()["eval_loss"]
    forwards, backbone = [], []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    backbone_hook = model.model.register_forward_pre_hook(lambda module, args: backbone.append(1))
    trained = [p for p in trainer.model.parameters() if p.requires_grad]
    before = torch.cat([p.detach().flatten().clone() for p in trained])
    trainer.train()
    hook.remove()
    backbone_hook.remove()
    after = torch.cat([p.detach().flatten() for p in trained])
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    return logged, eval_loss, after - before, len(forwards), len(backbone)


def assert_same_step(got, expected) -> None:
    """``(logged metrics, eval loss, parameter change)`` of two runs equal: metrics and eval loss to 1e-5 relative,
    the change to 1e-4 of its largest element (which must be non-zero)."""
    (logged, eval_loss, step), (logged_expected, eval_expected, step_expected) = got, expected
    for metric in METRICS:
        assert logged[metric] == pytest.approx(logged_expected[metric], rel=1e-5), metric
    assert eval_loss == pytest.approx(eval_expected, rel=1e-5)
    largest = step_expected.abs().max()
    assert largest > 1e-6
    torch.testing.assert_close(step, step_expected, rtol=0, atol=1e-4 * float(largest))


@pytest.mark.parametrize("name", list(CASES))
def test_a_token_budget_gives_the_step_of_one_forward(tmp_path, name):
    family, data, settings = CASES[name]
    whole, whole_eval, step, whole_forwards, _ = one_step(tmp_path / "whole", family, data, settings, None)
    split, split_eval, split_step, split_forwards, _ = one_step(tmp_path / "split", family, data, settings, 40)
    assert whole_forwards == 2 and split_forwards > whole_forwards  # the budget really cut the micro-batches
    assert_same_step((split, split_eval, split_step), (whole, whole_eval, step))


@pytest.mark.parametrize("name", ["llada-semi-ar-row-masked", "dream-semi-ar-lora-checkpointing"])
def test_recomputed_forwards_give_the_step_of_one_forward(tmp_path, name):
    """``recompute_scoring_forwards``: the budget's forwards back-propagated by Trainer's one backward, each run
    again in it, give the same step as one forward (LoRA and layer checkpointing inside, for Dream)."""
    family, data, settings = CASES[name]
    whole, whole_eval, step, whole_forwards, _ = one_step(tmp_path / "whole", family, data, settings, None)
    split, split_eval, split_step, split_forwards, backbone = one_step(
        tmp_path / "split", family, data, {**settings, "recompute_scoring_forwards": True}, 40)
    *_, budget_backbone = one_step(tmp_path / "budget", family, data, settings, 40)
    assert split_forwards > whole_forwards == 2
    assert backbone == 2 * budget_backbone  # each of the budget's forwards run again in the backward pass
    assert_same_step((split, split_eval, split_step), (whole, whole_eval, step))


def test_split_rows_keeps_each_forward_within_the_budget():
    """Consecutive row ranges, each within the budget (a row wider than it alone), the layout cut with the rows;
    the chunks' losses add up to the whole batch's."""
    model = tiny_model("sdar")
    ids = torch.randint(5, 100, (5, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    valid = torch.ones_like(ids, dtype=torch.bool)
    valid[1, 9:] = valid[3, 10:] = False
    labels[~valid] = -100
    batch = build_objective("block", ids, labels, valid, sample_generators(list(range(5)), 0, 0),
                            mask_token_id=MASK_ID, block_size=4)
    width = batch.input_ids.shape[1]
    for budget, sizes in ((None, [5]), (2 * width, [2, 2, 1]), (2 * width + 1, [2, 2, 1]), (1, [1] * 5)):
        chunks = split_rows(batch, budget)
        assert [len(c.input_ids) for c in chunks] == sizes
        rebuilt = ScoringBatch(*(torch.cat([getattr(c, f) for c in chunks]) for f in (
            "input_ids", "position_ids")), AttentionLayout(*(torch.cat([getattr(c.layout, f) for c in chunks])
                                                             for f in ("block", "copy", "valid"))),
            *(torch.cat([getattr(c, f) for c in chunks]) for f in ("targets", "weights")))
        for field in ("input_ids", "position_ids", "targets", "weights"):
            assert torch.equal(getattr(rebuilt, field), getattr(batch, field))
        assert torch.equal(rebuilt.layout.dense(), batch.layout.dense())
        with torch.no_grad():
            whole = diffusion_loss(model, batch, 10)[0]
            parts = sum(diffusion_loss(model, c, 10)[0] for c in chunks)
        torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6 * float(whole.abs()))


def test_the_logged_router_loss_is_the_mean_of_the_forwards(tmp_path):
    """A mixture-of-experts model's load-balancing loss is not a sum over rows: with a budget each forward adds
    its own, weighted by 1 / (number of forwards), and the logged ``aux_loss`` is their mean (GRPO's rule for a
    batch scored in several forwards)."""
    model = tiny_moe_model("llada_moe").train()
    args = sft_config(tmp_path, per_device_train_batch_size=2, router_aux_loss_coef=0.5, scoring_token_budget=20,
                      learning_rate=0.0)
    trainer = DiffusionSFTTrainer(model, args=args, train_dataset=conversational().select(range(2)),
                                  processing_class=TOKENIZER)
    seen = []
    hook = model.register_forward_hook(lambda module, args, output: seen.append(float(output.aux_loss)))
    trainer.train()
    hook.remove()
    logged = next(h for h in trainer.state.log_history if "loss" in h)
    assert len(seen) > 1
    assert logged["aux_loss"] == pytest.approx(sum(seen) / len(seen), rel=1e-5)


def test_a_budget_is_refused_where_a_backward_does_more_than_accumulate(tmp_path):
    """DeepSpeed (accelerate's backward steps the engine) and LOMO (updates inside the backward) would step once
    per forward; a budget below 1 is refused by the config."""
    with pytest.raises(ValueError, match="not supported with DeepSpeed"):
        _check_token_budget(sft_config(tmp_path, scoring_token_budget=64), deepspeed=True)
    _check_token_budget(sft_config(tmp_path, scoring_token_budget=None), deepspeed=True)
    for optim in ("lomo", "adalomo", "galore_adamw_layerwise", "apollo_adamw_layerwise"):
        updating = sft_config(tmp_path, scoring_token_budget=64)
        updating.optim = optim
        with pytest.raises(ValueError, match=f"optim='{optim}'"):
            _check_token_budget(updating, deepspeed=False)
    _check_token_budget(sft_config(tmp_path, scoring_token_budget=64, optim="adamw_torch"), deepspeed=False)
    with pytest.raises(ValueError, match="scoring_token_budget must be a positive integer"):
        sft_config(tmp_path, scoring_token_budget=0)
    # with recomputed forwards there is one backward per micro-batch: DeepSpeed (ZeRO-1/2) and LOMO may take it
    one_backward = sft_config(tmp_path, scoring_token_budget=64, recompute_scoring_forwards=True)
    _check_token_budget(one_backward, deepspeed=True)
    one_backward.optim = "lomo"
    _check_token_budget(one_backward, deepspeed=False)
    with pytest.raises(ValueError, match="recompute_scoring_forwards=True needs a scoring_token_budget"):
        sft_config(tmp_path, recompute_scoring_forwards=True)


def test_the_trainer_refuses_a_budget_with_an_optimizer_that_updates_inside_the_backward(tmp_path):
    """The refusal above comes from the trainer's construction, not only from the helper."""
    args = sft_config(tmp_path, scoring_token_budget=64, optim="lomo")
    with pytest.raises(ValueError, match=re.escape("scoring_token_budget is not supported with optim='lomo' (it "
                                                   "updates the weights inside each backward)") + ".*or unset "
                                                   "scoring_token_budget"):
        DiffusionSFTTrainer(tiny_model("sdar", **SMALL["sdar"]), args=args, train_dataset=conversational(),
                            processing_class=TOKENIZER)


def test_the_memory_benchmark_measures_the_same_step_in_every_variant(monkeypatch):
    """``benchmarks/memory.py --trainer sft``: each variant takes the same semi_ar training step (same loss), the
    budget variant in several forwards."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "memory_benchmark", Path(__file__).resolve().parents[1] / "benchmarks" / "memory.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setitem(bench.VARIANTS, "budget_2048", (100, False, False))  # 2 of the 4 rows of 40 tokens a forward
    records = [bench.measure_sft(variant, 32, 2, 8, 64, 1, 256, "cpu") for variant in ("unchunked", "budget_2048")]
    assert [(r["rows"], r["rows_per_forward"], r["forwards"]) for r in records] == [(4, 4, 1), (4, 2, 2)]
    assert records[1]["loss"] == pytest.approx(records[0]["loss"], rel=1e-5)


def test_compute_loss_called_by_itself_leaves_the_backward_to_the_caller(tmp_path):
    """Outside Trainer's training step (a callback, a user's loop) ``compute_loss`` back-propagates nothing itself:
    with a budget it returns the loss of every forward with all their graphs, whose backward is one forward's."""
    family, data, settings = CASES["llada-semi-ar-row-masked"]
    grads = []
    for budget in (None, 40):
        torch.manual_seed(0)
        model = tiny_model(family, **SMALL[family]).train()
        trainer = DiffusionSFTTrainer(model, args=sft_config(tmp_path, scoring_token_budget=budget, **settings),
                                      train_dataset=data(), processing_class=TOKENIZER)
        inputs = next(iter(trainer.get_train_dataloader()))
        loss = trainer.compute_loss(model, inputs)
        assert all(p.grad is None for p in model.parameters())  # nothing back-propagated yet
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-6 * float(grads[0].abs().max()))
