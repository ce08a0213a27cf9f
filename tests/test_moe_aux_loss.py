"""The mixture-of-experts load-balancing loss (``output_router_logits``, ``aux_loss``) of SDAR-MoE and LLaDA-MoE, and
how the trainers use it as TRL's do (``router_aux_loss_coef``): the loss against transformers' and a float64
reference, logits left alone, the SFT and TraceRL losses and logs, the dense-model refusal, and decoding, which never
asks for router logits."""

import copy

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from moe_reference import qwen3_moe_from
from transformers import AutoModelForCausalLM
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.olmoe.modeling_olmoe import load_balancing_loss_func as olmoe_loss
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func as qwen3_moe_loss

from trl_diffusion import (
    DiffusionSFTConfig,
    DiffusionSFTTrainer,
    TraceRLConfig,
    TraceRLTrainer,
)
from trl_diffusion.generation import cuda_graphs, sampler
from trl_diffusion.models import moe
from trl_diffusion.models.moe import SparseMoeBlock, load_balancing_loss
from trl_diffusion.testing import (
    build_tokenizer,
    tiny_model,
    tiny_moe_model,
)

CPU = dict(report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no")
LAYOUTS = {  # three layers, the middle one dense: router logits come from the sparse layers only
    "sdar_moe": dict(num_hidden_layers=3, mlp_only_layers=[1]),
    "llada_moe": dict(num_hidden_layers=3, moe_layer_freq=[1, 0, 1], shared_expert_intermediate_size=16,
                      moe_router_enable_expert_bias=True),
}
SFT_DATA = [{"prompt": "What is 1+2?", "completion": "3 and more"}, {"prompt": "Hi", "completion": "yo"}]


def reference_aux_loss(router_logits, num_experts: int, top_k: int, mask=None) -> torch.Tensor:
    """Switch Transformer's load-balancing loss from its definition, in float64: over every (layer, counted token),
    ``f_e`` the share of top-k slots that go to expert e, ``P_e`` its mean softmax probability; the loss is
    ``num_experts * sum_e f_e * P_e`` (differentiable through ``P``)."""
    slots = torch.zeros(num_experts, dtype=torch.float64)
    probability = torch.zeros(num_experts, dtype=torch.float64)
    counted = 0
    for logits in router_logits:
        probs = torch.softmax(logits.double(), dim=-1)
        keep = torch.ones(probs.shape[0], dtype=torch.bool) if mask is None else mask.reshape(-1).bool()
        chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, num_experts).sum(1)  # [tokens, experts]
        slots = slots + chosen[keep].sum(0)
        probability = probability + probs[keep].sum(0)
        counted += int(keep.sum())
    return num_experts * ((slots / counted) * (probability / counted)).sum()


def forward_calls(model) -> list[dict]:
    """Every call of ``model``'s forward from now on: its keyword arguments."""
    calls = []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    return calls


def padded_mask(rows: int, length: int) -> torch.Tensor:
    """A right-padded 2-D attention mask: row r has ``length - 2 r`` real tokens."""
    return (torch.arange(length)[None] < torch.tensor([length - 2 * r for r in range(rows)])[:, None]).long()


# ------------------------------------------------------------------------------------------------ the models


@pytest.mark.parametrize("family", ["sdar_moe", "llada_moe"])
@pytest.mark.parametrize("padded", [False, True])
def test_aux_loss_equals_transformers_load_balancing_loss(family, padded):
    """The function and the model's ``aux_loss`` (2-D mask: its real tokens; none: every token) equal transformers'
    ``load_balancing_loss_func`` (Qwen3-MoE's and OLMoE's, the one LLaDA-MoE's release copies) on the same router
    logits, and a float64 reference."""
    model = tiny_moe_model(family, **LAYOUTS[family])
    ids = torch.randint(5, 120, (3, 10), generator=torch.Generator().manual_seed(3))
    mask = padded_mask(3, 10) if padded else None
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_router_logits=True)
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    assert isinstance(out.router_logits, tuple) and len(out.router_logits) == 2  # the two sparse layers
    ours = load_balancing_loss(out.router_logits, experts, top_k, mask)
    for theirs in (qwen3_moe_loss(out.router_logits, experts, top_k, mask),
                   olmoe_loss(out.router_logits, experts, top_k, mask)):
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours.double(), reference_aux_loss(out.router_logits, experts, top_k, mask),
                               rtol=1e-6, atol=0)
    assert torch.equal(out.aux_loss, ours)
    if padded:  # the padding is left out: it would change the loss
        assert not torch.allclose(ours, load_balancing_loss(out.router_logits, experts, top_k))


