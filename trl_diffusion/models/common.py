"""Pieces shared by the three families: the diffusion interface, RMSNorm, RoPE, attention with a read-only or
committing KV cache, mask handling, and the Qwen-style decoder used by SDAR (Qwen3) and Dream (Qwen2)."""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast, MoeModelOutputWithPast

from ..states import attention_mask_from_positions, positions_from_padding
from ..vocabulary import check_mask_token_id
from .cache import DiffusionCache, StaticDiffusionCache
from .kernels import EAGER, Kernels, UsesKernels

# transformers 5.24 renamed the model outputs' ``past_key_values`` field to ``cache``; 5.20-5.23 have the old name
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


class DiffusionModelMixin:
    """The one interface the rest of the package reads instead of checking model names (listed before the
    ``PreTrainedModel`` base of a model class, so that its ``forward`` is the one used).

    * ``mask_token_id``: the id of the mask token,
    * ``block_size``: block-causal block size, or ``None`` for full bidirectional attention,
    * ``logits_shift``: True when token i is predicted from position i-1 (Dream),
    * ``top_p_first``: True when the family's sampler applies top-p before top-k (Dream; SDAR's applies top-k
      first, and LLaDA's neither), read by the sampler and by every scorer of its log-probs,
    * ``attention_kind``: ``"block_causal"`` or ``"full"``.
    """

    logits_shift: bool = False
    top_p_first: bool = False

    @property
    def block_size(self) -> int | None:
        return None

    @property
    def attention_kind(self) -> str:
        return "full" if self.block_size is None else "block_causal"

    @property
    def mask_token_id(self) -> int:
        mask_id = getattr(self.config, "mask_token_id", None)
        if mask_id is None:
            raise ValueError(
                f"{type(self).__name__} has no mask token: set `config.mask_token_id` (the id of the mask token "
                "in the tokenizer) before generating or training."
            )
        return int(mask_id)

    def align_logits(self, logits: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
        """Logits indexed by the position of the token they predict (undoes Dream's one-position shift: a column
        reads the logits of the column before it). A shifted model predicts a token from the previous *real* token:
        with ``valid`` ``[B, L]`` (the real columns; padding inside a row, e.g. after a right-padded prompt) a column
        reads the logits of the last valid column before it. The first column repeats its own logits."""
        if not self.logits_shift:
            return logits
        if valid is None:
            return torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        columns = torch.arange(valid.shape[1], device=valid.device).expand_as(valid)
        last_valid = torch.where(valid.bool(), columns, 0).cummax(dim=1).values
        source = torch.cat([last_valid[:, :1], last_valid[:, :-1]], dim=1)
        return logits.gather(1, source[..., None].expand_as(logits))

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values=None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        store_kv: bool = False,
        output_hidden_states: bool | None = None,
        logits_to_keep: int | torch.Tensor | tuple[torch.Tensor, torch.Tensor] = 0,
        num_items_in_batch: int | torch.Tensor | None = None,
        output_router_logits: bool | None = None,
        router_loss_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """``attention_mask``: None, 2-D key padding, or a custom 3-/4-D mask (see ``resolve_attention_mask``; the
        string ``"full"`` that Dream's released sampler passes means no mask). ``past_key_values``: a
        ``DiffusionCache``, read by every pass and written only when ``store_kv``. Logits are returned as the
        release computes them (Dream's shifted); ``labels`` are compared after ``align_logits``. The loss is the
        mean over labelled tokens, or, given transformers' ``num_items_in_batch`` (what ``Trainer`` passes to a
        forward with ``**kwargs``, and then does not divide the loss by the accumulation steps), the summed loss
        divided by it.

        ``logits_to_keep`` (see ``keep_positions``) runs the LM head only where logits are wanted: an int keeps the
        last positions and a 1-D tensor the given columns of every row (as in transformers); a ``(rows, cols)``
        pair of index tensors or a ``[B, L]`` boolean mask keeps those positions only and returns logits ``[N, V]``
        in that order (row-major for a mask): what training needs, since it scores a few positions of long packed
        rows and a vocabulary-wide head over every position would be a large part of the memory.

        Mixture-of-experts models (a config with an ``output_router_logits`` field; dense models ignore both
        arguments) return a ``MoeCausalLMOutputWithPast``; with ``output_router_logits`` (None: the config's) it
        holds each sparse layer's ``router_logits`` and the load-balancing ``aux_loss`` (``moe.MoeLMMixin``) over
        the tokens ``router_loss_mask`` ``[B, L]`` marks (default: a 2-D ``attention_mask``'s real tokens, else
        all; see ``moe.router_token_mask``). The logits do not change.

        ``num_logits_to_keep`` (the released Dream and LLaDA-MoE forwards' name) is read as ``logits_to_keep``.

        As in transformers, ``return_dict=False`` returns a tuple, ``output_hidden_states`` (None: the config's)
        adds the hidden states, and ``output_attentions=True`` (the argument or the config) is an error (see
        ``output_switches``)."""
        if kwargs.get("attention_bias") is not None:
            raise ValueError("attention_bias (LLaDA's released forward) is not read here: pass it as a 3-/4-D "
                             "attention_mask (True / 1 = attend, or an additive float mask).")
        if kwargs.get("num_logits_to_keep") is not None:  # Dream's and LLaDA-MoE's released name (it was ignored)
            if not isinstance(logits_to_keep, int) or logits_to_keep:
                raise ValueError("give either num_logits_to_keep (the released Dream / LLaDA-MoE name) or "
                                 "logits_to_keep, not both.")
            logits_to_keep = kwargs.pop("num_logits_to_keep")
        output_hidden_states, as_tuple = output_switches(self.config, output_hidden_states, kwargs)
        past_key_values, store_kv = cache_switches(past_key_values, store_kv, kwargs)
        if isinstance(attention_mask, str):
            attention_mask = None
        routed = router_logits_requested(self.config, output_router_logits)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, store_kv=store_kv,
                         output_hidden_states=output_hidden_states,
                         **({} if routed is None else {"output_router_logits": routed}))
        if labels is not None and not (logits_to_keep is None or (isinstance(logits_to_keep, int) and (
                logits_to_keep == 0 or logits_to_keep >= out.last_hidden_state.shape[1]))):
            raise ValueError("labels need logits at every position, in order; do not combine them with "
                             "logits_to_keep.")
        hidden = keep_positions(out.last_hidden_state, logits_to_keep)
        output = causal_lm_output(self, out, self.lm_logits(hidden), labels, num_items_in_batch)
        if routed is not None:  # a mixture-of-experts LM (``moe.MoeLMMixin``)
            output = self._moe_output(output, out.router_logits, attention_mask, router_loss_mask,
                                      tuple(out.last_hidden_state.shape[:2]))
        # transformers' return_dict=False: a tuple of the fields that are set (unpacking the output object would
        # give its keys)
        return output.to_tuple() if as_tuple else output


