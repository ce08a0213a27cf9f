"""TraceRLTrainer: a full training step for every family and estimator, LoRA, the reference model, the sampler
log-prob gap, group filtering and bad inputs."""

import hashlib
import math

import numpy as np
import peft
import pytest
import torch
from datasets import Dataset

from trl_diffusion.estimators import ESTIMATORS
from trl_diffusion.testing import EOS_ID, build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer, mask_seed, step_weights

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def make_trainer(tmp_path, family="sdar", reward=distinct_chars, model=None, prompts=PROMPTS, **overrides):
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                  block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False, dynamic_group_filtering="none")  # rewards beyond [0, 1]
    peft_config = overrides.pop("peft_config", None)
    config.update(overrides)
    model = model if model is not None else tiny_model(family).train()
    dataset = Dataset.from_dict({"prompt": prompts})
    return TraceRLTrainer(model, reward, args=TraceRLConfig(**config), train_dataset=dataset,
                          processing_class=build_tokenizer(), peft_config=peft_config)


def changed_parameters(before, model):
    return [n for n, p in model.named_parameters() if n in before and not torch.equal(before[n], p.detach())]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_training_step_for_every_family_and_estimator(tmp_path, family, estimator):
    trainer = make_trainer(tmp_path, family, likelihood_estimator=estimator, num_iterations=2, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"])
    assert logs["rollout/tokens_per_step"] >= 1.0
    assert changed_parameters(before, trainer.model)
    if estimator == "trajectory":
        assert logs["rollout/sampler_logp_gap"] < 1e-4  # first iteration, same weights: ratio exactly 1


def test_lora(tmp_path):
    trainer = make_trainer(tmp_path, "llada", peft_config=peft.LoraConfig(r=4, lora_alpha=8), beta=0.04,
                           kl_reference="reference_model")  # the base model (adapters off) is the reference
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_" not in n}
    adapters = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    trainer.train()
    assert not changed_parameters(base, trainer.model)  # only adapters move
    assert changed_parameters(adapters, trainer.model)
    assert math.isfinite(trainer.state.log_history[0]["kl"])


def test_reference_model_is_a_frozen_copy(tmp_path):
    trainer = make_trainer(tmp_path, "dream", beta=0.1, max_steps=2, num_iterations=1, kl_reference="reference_model")
    assert trainer.ref_model is not None and trainer.ref_model is not trainer.model
    initial = {n: p.detach().clone() for n, p in trainer.ref_model.named_parameters()}
    trainer.train()
    assert not changed_parameters(initial, trainer.ref_model)
    assert changed_parameters(initial, trainer.model)
    assert trainer.state.log_history[1]["kl"] > 0  # the policy moved away from the frozen copy


def test_mask_seeds_are_stable_and_distinct():
    """A row's seed is the documented sha256 derivation (so the same in every process and run, whatever
    PYTHONHASHSEED: resumed and multi-process runs redraw the same masks), not Python's salted hash()."""
    def sha256_seed(*parts) -> int:  # the first 8 bytes of sha256("seed:step:index"), little-endian, to 63 bits
        digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    assert mask_seed(0, 3, 5) == sha256_seed(0, 3, 5) == 4022270347702650852
    assert mask_seed(7, "eval-2", 11) == sha256_seed(7, "eval-2", 11)
    assert len({mask_seed(0, step, i) for step in range(4) for i in range(16)}) == 64


def test_step_weights_normalise_each_merged_step():
    weights = step_weights(torch.tensor([[0, 0, 1, 2, 2, 2, -1]]))
    assert weights.tolist()[0][:6] == pytest.approx([0.5, 0.5, 1.0, 1 / 3, 1 / 3, 1 / 3])
    assert weights[0, 6] == 0 and weights.sum().item() == pytest.approx(3.0)  # one unit per step


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def one_group():
    return [{"prompt": PROMPTS[0]}] * 4  # the 4 generations of one prompt


def policy_gradient(trainer, output):
    """The policy gradient of one micro-batch, flattened."""
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop
    trainer.compute_loss(trainer.model, output).backward()
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])


def test_equal_rewards_give_zero_advantages_and_no_gradient(tmp_path):
    """Equal rewards in a group: every advantage is exactly 0 and so is the gradient, while the same rollouts with
    varied rewards do get a gradient (the loss is ~0 either way at the first iteration, so it proves nothing).
    Dynamic group filtering drops the group."""
    gradients = {}
    for name, reward in (("equal", constant), ("varied", distinct_chars)):
        trainer = make_trainer(tmp_path, "sdar", reward=reward)
        output = trainer._generate_and_score_completions(one_group())
        if name == "equal":
            assert bool((output["advantages"] == 0).all())
        gradients[name] = policy_gradient(trainer, output)
    assert bool((gradients["equal"] == 0).all()) and gradients["varied"].abs().max() > 1e-6
    trainer = make_trainer(tmp_path, "sdar", reward=constant, dynamic_group_filtering=True)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["filtered_groups"] == 1.0 and logs["grad_norm"] == 0.0


