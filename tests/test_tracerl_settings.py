"""TraceRLTrainer settings that reach the scoring and the loss: ``training_block_size`` different from the
rollout's ``block_length``, ``step_normalization``, a temperature other than 1, asynchronous reward functions, a
reward model and a policy given as a path."""

import math

import pytest
import torch
from datasets import Dataset
from numerics import assert_close_fp32

from trl_diffusion.estimators import replay_logprobs, step_groups
from trl_diffusion.states import completion_blocks
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer, _rollout_cuda_graphs, step_weights

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def make_config(tmp_path, **overrides) -> TraceRLConfig:
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=12, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                  block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none")  # rewards beyond [0, 1]
    config.update(overrides)
    return TraceRLConfig(**config)


def make_trainer(tmp_path, model=None, reward=distinct_chars, **overrides):
    model = model if model is not None else tiny_model("sdar").train()
    return TraceRLTrainer(model, reward, args=make_config(tmp_path, **overrides), train_dataset=Dataset.from_dict(
        {"prompt": PROMPTS}), processing_class=build_tokenizer())


def rollout_and_scores(trainer):
    """One generation batch (the 4 generations of one prompt) and the trainer's differentiable per-token log-probs
    of it, as its loss computes them."""
    output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    stash = {}
    score = trainer._get_per_token_logps_and_entropies

    def keep(*args, **kwargs):
        result = score(*args, **kwargs)
        stash["logps"] = result[0]
        return result

    trainer._get_per_token_logps_and_entropies = keep
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    loss = trainer.compute_loss(trainer.model, output)
    return output, stash["logps"], loss


def full_sequences(output):
    """``[prompt | canvas]`` and ``unmask_step`` over the same columns (-1 on the prompt)."""
    sequences = torch.cat([output["prompt_ids"], output["canvas_ids"]], 1)
    steps = torch.cat([torch.full_like(output["prompt_ids"], -1), output["unmask_step"]], 1)
    return sequences, steps


def test_training_block_size_differs_from_the_rollout_block_length(tmp_path):
    """Rollouts in blocks of 4, scoring in blocks of 8 (block-size adaptation): the trainer scores each token given
    the state before its merged step under block-causal attention in blocks of 8, steps merged (shrinkage 4) inside
    those blocks (so across the rollout's blocks), and weights the loss by those merged steps."""
    trainer = make_trainer(tmp_path, training_block_size=8, shrinkage=4)
    output, logps, _ = rollout_and_scores(trainer)
    sequences, steps = full_sequences(output)
    prompt_mask, canvas_steps = output["prompt_mask"], output["unmask_step"]
    groups = step_groups(canvas_steps, 4, completion_blocks(prompt_mask, canvas_steps.shape[1], 8))
    full_groups = torch.cat([torch.full_like(prompt_mask, -1), groups], 1)
    width = output["completion_ids"].shape[1]
    prompt_width = prompt_mask.shape[1]
    with torch.no_grad():
        expected = replay_logprobs(trainer.model, sequences, prompt_mask, steps, block_length=8,
                                   groups=full_groups)[:, prompt_width:prompt_width + width]
        in_blocks_of_4 = replay_logprobs(trainer.model, sequences, prompt_mask, steps, block_length=4,
                                         groups=full_groups)[:, prompt_width:prompt_width + width]
    trained = output["completion_mask"] > 0
    assert_close_fp32(logps, expected, trained)
    assert (in_blocks_of_4 - expected)[trained].abs().max() > 1e-3  # the block size matters here
    weights = step_weights(groups)[:, :width]
    assert torch.equal(output["completion_mask"], weights * (output["completion_mask"] > 0))
    assert int(groups.max()) < int(step_groups(canvas_steps, 4, completion_blocks(prompt_mask, width, 4)).max())


@pytest.mark.parametrize("normalization", ["step", "sequence"])
def test_step_normalization_reaches_the_loss(tmp_path, normalization):
    """With loss_type='grpo' (ratio 1 at the first iteration): d loss / d log p_j = -A_i w_j / sum_j w_j / B, with
    w_j = 1/|tau(t_j)| ('step': a sequence's loss is the mean over its steps of per-step means, as TraceRL) or
    w_j = 1 ('sequence': TRL's per-token mean)."""
    # 3 steps per block of 4 commit 2, 1, 1 tokens: steps of different sizes, so the two normalisations differ
    trainer = make_trainer(tmp_path, loss_type="grpo", step_normalization=normalization, shrinkage=1,
                           denoising_steps=3)
    output, logps, loss = rollout_and_scores(trainer)
    gradient, = torch.autograd.grad(loss, logps)
    width = logps.shape[1]
    committed = (output["unmask_step"][:, :width] >= 0) & (output["completion_mask"] > 0)
    groups = step_groups(output["unmask_step"], 1, completion_blocks(output["prompt_mask"], width, 4))[:, :width]
    weights = step_weights(groups) if normalization == "step" else committed.float()
    weights = weights * committed
    advantages = output["advantages"][:, None]
    expected = -advantages * weights / weights.sum(1, keepdim=True) / len(weights)
    assert advantages.abs().max() > 0
    assert len(weights[committed].unique()) == (2 if normalization == "step" else 1)
    assert_close_fp32(gradient, expected)


