"""TraceRLTrainer: TRL's GRPOTrainer with diffusion rollouts and trajectory-aware likelihoods.

What changes relative to GRPO (everything else — rewards, advantages, loss types, clipping, KL, buffering,
logging, callbacks — is TRL's):

* rollouts come from the model's diffusion ``generate()``; the whole sampler canvas, its trajectory
  (``unmask_step``), the sampler's log-probs and per-row mask seeds travel with the batch as tensors;
* ``_get_per_token_logps_and_entropies`` scores completions with the configured likelihood estimator
  (TraceRL's ``trajectory`` by default) instead of causal next-token log-probs;
* the loss mask carries TraceRL's per-step weights (1/|tau(t)|) and, for masking estimators, which tokens were
  scored;
* optional dynamic group filtering; a frozen copy of the initial policy is the reference model when the policy is
  given as an object.
"""

from __future__ import annotations

import copy
import hashlib

import torch
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.utils import disable_dropout_in_model, is_async_callable, pad

from ..estimators import EstimatorSettings, draw_masks, estimate_logprobs, step_groups
from ..models import check_tokenizer
from ..states import block_index, positions_from_padding
from .tracerl_config import TraceRLConfig


def mask_seed(seed: int, rollout_step: int, sample_index: int) -> int:
    """A stable 63-bit seed for one row's random masks: the same for old, new and reference log-probs and for a
    resumed run, different across rows and rollouts."""
    digest = hashlib.sha256(f"{seed}:{rollout_step}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def step_weights(groups: torch.Tensor) -> torch.Tensor:
    """1 / |tau(t)| for every token of merged step t (0 where nothing was committed)."""
    weights = torch.zeros(groups.shape, dtype=torch.float32, device=groups.device)
    for row in range(groups.shape[0]):
        valid = groups[row] >= 0
        if valid.any():
            counts = torch.bincount(groups[row][valid])
            weights[row, valid] = 1.0 / counts[groups[row][valid]].float()
    return weights


class TraceRLTrainer(GRPOTrainer):
    """Trajectory-aware RL for diffusion language models (TraceRL, arXiv 2509.06949) on TRL's GRPOTrainer.

    Accepts everything ``GRPOTrainer`` accepts; ``args`` is a :class:`TraceRLConfig`.
    """

    _tag_names = ["trl", "trl_diffusion", "tracerl"]
    _name = "TraceRL"
    _paper = {
        "title": "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language Models",
        "id": "2509.06949",
        "citation": (
            "@article{wang2025tracerl,\n  title={Revolutionizing Reinforcement Learning Framework for Diffusion "
            "Large Language Models},\n  author={Wang, Yinjie and Yang, Ling and Li, Bowen and Tian, Ye and Shen, "
            "Ke and Wang, Mengdi},\n  journal={arXiv preprint arXiv:2509.06949},\n  year={2025}\n}"
        ),
    }

    def __init__(self, model, reward_funcs=None, args: TraceRLConfig | None = None, *pos, **kwargs):
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path or "model"
            args = TraceRLConfig(f"{str(name).split('/')[-1]}-TraceRL")
        elif not isinstance(args, TraceRLConfig):
            raise TypeError(f"args must be a TraceRLConfig, got {type(args).__name__}.")
        own_reference = args.beta != 0.0 and not isinstance(model, str) and not _is_peft(model) \
            and kwargs.get("peft_config") is None
        beta = args.beta
        reference = None
        if own_reference:  # TRL would re-load the reference from config._name_or_path, which an in-memory model lacks
            # copy before TRL patches the policy's forward (a copy made later would call the policy's weights)
            reference = copy.deepcopy(model).eval()
            args.beta = 0.0
        try:
            super().__init__(model, reward_funcs, args, *pos, **kwargs)
        finally:
            args.beta = beta
        unwrapped = self.accelerator.unwrap_model(self.model)
        base = unwrapped.get_base_model() if _is_peft(unwrapped) else unwrapped
        if not hasattr(base, "attention_kind"):
            raise TypeError(f"{type(base).__name__} is not a diffusion model of trl_diffusion (SDAR, LLaDA, Dream).")
        _ = base.mask_token_id  # raises a clear error when the model has no mask token
        check_tokenizer(self._tokenizer, base)
        if own_reference:
            self.beta = beta
            reference.requires_grad_(False)
            if args.disable_dropout:
                disable_dropout_in_model(reference)
            if self.is_deepspeed_enabled:
                reference = prepare_deepspeed(reference, self.accelerator)
            elif self.is_fsdp_enabled:
                reference = prepare_fsdp(reference, self.accelerator)
            else:
                reference = self.accelerator.prepare_model(reference, evaluation_mode=True)
            self.ref_model = reference
        training_block = args.training_block_size or args.block_length
        self.estimator_settings = EstimatorSettings(
            name=args.likelihood_estimator, shrinkage=args.shrinkage, block_size=training_block,
            temperature=args.temperature, token_budget=args.scoring_token_budget,
            mask_low=args.random_mask_low, mask_high=args.random_mask_high,
            coupled_low=args.coupled_low, coupled_high=args.coupled_high, prompt_mask_prob=args.prompt_mask_prob,
        )
        self.reward_funcs = [_name_errors(f, n) for f, n in zip(self.reward_funcs, self.reward_func_names)]
        self._scoring: dict | None = None  # the rows being scored: canvas, trajectory, seeds, sampler log-probs
        self._rollout_rewards: torch.Tensor | None = None

    # ------------------------------------------------------------------------------------------------ rollouts
    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if images is not None and any(images):
            raise ValueError("TraceRLTrainer does not support images.")
        device = self.accelerator.device
        tensors = [torch.tensor(ids) for ids in prompt_ids]
        prompt = pad(tensors, padding_value=self._tokenizer.pad_token_id, padding_side="left").to(device)
        prompt_mask = pad([torch.ones_like(t) for t in tensors], padding_value=0, padding_side="left").to(device)
        rows = len(prompt_ids)
        first = self.accelerator.process_index * rows
        rollout_step = self.state.global_step
        seeds = torch.tensor([mask_seed(self.args.seed, rollout_step, first + i) for i in range(rows)])
        generator = torch.Generator(device=device).manual_seed(mask_seed(self.args.seed + 1, rollout_step, first))
        top_k = self.args.top_k or None
        top_p = self.args.top_p if self.args.top_p < 1.0 else None
        with (
            unwrap_model_for_generation(self.model_wrapped, self.accelerator,
                                        gather_deepspeed3_params=self.args.ds3_gather_for_generation) as unwrapped,
            torch.no_grad(),
        ):
            model = unwrapped.get_base_model() if _is_peft(unwrapped) else unwrapped
            out = model.generate(
                prompt, prompt_mask, max_new_tokens=self.max_completion_length, block_length=self.args.block_length,
                denoising_steps=self.args.denoising_steps, remasking_strategy=self.args.remasking_strategy,
                confidence_threshold=self.args.confidence_threshold, temperature=self.args.temperature,
                top_k=top_k, top_p=top_p, use_cache=self.args.use_cache, stop_token_ids=list(self.eos_token_ids),
                pad_token_id=self._tokenizer.pad_token_id, return_dict_in_generate=True, generator=generator,
            )
        width = prompt.shape[1]
        canvas, steps, logps = out.sequences[:, width:], out.unmask_step[:, width:], out.token_logprobs[:, width:]
        self._scoring = {"canvas_ids": canvas, "unmask_step": steps, "mask_seeds": seeds.to(device),
                         "sampler_logps": logps}
        mode = "train" if self.model.training else "eval"
        blocks_done = (steps >= 0).any(0).sum().float() / self.args.block_length
        self._metrics[mode]["rollout/tokens_per_step"].append(out.tokens_per_step.mean().item())
        self._metrics[mode]["rollout/forward_passes"].append(float(out.num_forward_passes))
        self._metrics[mode]["rollout/denoising_steps_per_block"].append(
            (out.denoising_steps.float().mean() / blocks_done.clamp(min=1)).item())
        completion_ids, completion_logps = [], []
        stop = torch.tensor(list(self.eos_token_ids), device=device)
        for row in range(rows):
            committed = (steps[row] >= 0).nonzero().squeeze(-1)
            length = min(int(committed.max()) + 1 if committed.numel() else 0, self.max_completion_length)
            is_stop = torch.isin(canvas[row, :length], stop).nonzero()
            if is_stop.numel():
                length = int(is_stop[0]) + 1
            completion_ids.append(canvas[row, :length].tolist())
            completion_logps.append(logps[row, :length].tolist())
        return completion_ids, completion_logps

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rollout_rewards = rewards  # gathered across processes; used by dynamic group filtering
        return rewards

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        scoring = self._scoring
        output.update(scoring)
        completion_width = output["completion_ids"].shape[1]
        weights = self._loss_weights(output["prompt_mask"], scoring)[:, :completion_width]
        weights = _fit_width(weights, completion_width)
        mask = output["completion_mask"].float() * weights
        mode = "train" if self.model.training else "eval"
        if self.args.dynamic_group_filtering and self._rollout_rewards is not None:
            keep = self._kept_rows(len(output["completion_ids"]))
            mask = mask * keep[:, None].float()
            self._metrics[mode]["filtered_groups"].append(1.0 - keep.float().mean().item())
        output["completion_mask"] = mask
        return output

    def _loss_weights(self, prompt_mask: torch.Tensor, scoring: dict) -> torch.Tensor:
        """Per-token loss weights over the canvas: 1/|tau(t)| (step normalisation) times "was scored"."""
        steps = scoring["unmask_step"]
        committed = steps >= 0
        settings = self.estimator_settings
        if settings.name != "trajectory":
            draws = draw_masks(settings, committed, scoring["mask_seeds"], prompt_mask.shape[1])
            return draws["scored"].float()
        if self.args.step_normalization == "sequence":
            return committed.float()
        return step_weights(step_groups(steps, settings.shrinkage, self._completion_blocks(prompt_mask, steps)))

    def _completion_blocks(self, prompt_mask, steps):
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if _is_peft(model) else model
        if base.block_size is None:
            return None
        valid = torch.cat([prompt_mask.bool(), torch.ones_like(steps, dtype=torch.bool)], dim=1)
        positions = positions_from_padding(valid)[:, prompt_mask.shape[1]:]
        return block_index(positions, self.estimator_settings.block_size)

    def _kept_rows(self, local_rows: int) -> torch.Tensor:
        """False for rows of groups whose (weighted) rewards are all equal."""
        rewards = torch.nansum(self._rollout_rewards * self.reward_weights.to(self._rollout_rewards.device), dim=1)
        groups = rewards.view(-1, self.num_generations)
        varied = (groups.max(1).values - groups.min(1).values) > 0
        keep = varied.repeat_interleave(self.num_generations)
        start = self.accelerator.process_index * local_rows
        return keep[start : start + local_rows].to(self.accelerator.device)

    # ------------------------------------------------------------------------------------------------ scoring
    def _compute_loss(self, model, inputs):
        self._scoring = {k: inputs[k] for k in ("canvas_ids", "unmask_step", "mask_seeds", "sampler_logps")}
        return super()._compute_loss(model, inputs)

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **unused):
        scoring = self._scoring
        if scoring is None or scoring["canvas_ids"].shape[0] != input_ids.shape[0]:
            raise RuntimeError("TraceRLTrainer scores completions from their recorded trajectories; none are attached "
                               "to this batch.")
        prompt_width = input_ids.shape[1] - logits_to_keep
        prompt_ids, prompt_mask = input_ids[:, :prompt_width], attention_mask[:, :prompt_width]
        unwrapped = self.accelerator.unwrap_model(model)
        rows = batch_size or input_ids.shape[0]
        logps, entropies = [], []
        for start in range(0, input_ids.shape[0], rows):
            part = slice(start, start + rows)
            lp, ent, _ = estimate_logprobs(
                _ForwardThrough(model, unwrapped), prompt_ids[part], prompt_mask[part], scoring["canvas_ids"][part],
                scoring["unmask_step"][part], self.estimator_settings, scoring["mask_seeds"][part], compute_entropy,
            )
            logps.append(lp)
            entropies.append(ent)
        logps = _fit_width(torch.cat(logps), logits_to_keep)
        entropies = _fit_width(torch.cat(entropies), logits_to_keep) if compute_entropy else None
        if torch.is_grad_enabled() and self.estimator_settings.name == "trajectory":
            sampler = _fit_width(scoring["sampler_logps"], logits_to_keep)
            committed = _fit_width((scoring["unmask_step"] >= 0).float(), logits_to_keep) * attention_mask[
                :, prompt_width:].float().clamp(max=1)
            gap = ((logps.detach() - sampler).abs() * committed).sum() / committed.sum().clamp(min=1)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["rollout/sampler_logp_gap"].append(self.accelerator.gather(gap).mean().item())
        aux = torch.zeros((), device=input_ids.device) if compute_aux_loss else None
        return logps, entropies, aux