def output_switches(config, output_hidden_states: bool | None, kwargs: dict) -> tuple[bool, bool]:
    """transformers' output arguments of a forward: ``(output_hidden_states, return a tuple)``.

    ``output_hidden_states`` None takes the config's (``from_pretrained(..., output_hidden_states=True)``).
    ``output_attentions`` (the argument, else the config's) True is an error: attention runs in SDPA /
    flex-attention kernels, which never form the weights (it was silently None). A tuple is returned for the
    keyword ``return_dict=False`` only: the config's ``return_dict`` is not read, because this package's own
    trainers and sampler read the output's fields by name."""
    attentions = kwargs.get("output_attentions")
    if attentions if attentions is not None else getattr(config, "output_attentions", False):
        raise ValueError("output_attentions=True is not supported: attention runs in SDPA / flex-attention "
                         "kernels, which never form the attention weights (attn_implementation is not read).")
    if output_hidden_states is None:
        output_hidden_states = bool(getattr(config, "output_hidden_states", False))
    return output_hidden_states, kwargs.get("return_dict") is False


def cache_switches(past_key_values, store_kv: bool, kwargs: dict) -> tuple:
    """transformers' cache arguments of a forward, as ``(past_key_values, store_kv)``.

    ``cache`` is transformers >= 5.24's name for ``past_key_values`` (the name the output hands the cache back
    under): either may carry it, both at once is an error. ``use_cache=True`` stores this pass's keys and values, as
    a transformers model does, into the given cache or a new ``DiffusionCache`` (the output's ``cache``); ``None`` or
    ``False`` leaves writing to ``store_kv``: a diffusion forward returns no cache unless asked (the config's
    ``use_cache`` is not read), since its denoising passes read a prefix they must not write."""
    cache = kwargs.get("cache")
    if cache is not None:
        if past_key_values is not None:
            raise ValueError("pass the cache as either past_key_values or cache (transformers >= 5.24's name), not "
                             "both.")
        past_key_values = cache
    if kwargs.get("use_cache"):
        return (DiffusionCache() if past_key_values is None else past_key_values), True
    return past_key_values, store_kv


def keep_positions(hidden: torch.Tensor, keep) -> torch.Tensor:
    """The part of ``hidden`` ``[B, L, ...]`` an output head should see: everything (``keep`` 0 or None), the last
    ``keep`` positions (int), the given columns of every row (1-D tensor), or only the given positions, flattened
    to ``[N, ...]``: a ``(rows, cols)`` pair of index tensors or a ``[B, L]`` boolean mask (row-major order)."""
    if keep is None or (isinstance(keep, int) and keep == 0):
        return hidden
    if isinstance(keep, int):
        return hidden[:, -keep:]
    if isinstance(keep, (tuple, list)):
        rows, cols = keep
        return hidden[rows, cols]
    if keep.dtype == torch.bool:
        if keep.shape != hidden.shape[:2]:
            raise ValueError(f"a boolean logits_to_keep must be [B, L] = {tuple(hidden.shape[:2])}, got "
                             f"{tuple(keep.shape)}.")
        return hidden[keep]
    if keep.dim() == 1:
        return hidden[:, keep]
    raise ValueError("logits_to_keep must be an int, a 1-D index tensor, a (rows, cols) pair or a [B, L] boolean "
                     f"mask; got a {keep.dim()}-D {keep.dtype} tensor.")


