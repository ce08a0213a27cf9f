"""``set_fused_kernels``: the layers' elementwise chains compiled by ``torch.compile``. The compiled chains must
compute what the eager ones do (inductor, values and gradients), the models must generate and train as eagerly
with them on (every family, through dynamo and AOTAutograd: the ``aot_eager`` backend, which compiles in seconds),
and the trainers' ``fused_kernels`` must switch them on for every model they run."""

import pytest
import torch
from datasets import Dataset

from trl_diffusion import set_fused_kernels
from trl_diffusion.models import kernels
from trl_diffusion.testing import build_tokenizer, tiny_model, tiny_moe_model
from trl_diffusion.trainers import DiffusionSFTConfig, DiffusionSFTTrainer, TraceRLConfig, TraceRLTrainer
from trl_diffusion.value import DiffusionValueConfig, DiffusionValueModel, DiffusionValueTrainer

CPU = dict(report_to=[], use_cpu=True, bf16=False, disable_tqdm=True, save_strategy="no")


def build(family: str) -> torch.nn.Module:
    if family == "llada_moe":  # a dense and a sparse layer, a shared expert, clip_qkv, q/k norms
        return tiny_moe_model(family, num_hidden_layers=2, moe_layer_freq=[0, 1], shared_expert_intermediate_size=24,
                              clip_qkv=1.5, qk_layernorm=True)
    return tiny_moe_model(family) if family == "sdar_moe" else tiny_model(family)


def close(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Equal to ``rel`` of the larger of 1 and the expected tensor's largest magnitude."""
    scale = max(1.0, float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=0, atol=rel * scale)


def test_inductor_chains_compute_the_eager_values_and_gradients():
    """Each chain compiled by inductor (one fused C++ kernel on a CPU) against its eager self, float32: values and
    the gradients of every input. ``rms_norm`` is inside ``add_rms_norm`` (its own compilation would add ten CPU
    seconds to the suite)."""
    compiled = kernels.compiled_kernels("inductor")
    generator = torch.Generator().manual_seed(0)

    def rand(*shape, grad=True):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).requires_grad_(grad)

    x, residual, weight = rand(2, 5, 32), rand(2, 5, 32), rand(32)
    q, k = rand(2, 4, 5, 16), rand(2, 2, 5, 16)
    cos, sin = rand(2, 1, 5, 16, grad=False), rand(2, 1, 5, 16, grad=False)
    cases = {"add_rms_norm": (x, residual, weight, 1e-6),
             "rotate_pair": (q, k, cos, sin, False), "silu_mul": (x, residual)}
    for name, args in cases.items():
        results = []
        for chains in (kernels.EAGER, compiled):
            out = getattr(chains, name)(*args)
            outs = out if isinstance(out, tuple) else (out,)
            inputs = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
            grads = torch.autograd.grad(sum((o * (i + 1)).sum() for i, o in enumerate(outs)), inputs)
            results.append([o.detach() for o in outs] + list(grads))
        for eager, fused in zip(*results):
            close(fused, eager, 1e-5)


@pytest.mark.parametrize("family", ["sdar", "llada", "dream", "sdar_moe", "llada_moe"])
def test_models_generate_and_train_as_eager_with_fused_kernels(family):
    """float64, so that equal computations give equal greedy tokens: ``generate`` (exact / dual cache) gives the
    eager tokens and log-probs, and a forward + backward with gradient checkpointing the eager loss and gradients."""
    torch.manual_seed(0)
    model = build(family).double()
    prompt = torch.randint(10, 100, (2, 10))
    settings = dict(max_new_tokens=12, block_length=4, denoising_steps=4, temperature=0.0, stop_token_ids=[],
                    return_dict_in_generate=True)
    ids = torch.randint(10, 100, (2, 16))

    def run():
        out = model.generate(prompt, **settings)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.gradient_checkpointing_disable()
        model.eval()
        return out, loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    eager = run()
    assert set_fused_kernels(model, "aot_eager") > 0
    assert all(m.kernels is not kernels.EAGER for m in model.modules() if isinstance(m, kernels.UsesKernels))
    fused = run()
    assert torch.equal(fused[0].sequences, eager[0].sequences)
    assert torch.equal(fused[0].unmask_step, eager[0].unmask_step)
    close(fused[0].token_logprobs, eager[0].token_logprobs, 1e-10)
    close(fused[1], eager[1], 1e-10)
    assert len(fused[2]) == len(eager[2]) > 0
    for a, b in zip(fused[2], eager[2]):
        close(a, b, 1e-10)


def test_set_fused_kernels_switches_back_and_refuses_what_it_cannot_apply():
    model = tiny_model("sdar")
    chain_modules = [m for m in model.modules() if isinstance(m, kernels.UsesKernels)]
    # per layer: 4 norms (input, post-attention, q, k), the attention, the MLP; plus the final norm
    assert set_fused_kernels(model) == len(chain_modules) == 2 * 6 + 1
    assert {m.fused_kernels for m in chain_modules} == {"inductor"}
    set_fused_kernels(model, None)
    assert all(m.kernels is kernels.EAGER for m in chain_modules)
    with pytest.raises(ValueError, match="torch.compile backend"):
        set_fused_kernels(model, "no_such_backend")
    with pytest.raises(ValueError, match="no layers with fused kernels"):
        set_fused_kernels(torch.nn.Linear(2, 2))


def fused(model) -> set:
    return {m.fused_kernels for m in model.modules() if isinstance(m, kernels.UsesKernels)}