def test_a_temperature_other_than_one_is_sampled_and_scored_alike(tmp_path):
    """Rollouts at temperature 0.7 are scored at 0.7: the trainer's log-probs equal the sampler's (ratio 1), which
    differ from scoring at temperature 1."""
    trainer = make_trainer(tmp_path, temperature=0.7)
    output, logps, _ = rollout_and_scores(trainer)
    sampler = output["sampler_logps"][:, : logps.shape[1]]
    trained = output["completion_mask"] > 0
    assert_close_fp32(logps, sampler, trained)
    sequences, steps = full_sequences(output)
    prompt_width = output["prompt_mask"].shape[1]
    with torch.no_grad():
        at_one = replay_logprobs(trainer.model, sequences, output["prompt_mask"], steps, block_length=4)
    at_one = at_one[:, prompt_width:prompt_width + logps.shape[1]]
    assert (at_one - sampler)[trained].abs().max() > 1e-2
    trainer.train()
    assert trainer.state.log_history[0]["rollout/sampler_logp_gap"] < 1e-4


def test_async_reward_functions_score_like_their_synchronous_twin(tmp_path):
    async def async_distinct_chars(completions, **kwargs):
        return distinct_chars(completions)

    outputs = {}
    for name, reward in (("sync", distinct_chars), ("async", async_distinct_chars)):
        trainer = make_trainer(tmp_path, reward=reward)
        output = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
        outputs[name] = (list(trainer._logs["rewards"][reward.__name__]), output["advantages"])
    assert outputs["async"][0] == outputs["sync"][0] and len(set(outputs["sync"][0])) > 1
    assert torch.equal(outputs["async"][1], outputs["sync"][1])
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])


def test_policy_given_as_a_path(tmp_path):
    """TRL loads the policy (and, with beta > 0, the reference model) from the path; training moves the policy and
    not the reference."""
    tiny_model("sdar").save_pretrained(tmp_path / "policy")
    build_tokenizer().save_pretrained(tmp_path / "policy")
    trainer = make_trainer(tmp_path / "out", model=str(tmp_path / "policy"), beta=0.1, kl_reference="reference_model")
    assert type(trainer.model).__name__ == "SDARForCausalLM" and trainer.ref_model is not None
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    reference = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    for name, tensor in tiny_model("sdar").state_dict().items():
        assert torch.equal(before[name], tensor)
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert all(torch.equal(reference[n], p) for n, p in trainer.ref_model.named_parameters())


def test_rollout_cuda_graphs_reaches_generate(tmp_path, monkeypatch):
    """``rollout_cuda_graphs`` is the rollouts' ``cuda_graphs`` (on the CPU they decode eagerly either way)."""
    from trl_diffusion.generation import sampler

    seen = []
    choose = sampler.runner_class

    def spy(settings, device, generator):
        seen.append(settings.cuda_graphs)
        return choose(settings, device, generator)

    monkeypatch.setattr(sampler, "runner_class", spy)
    trainer = make_trainer(tmp_path, rollout_cuda_graphs="auto")
    trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    assert seen == ["auto"]
    with pytest.raises(ValueError, match="rollout_cuda_graphs must be one of"):
        TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, rollout_cuda_graphs="on")


@pytest.mark.parametrize("fsdp,zero_stage,eager", [(True, None, True), (False, 3, True), (False, 2, False),
                                                   (False, None, False)])
def test_rollout_cuda_graphs_decode_eagerly_under_parameter_gathering(tmp_path, fsdp, zero_stage, eager):
    """The default ``"auto"`` works with every setup: FSDP and ZeRO-3, whose forwards gather parameters (which a
    capture cannot hold), decode their rollouts eagerly; ``"off"`` stays off."""
    args = TraceRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    assert args.rollout_cuda_graphs == "auto"
    assert _rollout_cuda_graphs(args, fsdp, zero_stage) == ("off" if eager else "auto")
    args.rollout_cuda_graphs = "off"
    assert _rollout_cuda_graphs(args, fsdp, zero_stage) == "off"


