"""``DiffusionValueModel``: a diffusion backbone (SDAR, SDAR-MoE, LLaDA, LLaDA-MoE or Dream) plus a zero-initialised
scalar head.

For every response token it predicts a value conditioned on the state the policy saw when that token was
committed. ``token_values`` builds those states with the trajectory estimator's packed layouts
(``estimators.packing``: one noisy block copy per merged step for block-causal models, one row per merged step
for full-attention ones) and reads the value at each token's own position, where the token is still masked.

The config is the backbone's own (``model_type`` ``sdar`` / ``sdar_moe`` / ``llada`` (LLaDA and LLaDA-MoE) /
``Dream``) and the state-dict keys are ``model.*`` (the backbone, named as in the policy) and ``value_head.weight``,
the layout of the TraceRL reference's SDAR value model. ``from_policy`` copies a policy's backbone weights.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers import initialization as init
from transformers.utils import ModelOutput, find_adapter_config_file, logging

from ..estimators.likelihood import row_canvas
from ..estimators.packing import build_scoring_chunks
from ..models.common import DiffusionModelMixin, DiffusionPreTrainedModel, keep_positions, leftover_kwargs_error
from ..models.dream.modeling_dream import DreamBaseModel
from ..models.llada.modeling_llada import LLaDAModel
from ..models.llada_moe import LLaDAMoEConfig, LLaDAMoEModel
from ..models.sdar.modeling_sdar import SDARModel
from ..models.sdar_moe.modeling_sdar_moe import SDARMoeModel
from ..states import resolve_model_attention_backend, trajectory_groups
from ..synced_forwards import agreed_forward_count, needs_synced_forwards, zero_forward_term
from ..zero3 import has_partitioned_parameters, whole_state_dict

logger = logging.get_logger(__name__)

BACKBONES = {"sdar": SDARModel, "sdar_moe": SDARMoeModel, "llada": LLaDAModel, "llada_moe": LLaDAMoEModel,
             "Dream": DreamBaseModel}
"""The backbone class per family: the config's ``model_type``, but LLaDA-MoE's (also ``"llada"``; see ``_family``)."""
_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder",
               "trust_remote_code")
_MERGE_ADAPTERS = ("a value model copies a plain policy's weights; merge the PEFT adapters first: "
                   "model.merge_and_unload(), or for a saved adapter "
                   "peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), path)"
                   ".merge_and_unload().")


@dataclass
class ValueOutput(ModelOutput):
    """``value`` ``[B, L]`` (float32): one scalar per position. (Not ``values``: that would shadow the dict method
    ``ModelOutput.values()``, which DDP and pytree flattening call.)"""

    value: torch.Tensor | None = None
    hidden_states: tuple[torch.Tensor, ...] | None = None


class DiffusionValueModel(DiffusionPreTrainedModel, DiffusionModelMixin):
    """Value model for TraceRL: ``config`` is an SDAR(-MoE), LLaDA(-MoE) or Dream config; the head starts at zero.

    ``from_pretrained`` loads a saved value model as transformers loads any model: the config class comes from the
    saved ``model_type`` (``import trl_diffusion`` registers them), ``config=`` may be a config object or a path, and
    keywords that are config attributes (``block_size=8``) update the config. Missing or unexpected keys are an
    error: use ``from_policy`` (or ``load``) for a policy checkpoint."""

    # transformers loads the config of a path with ``config_class.from_pretrained(path, return_unused_kwargs=True,
    # **kwargs)``: AutoConfig picks the backbone family's class from ``model_type`` and sets the keywords that are its
    # attributes, as a model with a fixed config class does; the rest reach ``__init__``
    config_class = AutoConfig
    _no_split_modules = ["QwenStyleDecoderLayer", "LLaDALlamaBlock", "LLaDAMoEDecoderLayer"]

    def __init__(self, config: PretrainedConfig, **kwargs) -> None:
        if kwargs:  # from_pretrained hands the model the keyword arguments its config did not take
            raise leftover_kwargs_error(type(self).__name__, config, kwargs)
        super().__init__(config)
        backbone = BACKBONES.get(_family(config))
        if backbone is None:
            raise ValueError(f"DiffusionValueModel needs an SDAR, SDAR-MoE, LLaDA, LLaDA-MoE or Dream config, got "
                             f"model_type {config.model_type!r}; supported: {sorted(BACKBONES)}.")
        self.model = backbone(config)
        transformer = getattr(self.model, "transformer", None)
        if transformer is not None and "ff_out" in transformer:  # LLaDA keeps its LM head in the backbone
            del transformer["ff_out"]
        self.value_head = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    @property
    def block_size(self) -> int | None:
        return self.model.diffusion_block_size

    def _init_weights(self, module: nn.Module) -> None:
        if module is getattr(self, "value_head", None):
            init.zeros_(module.weight)  # respects weights already loaded by from_pretrained
        else:
            super()._init_weights(module)

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.model.set_input_embeddings(value)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        values_to_keep: int | torch.Tensor | tuple[torch.Tensor, torch.Tensor] = 0,
        **kwargs,
    ) -> ValueOutput:
        """``attention_mask``: None, 2-D key padding or a custom 3-/4-D mask, as the backbone takes it.
        ``values_to_keep``: the positions to compute values at, as the LM's ``logits_to_keep`` takes them
        (``models.common.keep_positions``; a ``(rows, cols)`` pair gives ``value`` ``[N]``).
        ``output_hidden_states`` None takes the config's, as the policy's forward does. Of transformers' other
        arguments, ``output_attentions`` goes to the backbone (which refuses True) and ``output_router_logits`` is
        accepted and off (values train no router loss); anything else, ``return_dict=False`` included, is an error
        rather than ignored (the output is always a ``ValueOutput``)."""
        unknown = sorted(set(kwargs) - {"output_attentions", "output_router_logits", "return_dict"})
        if unknown:
            hint = " (values_to_keep picks the positions)" if "logits_to_keep" in unknown else ""
            raise TypeError(f"{type(self).__name__}.forward() got unexpected arguments {unknown}{hint}.")
        if kwargs.get("return_dict") is False:
            raise ValueError(f"return_dict=False is not supported: {type(self).__name__} returns a ValueOutput.")
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         inputs_embeds=inputs_embeds, output_hidden_states=output_hidden_states,
                         output_attentions=kwargs.get("output_attentions"),
                         output_router_logits=False)  # values train no router loss (MoE; dense ignores it)
        hidden = keep_positions(out.last_hidden_state, values_to_keep).to(self.value_head.weight.dtype)
        return ValueOutput(value=self.value_head(hidden).squeeze(-1).float(), hidden_states=out.hidden_states)

    @classmethod
    def from_policy(cls, policy, **kwargs) -> DiffusionValueModel:
        """A value model whose backbone is a copy of ``policy``'s (a model, or a path loaded with
        ``AutoModelForCausalLM`` and ``kwargs``: with a model object ``kwargs`` is a TypeError); zero head, same dtype
        and device. Shares no tensors with it."""
        if isinstance(policy, (str, os.PathLike)):
            policy = AutoModelForCausalLM.from_pretrained(policy, **kwargs)
        elif kwargs:  # they are loading arguments: a model object is copied as it is (its dtype, its device)
            raise TypeError(f"from_policy got a model object and the loading arguments {sorted(kwargs)}, which apply "
                            "to a path only: the copy keeps the policy's dtype and device (convert the value model "
                            "afterwards, e.g. .to(torch.float32)).")
        if _has_adapters(policy):  # the copy would drop them (and their keys do not fit the backbone)
            raise TypeError(f"from_policy got a policy with PEFT adapters: {_MERGE_ADAPTERS}")
        state = {k: v for k, v in whole_state_dict(policy.model).items() if k != "transformer.ff_out.weight"}
        _check_not_offloaded(state)
        config = copy.deepcopy(policy.config)
        config.architectures = [cls.__name__]
        # the stop ids of the policy's rollouts (TRL: its generation_config's eos ids, e.g. an end-of-turn token only
        # declared there), so that DiffusionValueTrainer ends a completion where TraceRL does
        rollout_eos = getattr(getattr(policy, "generation_config", None), "eos_token_id", None)
        if rollout_eos is not None:
            config.eos_token_id = rollout_eos
        value = cls(config).to(device=policy.device, dtype=policy.dtype)
        value.model.load_state_dict(state, strict=True)
        return value

    @classmethod
    def load(cls, name_or_path: str, **kwargs) -> DiffusionValueModel:
        """``from_pretrained`` for a saved value model, ``from_policy`` for a policy checkpoint."""
        hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
        if find_adapter_config_file(name_or_path, **{k: v for k, v in hub.items() if k != "trust_remote_code"}):
            raise ValueError(f"{name_or_path} holds a PEFT adapter, not a model: {_MERGE_ADAPTERS}")
        config = AutoConfig.from_pretrained(name_or_path, **hub)
        if cls.__name__ in (getattr(config, "architectures", None) or []):
            return cls.from_pretrained(name_or_path, **kwargs)  # reads the config again, applying config keywords
        return cls.from_policy(name_or_path, **kwargs)

    def whole(self) -> DiffusionValueModel:
        """This model, or a whole copy of it where transformers loaded it partitioned (DeepSpeed ZeRO-3's
        ``zero.Init``; see ``zero3``): TraceRL keeps its value model whole on every process."""
        if not has_partitioned_parameters(self):
            return self
        whole = type(self)(self.config).to(dtype=self.dtype)
        whole.load_state_dict(whole_state_dict(self))
        return whole


def warn_if_half_precision(model: nn.Module, learning_rate: float, option: str) -> None:
    """Warn that a bf16 / fp16 value model trains without a float32 master copy (both value trainers use a plain
    AdamW): an update smaller than the weights' rounding is lost, which at the value learning rates (5e-6) leaves
    most weights of a pretrained backbone where they were."""
    if model.dtype in (torch.bfloat16, torch.float16):
        logger.warning(f"the value model's weights are {model.dtype} and its AdamW keeps no float32 copy: an update "
                       f"smaller than their rounding is lost (at {option}={learning_rate:g} most weights of a "
                       "pretrained backbone never move). Pass a float32 value model, or its path (loaded in float32).")


def check_value_model(model: object, argument: str) -> None:
    """Refuse anything but a ``DiffusionValueModel`` without adapters as ``argument``, naming PEFT when it has them
    (wrapped in a ``PeftModel`` or injected in place): the value model trains in full (only the policy takes
    adapters)."""
    wrapped = hasattr(model, "get_base_model") and isinstance(model.get_base_model(), DiffusionValueModel)
    if wrapped or (isinstance(model, DiffusionValueModel) and _has_adapters(model)):
        raise TypeError(f"{argument} is a DiffusionValueModel with PEFT adapters ({type(model).__name__}): the value "
                        "model trains in full (with adapters only they would train, and its value head stays at "
                        "zero); pass one without adapters (LoRA applies to the policy only).")
    if not isinstance(model, DiffusionValueModel):
        raise TypeError(f"{argument} must be a DiffusionValueModel, got {type(model).__name__}.")


def _family(config: PretrainedConfig) -> str:
    """The ``BACKBONES`` key of ``config``: its ``model_type``, but ``"llada_moe"`` for an ``LLaDAMoEConfig`` (whose
    ``model_type`` is the released ``"llada"``, dense LLaDA's)."""
    return "llada_moe" if isinstance(config, LLaDAMoEConfig) else config.model_type


def _check_not_offloaded(state: dict[str, torch.Tensor]) -> None:
    """Refuse a policy whose weights are offloaded (a ``device_map`` with ``"disk"`` entries): they are meta tensors,
    filled in by accelerate's hooks only during a forward, so there is nothing to copy, and ``load_state_dict`` would
    fail deep inside torch with "Cannot copy out of meta tensor"."""
    offloaded = [name for name, tensor in state.items() if tensor.is_meta]
    if offloaded:
        raise ValueError(f"the policy's weights are offloaded ({len(offloaded)} of {len(state)} are meta tensors, "
                         f"e.g. {offloaded[:3]}): building a value model from offloaded (meta / disk) policy weights "
                         "is not supported, the copy needs the weights themselves. Load the policy fully on CPU or "
                         "GPU first (a device_map without 'disk' entries, or none), then call "
                         "DiffusionValueModel.from_policy(policy).")


def _has_adapters(model: nn.Module) -> bool:
    """True for a PEFT model, and for a model with adapter layers injected in place (``get_peft_model`` changes the
    model it wraps; transformers' ``load_adapter`` and loading an adapter directory inject them too)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return hasattr(model, "get_base_model") or any(isinstance(m, BaseTunerLayer) for m in model.modules())


def token_values(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    unmask_step: torch.Tensor,
    shrinkage: int = 1,
    block_size: int | None = None,
    token_budget: int | None = None,
    interface: DiffusionValueModel | None = None,
    attention_backend: str = "auto",
    completion_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, groups)`` ``[B, C]``: the value of every committed completion token given the state before its
    merged step (0 elsewhere), and the merged-step ids (``states.trajectory_groups``) the states were built from.

    ``model`` is a ``DiffusionValueModel``, possibly wrapped (DDP, ...): then ``interface`` is the unwrapped one,
    which answers ``mask_token_id`` / ``block_size``. ``completion_ids`` / ``unmask_step`` cover the whole sampler
    canvas. ``block_size`` is the training block size of a block-causal model (default: the model's).
    ``attention_backend``: how the packed masks are built (``states.ATTENTION_BACKENDS``). ``completion_mask``
    ``[B, C]`` marks each row's own canvas when rows of different canvas lengths are right-padded to one width
    (default: every column is part of every row's canvas); the padding is never shown to the model. A block model's
    states show each row up to its last committed token, as the trajectory estimator shows the policy
    (``estimators.likelihood.row_canvas``): a training block larger than the rollouts' would otherwise show the
    never-committed columns after an early stop as masks, and a row's values would depend on its batch.
    Differentiable.
    """
    interface = interface if interface is not None else model
    block = (block_size or interface.block_size) if interface.block_size is not None else None
    groups = trajectory_groups(unmask_step, prompt_mask, shrinkage, block)
    shown = row_canvas(unmask_step >= 0, block)
    if shown is not None:
        completion_mask = shown if completion_mask is None else shown & completion_mask.bool()
    chunks = build_scoring_chunks(prompt_ids, prompt_mask, completion_ids, groups, interface.mask_token_id, block,
                                  token_budget, pad_token_id=0, completion_mask=completion_mask)
    values = torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
    backend = resolve_model_attention_backend(attention_backend, interface, completion_ids.device)
    synced = needs_synced_forwards(model)  # FSDP / ZeRO-3: every process runs as many forwards as the busiest
    for _ in range(agreed_forward_count(len(chunks), completion_ids.device, synced) - len(chunks)):
        values = values + zero_forward_term(model, completion_ids[:1, :1])
    for chunk in chunks:
        mask = chunk.layout.attention_mask(backend)
        out = model(input_ids=chunk.input_ids, attention_mask=mask, position_ids=chunk.position_ids,
                    values_to_keep=(chunk.chunk_row, chunk.chunk_col))
        values = values.index_put((chunk.source_row, chunk.source_col), out.value)
    return values, groups
