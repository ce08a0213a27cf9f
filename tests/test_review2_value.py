"""Review round 2 of the diffusion value model and its use in TraceRL: GAE against a slow float64 transcription of
dLLM-RL's definitions, the dtype a value model is trained in, and settings that silently did nothing."""

import logging

import pytest
import torch
from datasets import Dataset
from example_scripts import load_example
from numerics import assert_close_fp32

from trl_diffusion.assets import EMBEDDED_MODEL
from trl_diffusion.scripts.utils import run_script
from trl_diffusion.states import trajectory_groups
from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import (
    DiffusionValueConfig,
    DiffusionValueModel,
    DiffusionValueTrainer,
    outcome_token_rewards,
    step_gae,
)

PROMPTS = ["What is 1+2?", "Say hi", "abc", "What is 7-3?"]


def distinct_chars(completions, **kwargs):
    return [float(len(set(c))) for c in completions]


def tracerl(tmp_path, model, value_model, **overrides) -> TraceRLTrainer:
    config = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                  max_completion_length=8, max_steps=1, report_to="none", block_length=4, denoising_steps=2,
                  save_strategy="no", use_cpu=True, bf16=False, disable_tqdm=True, seed=0,
                  dynamic_group_filtering="none")
    config.update(overrides)
    return TraceRLTrainer(model, distinct_chars, args=TraceRLConfig(**config),
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}), processing_class=build_tokenizer(),
                          value_model=value_model)


# ------------------------------------------------------------------------------------------------ GAE