def test_group_filtering_drops_the_equal_group_from_the_loss(tmp_path):
    """One group with equal rewards, one without: filtering logs half the groups dropped and takes the dropped
    group's tokens out of the normaliser, so the same rollouts move the weights further (plain SGD, no clipping)
    than without filtering, where the zero-advantage tokens still count."""

    def half_constant(prompts, completions, **kwargs):
        return [1.0 if p.startswith("What") else float(i % 4) for i, p in enumerate(prompts)]

    deltas = {}
    for filtering in (False, True):
        trainer = make_trainer(tmp_path, "sdar", reward=half_constant, prompts=["What is 1+2?", "abc"],
                               per_device_train_batch_size=8, dynamic_group_filtering=filtering, optim="sgd",
                               max_grad_norm=0.0, loss_type="dapo")
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        deltas[filtering] = torch.cat([(p.detach() - before[n]).flatten()
                                       for n, p in trainer.model.named_parameters()]).norm()
        if filtering:
            assert trainer.state.log_history[0]["filtered_groups"] == 0.5
    assert deltas[False] > 0
    assert deltas[True] > 1.2 * deltas[False]


def test_reward_that_raises_names_the_function(tmp_path):
    def broken_reward(completions, **kwargs):
        raise KeyError("solution")

    trainer = make_trainer(tmp_path, reward=broken_reward)
    with pytest.raises(RuntimeError, match="broken_reward"):
        trainer.train()


def test_none_and_nan_rewards_follow_trl(tmp_path):
    """TRL's semantics (GRPOTrainer._generate_and_score_completions): a function's None / NaN leaves that function
    out of the row's weighted sum; a row where every function gave None is unscorable: left out of its group's
    mean and std (Bessel-corrected), and its advantage is 0. Training on such a batch stays finite."""

    def half_none(completions, **kwargs):  # None on odd rows and on row 0
        return [None if i % 2 or i == 0 else float(len(c)) for i, c in enumerate(completions)]

    def nan_first(completions, **kwargs):  # NaN (not None) on row 0
        return [float("nan") if i == 0 else float(len(set(c))) for i, c in enumerate(completions)]

    trainer = make_trainer(tmp_path, reward=[half_none, nan_first], reward_weights=[2.0, 1.0],
                           reward_std="sample")  # TRL's own advantages (the default is dLLM-RL's population std)
    output = trainer._generate_and_score_completions(one_group())
    per_function = np.array([trainer._logs["rewards"][name] for name in ("half_none", "nan_first")]).T
    assert np.isnan(per_function[0]).all() and np.isnan(per_function[1::2, 0]).all()
    assert not np.isnan(per_function[2:, 1]).any()
    total = np.nansum(per_function * [2.0, 1.0], axis=1)
    total[0] = np.nan  # unscorable
    expected = (total - np.nanmean(total)) / (np.nanstd(total, ddof=1) + 1e-4)
    expected[0] = 0.0
    assert np.nanstd(total, ddof=1) > 0
    assert output["advantages"].tolist() == pytest.approx(expected.tolist(), rel=1e-5, abs=1e-6)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"]) and math.isfinite(logs["grad_norm"]) and logs["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_group_filtering_treats_an_unscorable_row_as_trl_does(tmp_path):
    """One row unscorable (None) and the others equal: TRL gives every row advantage 0, so the group carries no
    signal and dynamic filtering drops it (an unscorable row is not a reward of 0)."""

    def none_first(completions, **kwargs):
        return [None if i == 0 else 1.0 for i in range(len(completions))]

    trainer = make_trainer(tmp_path, reward=none_first, dynamic_group_filtering=True)
    output = trainer._generate_and_score_completions(one_group())
    assert bool((output["advantages"] == 0).all())
    assert trainer._metrics["train"]["filtered_groups"] == [1.0]


