"""How a trainer gets log pi(completion) from a diffusion model (see ``trajectory``)."""

from .trajectory import replay_logprobs, trajectory_layout

__all__ = ["replay_logprobs", "trajectory_layout"]