@pytest.mark.parametrize("padded", [False, True])
def test_sdar_moe_aux_loss_equals_transformers_qwen3_moe(tmp_path, padded):
    """At ``block_size=1`` SDAR-MoE is transformers' Qwen3-MoE: its ``aux_loss`` is Qwen3MoeForCausalLM's, with a
    right-padded 2-D attention mask and without one."""
    model = tiny_moe_model("sdar_moe", block_size=1, **LAYOUTS["sdar_moe"])
    reference = qwen3_moe_from(model, tmp_path)
    ids = torch.randint(5, 120, (3, 11), generator=torch.Generator().manual_seed(4))
    mask = padded_mask(3, 11) if padded else None
    with torch.no_grad():
        ours = model(ids, attention_mask=mask, output_router_logits=True)
        theirs = reference(ids, attention_mask=mask, output_router_logits=True)
    assert len(ours.router_logits) == len(theirs.router_logits) == 2
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("family", ["sdar_moe", "llada_moe"])
def test_router_logits_leave_the_logits_alone(family):
    """Asked for (by the call, or by the config when the call does not say), the output carries one float32
    ``[tokens, num_experts]`` tensor per sparse layer (the gate's output upcast, also in bfloat16) and ``aux_loss``;
    the logits are identical. Not asked for, neither is there."""
    model = tiny_moe_model(family, **LAYOUTS[family])
    ids = torch.randint(5, 120, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        plain = model(ids)
        routed = model(ids, output_router_logits=True)
        model.config.output_router_logits = True
        by_config = model(ids)
        told_not_to = model(ids, output_router_logits=False)
    assert isinstance(plain, MoeCausalLMOutputWithPast) and plain.router_logits is None and plain.aux_loss is None
    assert told_not_to.router_logits is None and told_not_to.aux_loss is None
    for out in (routed, by_config, told_not_to):
        assert torch.equal(out.logits, plain.logits)
    assert torch.equal(by_config.aux_loss, routed.aux_loss)
    sparse = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert len(routed.router_logits) == len(sparse) == 2
    for logits in routed.router_logits:
        assert logits.shape == (18, model.config.num_experts) and logits.dtype == torch.float32
    half = copy.deepcopy(model).to(torch.bfloat16)
    seen = []
    half.model.layers[0].mlp.gate.register_forward_hook(lambda module, args, output: seen.append(output))
    with torch.no_grad():
        out = half(ids, output_router_logits=True)
    assert seen[0].dtype == torch.bfloat16 and out.router_logits[0].dtype == torch.float32
    assert torch.equal(out.router_logits[0], seen[0].float())


@pytest.mark.parametrize("family", ["sdar_moe", "llada_moe"])
def test_a_loss_from_labels_gets_the_weighted_aux_loss(family):
    """As transformers' Qwen3-MoE / OLMoE: with labels and router logits, ``loss`` is the LM loss plus
    ``router_aux_loss_coef * aux_loss``."""
    model = tiny_moe_model(family, router_aux_loss_coef=0.25)
    ids = torch.randint(5, 120, (2, 8), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        plain = model(ids, labels=ids)
        routed = model(ids, labels=ids, output_router_logits=True)
    torch.testing.assert_close(routed.loss, plain.loss + 0.25 * routed.aux_loss)


def test_router_loss_mask_picks_the_counted_tokens():
    """``router_loss_mask`` says which tokens the loss counts (over a 2-D attention mask); a 4-D mask says who sees
    whom, so without one every token counts."""
    model = tiny_moe_model("llada_moe")
    ids = torch.randint(5, 120, (2, 8), generator=torch.Generator().manual_seed(7))
    counted = torch.rand(2, 8, generator=torch.Generator().manual_seed(8)) < 0.6
    with torch.no_grad():
        out = model(ids, attention_mask=padded_mask(2, 8), router_loss_mask=counted, output_router_logits=True)
        full = model(ids, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool), output_router_logits=True)
    experts, top_k = model.config.num_experts, model.config.num_experts_per_tok
    assert torch.equal(out.aux_loss, load_balancing_loss(out.router_logits, experts, top_k, counted))
    assert torch.equal(full.aux_loss, load_balancing_loss(full.router_logits, experts, top_k))
    with pytest.raises(ValueError, match="router_loss_mask must be"):
        model(ids, router_loss_mask=counted[:, :5], output_router_logits=True)


@pytest.mark.parametrize("family", ["sdar_moe", "llada_moe"])
def test_output_router_logits_is_a_config_field(tmp_path, family):
    """Saved (``false``, the released value), loaded, and settable when loading, as transformers' MoE configs."""
    model = tiny_moe_model(family)
    assert model.config.output_router_logits is False
    model.save_pretrained(tmp_path)
    assert AutoModelForCausalLM.from_pretrained(tmp_path).config.output_router_logits is False
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, output_router_logits=True).eval()
    ids = torch.randint(5, 120, (1, 6))
    with torch.no_grad():
        assert len(loaded(ids).router_logits) == 2


