"""TraceRL as published (dLLM-RL, arXiv 2509.06949), option by option: every official objective, filter and value
setting is compared on fixed rollouts with a slow transcription of the official formula written out here (not
built from the trainer's helpers)."""

import torch
from datasets import Dataset

from trl_diffusion.testing import build_tokenizer, tiny_model
from trl_diffusion.trainers.tracerl_config import TraceRLConfig
from trl_diffusion.trainers.tracerl_trainer import TraceRLTrainer
from trl_diffusion.value import DiffusionValueModel, step_gae

STOP_CHARACTERS = "aeiouAEIOU 0123456789"


def base_config(tmp_path, **overrides) -> dict:
    config = dict(output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=16, max_steps=1, logging_steps=1, report_to="none", learning_rate=1e-2,
                  block_length=4, denoising_steps=2, save_strategy="no", use_cpu=True, gradient_checkpointing=False,
                  disable_tqdm=True, seed=0, bf16=False)
    config.update(overrides)
    return config


# ------------------------------------------------------------------------------------------------ the crash


def test_gae_ignores_group_ids_outside_the_mask():
    """Tokens outside the mask (canvas after EOS, filtered rows) may carry larger group ids than any token inside
    it; they must neither index the step table nor receive an advantage."""
    groups = torch.tensor([[0, 1, 2, 7, 7], [0, 0, 5, 6, -1]])
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5], [0.5, 0.25, 1.0, 1.0, 1.0]])
    rewards = torch.tensor([[0.0, 1.0, 9.0, 9.0, 9.0], [2.0, 2.0, 9.0, 9.0, 9.0]])
    advantages, returns = step_gae(rewards, values, groups, mask)
    # gamma = lam = 1: every masked token's return is the sum of its row's step-mean rewards from its step on
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0, 0, 0], [2.0, 2.0, 0, 0, 0]]))
    torch.testing.assert_close(advantages, torch.tensor([[0.9, 0.8, 0, 0, 0], [1.5, 1.75, 0, 0, 0]]))


def test_value_model_with_group_filtering_and_early_stops(tmp_path):
    """The reported crash: a value model, group filtering, and several stop ids so that rows stop at different
    points inside their blocks (canvas tokens after the stop carry larger step ids than any trained token)."""
    tokenizer = build_tokenizer()
    policy = tiny_model("sdar").train()
    policy.generation_config.eos_token_id = [tokenizer.convert_tokens_to_ids(c) for c in STOP_CHARACTERS]

    def reward(prompts, completions, **kwargs):  # the "abc" group is all-equal and is filtered
        return [1.0 if p == "abc" else float(i % 2) for i, p in enumerate(prompts)]

    args = TraceRLConfig(**base_config(tmp_path, seed=1, dynamic_group_filtering=True))
    trainer = TraceRLTrainer(policy, reward, args=args, train_dataset=Dataset.from_dict({"prompt": ["What is 1+2?", "abc"]}),
                             processing_class=tokenizer, value_model=DiffusionValueModel.from_policy(policy))
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["filtered_groups"] == 0.5
    assert logs["completions/min_length"] < logs["completions/max_length"]
