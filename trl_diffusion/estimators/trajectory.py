"""Scoring a recorded trajectory: the log-prob of every committed token given the state it was committed from.

``replay_logprobs`` is the slow, obvious form (one forward per denoising step); faster packed forms must equal
it. At the first iteration on a fresh rollout it reproduces the sampler's ``token_logprobs``.
"""

from __future__ import annotations

import torch

from ..generation.sampling import checked_cfg_scale, guided_logits, sampling_logits
from ..states import attention_mask_from_positions, positions_from_padding, state_before_step


def trajectory_layout(prompt_mask: torch.Tensor, completion_width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid, generated)`` ``[B, P + C]`` for padded prompts (as given) followed by ``completion_width``
    generated columns, as ``generate`` lays them out. Every completion column was part of the sampler's canvas."""
    batch = prompt_mask.shape[0]
    completion = torch.ones(batch, completion_width, dtype=torch.bool, device=prompt_mask.device)
    valid = torch.cat([prompt_mask.bool(), completion], dim=1)
    generated = torch.cat([torch.zeros_like(prompt_mask, dtype=torch.bool), completion], dim=1)
    return valid, generated


def replay_logprobs(
    model,
    sequences: torch.Tensor,
    prompt_mask: torch.Tensor,
    unmask_step: torch.Tensor,
    block_length: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    groups: torch.Tensor | None = None,
    exclude_mask_token: bool = True,
    cfg_scale: float = 0.0,
) -> torch.Tensor:
    """Log-prob of each committed token under the sampling distribution at its commit step (0 elsewhere).

    ``sequences`` / ``unmask_step`` as returned by ``generate`` (prompt width = ``prompt_mask.shape[1]``).
    ``block_length`` is the rollout's block length for block-causal models (default: the model's). ``groups``
    (same layout, e.g. from ``step_groups``) replaces the steps by merged steps; ``exclude_mask_token=False`` keeps
    the mask token in the softmax (dLLM-RL's trainers). ``cfg_scale``: the ``generate()`` call's classifier-free
    guidance scale (0: none), which changed the logits every token was sampled from (``guided_logits``, the
    sampler's own function). One whole-sequence forward per (merged) step (two with guidance): slow and obvious, the
    reference the packed scorer is tested against. Differentiable.
    """
    cfg_scale = checked_cfg_scale(cfg_scale)  # the generate() call's, as generate() reads it
    if groups is not None:
        unmask_step = groups
    valid, generated = trajectory_layout(prompt_mask, sequences.shape[1] - prompt_mask.shape[1])
    if bool(((unmask_step >= 0) & ~generated).any()):  # a mask over the whole sequence made every token "prompt"
        raise ValueError(f"unmask_step marks tokens the sampler committed within the first {prompt_mask.shape[1]} "
                         "columns, which prompt_mask makes the prompt: pass the prompt's attention mask (the one "
                         "given to generate()), not a mask over the whole sequence.")
    # prompt padding may hold any id (generate() copies it through): the forward must not look it up
    sequences = sequences.masked_fill(~valid, model.mask_token_id)
    prompt = valid & ~generated  # the prompt's real tokens: what guidance's unconditional input masks
    positions = positions_from_padding(valid)
    block = (block_length or model.block_size) if model.block_size is not None else None
    mask = attention_mask_from_positions(positions, positions, valid, block)
    out = torch.zeros(sequences.shape, dtype=torch.float32, device=sequences.device)
    for step in range(int(unmask_step.max()) + 1):
        state = state_before_step(sequences, unmask_step, generated, step, model.mask_token_id)
        logits = model.align_logits(guided_logits(model, state, mask, positions, prompt, cfg_scale), valid)
        excluded = model.mask_token_id if exclude_mask_token else None
        log_dist = sampling_logits(logits, temperature, top_k, top_p, excluded, model.top_p_first).log_softmax(-1)
        scores = log_dist.gather(-1, sequences[..., None]).squeeze(-1)
        now = unmask_step == step
        out = torch.where(now, scores, out)
    return out