@pytest.mark.parametrize("enabled", [True, False])
def test_trainers_fused_kernels_reach_every_model_they_run(tmp_path, enabled):
    """SFT: the policy; TraceRL: the policy, its reference model and the value model; value: the value model.
    False leaves each model as it was given."""
    tokenizer = build_tokenizer()
    expected = {"inductor"} if enabled else {None}
    sft = DiffusionSFTTrainer(tiny_model("sdar"), processing_class=tokenizer,
                              args=DiffusionSFTConfig(output_dir=str(tmp_path), fused_kernels=enabled, **CPU),
                              train_dataset=Dataset.from_dict({"prompt": ["1+2="], "completion": ["3"]}))
    assert fused(sft.model) == expected
    args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                         max_completion_length=8, beta=0.1, kl_reference="reference_model",
                         fused_kernels=enabled, **CPU)
    rl = TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [0.0] * len(completions), args=args,
                        processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": ["1+2="] * 2}),
                        value_model=DiffusionValueModel.from_policy(tiny_model("sdar", seed=1)))
    assert fused(rl.model) == fused(rl.ref_model) == fused(rl.value_model) == expected
    rows = {"prompt": ["ab"], "completion_ids": [[5, 6]], "unmask_step": [[0, 1]], "reward": [1.0]}
    value = DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("dream")), processing_class=tokenizer,
                                  args=DiffusionValueConfig(output_dir=str(tmp_path), fused_kernels=enabled, **CPU),
                                  train_dataset=Dataset.from_dict(rows))
    assert fused(value.model) == expected


def test_eval_loads_the_model_with_fused_kernels_when_asked():
    from trl_diffusion.eval.evaluate import EvalConfig, load_model_and_tokenizer

    for enabled, expected in ((True, {"inductor"}), (False, {None})):
        model, _ = load_model_and_tokenizer(EvalConfig(fused_kernels=enabled, device="cpu"))
        assert fused(model) == expected


def test_a_tracerl_step_with_fused_kernels_trains_as_eager(tmp_path, monkeypatch):
    """One TraceRL step (rollouts through the exact cache, scoring, backward, optimizer) with the trainer's
    ``fused_kernels`` gives the eager step's loss and weights (the chains compiled by ``aot_eager`` here, for time)."""
    aot_eager = kernels.compiled_kernels("aot_eager")
    monkeypatch.setattr(kernels, "compiled_kernels", lambda backend: aot_eager)
    initial = [p.detach().clone() for p in tiny_model("sdar").parameters()]

    def train(enabled):
        args = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                             max_completion_length=8, max_steps=1, learning_rate=1e-2, logging_steps=1, seed=0,
                             temperature=1.0, dynamic_group_filtering="none", fused_kernels=enabled, **CPU)
        trainer = TraceRLTrainer(tiny_model("sdar"), lambda completions, **kw: [float(len(c)) for c in completions],
                                 args=args, processing_class=build_tokenizer(),
                                 train_dataset=Dataset.from_dict({"prompt": ["1+2=", "2+2="] * 2}))
        assert fused(trainer.model) == ({"inductor"} if enabled else {None})
        trainer.train()
        loss = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return loss, [p.detach().clone() for p in trainer.model.parameters()]

    (eager_loss, eager_weights), (fused_loss, fused_weights) = train(False), train(True)
    assert len(eager_loss) == 1 and fused_loss == pytest.approx(eager_loss, rel=1e-4, abs=1e-6)
    assert any(not torch.equal(w, w0) for w, w0 in zip(eager_weights, initial))  # the step trained something
    for a, b in zip(fused_weights, eager_weights):
        close(a, b, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.filterwarnings("error:CUDA-graph capture failed")  # a fallback would not capture the fused kernels
@pytest.mark.parametrize("family,cache", [("sdar", True), ("llada", "dual"), ("dream", "dual")])
def test_cuda_graphs_capture_inductor_kernels_and_decode_as_eager(family, cache):
    """Inductor's GPU kernels, compiled in the graph runner's warm-up and captured with the step: float32 greedy
    decoding gives the eager tokens, ``unmask_step`` and log-probs (to float32 rounding)."""
    model = tiny_model(family).cuda()
    prompt = torch.randint(10, 100, (3, 10), generator=torch.Generator().manual_seed(0)).cuda()
    settings = dict(max_new_tokens=16, block_length=4, denoising_steps=4, temperature=0.0, stop_token_ids=[],
                    use_cache=cache, cuda_graphs="auto", return_dict_in_generate=True)
    eager = model.generate(prompt, **settings)
    set_fused_kernels(model)
    fused = model.generate(prompt, **settings)
    assert torch.equal(fused.sequences, eager.sequences) and torch.equal(fused.unmask_step, eager.unmask_step)
    close(fused.token_logprobs, eager.token_logprobs, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["sdar", "llada", "dream"])
def test_bf16_training_with_inductor_kernels_is_eager_to_bf16_precision(family):
    """bf16 with gradient checkpointing: the fused chains round once where eager rounds after every operation, so
    the loss and gradients agree to bf16 precision, not bit for bit."""
    model = tiny_model(family).cuda().to(torch.bfloat16).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(10, 100, (2, 32), generator=torch.Generator().manual_seed(0)).cuda()

    def step():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach().float(), [p.grad.float() for p in model.parameters() if p.grad is not None]

    eager = step()
    set_fused_kernels(model)
    fused = step()
    close(fused[0], eager[0], 2e-2)
    for a, b in zip(fused[1], eager[1]):
        close(a, b, 5e-2)