# ------------------------------------------------------------------------------------------------ decoding


def force_graph_runners(monkeypatch) -> None:
    """The CUDA-graph runners on the CPU, each capture an eager call, and the model let in (its dispatch reads the
    host, so it is never captured on CUDA): what their forwards pass is all this checks."""
    class Eager:
        def __init__(self, body):
            self.replay = body

    monkeypatch.setattr(cuda_graphs.GraphRunner, "_record", lambda self, body: Eager(body))
    monkeypatch.setattr(cuda_graphs, "CAPTURE_FAILED", False)
    monkeypatch.setattr(sampler, "cuda_graph_capturable", lambda model: True)
    monkeypatch.setattr(sampler, "runner_class", lambda settings, device, generator: cuda_graphs.runner_class(
        settings, torch.device("cuda"), generator))


@pytest.mark.parametrize("family,cache", [("sdar_moe", True), ("llada_moe", "dual"), ("llada_moe", False)])
@pytest.mark.parametrize("graphs", [False, True])
def test_generate_never_asks_for_router_logits(monkeypatch, family, cache, graphs):
    """A config that says ``output_router_logits`` (as TRL leaves it after SFT) does not reach decoding: every
    forward of ``generate()`` (eager, and the CUDA-graph runners' steps) asks for none, and the tokens are the
    same."""
    if graphs:
        force_graph_runners(monkeypatch)
    model = tiny_moe_model(family)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    kw = dict(max_new_tokens=8, block_length=4, temperature=0.0, use_cache=cache, stop_token_ids=[],
              cuda_graphs="auto")
    before = model.generate(ids, **kw)
    model.config.output_router_logits = True
    calls = forward_calls(model)
    losses = []
    monkeypatch.setattr(moe, "load_balancing_loss", lambda *a, **k: losses.append(1))
    assert torch.equal(model.generate(ids, **kw), before)
    assert calls and all(call.get("output_router_logits") is False for call in calls)
    assert not losses


# ------------------------------------------------------------------------------------------------ SFT


def sft_trainer(model, tmp_path, **config):
    fields = dict(max_length=32, per_device_train_batch_size=2, max_steps=1, logging_steps=1,
                  gradient_checkpointing=False)
    args = DiffusionSFTConfig(output_dir=str(tmp_path), **{**fields, **config}, **CPU)
    return DiffusionSFTTrainer(model, args=args, train_dataset=Dataset.from_list(SFT_DATA),
                               processing_class=build_tokenizer())