class RMSNorm(UsesKernels, nn.Module):
    """RMSNorm (``kernels.rms_norm``); given a ``residual``, the residual connection before it as well: returns
    ``(residual + x, norm(residual + x))``, one fused kernel when the kernels are compiled."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        return self.kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rotary_cos_sin(position_ids: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(cos, signed_sin)`` ``[B, 1, L, head_dim]`` for the HF rotate-half convention, computed once per
    forward and shared by every layer. ``signed_sin`` is ``sin`` with its first half negated, so that
    ``rotate_half(x) * sin == x.roll(half) * signed_sin`` exactly (negation is exact), one operation instead of four.

    Computed from the config on every call (no ``inv_freq`` buffer), so nothing can be left uninitialised by
    meta-device loading in transformers 5.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=position_ids.device).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = position_ids.float()[:, None, :, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


class RotaryTables:
    """One forward's fp32 rotary tables (``rotary_cos_sin``), shared by every layer, and their casts to the dtypes
    the layers rotate in, each made once (two kernels per layer saved in a bf16 forward, where a layer would cast
    them itself)."""

    def __init__(self, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
        self._tables = {cos.dtype: (cos, signed_sin)}

    def cast(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if dtype not in self._tables:
            cos, signed_sin = self._tables[torch.float32]
            self._tables[dtype] = (cos.to(dtype), signed_sin.to(dtype))
        return self._tables[dtype]


class UnscaledRopeConfig:
    """Config mixin (listed before ``PreTrainedConfig``) for the families' RoPE settings: unscaled rotary embeddings of
    base ``rope_theta``, a top-level field as in the released ``config.json`` files (which the released modeling code
    reads, and which the config keeps saving: ``rope_parameters`` is never written).

    transformers 5 configs carry the base in ``rope_parameters`` (``{"rope_type": "default", "rope_theta": ...}``, no
    top-level ``rope_theta``: ``Qwen3Config(...).to_dict()``, a ``config.json`` saved by transformers 5) and read
    ``rope_scaling`` as its old name. Both keys are read here (``take_rope_keys``, called first by ``__post_init__``;
    assigning either after construction, as ``from_pretrained(..., rope_scaling=...)`` does, goes through the same
    check): a ``rope_theta`` in them is the base when the top-level one is unset (different values are an error
    naming both), rope type ``"default"`` (``rope_type`` or ``type``) is no scaling, as null is, and any other rope
    type, or a key that would change the rotation, is refused: the models have no scaled RoPE, which would otherwise
    be ignored silently. ``config.rope_parameters`` reads ``{"rope_type": "default", "rope_theta": rope_theta}`` and
    ``config.rope_scaling`` None (the released value)."""

    def take_rope_keys(self, kwargs: dict, default_theta: float | None) -> None:
        """Pop ``rope_parameters`` and ``rope_scaling`` from a ``__post_init__``'s ``kwargs``, check them and set
        ``rope_theta`` (``default_theta``, the release's default, when none of them gives one)."""
        given = {"rope_theta": self.rope_theta} if self.rope_theta is not None else {}
        for key in ("rope_parameters", "rope_scaling"):
            theta = self._unscaled_rope_theta(key, kwargs.pop(key, None))
            if theta is not None:
                given[f"{key}['rope_theta']"] = theta
        if len({float(value) for value in given.values()}) > 1:
            raise ValueError(f"{type(self).__name__}: {' and '.join(f'{k}={v!r}' for k, v in given.items())} differ; "
                             "give the RoPE base once (transformers 5 writes rope_parameters, the released "
                             "config.json files rope_theta).")
        self.rope_theta = next(iter(given.values()), default_theta)

    def _unscaled_rope_theta(self, key: str, value) -> float | None:
        """The ``rope_theta`` of an unscaled ``rope_parameters`` / ``rope_scaling`` value (None when it has none, or is
        null or empty); a ValueError naming ``key`` for anything else."""
        if value is None:
            return None
        name = type(self).__name__
        refused = f"{name}: rope_scaling is not supported (the released checkpoints use none): {key}={value!r}"
        if not isinstance(value, dict):
            raise ValueError(f"{refused} is not a dict of RoPE parameters.")
        scaled = [value[k] for k in ("rope_type", "type") if value.get(k) not in (None, "default")]
        if scaled:
            raise ValueError(f"{refused} asks for rope type {scaled[0]!r}; only unscaled RoPE is supported "
                             "(rope_type 'default', or null), with its base in rope_theta.")
        neutral = {"rope_type": None, "type": None, "rope_theta": None, "partial_rotary_factor": (None, 1),
                   "factor": (None, 1)}
        extra = sorted(k for k, v in value.items() if k not in neutral or (neutral[k] and v not in neutral[k]))
        if extra:
            raise ValueError(f"{refused} sets {extra}, which unscaled RoPE (rope_type 'default') does not take; "
                             "only rope_type and rope_theta are supported.")
        theta = value.get("rope_theta")
        if theta is not None and (isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0):
            raise ValueError(f"{name}: {key}['rope_theta'] must be a positive number, got {theta!r}.")
        return theta

    @property
    def rope_parameters(self) -> dict:
        """transformers 5's form of the settings, ``{"rope_type": "default", "rope_theta": rope_theta}`` (a new dict
        each time: assign to change them). Not saved; ``config.json`` carries ``rope_theta``, as released."""
        return {"rope_type": "default", "rope_theta": getattr(self, "rope_theta", None)}

    @rope_parameters.setter
    def rope_parameters(self, value) -> None:
        theta = self._unscaled_rope_theta("rope_parameters", value)
        if theta is not None:
            self.rope_theta = theta

    @property
    def rope_scaling(self) -> None:
        """None: the models have no RoPE scaling (the released ``config.json`` files say ``rope_scaling: null``).
        Assigning null or an unscaled value is accepted (its ``rope_theta``, if any, sets ``rope_theta``)."""
        return None

    @rope_scaling.setter
    def rope_scaling(self, value) -> None:
        theta = self._unscaled_rope_theta("rope_scaling", value)
        if theta is not None:
            self.rope_theta = theta

    def convert_rope_params_to_dict(self, **kwargs):
        """``PreTrainedConfig.__post_init__``'s conversion of ``rope_theta`` / ``rope_scaling`` into a stored
        ``rope_parameters``: ``take_rope_keys`` did the reading; ``rope_theta`` stays the top-level field."""
        for key in ("rope_parameters", "rope_scaling"):  # only when a __post_init__ left them (it takes them first)
            if key in kwargs:
                setattr(self, key, kwargs.pop(key))
        return kwargs


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, rope: RotaryTables, full_precision: bool, kernels: Kernels = EAGER
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q``/``k`` ``[B, H, L, D]`` with the forward's tables: ``x * cos + rotate_half(x) * sin``.
    ``full_precision`` rotates in fp32 (LLaDA); otherwise the tables are cast to the activation dtype and the
    rotation runs in it (SDAR, Dream). ``kernels``: the layer's (``kernels.rotate_pair``)."""
    cos, signed_sin = rope.cast(torch.float32 if full_precision else q.dtype)
    return kernels.rotate_pair(q, k, cos, signed_sin, full_precision)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    layer_idx: int,
    cache: DiffusionCache | StaticDiffusionCache | None,
    store: bool,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Scaled dot-product attention over the cache's keys and the new ones (``cache.update``: a growing cache
    reads ``[cached | new]`` and appends the new keys only if ``store``; a static cache writes them in place).

    ``q`` ``[B, H, Q, D]``, ``k``/``v`` ``[B, KV, Q, D]`` (post-RoPE). ``mask`` is boolean (True = attend) or
    additive float, broadcastable to ``[B, H, Q, K]`` (SDPA), or a flex-attention ``BlockMask`` (flex attention,
    no dense mask). Grouped-query heads are expanded inside the kernel (no copy of the cached keys).
    """
    if cache is not None:
        k, v = cache.update(layer_idx, k, v, store)
    gqa = q.shape[1] != k.shape[1]
    shared_mask = mask is None or not is_block_mask(mask) and mask.dim() == 4 and mask.shape[1] == 1
    if cache is not None and gqa and shared_mask:  # decoding over a cache: see grouped_query_attention
        return grouped_query_attention(q, k, v, mask, dropout)
    if is_block_mask(mask):
        if dropout:
            raise ValueError("flex attention has no attention dropout; set attention_dropout to 0 or use "
                             "attention_backend='sdpa'.")
        return flex_attention_kernel(q.device)(q, k, v, block_mask=mask, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=False,
                                          enable_gqa=gqa)


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                            dropout: float = 0.0) -> torch.Tensor:
    """SDPA of ``q`` ``[B, H, Q, D]`` over fewer key/value heads ``[B, KV, K, D]`` (a KV cache's read window) with
    each key/value head's ``H / KV`` query heads folded into the query length, ``[B, KV, H / KV * Q, D]``: the same
    attention, with the cached keys read once per key/value head and never copied, whatever kernel SDPA picks.
    By torch's documentation ``enable_gqa`` runs only on the flash and math kernels on CUDA (cuDNN took it in the
    H200 training profile, torch 2.11), flash takes no mask, and the math kernel copies every cached key and value
    ``H / KV`` times in every layer and step, a cost that grows with batch x cache length. ``mask``: None, or
    ``[B or 1, 1, Q, K]`` (shared by the heads), repeated over the folded rows."""
    b, heads, n, d = q.shape
    group = heads // k.shape[1]
    folded = q.reshape(b, k.shape[1], group * n, d)
    if mask is not None:
        mask = mask.expand(mask.shape[0], 1, n, mask.shape[-1]).repeat(1, 1, group, 1)
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, dropout_p=dropout, is_causal=False)
    return out.reshape(b, heads, n, d)


def is_block_mask(mask) -> bool:
    """Whether ``mask`` is a flex-attention ``BlockMask`` (without importing flex attention when it isn't)."""
    return type(mask).__name__ == "BlockMask" and hasattr(mask, "mask_mod")


@functools.cache
def flex_attention_kernel(device: torch.device):
    """flex_attention, compiled on CUDA (its fused kernel; eager flex materialises the scores), eager elsewhere.
    Compiled with automatic dynamic shapes: packed training rows change length from batch to batch."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention) if torch.device(device).type == "cuda" else flex_attention


def resolve_attention_mask(
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor,
    batch: int,
    q_len: int,
    cache: DiffusionCache | StaticDiffusionCache | None,
    block_size: int | None,
    dtype: torch.dtype,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Turn the user's ``attention_mask`` into the 4-D mask every layer uses.

    Accepted: ``None``; a 2-D key-padding mask ``[B, past + L]`` (1 = real token); a 3-D ``[B, Q, K]`` or 4-D
    ``[B, 1 | H, Q, K]`` mask, boolean/0-1 of any dtype (True = attend; see ``is_visibility_mask``) or additive
    float, used as given; a flex-attention
    ``BlockMask`` (training forwards without a cache), used as given. For 2-D and
    ``None`` the structure (block-causal or full) comes from the positions. Returns the mask and the validity of
    the new keys (what a committing cache pass stores). With a ``StaticDiffusionCache`` the mask covers its read
    window (None: all of it), as the sampler that places the cache knows which slots are visible.
    """
    past = cache.get_seq_length() if cache is not None else 0
    k_len = cache.key_length(q_len) if cache is not None else q_len
    device = position_ids.device
    if isinstance(cache, StaticDiffusionCache):
        if attention_mask is None:  # every slot of the read window is visible
            return None, torch.ones(batch, q_len, dtype=torch.bool, device=device)
        if is_block_mask(attention_mask) or attention_mask.dim() not in (3, 4):
            raise ValueError("a StaticDiffusionCache takes None or a 3-D / 4-D attention_mask over its read window "
                             f"([B, 1, {q_len}, {k_len}]).")
    if is_block_mask(attention_mask):
        mask_q, mask_k = attention_mask.shape[-2:]
        if past or mask_q != q_len or mask_k != k_len or attention_mask.shape[0] not in (1, batch):
            raise ValueError(f"a BlockMask of shape {tuple(attention_mask.shape)} does not fit {q_len} queries and "
                             f"{k_len} keys (batch {batch}); BlockMasks are for cache-free training forwards.")
        return attention_mask, torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if attention_mask is not None and attention_mask.dim() in (3, 4):
        mask = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
        if mask.shape[-2] != q_len or mask.shape[-1] != k_len or mask.shape[0] not in (1, batch):
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not fit {q_len} queries and {k_len} "
                f"keys (batch {batch}); expected [B, 1, {q_len}, {k_len}] or [B, {q_len}, {k_len}]."
            )
        mask = mask.bool() if is_visibility_mask(mask) else mask.to(dtype)
        return mask, torch.ones(batch, q_len, dtype=torch.bool, device=device)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape != (batch, k_len):
            raise ValueError(
                f"attention_mask of shape {tuple(attention_mask.shape)} does not fit; a 2-D mask must be "
                f"[batch={batch}, past+length={k_len}]."
            )
        key_valid = attention_mask.bool()
    else:
        key_valid = torch.ones(batch, k_len, dtype=torch.bool, device=device)
    new_valid = key_valid[:, past:]
    if cache is not None and cache.positions is not None:
        key_positions = torch.cat([cache.positions.expand(batch, -1), position_ids.expand(batch, -1)], dim=-1)
        key_valid = torch.cat([cache.valid.expand(batch, -1), new_valid], dim=-1) & key_valid
    else:
        key_positions = position_ids.expand(batch, -1)
    if block_size is None and bool(key_valid.all()):
        return None, new_valid
    mask = attention_mask_from_positions(position_ids.expand(batch, -1), key_positions, key_valid, block_size)
    return mask, new_valid


