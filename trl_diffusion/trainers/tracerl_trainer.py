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
  given as an object;
* optional ``value_model``: token-wise GAE advantages over merged denoising steps replace GRPO's scalar ones, and
  the value model trains with its own optimizer on each (k-th) generation batch.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import os

import torch
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
from transformers.utils import logging
from trl import GRPOTrainer
from trl.models import prepare_deepspeed, prepare_fsdp, unwrap_model_for_generation
from trl.trainer.utils import disable_dropout_in_model, is_async_callable, pad

from ..estimators import EstimatorSettings, draw_masks, estimate_logprobs
from ..models import check_tokenizer
from ..states import trajectory_groups
from ..value import (
    DiffusionValueModel,
    clipped_value_loss,
    outcome_token_rewards,
    step_gae,
    summarize_value_statistics,
    token_values,
    value_statistics,
)
from .tracerl_config import TraceRLConfig

logger = logging.get_logger(__name__)


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

    Accepts everything ``GRPOTrainer`` accepts; ``args`` is a :class:`TraceRLConfig`. ``value_model`` (a
    :class:`~trl_diffusion.value.DiffusionValueModel` or a path for ``DiffusionValueModel.load``) switches on the
    value model: per-token advantages (``gamma``, ``lam``) and its own training (``cliprange_value``,
    ``value_learning_rate``, ``value_train_every``).
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

    def __init__(self, model, reward_funcs=None, args: TraceRLConfig | None = None, *pos, value_model=None, **kwargs):
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
        _check_completion_fits(base, args)
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
            attention_backend=args.attention_backend,
        )
        self.reward_funcs = [_name_errors(f, n) for f, n in zip(self.reward_funcs, self.reward_func_names)]
        self._scoring: dict | None = None  # the rows being scored: canvas, trajectory, seeds, sampler log-probs
        self._rollout_rewards: torch.Tensor | None = None
        self._flat_reward_batches = 0  # training generation batches in a row without a group of differing rewards
        self.value_model = self.value_optimizer = None
        self._value_batches = 0  # training generation batches seen by the value model
        if value_model is not None:
            self._setup_value_model(value_model, base)

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
        # one sampling generator per row, keyed like the masks: a row's rollout does not depend on its batch or
        # process, so a 2-process run samples exactly what a 1-process run with twice the batch samples
        generator = [torch.Generator().manual_seed(mask_seed(self.args.seed + 1, rollout_step, first + i))
                     for i in range(rows)]
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
                top_k=top_k, top_p=top_p, use_cache=self.args.rollout_cache, stop_token_ids=list(self.eos_token_ids),
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
        if self.model.training:
            self._watch_reward_signal(rewards)
        return rewards

    identical_rewards_patience = 10
    """Training generation batches in a row in which no group's rewards differ before the trainer warns."""

    def _watch_reward_signal(self, rewards: torch.Tensor) -> None:
        """Warn (once per run of flat batches) when, for ``identical_rewards_patience`` generation batches in a row,
        every group's completions got identical rewards: every advantage is then 0 and the policy does not move."""
        total = torch.nansum(rewards * self.reward_weights.to(rewards.device), dim=1)
        groups = total.view(-1, self.num_generations)
        flat = bool(((groups.max(1).values - groups.min(1).values) == 0).all())
        self._flat_reward_batches = self._flat_reward_batches + 1 if flat else 0
        if self._flat_reward_batches == self.identical_rewards_patience and self.accelerator.is_main_process:
            seen = sorted({round(v, 4) for v in total.tolist()})
            logger.warning(
                f"TraceRL: for {self._flat_reward_batches} generation batches in a row every group's completions got "
                f"identical rewards (values seen: {seen[:5]}), so every advantage is 0 and nothing is learned. Check "
                "that the prompts are in the format the model was trained on (the embedded model wants plain "
                "prompts: to_dataset(problems, EMBEDDED_FORMAT)), that the reward function reads the right dataset "
                "columns, that max_completion_length leaves room for an answer, and look at the completions "
                "(log_completions=True)."
            )

    def _generate_and_score_completions(self, inputs):
        output = super()._generate_and_score_completions(inputs)
        scoring = self._scoring
        output.update(scoring)
        completion_width = output["completion_ids"].shape[1]
        weights = self._loss_weights(output["prompt_mask"], scoring)[:, :completion_width]
        weights = _fit_width(weights, completion_width)
        trainable = output["completion_mask"].bool() & _fit_width(scoring["unmask_step"] >= 0, completion_width)
        mask = output["completion_mask"].float() * weights
        mode = "train" if self.model.training else "eval"
        if self.args.dynamic_group_filtering and self._rollout_rewards is not None:
            keep = self._kept_rows(len(output["completion_ids"]))
            mask = mask * keep[:, None].float()
            trainable = trainable & keep[:, None]
            # dropped groups leave the batch, so they leave the token normaliser too (TRL counted them)
            kept_tokens = (output["completion_mask"] * keep[:, None]).sum()
            output["num_items_in_batch"] = self.accelerator.gather(kept_tokens).sum()
            self._metrics[mode]["filtered_groups"].append(1.0 - keep.float().mean().item())
        output["completion_mask"] = mask
        if self.value_model is not None:
            output["advantages"] = self._value_advantages(output, trainable, mode)
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
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if _is_peft(model) else model
        block = settings.block_size if base.block_size is not None else None
        return step_weights(trajectory_groups(steps, prompt_mask, settings.shrinkage, block))

    def _own_state_tokens(self, prompt_mask: torch.Tensor, unmask_step: torch.Tensor) -> torch.Tensor:
        """True for committed tokens the trajectory estimator scores given the state the sampler committed them
        from: those of the first denoising step of their merged group (every committed token at shrinkage 1)."""
        model = self.accelerator.unwrap_model(self.model)
        base = model.get_base_model() if _is_peft(model) else model
        settings = self.estimator_settings
        groups = trajectory_groups(unmask_step, prompt_mask, settings.shrinkage,
                                   settings.block_size if base.block_size is not None else None)
        committed = groups >= 0
        if not bool(committed.any()):
            return committed
        index = groups.clamp(min=0)
        late = int(unmask_step.max()) + 1
        first = torch.full((groups.shape[0], int(groups.max()) + 1), late, device=groups.device,
                           dtype=unmask_step.dtype)
        first = first.scatter_reduce(1, index, torch.where(committed, unmask_step, late), reduce="amin")
        return committed & (unmask_step == first.gather(1, index))

    def _kept_rows(self, local_rows: int) -> torch.Tensor:
        """False for rows of groups whose (weighted) rewards are all equal."""
        rewards = torch.nansum(self._rollout_rewards * self.reward_weights.to(self._rollout_rewards.device), dim=1)
        groups = rewards.view(-1, self.num_generations)
        varied = (groups.max(1).values - groups.min(1).values) > 0
        keep = varied.repeat_interleave(self.num_generations)
        start = self.accelerator.process_index * local_rows
        return keep[start : start + local_rows].to(self.accelerator.device)

    # ------------------------------------------------------------------------------------------------ value model
    def _setup_value_model(self, value_model, policy) -> None:
        """Check the value model against the policy, place and prepare it like the policy, give it an optimizer."""
        if isinstance(value_model, (str, os.PathLike)):
            value_model = DiffusionValueModel.load(str(value_model))
        if not isinstance(value_model, DiffusionValueModel):
            raise TypeError(f"value_model must be a DiffusionValueModel, got {type(value_model).__name__}.")
        if value_model.mask_token_id != policy.mask_token_id:
            raise ValueError(f"the value model's mask_token_id ({value_model.mask_token_id}) differs from the "
                             f"policy's ({policy.mask_token_id}): it must share the policy's tokenizer.")
        check_tokenizer(self._tokenizer, value_model)
        if value_model.get_input_embeddings().num_embeddings < len(self._tokenizer):
            raise ValueError(f"the value model's vocabulary ({value_model.get_input_embeddings().num_embeddings}) is "
                             f"smaller than the tokenizer's ({len(self._tokenizer)}): it must share the policy's "
                             "tokenizer.")
        if value_model.attention_kind != policy.attention_kind:
            raise ValueError(f"the value model's attention ({value_model.attention_kind}) differs from the policy's "
                             f"({policy.attention_kind}); use a backbone of the policy's family.")
        if getattr(self.accelerator, "is_fsdp2", False):
            raise NotImplementedError("a value model under FSDP2 is not supported yet; use DDP, FSDP1 or DeepSpeed.")
        args = self.args
        if args.gradient_checkpointing:
            value_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        if args.disable_dropout:
            disable_dropout_in_model(value_model)
        self.value_model = self.accelerator.prepare_model(value_model)
        params = [p for p in self.value_model.parameters() if p.requires_grad]
        self.value_optimizer = torch.optim.AdamW(params, lr=args.value_learning_rate,
                                                 betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                                 weight_decay=args.weight_decay)

    def _token_values(self, prompt_ids, prompt_mask, canvas_ids, unmask_step) -> tuple[torch.Tensor, torch.Tensor]:
        settings, unwrapped = self.estimator_settings, self.accelerator.unwrap_model(self.value_model)
        return token_values(self.value_model, prompt_ids, prompt_mask, canvas_ids, unmask_step, settings.shrinkage,
                            settings.block_size, settings.token_budget, unwrapped, settings.attention_backend)

    def _value_advantages(self, output: dict, trainable: torch.Tensor, mode: str) -> torch.Tensor:
        """``[B, C]`` GAE advantages from the value model as it is now (GRPO's normalised reward is the outcome
        reward on each response's last step); then, on every ``value_train_every``-th training batch, one value
        update towards the returns."""
        width = trainable.shape[1]
        inputs = (output["prompt_ids"], output["prompt_mask"], output["canvas_ids"], output["unmask_step"])
        self.value_model.eval()
        with torch.no_grad():
            old_values, groups = self._token_values(*inputs)
        old_values, groups = _fit_width(old_values, width), _fit_width(groups, width)
        rewards = outcome_token_rewards(output["advantages"], groups, trainable)
        advantages, returns = step_gae(rewards, old_values, groups, trainable, self.args.gamma, self.args.lam)
        stats = self.accelerator.gather(value_statistics(old_values, returns, trainable)[None]).sum(0)
        for name, number in summarize_value_statistics(stats).items():
            self._metrics[mode][f"value/{name}"].append(number)
        if mode == "train":
            if self._value_batches % self.args.value_train_every == 0:
                loss = self._train_value_model(inputs, old_values, returns, trainable)
                self._metrics[mode]["value/loss"].append(self.accelerator.gather(loss[None]).mean().item())
            self._value_batches += 1
        return advantages.detach()

    def _train_value_model(self, inputs, old_values, returns, mask) -> torch.Tensor:
        """Clipped value loss over the generation batch: as many optimizer steps as the policy takes per batch
        (``steps_per_generation // gradient_accumulation_steps``), each averaged over its tokens.

        Under DDP (and for a replicated model accelerate did not wrap, as under DeepSpeed) gradients accumulate
        locally and are averaged across processes once per step, so a micro-batch may take several forwards."""
        args, model = self.args, self.value_model
        params = [p for p in model.parameters() if p.requires_grad]
        unwrapped = self.accelerator.unwrap_model(model)
        manual_sync = self.accelerator.num_processes > 1 and (
            unwrapped is model or isinstance(model, torch.nn.parallel.DistributedDataParallel))
        rows_all = torch.arange(old_values.shape[0], device=old_values.device)
        updates = rows_all.chunk(max(1, args.steps_per_generation // args.gradient_accumulation_steps))
        total = torch.zeros((), device=old_values.device)
        model.train()
        for rows in updates:
            # every rank's tokens: DDP averages gradients over ranks, so divide by the mean token count per rank
            # (a per-rank count would make a 2-process run differ from a 1-process run with twice the batch)
            tokens = self.accelerator.reduce(mask[rows].sum(), reduction="sum").clamp(min=1) \
                / self.accelerator.num_processes
            pieces = rows.split(args.per_device_train_batch_size)
            for i, piece in enumerate(pieces):
                sync_now = i == len(pieces) - 1 and not manual_sync
                with contextlib.nullcontext() if sync_now else self.accelerator.no_sync(model):
                    values, _ = self._token_values(*(t[piece] for t in inputs))
                    values = _fit_width(values, mask.shape[1])
                    per_token = clipped_value_loss(values, old_values[piece], returns[piece], args.cliprange_value)
                    loss = (per_token * mask[piece]).sum() / tokens
                    loss.backward()
                total = total + loss.detach() / len(updates)
            if manual_sync:
                for p in params:
                    if p.grad is not None:
                        p.grad = self.accelerator.reduce(p.grad, reduction="mean")
            if args.max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            self.value_optimizer.step()
            self.value_optimizer.zero_grad(set_to_none=True)
        model.eval()
        return total

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint plus what exact resume needs: the buffered rollout of the current generation cycle and
        GRPO's micro-step counter (per process), and the value model with its optimizer."""
        super()._save_checkpoint(model, trial)
        folder = os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        torch.save({"step": self._step, "buffer": self._buffered_inputs},
                   os.path.join(folder, f"rollout_buffer_{self.accelerator.process_index}.pt"))
        if self.value_model is not None and self.args.should_save:
            self.accelerator.unwrap_model(self.value_model).save_pretrained(os.path.join(folder, "value_model"))
            torch.save({"optimizer": self.value_optimizer.state_dict(), "value_batches": self._value_batches},
                       os.path.join(folder, "value_state.pt"))

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, f"rollout_buffer_{self.accelerator.process_index}.pt")
        if os.path.exists(path):
            saved = torch.load(path, map_location=self.accelerator.device, weights_only=False)
            self._step, self._buffered_inputs = saved["step"], saved["buffer"]
        value_dir = os.path.join(checkpoint, "value_model")
        if self.value_model is not None and os.path.isdir(value_dir):
            state = DiffusionValueModel.from_pretrained(value_dir).state_dict()
            self.accelerator.unwrap_model(self.value_model).load_state_dict(state)
            extra = torch.load(os.path.join(checkpoint, "value_state.pt"), map_location="cpu", weights_only=False)
            self.value_optimizer.load_state_dict(extra["optimizer"])
            self._value_batches = extra["value_batches"]

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
            difference = (logps.detach() - sampler).abs() * committed
            gap = difference.sum() / committed.sum().clamp(min=1)
            # tokens scored from the very state the sampler committed them from: 0 gap when the two agree, whatever
            # the shrinkage (the full gap also measures how much merging steps changes the scored states)
            own = committed * _fit_width(self._own_state_tokens(prompt_mask, scoring["unmask_step"]).float(),
                                         logits_to_keep)
            exact = (difference * own).sum() / own.sum().clamp(min=1)
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["rollout/sampler_logp_gap"].append(self.accelerator.gather(gap).mean().item())
            self._metrics[mode]["rollout/sampler_logp_gap_exact"].append(
                self.accelerator.gather(exact).mean().item())
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


def _check_completion_fits(model, args: TraceRLConfig) -> None:
    """Raise now, not at the first rollout, when ``max_completion_length`` (plus the block a block model may add)
    leaves no room for a prompt in the model's positions."""
    config = model.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "max_sequence_length", None)
    extra = args.block_length if model.block_size is not None else 0
    if positions is not None and args.max_completion_length + extra >= positions:
        slack = f" + block_length ({extra})" if extra else ""
        raise ValueError(f"max_completion_length ({args.max_completion_length}){slack} leaves no room for a prompt in "
                         f"the model's {positions} positions (max_position_embeddings); lower max_completion_length.")


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
