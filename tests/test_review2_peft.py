"""PEFT / LoRA across the package (review round 2): peft's wrappers around our models, generation through an
adapter, and the trainers with ``peft_config``."""

import peft
import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32
from transformers import AutoModelForCausalLM

from trl_diffusion import TraceRLConfig, TraceRLTrainer
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.value import DiffusionValueModel

PROMPT = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(0))
GREEDY = dict(max_new_tokens=8, block_length=4, denoising_steps=4, temperature=0.0)


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def make_tracerl(tmp_path, model, peft_config=None, **overrides):
    """One TraceRL step on four prompts (4 generations each, 8 tokens in blocks of 4)."""
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                  block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none")  # rewards beyond [0, 1]
    config.update(overrides)
    dataset = Dataset.from_dict({"prompt": ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]})
    return TraceRLTrainer(model, distinct_chars, args=TraceRLConfig(**config), train_dataset=dataset,
                          processing_class=build_tokenizer(), peft_config=peft_config)


def with_adapter(model, seed=1, **lora):
    """``model`` under a LoRA adapter with non-zero weights (a fresh adapter is the identity)."""
    torch.manual_seed(seed)  # lora_A's initialisation
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **lora))
    generator = torch.Generator().manual_seed(seed)
    for name, param in wrapped.named_parameters():
        if "lora_B" in name:
            param.data = 0.5 * torch.randn(param.shape, generator=generator)
    return wrapped.eval()


def test_causal_lm_task_type_wraps_generates_and_reloads(tmp_path, family):
    """``LoraConfig(task_type="CAUSAL_LM")`` (TRL's usual LoRA config) makes a ``PeftModelForCausalLM``, which
    reads the model's ``prepare_inputs_for_generation``: it used to raise AttributeError for every family. The
    wrapper computes what the plain ``PeftModel`` computes, and ``AutoPeftModelForCausalLM`` reloads it."""
    tiny_model(family).save_pretrained(tmp_path / "base")
    plain = with_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"))
    causal = with_adapter(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), task_type="CAUSAL_LM")
    assert isinstance(causal, peft.PeftModelForCausalLM)
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = causal(input_ids=ids).logits
        assert torch.equal(logits, plain(input_ids=ids).logits)
    sequences = causal.generate(PROMPT, torch.ones_like(PROMPT), **GREEDY)
    assert torch.equal(sequences, plain.generate(PROMPT, torch.ones_like(PROMPT), **GREEDY))
    causal.save_pretrained(tmp_path / "adapter")
    reloaded = peft.AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter").eval()
    with torch.no_grad():
        assert_close_fp32(reloaded(input_ids=ids).logits, logits)


def test_lora_rollouts_run_under_the_training_autocast(tmp_path):
    """bf16 mixed precision: accelerate wraps the prepared model's forward in autocast, but a LoRA policy's
    rollouts call its base model's ``generate``, which bypassed it: the sampler ran in float32 while the trainer
    scored in bf16 (LLaDA, fp32 weights: ``rollout/sampler_logp_gap_exact`` 0.030 with LoRA, 0.0 without). The
    rollout now runs under the same autocast as the training forward, as it does without LoRA."""
    model = tiny_model("llada").train()  # fp32 weights, bf16 autocast
    trainer = make_tracerl(tmp_path, model, bf16=True, beta=0.0,
                           peft_config=peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))
    autocast = {"rollout": set(), "training": set()}
    model.model.register_forward_hook(lambda module, args, output: autocast[
        "training" if torch.is_grad_enabled() else "rollout"].add(torch.is_autocast_enabled("cpu")))
    trainer.train()
    assert autocast == {"rollout": {True}, "training": {True}}


def test_reference_of_a_passed_peft_model_is_its_initial_adapter(tmp_path):
    """docs/tracerl.md: with a ``PeftModel`` passed (a trained adapter) and ``kl_reference="reference_model"``, the
    reference is a frozen copy of that adapter (TRL's ``ref`` adapter), not the base model: the KL of the first
    step, taken before any update, is 0 although the adapter is far from the identity."""
    policy = with_adapter(tiny_model("sdar"), seed=3).train()
    trainer = make_tracerl(tmp_path, policy, beta=0.04, kl_reference="reference_model")
    assert set(trainer.model.peft_config) == {"default", "ref"}
    trainer.train()
    assert trainer.state.log_history[0]["kl"] == 0.0


def test_lora_rollouts_are_scored_as_sampled(tmp_path, family):
    """On-policy replay through an adapter that is far from the identity: the trainer's scores of each rollout
    token from the sampler's own state equal the sampler's log-probs (SDAR with its exact KV cache), so the
    adapter applies in decoding as in training."""
    trainer = make_tracerl(tmp_path, tiny_model(family).train(), rollout_cache=family == "sdar",
                           peft_config=peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False))
    trainer.train()
    assert trainer.state.log_history[0]["rollout/sampler_logp_gap_exact"] < 1e-4


def test_value_model_from_a_lora_policy_asks_to_merge(tmp_path):
    """A value model copies a plain policy: a policy with LoRA layers injected in place (the model object a
    trainer's ``peft_config`` wrapped), or a saved adapter directory, used to fail with a state-dict key
    ``RuntimeError`` (``from_policy``) or "Unrecognized model" (``load``); each now says to merge the adapters, and
    the merged policy gives a value model."""
    tiny_model("sdar").save_pretrained(tmp_path / "base")
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    wrapped = with_adapter(policy)
    wrapped.save_pretrained(tmp_path / "adapter")  # names the base model's directory
    for source in (policy, str(tmp_path / "adapter"), wrapped):
        with pytest.raises(TypeError, match="merge the PEFT adapters first"):
            DiffusionValueModel.from_policy(source)
    with pytest.raises(ValueError, match="holds a PEFT adapter"):
        DiffusionValueModel.load(str(tmp_path / "adapter"))
    merged = wrapped.merge_and_unload()
    value = DiffusionValueModel.from_policy(merged)
    assert torch.equal(value.model.layers[0].self_attn.q_proj.weight, merged.model.layers[0].self_attn.q_proj.weight)