def is_visibility_mask(mask: torch.Tensor) -> bool:
    """Whether a 3-/4-D ``mask`` says who may attend (True / 1 = attend) rather than adding a bias to the scores.

    Boolean and integer masks do. So does a floating mask of 0s and 1s with at least one 1: the releases' samplers
    pass such masks (SDAR's ``block_diffusion_generate`` builds a float ``tril`` of ones) and the released models
    read them as visibility; taken as additive, a +1 bias on visible keys, they would mask nothing. Any other
    floating mask (0 / -inf or a finite minimum, or all zeros) is additive."""
    if not mask.dtype.is_floating_point:
        return True
    ones = mask == 1
    return bool(((mask == 0) | ones).all()) and bool(ones.any())


def default_position_ids(input_shape: tuple[int, int], cache: DiffusionCache | StaticDiffusionCache | None,
                         device, attention_mask=None, by_padding: bool = False) -> torch.Tensor:
    """Positions when none are given: ``past + arange(L)``, the transformers default, under which rotary attention
    is the same for any shift (a static cache's slots are not positions: pass them).

    ``by_padding`` (block models, whose blocks come from the positions: ``arange`` would put a left-padded row's
    pads and real tokens in one block, as their releases do): each row's real tokens count from 0
    (``states.positions_from_padding`` of a 2-D ``attention_mask`` over the past and new tokens, else of all-real
    new tokens), continuing after the last real position a ``DiffusionCache`` holds for the row, so a padded row is
    placed as it would be alone, with or without a mask on the later calls."""
    if isinstance(cache, StaticDiffusionCache):
        raise ValueError("a StaticDiffusionCache needs explicit position_ids.")
    past = cache.get_seq_length() if cache is not None else 0
    batch, q_len = input_shape
    if not by_padding:
        return torch.arange(past, past + q_len, device=device)[None].expand(batch, -1)
    if isinstance(attention_mask, torch.Tensor) and tuple(attention_mask.shape) == (batch, past + q_len):
        new = attention_mask[:, past:].to(device)
    else:
        new = torch.ones(batch, q_len, dtype=torch.long, device=device)
    positions = positions_from_padding(new)
    if past and cache.positions is not None:  # after the row's last real cached position
        last = cache.positions.masked_fill(~cache.valid, -1).max(-1, keepdim=True).values
        positions = positions + (last + 1).to(device)
    return positions


