"""TraceRL's loss weights, training-row counts, group filter and group-normalised advantages (pure tensor
functions; the trainer wires them into TRL's loss).

dLLM-RL (the TraceRL reference implementation) trains on *rows*: one row per response and merged denoising step.
A row's loss is the sum of its tokens' PPO terms times a per-token weight, and an optimizer step averages over its
rows. The weight is 1/|tau(t)| (the paper's formula; dLLM-RL's Dream and LLaDA code) or 1/L_max (dLLM-RL's SDAR /
TraDo code, which also stacks the r-th step of every block into one row).
"""

from __future__ import annotations

import torch

STEP_NORMALIZATIONS = ("step", "max_length", "sequence")


def step_weights(groups: torch.Tensor, trained: torch.Tensor | None = None) -> torch.Tensor:
    """1 / |tau(t)| for every trained token of merged step t, 0 elsewhere. |tau(t)| counts only the step's trained
    tokens (``trained``; default: every committed token), not canvas tokens after the end of the completion."""
    valid = groups >= 0 if trained is None else trained.bool() & (groups >= 0)
    index = torch.where(valid, groups, torch.zeros_like(groups))
    counts = torch.zeros(groups.shape[0], int(index.max()) + 1 if groups.numel() else 1, device=groups.device)
    counts.scatter_add_(1, index, valid.float())
    sizes = counts.gather(1, index)
    return torch.where(valid, 1.0 / sizes.clamp(min=1), torch.zeros_like(sizes))


def training_rows(groups: torch.Tensor, trained: torch.Tensor, blocks: torch.Tensor | None,
                  stack_blocks: bool) -> torch.Tensor:
    """``[B]`` number of dLLM-RL training rows of each response: its merged steps that hold a trained token, or,
    with ``stack_blocks`` on a block model (dLLM-RL's SDAR/TraDo layout, where row r holds the r-th merged step of
    every block), the largest number of such steps in one block."""
    valid = trained.bool() & (groups >= 0)
    batch, width = groups.shape
    if not bool(valid.any()):
        return torch.zeros(batch, dtype=torch.long, device=groups.device)
    rows = torch.arange(batch, device=groups.device)[:, None].expand(batch, width)
    block = blocks if (stack_blocks and blocks is not None) else torch.zeros_like(groups)
    n_groups, n_blocks = int(groups[valid].max()) + 1, int(block[valid].max()) + 1
    distinct = torch.unique((rows[valid] * n_blocks + block[valid]) * n_groups + groups[valid])
    row_block = torch.div(distinct, n_groups, rounding_mode="floor")
    per_block = torch.zeros(batch * n_blocks, dtype=torch.long, device=groups.device)
    per_block.scatter_add_(0, row_block, torch.ones_like(row_block))
    return per_block.view(batch, n_blocks).max(dim=1).values


BAND_ROUNDING = 1e-5
"""How far outside [0, 1] ``accuracy_band`` lets a reward lie: float32 rounding of a weighted sum, not a scale."""


def kept_groups(rewards: torch.Tensor, num_generations: int, mode: str, low: float, high: float) -> torch.Tensor:
    """``[N]`` True for responses whose group survives the filter. ``rewards`` ``[N]`` (NaN = unscorable, left out).

    * ``accuracy_band`` (dLLM-RL): keep groups whose mean reward -- the accuracy, for a 0/1 correctness reward --
      lies in ``[low, high]``; rewards must lie in [0, 1].
    * ``all_equal``: drop groups whose rewards are all equal (no learning signal).
    * ``none``: keep everything.
    """
    if mode == "none":
        return torch.ones_like(rewards, dtype=torch.bool)
    groups = rewards.view(-1, num_generations)
    scored = ~torch.isnan(groups)
    if mode == "accuracy_band":
        values = groups[scored]
        # a float32 sum of weighted rewards may overshoot 1 by rounding (0.4 + 0.3 + 0.1 + 0.2 = 1.0000001)
        if values.numel() and (values.min() < -BAND_ROUNDING or values.max() > 1 + BAND_ROUNDING):
            raise ValueError("dynamic_group_filtering='accuracy_band' reads each response's (weighted, summed) reward "
                             "as its correctness and needs rewards in [0, 1]; got rewards in "
                             f"[{values.min().item():.9g}, {values.max().item():.9g}]. Use a 0/1 reward, or set "
                             "dynamic_group_filtering='all_equal' or 'none'.")
        accuracy = torch.nanmean(groups.clamp(0, 1), dim=1)  # an overshoot by rounding reads as the bound itself
        keep = (accuracy >= low) & (accuracy <= high)
    elif mode == "all_equal":
        high_value = torch.where(scored, groups, torch.full_like(groups, -torch.inf)).max(dim=1).values
        low_value = torch.where(scored, groups, torch.full_like(groups, torch.inf)).min(dim=1).values
        keep = high_value > low_value
    else:
        raise ValueError(f"unknown dynamic_group_filtering {mode!r}.")
    return keep.repeat_interleave(num_generations)


def leave_one_out_scale(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """``[N]`` factors that turn group-mean advantages into leave-one-out ones (DiffuCoder's coupled-GRPO): a reward
    minus the mean of its group's other scored rewards is ``(r - group mean) * k / (k - 1)``, with ``k`` the group's
    scored (not NaN) rewards, which is what the group statistics count; 1 where ``k < 2`` (nothing to compare)."""
    scored = (~torch.isnan(rewards.view(-1, num_generations))).sum(1, keepdim=True).to(rewards.dtype)
    scale = torch.where(scored > 1, scored / (scored - 1).clamp(min=1), torch.ones_like(scored))
    return scale.expand(-1, num_generations).flatten()


def population_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str) -> torch.Tensor:
    """``[N]`` advantages as dLLM-RL computes them: ``(r - group mean) / population std``, 0 where the std is 0
    (``scale_rewards='group'``; ``'batch'`` takes the std over the whole batch, ``'none'`` only centres). NaN rewards
    (unscorable responses) are left out of the statistics and get 0."""
    groups = rewards.view(-1, num_generations).double()  # float32 squares overflow from rewards of about 1e19
    mean = torch.nanmean(groups, dim=1, keepdim=True)
    centred = groups - mean
    if scale_rewards == "group":
        std = torch.nanmean(centred**2, dim=1, keepdim=True).sqrt()
    elif scale_rewards == "batch":
        std = torch.nanmean((groups - torch.nanmean(groups)) ** 2).sqrt().expand_as(mean)
    elif scale_rewards == "none":
        std = torch.ones_like(mean)
    else:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}.")
    advantages = torch.where(std > 0, centred / torch.where(std > 0, std, torch.ones_like(std)), 0.0)
    return torch.nan_to_num(advantages, nan=0.0).flatten().to(rewards.dtype)