def sft_losses(tmp_path, coefs: list, accumulation: int = 1, backward: bool = False):
    """For each ``router_aux_loss_coef``, a trainer on its own copy of one LLaDA-MoE (full attention, the
    ``random_masking`` objective, a padded batch), its ``compute_loss`` on the same batch (in training, with
    ``num_items_in_batch`` and ``accumulation`` steps as ``Trainer`` passes them) and the forwards it ran."""
    base = tiny_moe_model("llada_moe", **LAYOUTS["llada_moe"]).train()
    results = []
    for coef in coefs:
        model = copy.deepcopy(base)
        trainer = sft_trainer(model, tmp_path, **({} if coef == "config" else {"router_aux_loss_coef": coef}))
        inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
        trainer.current_gradient_accumulation_steps = accumulation
        calls = forward_calls(model)
        loss = trainer.compute_loss(model, dict(inputs), num_items_in_batch=(inputs["labels"] != -100).sum())
        if backward:
            loss.backward()
        results.append((trainer, model, inputs, calls, loss))
    return results


def independent_aux_loss(model, call: dict, token_mask) -> torch.Tensor:
    """The load-balancing loss of a recorded forward, recomputed: the same inputs through the model, the float64
    reference over ``token_mask``."""
    out = model(input_ids=call["input_ids"], attention_mask=call["attention_mask"],
                position_ids=call["position_ids"], output_router_logits=True)
    return reference_aux_loss(out.router_logits, model.config.num_experts, model.config.num_experts_per_tok,
                              token_mask)


@pytest.mark.parametrize("accumulation", [1, 4])
def test_sft_loss_is_the_diffusion_loss_plus_the_weighted_aux_loss(tmp_path, accumulation):
    """SFTTrainer's semantics: ``router_aux_loss_coef`` (unset: the config's 0.01) times the forward's
    load-balancing loss over its real tokens (here the collated batch's attention mask: the padding is left out),
    over the accumulation steps, added to the diffusion loss and logged as ``aux_loss``; 0 turns it off."""
    (off, _, inputs, off_calls, loss_off), (on, model, _, calls, loss_on), (default, _, _, _, loss_default) = \
        sft_losses(tmp_path, [0.0, 0.3, "config"], accumulation)
    assert not off.aux_loss_enabled and on.aux_loss_enabled and default.aux_loss_enabled
    assert default.router_aux_loss_coef == 0.01
    real = inputs["attention_mask"].bool()
    assert not bool(real.all())  # the batch is padded
    assert len(calls) == 1 and calls[0]["output_router_logits"] is True
    assert torch.equal(calls[0]["router_loss_mask"], real)
    with torch.no_grad():
        aux = independent_aux_loss(model, calls[0], real).float()
    torch.testing.assert_close(loss_on, loss_off + 0.3 * aux / accumulation, rtol=1e-5, atol=0)
    torch.testing.assert_close(loss_default, loss_off + 0.01 * aux / accumulation, rtol=1e-5, atol=0)
    assert on._metrics["train"]["aux_loss"] == pytest.approx([aux.item()], rel=1e-5)
    assert "aux_loss" not in off._metrics["train"]
    assert off_calls[0]["output_router_logits"] is False and off.model.config.output_router_logits is False


