"""LLaDA: an OLMo-style LLaMA block stack (``model.transformer.{wte,blocks.N.*,ln_f,ff_out}``) with full
bidirectional attention and an optional key-padding mask (the release's updated mask semantics). RoPE is
applied in fp32 when ``rope_full_precision``. Logits are not shifted.

Beyond the release, ``forward`` also takes ``position_ids`` (default ``0..T-1`` as in the release) and a
``DiffusionCache``, so LLaDA shares the sampler's prefix / dual cache paths and exact left-padding placement.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast

from ...generation.mixin import DiffusionGenerationMixin
from ..cache import DiffusionCache
from ..common import (
    DiffusionModelMixin,
    DiffusionPreTrainedModel,
    RMSNorm,
    apply_rotary,
    attend,
    cache_switches,
    leftover_kwargs_error,
    output_switches,
    run_backbone,
)
from ..kernels import UsesKernels
from .configuration_llada import LLaDAConfig


def _check_supported(config: LLaDAConfig) -> None:
    """The released LLaDA models use exactly this subset of the OLMo options; refuse the rest clearly."""
    if any("MoE" in a for a in config.architectures or []) or getattr(config, "num_experts", None):
        # LLaDA-MoE's config.json also says model_type "llada"
        raise ValueError(
            f"LLaDA-MoE configs (architectures {config.architectures}) are for LLaDAMoEModelLM, not LLaDAModelLM (the "
            "dense LLaDA-8B / LLaDA-1.5 architecture): load the folder with AutoModelForCausalLM.from_pretrained or "
            "LLaDAMoEModelLM.from_pretrained (AutoConfig gives an LLaDAMoEConfig for it)."
        )
    wanted = {
        "block_type": "llama",
        "activation_type": "silu",
        "layer_norm_type": "rms",
        "rope": True,
        "alibi": False,
        "attention_layer_norm": False,
        "input_emb_norm": False,
        "block_group_size": 1,
    }
    bad = {k: getattr(config, k) for k, v in wanted.items() if getattr(config, k) != v}
    if bad:
        raise ValueError(
            f"LLaDA options {bad} are not supported; the released checkpoints use {wanted}. "
            "Set these fields in the config (config.json of LLaDA-8B sets all of them)."
        )
    if config.embedding_size is not None and config.embedding_size < config.vocab_size:
        # the release's LLaDAModel refuses this too ("embedding size should be at least as big as vocab size")
        raise ValueError(
            f"LLaDA embedding_size ({config.embedding_size}) is smaller than vocab_size ({config.vocab_size}): the "
            "embedding and the output layer have embedding_size rows, so token ids from embedding_size up would have "
            "no row. Set embedding_size >= vocab_size, or leave it unset (null) for vocab_size rows."
        )
    # The norms below always carry a weight and no bias; the release's follow layer_norm_with_affine and
    # bias_for_layer_norm (None: include_bias), so a config asking for anything else would build another model
    if not config.layer_norm_with_affine:
        raise ValueError(
            "LLaDA layer_norm_with_affine=False (RMS norms without a weight) is not supported; the released "
            "checkpoints use layer_norm_with_affine=True (every attn_norm / ff_norm / ln_f has a weight)."
        )
    norm_bias = config.bias_for_layer_norm if config.bias_for_layer_norm is not None else config.include_bias
    if norm_bias:
        raise ValueError(
            f"LLaDA layer norms with a bias (bias_for_layer_norm={config.bias_for_layer_norm!r}, include_bias="
            f"{config.include_bias!r}; an unset bias_for_layer_norm follows include_bias) are not supported; the "
            "released checkpoints have none (include_bias=False). Set bias_for_layer_norm=False to keep the linear "
            "layers' biases without norm biases."
        )


class LLaDALlamaBlock(UsesKernels, GradientCheckpointingLayer):
    def __init__(self, config: LLaDAConfig, layer_idx: int) -> None:
        super().__init__()
        d, hidden = config.d_model, config.effective_mlp_hidden_size
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads = config.n_heads, config.effective_n_kv_heads
        self.head_dim = d // config.n_heads
        self.rope_theta = config.rope_theta
        self.rope_full_precision = config.rope_full_precision
        self.dropout = config.attention_dropout
        qkv_bias = bool(config.include_bias or config.include_qkv_bias)
        self.attn_norm = RMSNorm(d, config.rms_norm_eps)
        self.q_proj = nn.Linear(d, d, bias=qkv_bias)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.attn_out = nn.Linear(d, d, bias=config.include_bias)
        self.ff_norm = RMSNorm(d, config.rms_norm_eps)
        self.ff_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.up_proj = nn.Linear(d, hidden, bias=config.include_bias)
        self.ff_out = nn.Linear(hidden, d, bias=config.include_bias)
        self.residual_dropout = nn.Dropout(config.residual_dropout)

    def forward(self, x, rope, mask, cache=None, store=False):
        b, n, _ = x.shape
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, k, rope, self.rope_full_precision, self.kernels)
        dropout = self.dropout if self.training else 0.0
        att = attend(q, k, v, mask, self.layer_idx, cache, store, dropout).transpose(1, 2).reshape(b, n, -1)
        x, h = self.ff_norm(self.residual_dropout(self.attn_out(att)), residual=x)
        return x + self.residual_dropout(self.ff_out(self.kernels.silu_mul(self.ff_proj(h), self.up_proj(h))))


class LLaDAPreTrainedModel(DiffusionPreTrainedModel):
    config_class = LLaDAConfig
    config: LLaDAConfig
    _no_split_modules = ["LLaDALlamaBlock"]


class LLaDAModel(LLaDAPreTrainedModel):
    """Holds ``transformer = ModuleDict(wte, emb_drop, blocks, ln_f[, ff_out])`` as the release does."""

    diffusion_block_size = None

    def __init__(self, config: LLaDAConfig) -> None:
        super().__init__(config)
        _check_supported(config)
        vocab = config.embedding_size or config.vocab_size
        modules = {
            "wte": nn.Embedding(vocab, config.d_model),
            "emb_drop": nn.Dropout(config.embedding_dropout),
            "blocks": nn.ModuleList(LLaDALlamaBlock(config, i) for i in range(config.n_layers)),
            "ln_f": RMSNorm(config.d_model, config.rms_norm_eps),
        }
        if not config.weight_tying:
            modules["ff_out"] = nn.Linear(config.d_model, vocab, bias=config.include_bias)
        self.transformer = nn.ModuleDict(modules)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.transformer.wte

    def set_input_embeddings(self, value):
        self.transformer.wte = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values: DiffusionCache | None = None, inputs_embeds=None, store_kv: bool = False,
                output_hidden_states: bool | None = None, **kwargs) -> BaseModelOutputWithPast | tuple:
        output_hidden_states, as_tuple = output_switches(self.config, output_hidden_states, kwargs)
        past_key_values, store_kv = cache_switches(past_key_values, store_kv, kwargs)
        t = self.transformer
        out = run_backbone(self, t.wte, t.blocks, t.ln_f, self.config.d_model // self.config.n_heads, input_ids,
                           inputs_embeds, attention_mask, position_ids, past_key_values, store_kv,
                           output_hidden_states, embed_dropout=t.emb_drop)
        return out.to_tuple() if as_tuple else out


class LLaDAModelLM(DiffusionModelMixin, LLaDAPreTrainedModel, DiffusionGenerationMixin):
    """The released class name (``architectures: ["LLaDAModelLM"]``).

    With ``weight_tying`` there is no ``ff_out`` head: the logits use ``wte``'s weight directly (as the release
    does), so there are no weights for transformers to tie.
    """

    def __init__(self, config: LLaDAConfig, **kwargs) -> None:
        if kwargs:  # from_pretrained hands the model the keyword arguments its config did not take
            raise leftover_kwargs_error(type(self).__name__, config, kwargs)
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def set_input_embeddings(self, value):
        self.model.transformer.wte = value

    def get_output_embeddings(self):
        return self.model.transformer["ff_out"] if "ff_out" in self.model.transformer else None

    def set_output_embeddings(self, new_embeddings):  # transformers' parameter name
        self.model.transformer["ff_out"] = new_embeddings

    @property
    def lm_head(self) -> nn.Linear | None:
        """The output layer under the name TRL reads and assigns (``cast_lm_head_to_fp32``); it stays stored as
        ``model.transformer.ff_out``, the released key names. None with ``weight_tying`` (no separate layer)."""
        return self.get_output_embeddings()

    def __setattr__(self, name: str, value) -> None:
        if name == "lm_head":  # nn.Module would register the layer a second time, under a new state-dict key
            self.set_output_embeddings(value)
        else:
            super().__setattr__(name, value)

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """transformers' resize (``wte`` and the ``ff_out`` head), keeping ``config.embedding_size`` (what sizes
        both when the model is built again from the saved config) equal to the new number of rows."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        if self.config.embedding_size is not None:
            self.config.embedding_size = embeddings.num_embeddings
        return embeddings

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if "ff_out" in self.model.transformer:
            logits = self.model.transformer.ff_out(hidden)
        else:
            weight = self.model.transformer.wte.weight
            if weight.is_meta:  # read outside wte's forward: accelerate's offload hooks never load it (garbage logits)
                raise RuntimeError("LLaDA with weight_tying uses wte's weight as its LM head outside wte's forward, "
                                   "where an offloaded wte (device_map with disk or CPU offload) is never loaded: "
                                   "place 'model.transformer.wte' on an execution device in device_map.")
            logits = F.linear(hidden, weight)
        if self.config.scale_logits:
            logits = logits * (1 / math.sqrt(self.config.d_model))
        return logits