# ----------------------------------------------------------------------------------------------------------
# Qwen-style decoder (SDAR = Qwen3 with q/k norms; Dream = Qwen2 with q/k/v biases)
# ----------------------------------------------------------------------------------------------------------


class QwenStyleAttention(UsesKernels, nn.Module):
    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rope_theta = config.rope_theta
        self.dropout = config.attention_dropout
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # OLMoE's clip_qkv (LLaDA-MoE's config has it): q, k (after their norms) and v clamped to [-clip, clip]
        self.clip_qkv = getattr(config, "clip_qkv", None)

    def forward(self, x, rope, mask, cache, store):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = apply_rotary(q.transpose(1, 2), k.transpose(1, 2), rope, False, self.kernels)
        dropout = self.dropout if self.training else 0.0
        out = attend(q, k, v, mask, self.layer_idx, cache, store, dropout)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1))


class SwiGLUMLP(UsesKernels, nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, no biases: a dense MLP, one expert or a shared expert."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.kernels.silu_mul(self.gate_proj(x), self.up_proj(x)))


class QwenStyleMLP(SwiGLUMLP):
    """The dense MLP of SDAR's and Dream's layers (``intermediate_size`` wide)."""

    def __init__(self, config) -> None:
        if config.hidden_act != "silu":
            raise ValueError(f"only hidden_act='silu' is supported, got {config.hidden_act!r}.")
        super().__init__(config.hidden_size, config.intermediate_size)


class QwenStyleDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm attention + MLP. ``mlp``: the layer's MLP (a module mapping ``[..., hidden]`` to the same shape, e.g.
    SDAR-MoE's sparse expert block); default the dense ``QwenStyleMLP``."""

    def __init__(self, config, layer_idx: int, qkv_bias: bool, qk_norm: bool, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = QwenStyleAttention(config, layer_idx, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = QwenStyleMLP(config) if mlp is None else mlp

    def forward(self, hidden_states, rope, mask, cache=None, store=False, output_router_logits: bool = False):
        """The layer's output; with ``output_router_logits`` (a mixture-of-experts backbone collecting them),
        ``(output, router_logits)`` (see ``mlp_output``)."""
        attended = self.self_attn(self.input_layernorm(hidden_states), rope, mask, cache, store)
        h, normed = self.post_attention_layernorm(attended, residual=hidden_states)
        out, router_logits = mlp_output(self.mlp, normed, output_router_logits)
        return (h + out, router_logits) if output_router_logits else h + out


def mlp_output(mlp: nn.Module, hidden: torch.Tensor,
               output_router_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mlp(hidden)`` and, when asked and ``mlp`` is a mixture-of-experts block (``routes_tokens``:
    ``moe.SparseMoeBlock``), its router logits ``[tokens, num_experts]``; None otherwise."""
    if output_router_logits and getattr(mlp, "routes_tokens", False):
        return mlp(hidden, output_router_logits=True)
    return mlp(hidden), None


def router_logits_requested(config, requested: bool | None) -> bool | None:
    """Whether a forward returns router logits: None for a model without routers (its config has no
    ``output_router_logits`` field, which is also how TRL's trainers tell mixture-of-experts models apart), else the
    call's ``output_router_logits``, or the config's when the call leaves it None (as transformers reads it)."""
    if not hasattr(config, "output_router_logits"):
        return None
    return bool(config.output_router_logits if requested is None else requested)


def mismatched_checkpoint_hint(bad_keys: dict[str, list[str]]) -> str:
    """What a checkpoint whose keys do not fit the model most likely is, and how to load it: a value model's (its
    ``value_head.weight``) loaded as a policy, a policy's loaded as a value model, or neither."""
    if "value_head.weight" in bad_keys.get("unexpected_keys", []):
        return ("It holds a value model (value_head.weight; TraceRL saves one in <output_dir>/value_model beside the "
                "policy): load it with trl_diffusion.DiffusionValueModel.from_pretrained.")
    if "value_head.weight" in bad_keys.get("missing_keys", []):
        return ("It holds a policy (no value_head.weight): start a value model from it with "
                "DiffusionValueModel.from_policy, or DiffusionValueModel.load, which picks for you.")
    return ("Check that the checkpoint is a released SDAR/TraDo(-MoE), LLaDA(-MoE) or Dream/DiffuCoder model with its "
            "original key names.")


class DiffusionPreTrainedModel(PreTrainedModel):
    """Shared ``PreTrainedModel`` settings and weight init for our families."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = True  # released SDAR configs ask for "flex_attention"; the kernel follows the mask passed

    def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
        """transformers' check of ``attn_implementation``, after ours: the kernel follows the attention mask (SDPA,
        or flex attention for a ``BlockMask``), so ``"sdpa"``, ``"flex_attention"`` and ``"eager"`` (the same
        attention; its weights are never formed) load, and flash-attn or a Hub kernel is a clear error rather than
        transformers' "request support on the model's Hub page"."""
        if isinstance(attn_implementation, str) and attn_implementation not in ("eager", "sdpa", "flex_attention"):
            raise ValueError(f"attn_implementation={attn_implementation!r}: {type(self).__name__} (trl_diffusion) "
                             "does not use flash-attn or Hub kernels: its attention is PyTorch SDPA, or flex "
                             "attention when given a flex-attention BlockMask (the trainers' attention_backend). "
                             "Leave attn_implementation unset (or 'sdpa').")
        return super()._check_and_adjust_attn_implementation(attn_implementation, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """``PreTrainedModel.from_pretrained``, but a checkpoint whose keys don't match is an error, not a
        warning: a silently re-initialised weight would make every later number wrong. Weights of another shape
        are re-initialised only when asked (``ignore_mismatched_sizes=True``, transformers' warning names them)."""
        want_info = kwargs.pop("output_loading_info", False)
        model, info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        checked = ["missing_keys", "unexpected_keys"]
        if not kwargs.get("ignore_mismatched_sizes"):
            checked.append("mismatched_keys")
        bad = {k: sorted(info.get(k) or []) for k in checked}
        bad = {k: v for k, v in bad.items() if v}
        if bad:
            raise ValueError(f"the checkpoint does not match {cls.__name__} ({model.config.model_type}): {bad}. "
                             f"{mismatched_checkpoint_hint(bad)}")
        return (model, info) if want_info else model

    def _init_weights(self, module: nn.Module) -> None:
        from transformers import initialization as init

        std = getattr(self.config, "initializer_range", None) or getattr(self.config, "init_std", 0.02)
        if isinstance(module, nn.Linear):
            init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            init.normal_(module.weight, mean=0.0, std=std)
            # the pad row starts at zero, as the releases initialise it (Dream's `padding_idx` row never gets a
            # gradient, so it would stay random); a loaded weight is flagged initialised and left as loaded (the
            # row slice below would lose that flag, hence the explicit check, as in transformers' own models)
            if module.padding_idx is not None and not getattr(module.weight, "_is_hf_initialized", False):
                init.zeros_(module.weight[module.padding_idx])
        elif isinstance(module, RMSNorm):
            init.ones_(module.weight)


def leftover_kwargs_error(model_name: str, config: object, kwargs: dict) -> ValueError:
    """The error for the keyword arguments ``from_pretrained`` handed to a model's ``__init__``. Names that are not
    config attributes are unknown; names that are were not applied because ``config=`` was passed as an object
    (transformers then hands every keyword to the model instead of setting it on the config), so the error says to
    set them on that object: reporting them as unknown would send the user looking for a typo."""
    unknown = sorted(k for k in kwargs if k == "rope_scaling" or not hasattr(config, k))
    settable = sorted(k for k in kwargs if k not in unknown)
    parts = []
    if unknown:
        note = " rope_scaling is not supported (the released checkpoints use none)." * ("rope_scaling" in kwargs)
        parts.append(f"{model_name} got arguments its config does not have: {unknown}.{note}")
    if settable:
        assignments = "; ".join(f"config.{k} = {kwargs[k]!r}" for k in settable)
        parts.append(f"{model_name} got config arguments {settable} together with config= passed as an object: "
                     "transformers does not apply config keywords then. Set them on the config object instead "
                     f"({assignments}) and pass the config alone.")
    return ValueError(" ".join(parts))


class QwenStyleLM(DiffusionModelMixin):
    """``model`` (a Qwen-style backbone) + ``lm_head``: what SDAR's and Dream's LM classes share. List it before
    the ``PreTrainedModel`` base so that its ``__init__`` and the mixin's ``forward`` win over ``nn.Module``'s."""

    backbone_class: type

    def __init__(self, config, **kwargs) -> None:
        if kwargs:  # from_pretrained hands the model the keyword arguments its config did not take
            raise leftover_kwargs_error(type(self).__name__, config, kwargs)
        super().__init__(config)
        # transformers derives "ForCausalLM" from the class name, and Trainer then counts num_items_in_batch over
        # labels[..., 1:] (a next-token loss); ours scores every label at its own position, but for a shifted model
        # (Dream) the first column's, which nothing predicts (``causal_lm_output``): there that count is right.
        self.loss_type = "ForCausalLM" if self.logits_shift else None
        self.model = self.backbone_class(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):  # transformers' parameter name (callers may pass it by keyword)
        self.lm_head = new_embeddings


def sliding_layers(config) -> bool:
    """Whether a Qwen2/3-style config asks for sliding-window attention in any layer: ``use_sliding_window`` with a
    ``sliding_window``, for the layers from ``max_window_layers`` up (none when that is the layer count)."""
    windowed_from = getattr(config, "max_window_layers", None)
    return bool(getattr(config, "use_sliding_window", False) and getattr(config, "sliding_window", None) is not None
                and (windowed_from is None or windowed_from < config.num_hidden_layers))


class QwenStyleBackbone(DiffusionPreTrainedModel):
    """``embed_tokens`` / ``layers`` / ``norm``: the backbone of SDAR and Dream."""

    qkv_bias: bool = False
    qk_norm: bool = False
    # the backbone alone loads from a released (LM) checkpoint, as the release's ``SDARModel`` / ``DreamBaseModel``
    # do: its head is the one key the backbone has no place for
    _keys_to_ignore_on_load_unexpected = [r"^lm_head\.weight$"]

    def __init__(self, config) -> None:
        if sliding_layers(config):  # the releases' Qwen2/3 option; every release leaves it off
            raise ValueError(f"{type(config).__name__}: use_sliding_window=True with sliding_window="
                             f"{config.sliding_window} is not supported for layers from max_window_layers="
                             f"{getattr(config, 'max_window_layers', None)} up (attention here is over the whole "
                             "context, as in the released checkpoints, which set use_sliding_window to false).")
        super().__init__(config)
        self.padding_idx = self._embedding_padding_idx(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(self._decoder_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.gradient_checkpointing = False
        self.post_init()

    def _decoder_layer(self, config, layer_idx: int) -> nn.Module:
        """Layer ``layer_idx``: a ``QwenStyleDecoderLayer`` with ``_layer_mlp``'s MLP (a backbone whose layers hold
        more, as LLaDA-MoE's shared expert, overrides this)."""
        mlp = self._layer_mlp(config, layer_idx)
        return QwenStyleDecoderLayer(config, layer_idx, self.qkv_bias, self.qk_norm, mlp)

    def _layer_mlp(self, config, layer_idx: int) -> nn.Module | None:
        """The MLP of layer ``layer_idx``; None = the dense ``QwenStyleMLP`` (a mixture-of-experts backbone overrides
        this to choose per layer)."""
        return None

    def _embedding_padding_idx(self, config) -> int | None:
        """``padding_idx = pad_token_id`` as SDAR's and Dream's releases build the embedding (the pad row gets no
        gradient); none when the config names no pad id (SDAR's released configs)."""
        pad = config.pad_token_id
        return pad if isinstance(pad, int) and 0 <= pad < config.vocab_size else None

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values: DiffusionCache | None = None, inputs_embeds=None, store_kv: bool = False,
                output_hidden_states: bool | None = None, output_router_logits: bool | None = None,
                **kwargs) -> BaseModelOutputWithPast | MoeModelOutputWithPast | tuple:
        """``output_router_logits`` (mixture-of-experts backbones; None: the config's): see ``run_backbone``; the
        output arguments as in the LM's forward (``output_switches``)."""
        output_hidden_states, as_tuple = output_switches(self.config, output_hidden_states, kwargs)
        past_key_values, store_kv = cache_switches(past_key_values, store_kv, kwargs)
        head_dim = self.layers[0].self_attn.head_dim
        out = run_backbone(self, self.embed_tokens, self.layers, self.norm, head_dim, input_ids, inputs_embeds,
                           attention_mask, position_ids, past_key_values, store_kv, output_hidden_states,
                           router_logits=router_logits_requested(self.config, output_router_logits))
        return out.to_tuple() if as_tuple else out


def run_backbone(model, embed, layers, final_norm, head_dim, input_ids, inputs_embeds, attention_mask,
                 position_ids, cache, store_kv, output_hidden_states, embed_dropout=None,
                 router_logits: bool | None = None) -> BaseModelOutputWithPast | MoeModelOutputWithPast:
    """The forward every backbone shares: embed, resolve positions and mask, run the layers (reading the cache,
    and writing it when ``store_kv``), final norm. ``router_logits``: None for a dense backbone (a
    ``BaseModelOutputWithPast``); for a mixture-of-experts one a ``MoeModelOutputWithPast``, whose
    ``router_logits`` hold, when True, each sparse layer's ``[B * L, num_experts]`` in layer order (the layers
    return them: gradient checkpointing keeps their gradient)."""
    if store_kv and model.gradient_checkpointing and model.training and torch.is_grad_enabled():
        # the checkpointed layers run again in backward and would append their keys a second time
        raise ValueError("store_kv=True under gradient checkpointing in a training forward (use_cache=True writes "
                         "a cache too): write a cache under torch.no_grad() or in eval mode.")
    hidden, position_ids, mask, new_valid = _prepare_inputs(
        model, input_ids, inputs_embeds, attention_mask, position_ids, cache, embed
    )
    if embed_dropout is not None:
        hidden = embed_dropout(hidden)
    rope = RotaryTables(*rotary_cos_sin(position_ids, head_dim, model.config.rope_theta))
    all_hidden = [] if output_hidden_states else None
    routers = [] if router_logits else None
    for layer in layers:
        if all_hidden is not None:
            all_hidden.append(hidden)
        if routers is None:
            hidden = layer(hidden, rope, mask, cache, store_kv)
            continue
        hidden, logits = layer(hidden, rope, mask, cache, store_kv, output_router_logits=True)
        if logits is not None:
            routers.append(logits)
    hidden = final_norm(hidden)
    if all_hidden is not None:
        all_hidden.append(hidden)
    if isinstance(cache, DiffusionCache) and store_kv:
        cache.append_positions(position_ids, new_valid)
    hidden_states = tuple(all_hidden) if all_hidden is not None else None
    if router_logits is None:
        return BaseModelOutputWithPast(last_hidden_state=hidden, hidden_states=hidden_states, **{CACHE_FIELD: cache})
    return MoeModelOutputWithPast(last_hidden_state=hidden, hidden_states=hidden_states,
                                  router_logits=tuple(routers) if routers is not None else None,
                                  **{CACHE_FIELD: cache})


def _prepare_inputs(model, input_ids, inputs_embeds, attention_mask, position_ids, cache, embed):
    """Embed, default the positions, and resolve the mask: the preamble every backbone forward shares."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds.")
    if cache is not None and not isinstance(cache, (DiffusionCache, StaticDiffusionCache)):
        raise ValueError(f"past_key_values must be a trl_diffusion DiffusionCache (or None), got "
                         f"{type(cache).__name__}: a diffusion forward reads a cache without writing it unless "
                         "store_kv=True, which transformers' caches do not do.")
    hidden = embed(input_ids) if inputs_embeds is None else inputs_embeds
    batch, q_len = hidden.shape[:2]
    if position_ids is None:
        position_ids = default_position_ids((batch, q_len), cache, hidden.device, attention_mask,
                                            by_padding=model.diffusion_block_size is not None)
    elif position_ids.dim() == 1:
        position_ids = position_ids[None]
    if position_ids.dim() != 2 or position_ids.shape[-1] != q_len or position_ids.shape[0] not in (1, batch):
        raise ValueError(f"position_ids must be [{batch}, {q_len}] (or [1, {q_len}] / [{q_len}], the same for every "
                         f"row): one position per input token, got {tuple(position_ids.shape)}.")
    position_ids = position_ids.expand(batch, -1)
    mask, new_valid = resolve_attention_mask(
        attention_mask, position_ids, batch, q_len, cache, model.diffusion_block_size, hidden.dtype
    )
    return hidden, position_ids, mask, new_valid


def diffusion_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                      num_items_in_batch: int | torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy of ``labels`` (-100 ignored) against position-aligned logits: the mean, or the sum divided by
    ``num_items_in_batch`` (the labelled tokens of the whole accumulated batch, as transformers' losses do)."""
    flat_logits, flat_labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
    if num_items_in_batch is None:
        return F.cross_entropy(flat_logits, flat_labels, ignore_index=-100)
    total = F.cross_entropy(flat_logits, flat_labels, ignore_index=-100, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def causal_lm_output(model, backbone_out, lm_logits: torch.Tensor, labels,
                     num_items_in_batch: int | torch.Tensor | None = None) -> CausalLMOutputWithPast:
    loss = None
    if labels is not None:
        if model.logits_shift:  # nothing predicts the first column (align_logits repeats the next column's logits)
            labels = torch.cat([torch.full_like(labels[:, :1], -100), labels[:, 1:]], dim=1)
        loss = diffusion_lm_loss(model.align_logits(lm_logits), labels, num_items_in_batch)
    return CausalLMOutputWithPast(
        loss=loss,
        logits=lm_logits,
        hidden_states=backbone_out.hidden_states,
        **{CACHE_FIELD: getattr(backbone_out, CACHE_FIELD)},
    )


def check_tokenizer(tokenizer, model) -> None:
    """Raise early when a tokenizer cannot drive diffusion with ``model``: it needs the model's mask token, which
    must be a row of the model's embedding."""
    mask_id = check_mask_token_id(model)
    tok_mask = getattr(tokenizer, "mask_token_id", None)
    if tok_mask is None:
        if mask_id >= len(tokenizer):
            raise ValueError(
                f"the tokenizer has no mask token and the model's mask id {mask_id} is outside its vocabulary "
                f"({len(tokenizer)} tokens); add the mask token to the tokenizer."
            )
        return  # LLaDA's released tokenizer declares no mask token; the id comes from the config
    if tok_mask != mask_id:
        raise ValueError(
            f"the tokenizer's mask token id ({tok_mask}) differs from the model's mask_token_id ({mask_id})."
        )


def check_router_aux_loss_coef(model, coef: float | None) -> None:
    """Refuse an explicit non-zero ``router_aux_loss_coef`` (TRL's ``SFTConfig`` / ``GRPOConfig`` field) for a model
    without routers: a config without ``output_router_logits``, TRL's own test for a mixture-of-experts model. TRL
    refuses it too, but only once its trainer has loaded the model and, for SFT, prepared the datasets."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config()
    if coef and not hasattr(config, "output_router_logits"):
        raise ValueError(
            f"router_aux_loss_coef={coef} weighs the load-balancing loss of a mixture-of-experts model's routers "
            f"(SDAR-MoE, LLaDA-MoE), but {type(base).__name__} is a dense model: it has no router and no such loss. "
            "Leave router_aux_loss_coef unset (or 0) for dense models."
        )


ADAPTER_USES = ("pass peft.PeftModel.from_pretrained(base_model, path, is_trainable=True) to train the adapter "
                "further, or peft.PeftModel.from_pretrained(base_model, path).merge_and_unload() to train the model "
                "with the adapter folded in (with peft_config= for a new adapter on it), base_model loaded by "
                "AutoModelForCausalLM.from_pretrained")
"""How to train from a PEFT adapter, for the errors of :func:`check_adapter_saveable` and
:func:`check_trains_parameters`."""


def check_adapter_saveable(model, trainer: str) -> None:
    """Refuse, before training, a PEFT adapter folder (what ``use_peft`` saves) given as the model path: TRL loads a
    model path through its ``config.json``, which an adapter folder lacks. Refuse as well a model that transformers
    loaded from such a folder (the adapter attached: ``_hf_peft_config_loaded``) when transformers needs a newer peft
    than the installed one to save it (transformers 5.24 and 5.25: peft >= 0.22.0; the run would train and then fail
    at its first save). A ``ValueError`` says how to load the adapter instead (:data:`ADAPTER_USES`)."""
    if isinstance(model, (str, os.PathLike)):
        path = os.path.expanduser(os.fspath(model))
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ValueError(f"{trainer}: {os.fspath(model)} is a PEFT adapter folder (adapter_config.json), not a "
                             f"model: {ADAPTER_USES}.")
        return
    if not getattr(model, "_hf_peft_config_loaded", False):  # a PeftModel forwards the attribute
        return
    from importlib.metadata import version

    from packaging.version import Version
    from transformers.integrations import peft as transformers_peft

    needed = getattr(transformers_peft, "MIN_PEFT_VERSION", None)
    if needed is None or Version(version("peft")) >= Version(needed):
        return
    raise ValueError(
        f"{trainer}: the model carries a PEFT adapter that transformers attached when loading an adapter folder, and "
        f"transformers cannot save such a model with peft {version('peft')} (it needs peft >= {needed}): the run "
        f"would fail at its first save. Load the adapter with peft instead: {ADAPTER_USES}.")


def check_trains_parameters(model, owner: str) -> None:
    """Refuse to train ``model`` (named ``owner`` in the error) when none of its parameters requires a gradient:
    the run would log losses and save checkpoints and change no weight. The usual cause is an adapter loaded for
    inference: ``peft.PeftModel.from_pretrained(base, path)`` freezes it unless ``is_trainable=True``, and so does
    transformers when it loads an adapter folder."""
    if any(parameter.requires_grad for parameter in model.parameters()):
        return
    from peft import PeftModel

    refused = f"{owner} has no trainable parameter, so training would change no weight"
    if isinstance(model, PeftModel):
        raise ValueError(f"{refused}: its PEFT adapter was loaded for inference (peft freezes an adapter it loads "
                         f"unless is_trainable=True); {ADAPTER_USES}.")
    if getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError(f"{refused}: it carries a PEFT adapter that transformers attached, frozen, when loading an "
                         f"adapter folder; {ADAPTER_USES}.")
    raise ValueError(f"{refused} (every parameter has requires_grad=False): unfreeze the parameters to train, "
                     "model.requires_grad_(True) for all of them.")


def without_autocast_wrapper(model) -> None:
    """Restore the ``forward`` of a model object that an earlier trainer prepared in mixed precision (``bf16`` /
    ``fp16``): accelerate wraps it in autocast on the object itself, and the wrapper outlives that trainer, so a later
    trainer with ``bf16=False`` (TraceRL after a value-model warm start, or after SFT, in one process) ran it in bf16
    while its config said float32. A trainer in mixed precision wraps it again."""
    if isinstance(model, nn.Module) and "_original_forward" in model.__dict__:
        extract_model_from_parallel(model, keep_fp32_wrapper=False)


def model_argument(model, processing_class, trainer: str):
    """``model`` as a trainer's ``__init__`` takes it: a path (``str`` or ``os.PathLike``, e.g.
    ``trl_diffusion.assets.EMBEDDED_MODEL``) becomes a ``str``, which TRL loads; a model object given without a
    ``processing_class`` must have been loaded from somewhere (``config._name_or_path``), since TRL loads the
    tokenizer from there. Raises a ``ValueError`` saying what to pass otherwise. A model object an earlier trainer
    ran in mixed precision loses that trainer's autocast wrapper (``without_autocast_wrapper``)."""
    check_adapter_saveable(model, trainer)
    without_autocast_wrapper(model)
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    if isinstance(model, str) or processing_class is not None:
        return model
    config = getattr(model, "config", None)
    if config is not None and not getattr(config, "_name_or_path", ""):
        raise ValueError(f"{trainer}: pass processing_class= (the tokenizer). The model was built in memory, not "
                         "loaded from a path, so there is no name to load its tokenizer from.")
    return model