def test_sft_aux_loss_gradient_reaches_the_routers_only_when_enabled(tmp_path):
    """The aux term's gradient: with the coefficient, the routers' gradients are the diffusion loss's plus
    ``coef * d aux``; with 0 the diffusion loss's alone; the LM head's are the same either way."""
    (_, off, _, _, _), (_, on, _, calls, _) = sft_losses(tmp_path, [0.0, 0.3], backward=True)
    replay = tiny_moe_model("llada_moe", **LAYOUTS["llada_moe"]).train()  # the same weights, outside any trainer
    aux = independent_aux_loss(replay, calls[0], calls[0]["router_loss_mask"])
    (0.3 * aux).backward()
    for i, layer in enumerate(on.model.layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            difference = layer.mlp.gate.weight.grad - off.model.layers[i].mlp.gate.weight.grad
            expected = replay.model.layers[i].mlp.gate.weight.grad
            assert expected.abs().sum() > 0  # float32 noise of the larger diffusion gradient aside:
            assert torch.linalg.norm(difference - expected) < 1e-3 * torch.linalg.norm(expected)
    torch.testing.assert_close(on.lm_head.weight.grad, off.lm_head.weight.grad, rtol=1e-6, atol=1e-9)


def test_a_training_step_logs_aux_loss(tmp_path):
    """A whole SFT step on SDAR-MoE (the block objective, gradient checkpointing): ``aux_loss`` in the logs."""
    model = tiny_moe_model("sdar_moe").train()
    trainer = sft_trainer(model, tmp_path, gradient_checkpointing=True)
    trainer.train()
    assert model.model.layers[0].gradient_checkpointing
    logs = trainer.state.log_history[0]
    assert logs["aux_loss"] > 0 and model.config.output_router_logits is True  # as TRL leaves the config


# ------------------------------------------------------------------------------------------------ dense models


@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_an_explicit_coefficient_for_a_dense_model_is_refused(tmp_path, family):
    """A model object: before any dataset is prepared, with the option named; a path: by TRL once it has loaded the
    model. Unset or 0, dense models train without the term."""
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01 .* is a dense model"):
        sft_trainer(tiny_model(family), tmp_path, router_aux_loss_coef=0.01)
    args = TraceRLConfig(output_dir=str(tmp_path), router_aux_loss_coef=0.01, gradient_checkpointing=False, **CPU)
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=0.01 .* is a dense model"):
        TraceRLTrainer(tiny_model(family), lambda completions, **kw: [0.0] * len(completions), args=args,
                       train_dataset=Dataset.from_dict({"prompt": ["a"]}), processing_class=build_tokenizer())
    tiny_model(family).save_pretrained(tmp_path / "model")
    build_tokenizer().save_pretrained(tmp_path / "model")
    args = DiffusionSFTConfig(output_dir=str(tmp_path / "out"), max_length=32, router_aux_loss_coef=0.01,
                              gradient_checkpointing=False, **CPU)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        DiffusionSFTTrainer(str(tmp_path / "model"), args=args, train_dataset=Dataset.from_list(SFT_DATA))
    for coef in (None, 0.0):
        assert not sft_trainer(tiny_model(family), tmp_path, router_aux_loss_coef=coef).aux_loss_enabled


# ------------------------------------------------------------------------------------------------ TraceRL


def tracerl_trainer(model, tmp_path, **config):
    fields = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=1,
                  logging_steps=1, learning_rate=0.0, block_length=4, denoising_steps=2, seed=0,
                  dynamic_group_filtering="none", gradient_checkpointing=False)
    args = TraceRLConfig(output_dir=str(tmp_path), **{**fields, **config}, **CPU)
    return TraceRLTrainer(model, lambda completions, **kw: [float(len(set(c))) for c in completions], args=args,
                          train_dataset=Dataset.from_dict({"prompt": ["What is 1+2?", "abc"]}),
                          processing_class=build_tokenizer())


def record_phases(trainer, model) -> list[tuple[str, dict]]:
    """Every forward of ``model`` during training, with the phase it ran in (rollout, scoring inside the loss, or
    other scoring), and each loss's inputs and value (``trainer.recorded_losses``)."""
    phase, calls, trainer.recorded_losses = ["scoring"], [], []
    model.register_forward_pre_hook(lambda module, args, kwargs: calls.append((phase[0], dict(kwargs))),
                                    with_kwargs=True)
    generate, compute_loss = model.generate, trainer._compute_loss

    def generating(*args, **kwargs):
        phase[0] = "rollout"
        try:
            return generate(*args, **kwargs)
        finally:
            phase[0] = "scoring"

    def in_loss(model_, inputs):
        phase[0] = "loss"
        try:
            loss = compute_loss(model_, inputs)
        finally:
            phase[0] = "scoring"
        trainer.recorded_losses.append((inputs, loss.detach()))
        return loss

    model.generate, trainer._compute_loss = generating, in_loss
    return calls