def test_empty_completions(tmp_path):
    """A policy that ends every completion at once (EOS first): the completions are empty text, and a training step
    on them, with varied rewards so that there is a gradient, keeps every logged number and the weights finite."""
    model = tiny_model("sdar").train()

    def eos_wins(module, inputs, logits):  # EOS 20 above the best other logit, its gradient left intact
        lift = (logits.amax(-1) + 20.0 - logits[..., EOS_ID]).detach()
        return logits + torch.nn.functional.one_hot(torch.tensor(EOS_ID), logits.shape[-1]) * lift[..., None]

    model.lm_head.register_forward_hook(eos_wins)
    trainer = make_trainer(tmp_path, model=model, reward=lambda completions, **kw: [float(i % 3) for i in
                                                                                   range(len(completions))])
    trainer.train()
    logs = trainer.state.log_history[0]
    assert set(trainer._logs["completion"]) == {""}
    assert logs["completions/mean_length"] == 1.0  # the EOS alone
    numbers = {k: v for k, v in logs.items() if isinstance(v, float)}
    assert all(math.isfinite(v) for v in numbers.values()), numbers
    assert logs["grad_norm"] > 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_model_without_mask_token_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="mask token"):
        make_trainer(tmp_path, model=tiny_model("sdar", mask_token_id=None))


def test_config_errors():
    with pytest.raises(ValueError, match="likelihood_estimator"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, likelihood_estimator="elbo")
    with pytest.raises(ValueError, match="temperature"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, temperature=0.0)
    with pytest.raises(ValueError, match="denoising_steps"):
        TraceRLConfig(output_dir="x", use_cpu=True, bf16=False, block_length=4, denoising_steps=8)


def test_conversational_prompts_and_trl_rewards(tmp_path):
    """A conversational dataset (DESIGN's example: ``trl.rewards.accuracy_reward`` on ``solution``): the prompt is
    rendered with the tokenizer's chat template, and each completion reaches the reward functions as one assistant
    message holding the decoded completion. The template here renders the user message as the plain prompt the
    embedded model was trained on, so the rollouts solve some problems; TRL's math-verify reward must then agree with
    exact match on the same completions (a template not applied, or completions passed in another shape, fail it)."""
    from transformers import AutoTokenizer
    from trl.rewards import accuracy_reward

    from trl_diffusion.assets import EMBEDDED_MODEL, EMBEDDED_TASK
    from trl_diffusion.data import make_problems, score_completion, to_dataset

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    tokenizer.chat_template = "{{ messages[0]['content'] + '\\n' }}"  # the plain prompt (a template's own last
    # newline is dropped by Jinja, hence the expression)
    seen = []

    def record(prompts, completions, completion_ids, answer, **kwargs):
        seen.extend(zip(prompts, completions, completion_ids, answer))
        return [0.0] * len(completions)

    train = make_problems(**EMBEDDED_TASK)[0][:16]
    config = TraceRLConfig(output_dir=str(tmp_path), per_device_train_batch_size=32, num_generations=2,
                           max_completion_length=16, max_steps=1, logging_steps=1, report_to="none",
                           learning_rate=1e-4, block_length=4, denoising_steps=4, save_strategy="no", use_cpu=True,
                           gradient_checkpointing=False, disable_tqdm=True, seed=0, bf16=False, temperature=0.5)
    trainer = TraceRLTrainer(str(EMBEDDED_MODEL), [accuracy_reward, record], args=config,
                             train_dataset=to_dataset(train, "conversational"), processing_class=tokenizer)
    trainer.train()
    assert len(seen) == 32
    answers = {p.prompt: str(p.answer) for p in train}
    for prompt, completion, ids, answer in seen:
        assert len(prompt) == 1 and prompt[0]["role"] == "user" and answers[prompt[0]["content"]] == answer
        assert completion == [{"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}]
    exact = [score_completion(completion, answer) for _, completion, _, answer in seen]
    logs = trainer.state.log_history[0]
    assert 0 < sum(exact) and logs["rewards/accuracy_reward/mean"] == pytest.approx(sum(exact) / len(exact))


def test_reward_weights_enter_the_population_advantages():
    """With several reward functions, dLLM-RL's population advantages (the default ``reward_std``) standardise the
    WEIGHTED sum of the rewards, as TRL sums them; reference: numpy z-scores (population std) of sum_j w_j r_j."""
    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    def distinct(completions, **kwargs):
        return [float(len(set(c))) for c in completions]

    weights = np.array([3.0, -1.0])
    trainer = make_trainer("unused", reward=[length, distinct], reward_weights=weights.tolist())
    output = trainer._generate_and_score_completions(one_group())
    per_function = np.array([trainer._logs["rewards"][name] for name in ("length", "distinct")]).T[-4:]
    total, unweighted = per_function @ weights, per_function.sum(1)
    assert total.std() > 0 and not np.allclose(total - total.mean(), unweighted - unweighted.mean())
    expected = (total - total.mean()) / total.std()
    np.testing.assert_allclose(output["advantages"].tolist(), expected, rtol=1e-4, atol=1e-4)