def test_a_reward_model_scores_prompt_and_completion_text(tmp_path):
    """A sequence-classification reward model among the reward functions (TRL runs it on ``prompt + completion``
    text, right-padded, without special tokens, and reads logit 0): the rewards logged are its scores of exactly the
    rollouts' texts."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    tokenizer = build_tokenizer()
    torch.manual_seed(1)
    scorer = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tokenizer.pad_token_id)).eval()
    texts = []

    def record(prompts, completions, **kwargs):
        texts.extend(p + c for p, c in zip(prompts, completions))
        return [0.0] * len(completions)

    trainer = TraceRLTrainer(tiny_model("sdar").train(), [scorer, record], args=make_config(tmp_path),
                             processing_class=tokenizer,
                             train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                             reward_processing_classes=[tokenizer, None])
    trainer.train()
    with torch.no_grad():
        inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
        expected = scorer(**inputs).logits[:, 0]
    name = trainer.reward_func_names[0]
    logs = trainer.state.log_history[0]
    assert len(texts) == 4 and expected.std() > 0
    assert logs[f"rewards/{name}/mean"] == pytest.approx(expected.mean().item(), rel=1e-4, abs=1e-5)
    assert logs[f"rewards/{name}/std"] == pytest.approx(expected.std().item(), rel=1e-3, abs=1e-5)


@pytest.mark.parametrize("reward_std, scale_rewards", [("population", "group"), ("sample", "none")])
def test_leave_one_out_advantages_are_diffucoders(tmp_path, reward_std, scale_rewards):
    """``advantage_baseline='leave_one_out'`` (DiffuCoder's coupled-GRPO, ``coupled_grpo.py``): each reward minus the
    mean of its group's other rewards, then scaled as ``scale_rewards`` / ``reward_std`` say."""
    outputs = {}
    for baseline in ("group_mean", "leave_one_out"):
        trainer = make_trainer(tmp_path, reward_std=reward_std, scale_rewards=scale_rewards,
                               advantage_baseline=baseline)
        outputs[baseline] = trainer._generate_and_score_completions([{"prompt": PROMPTS[0]}] * 4)
    rewards = trainer._rewards().double().cpu()
    expected = rewards - (rewards.sum() - rewards) / 3
    if scale_rewards == "group":
        expected = expected / (rewards - rewards.mean()).pow(2).mean().sqrt()
    assert expected.abs().max() > 0
    torch.testing.assert_close(outputs["leave_one_out"]["advantages"].double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outputs["leave_one_out"]["advantages"], outputs["group_mean"]["advantages"] * 4 / 3)


def test_leave_one_out_is_refused_with_a_value_model(tmp_path):
    with pytest.raises(ValueError, match="advantage_baseline='leave_one_out' sets the reward baseline"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars,
                       args=make_config(tmp_path, advantage_baseline="leave_one_out"),
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer(),
                       value_model=tiny_model("sdar"))
    with pytest.raises(ValueError, match="advantage_baseline must be"):
        make_config(tmp_path, advantage_baseline="loo")


def test_a_block_model_trained_at_another_block_size_is_warned_about(tmp_path, caplog):
    """TraceRLConfig's block_length defaults to TraDo's 4, whatever the model: an SDAR checkpoint of block size 8
    (the released b8 / b16 / b32 variants) was rolled out and trained at 4 without a word."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_propagation()
    try:
        with caplog.at_level("WARNING"):
            make_trainer(tmp_path, model=tiny_model("sdar", block_size=8))
        assert "block_size=8, but TraceRL rolls out and trains at block_length=4" in caplog.text
        caplog.clear()
        with caplog.at_level("WARNING"):
            make_trainer(tmp_path, model=tiny_model("sdar", block_size=8), block_length=8, denoising_steps=4)
            make_trainer(tmp_path)  # block size 4, rolled out at 4
            make_trainer(tmp_path, training_block_size=8)  # an explicit training block size (dLLM-RL's 4 -> 8)
        assert "TraceRL rolls out at block_length" not in caplog.text
    finally:
        hf_logging.disable_propagation()


def test_leave_one_out_leaves_unscorable_responses_out():
    """A response no reward function scores (None: NaN) is left out of the group statistics; its group's other
    responses compare with the k' - 1 other scored ones (the factor was k / (k - 1) with k = num_generations)."""
    from trl_diffusion.trainers.tracerl_objective import leave_one_out_scale, population_advantages

    rewards = torch.tensor([float("nan"), 1.0, 2.0, 3.0, 0.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    loo = population_advantages(rewards, 4, "none") * leave_one_out_scale(rewards, 4)
    expected = torch.tensor([0.0, 1 - 2.5, 2 - 2.0, 3 - 1.5, 0 - 2 / 3, 1 - 1 / 3, 0 - 2 / 3, 1 - 1 / 3],
                            dtype=torch.float64)
    torch.testing.assert_close(loo, expected)
    one_scored = torch.tensor([float("nan"), float("nan"), 5.0, float("nan")])
    assert torch.equal(leave_one_out_scale(one_scored, 4), torch.ones(4))


def test_an_images_column_and_an_empty_first_prompt(tmp_path):
    """An ``images`` column passed construction and failed at the first rollout (as a chat-template TypeError with
    some templates); an empty first prompt failed as "input_ids must be an integer tensor, got float32"."""
    with pytest.raises(ValueError, match="has an 'images' column: TraceRLTrainer does not support images"):
        TraceRLTrainer(tiny_model("sdar"), distinct_chars, args=make_config(tmp_path),
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS, "images": [None] * 4}),
                       processing_class=build_tokenizer())
    trainer = make_trainer(tmp_path)
    with pytest.raises(ValueError) as caught:
        trainer._generate_and_score_completions([{"prompt": ""}, {"prompt": "abc"}] * 2)
    assert "a prompt is empty" in str(caught.value)