@pytest.mark.parametrize("family", ["sdar_moe", "llada_moe"])
def test_tracerl_adds_the_mean_aux_loss_of_its_scoring_forwards(tmp_path, family):
    """By default (the config's coefficient) GRPO's term: the mean over the loss's scoring forwards of each one's
    load-balancing loss over the real tokens of its packed rows, weighted, over the accumulation steps, logged as
    ``aux_loss``. Rollouts and the other scoring forwards ask for no router logits."""
    model = tiny_moe_model(family).train()
    # two prompts a batch and a token budget: several packed chunks (forwards), some with padded rows
    trainer = tracerl_trainer(model, tmp_path, num_generations=2, scoring_token_budget=80)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == model.config.router_aux_loss_coef
    calls = record_phases(trainer, model)
    trainer.train()
    routed = [kwargs for phase, kwargs in calls if kwargs.get("output_router_logits")]
    assert {phase for phase, kwargs in calls} >= {"rollout", "loss"}
    assert routed and all(phase == "loss" for phase, kwargs in calls if kwargs.get("output_router_logits"))
    assert all(kwargs.get("output_router_logits") is False for phase, kwargs in calls if phase == "rollout")
    with torch.no_grad():
        losses = [independent_aux_loss(model, kwargs, kwargs["router_loss_mask"]) for kwargs in routed]
    assert len(routed) > 1 and any(not bool(kwargs["router_loss_mask"].all()) for kwargs in routed)
    assert all(bool((kwargs["input_ids"][~kwargs["router_loss_mask"]] == 0).all()) for kwargs in routed)  # padding
    aux = torch.stack(losses).mean().float()
    assert trainer.state.log_history[0]["aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    # the same loss with the router term off (learning rate 0: the weights did not move)
    (inputs, loss_on), = trainer.recorded_losses
    model.train()
    trainer.aux_loss_enabled = False
    with torch.no_grad():
        loss_off = trainer._compute_loss(model, inputs)
    steps = trainer.current_gradient_accumulation_steps
    torch.testing.assert_close(loss_on, loss_off + trainer.router_aux_loss_coef * aux / steps, rtol=1e-5, atol=1e-9)


def test_tracerl_coefficient_zero_asks_for_no_router_logits(tmp_path, monkeypatch):
    """``router_aux_loss_coef=0``: no forward asks for router logits, not even when the config says
    ``output_router_logits`` (as a checkpoint saved by SFT with the loss on does): the trainer decides."""
    model = tiny_moe_model("sdar_moe").train()
    model.config.output_router_logits = True
    trainer = tracerl_trainer(model, tmp_path, router_aux_loss_coef=0.0)
    assert not trainer.aux_loss_enabled
    calls = record_phases(trainer, model)
    losses = []
    monkeypatch.setattr(moe, "load_balancing_loss", lambda *a, **k: losses.append(1))
    trainer.train()
    assert {phase for phase, kwargs in calls} >= {"rollout", "loss"}
    assert all(kwargs.get("output_router_logits") is False for phase, kwargs in calls)
    assert not losses and "aux_loss" not in trainer.state.log_history[0]


def test_tracerl_refuses_the_aux_loss_where_group_filtering_rescales_the_loss(tmp_path):
    """Row-mean losses rescale the whole loss for filtered groups, which would rescale the router term too."""
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.001"):
        tracerl_trainer(tiny_moe_model("sdar_moe"), tmp_path, loss_type="grpo", dynamic_group_filtering="all_equal")
    tracerl_trainer(tiny_moe_model("sdar_moe"), tmp_path, loss_type="grpo", dynamic_group_filtering="all_equal",
                    router_aux_loss_coef=0.0)
    tracerl_trainer(tiny_moe_model("sdar_moe"), tmp_path, loss_type="dapo", dynamic_group_filtering="all_equal")


def test_tracerl_logs_every_processes_aux_loss(tmp_path):
    """GRPO logs ``aux_loss`` with ``gather_for_metrics``, which at a training epoch's last batch keeps the first
    ``remainder`` values: on two processes (5 prompts, 2 per process) process 0's alone (2.0351 logged where the
    processes had 2.0351 and 2.0257). The trainer logs the mean over every process with ``gather``: shown here by
    a ``gather_for_metrics`` that would keep nothing."""
    model = tiny_moe_model("sdar_moe").train()
    trainer = tracerl_trainer(model, tmp_path, num_generations=2)
    trainer.accelerator.gather_for_metrics = lambda data, **kwargs: data.reshape(-1)[:0]  # its mean would be NaN
    calls = record_phases(trainer, model)
    trainer.train()
    routed = [kwargs for phase, kwargs in calls if kwargs.get("output_router_logits")]
    with torch.no_grad():
        aux = torch.stack([independent_aux_loss(model, kwargs, kwargs["router_loss_mask"]) for kwargs in routed])
    assert trainer.state.log_history[0]["aux_loss"] == pytest.approx(aux.mean().item(), rel=1e-5)