class _ForwardThrough:
    """Calls the (possibly DDP/PEFT-wrapped) ``model`` but answers the diffusion interface from ``unwrapped``."""

    def __init__(self, model, unwrapped):
        self._model = model
        self._base = unwrapped.get_base_model() if _is_peft(unwrapped) else unwrapped

    def __call__(self, **kwargs):
        return self._model(**kwargs)

    def __getattr__(self, name):
        return getattr(self._base, name)


class _RewardErrorNamer:
    """Wraps a synchronous reward function so that an exception inside it names the function."""

    def __init__(self, func, name: str):
        self.func, self.__name__ = func, name

    def __call__(self, *args, **kwargs):
        try:
            return self.func(*args, **kwargs)
        except Exception as error:
            raise RuntimeError(f"reward function {self.__name__!r} raised {type(error).__name__}: {error}") from error


def _name_errors(func, name):
    if isinstance(func, torch.nn.Module) or is_async_callable(func):
        return func
    return _RewardErrorNamer(func, name)


def _fit_width(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or right-pad (with zeros) the last dimension to ``width``."""
    if tensor.shape[-1] >= width:
        return tensor[..., :width]
    return torch.nn.functional.pad(tensor, (0, width - tensor.shape[-1]))


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover - peft is a dependency
        return False
    return isinstance(model, PeftModel)