def collapse(steps: list[int], k: int) -> list[int]:
    """dLLM-RL's ``collapse_k_unique``: every k consecutive distinct step ids of a block map to the group's last."""
    distinct = sorted(set(steps))
    last = {v: distinct[min((i // k + 1) * k - 1, len(distinct) - 1)] for i, v in enumerate(distinct)}
    return [last[s] for s in steps]


def official_gae(step_map, blocks, trainable, reward, values, gamma, lam, shrink):
    """dLLM-RL's train_trado_value.py GAE for one response, in float64: merge steps per block, put the reward on
    the trainable tokens of the last step, step means, backward recursions, back to tokens. ``step_map`` holds
    global sampler steps (-1 = never committed); ``blocks`` is each token's block."""
    merged = list(step_map)
    for b in set(blocks):
        cols = [i for i, blk in enumerate(blocks) if blk == b and step_map[i] >= 0]
        for i, m in zip(cols, collapse([step_map[i] for i in cols], shrink)):
            merged[i] = m
    cols = [i for i in range(len(merged)) if trainable[i] and merged[i] >= 0]
    last = max(merged[i] for i in cols)
    r = {i: reward if merged[i] == last else 0.0 for i in cols}
    steps = sorted({merged[i] for i in cols})
    members = [[i for i in cols if merged[i] == s] for s in steps]
    r_star = [sum(r[i] for i in m) / len(m) for m in members] + [0.0]
    v_star = [sum(values[i] for i in m) / len(m) for m in members] + [0.0]
    big_r, big_a = [0.0] * (len(steps) + 1), [0.0] * (len(steps) + 1)
    for t in reversed(range(len(steps))):
        big_r[t] = r_star[t] + gamma * big_r[t + 1]
        big_a[t] = r_star[t] - v_star[t] + gamma * v_star[t + 1] + gamma * lam * big_a[t + 1]
    advantages, returns = [0.0] * len(merged), [0.0] * len(merged)
    for i in cols:
        t = steps.index(merged[i])
        returns[i] = r[i] + gamma * big_r[t + 1]
        advantages[i] = r[i] - values[i] + gamma * v_star[t + 1] + gamma * lam * big_a[t + 1]
    return advantages, returns


def test_step_gae_equals_dllm_rls_definitions_in_float64():
    """Blocks decoded one after the other, several tokens per step (dynamic decoding), shrinkage 1-3, gamma and
    lambda below 1, tokens outside the trained mask, never-committed tokens: equal to the float64 transcription."""
    rng = torch.Generator().manual_seed(0)
    for trial in range(40):
        block = (2, 4)[trial % 2]
        shrink = 1 + trial % 3
        gamma, lam = (1.0, 0.9, 0.5)[trial % 3], (1.0, 0.7, 0.0)[trial // 3 % 3]
        lengths = torch.randint(1, 8, (3,), generator=rng).tolist()
        width = 12
        prompt_mask = torch.tensor([[0] * (max(lengths) - n) + [1] * n for n in lengths])
        blocks = (torch.tensor(lengths)[:, None] + torch.arange(width)) // block  # blocks from position 0
        unmask = torch.full((3, width), -1)
        for row in range(3):
            step = 0
            for b in blocks[row].unique().tolist():
                cols = (blocks[row] == b).nonzero().flatten()
                cols = cols[torch.randperm(len(cols), generator=rng)].tolist()
                while cols:  # 1 to 3 tokens per step
                    n = int(torch.randint(1, 4, (), generator=rng))
                    unmask[row, cols[:n]] = step
                    cols, step = cols[n:], step + 1
        unmask[0, -2:] = -1
        trainable = (torch.rand(3, width, generator=rng) < 0.85) & (unmask >= 0)
        trainable[:, 0] = True
        values = torch.randn(3, width, generator=rng)
        reward = torch.randn(3, generator=rng)
        groups = trajectory_groups(unmask, prompt_mask, shrink, block)
        advantages, returns = step_gae(outcome_token_rewards(reward, groups, trainable), values, groups, trainable,
                                       gamma, lam)
        for row in range(3):
            expected = official_gae(unmask[row].tolist(), blocks[row].tolist(), trainable[row].tolist(),
                                    reward[row].item(), values[row].double().tolist(), gamma, lam, shrink)
            assert_close_fp32(advantages[row], torch.tensor(expected[0]))
            assert_close_fp32(returns[row], torch.tensor(expected[1]))


# ------------------------------------------------------------------------------------------------ dtype


@pytest.fixture
def bf16_checkpoint(tmp_path):
    """A policy checkpoint saved in bfloat16, as released ones are (TraDo, LLaDA, Dream)."""
    path = tmp_path / "policy"
    tiny_model("sdar").to(torch.bfloat16).save_pretrained(path)
    return str(path)


def test_a_value_model_path_is_loaded_in_float32_as_trl_loads_the_policy(tmp_path, bf16_checkpoint):
    """The value optimizer is a plain AdamW with no float32 master copy: a bf16 value model loses every update
    below bf16 rounding (one TraceRL step at lr 5e-6 moved 283 of 82,304 backbone weights of the tiny SDAR, 75,605
    in float32). A path used to load in the checkpoint's dtype (bf16), while TRL loads the policy path in float32."""
    trainer = tracerl(tmp_path, bf16_checkpoint, bf16_checkpoint)
    value = trainer.accelerator.unwrap_model(trainer.value_model)
    assert trainer.model.dtype == torch.float32
    assert value.dtype == torch.float32
    # model_init_kwargs' dtype applies to both, as TRL applies it to the policy path
    trainer = tracerl(tmp_path, bf16_checkpoint, bf16_checkpoint, model_init_kwargs={"dtype": "bfloat16"})
    assert trainer.accelerator.unwrap_model(trainer.value_model).dtype == torch.bfloat16


def test_value_trainer_loads_a_path_in_float32(tmp_path, bf16_checkpoint):
    args = DiffusionValueConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
    trainer = DiffusionValueTrainer(bf16_checkpoint, args=args, processing_class=build_tokenizer())
    assert trainer.model.dtype == torch.float32


def test_a_half_precision_value_model_is_warned_about(tmp_path, caplog):
    policy = tiny_model("sdar")
    value = DiffusionValueModel.from_policy(policy).to(torch.bfloat16)
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        tracerl(tmp_path, policy, value)
    assert "keeps no float32 copy" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
        tracerl(tmp_path, policy, DiffusionValueModel.from_policy(policy))
    assert "keeps no float32 copy" not in caplog.text


def test_the_value_trainer_warns_about_a_half_precision_value_model(tmp_path, caplog):
    """``DiffusionValueTrainer`` trains with the same plain AdamW at the same learning rate (5e-6): 4 steps moved 300
    of 90,432 backbone weights of a bf16 value model (86,175 in float32), without a word."""
    for dtype, warned in ((torch.bfloat16, True), (torch.float32, False)):
        model = DiffusionValueModel.from_policy(tiny_model("sdar")).to(dtype)
        caplog.clear()
        args = DiffusionValueConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, report_to="none")
        with caplog.at_level(logging.WARNING, logger="trl_diffusion"):
            DiffusionValueTrainer(model, args=args, processing_class=build_tokenizer())
        assert ("keeps no float32 copy" in caplog.text) == warned
        assert ("learning_rate=5e-06" in caplog.text) == warned


# ------------------------------------------------------------------------------------------------ examples


@pytest.mark.slow
def test_math_example_saves_the_trained_value_model(tmp_path):
    """`examples/math.py --value_model` trained a value model and dropped it (`save_model` saves the policy and the
    example's default is save_strategy="no"); it is saved beside the policy, ready for `--value_model`."""
    example = load_example("math")  # in this process, as its __main__ runs it
    result = run_script(example.main, example.make_parser(), [
        "--output_dir", str(tmp_path), "--use_cpu", "true", "--value_model", str(EMBEDDED_MODEL), "--max_steps", "1",
        "--per_device_train_batch_size", "8", "--num_generations", "4", "--num_eval", "4"])
    assert result["value_model"] == f"{tmp_path}/value_model"
    value = DiffusionValueModel.from_pretrained(result["value_model"])
    assert value.config.model_type == "sdar" and value.value_head.weight.shape[0] == 1


# ------------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), None])
def test_value_dataset_rejects_a_reward_that_is_not_a_finite_number(tmp_path, reward):
    """A NaN reward made the loss NaN and every weight NaN after one step, with a logged loss of 0 (transformers
    filters NaN losses from the log); None failed in the collator with a bare TypeError."""
    rows = {"prompt": ["a", "b"], "completion_ids": [[10, 11, 12, 13]] * 2, "unmask_step": [[0, 1, 1, 2]] * 2,
            "reward": [1.0, reward]}
    args = DiffusionValueConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match=r"row 1: 'reward' must be a finite number"):
        DiffusionValueTrainer(DiffusionValueModel.from_policy(tiny_model("sdar")), args=args,
                              train_dataset=Dataset.from_dict(rows), processing_class=build_tokenizer())
