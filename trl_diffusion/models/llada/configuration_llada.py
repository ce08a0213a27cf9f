"""LLaDAConfig: the config of LLaDA-8B-Base/Instruct and LLaDA-1.5 (OLMo-style names, full attention).

LLaDA-MoE's released config.json says ``model_type`` ``"llada"`` as well: loading such a dict (``from_dict``, which
``AutoConfig`` and ``from_pretrained`` use) gives an ``LLaDAMoEConfig`` instead."""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import PreTrainedConfig
from transformers.utils import logging

from ..common import UnscaledRopeConfig
from ..remote_code import CarryRemoteCodeConfig

logger = logging.get_logger(__name__)


class LLaDAConfig(UnscaledRopeConfig, CarryRemoteCodeConfig, PreTrainedConfig):
    """Field names and defaults are those of the released ``configuration_llada.py`` (its ``ModelConfig``
    dataclass; note they are *not* the 8B values, which every ``config.json`` sets). ``num_attention_heads``,
    ``num_hidden_layers`` and ``hidden_size`` read ``n_heads``, ``n_layers`` and ``d_model``. The released
    ``config.json`` has no ``rope_scaling``; ``rope_theta`` (default 10000.0) may come from a transformers-5
    ``rope_parameters`` instead, and RoPE scaling is refused (``UnscaledRopeConfig``)."""

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the output field before / since transformers 5.24
    attribute_map: ClassVar[dict[str, str]] = {
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "hidden_size": "d_model",
    }

    d_model: int = 768
    n_heads: int = 12
    n_kv_heads: int | None = None
    n_layers: int = 12
    mlp_ratio: int = 4
    mlp_hidden_size: int | None = None
    activation_type: str = "swiglu"
    block_type: str = "sequential"
    block_group_size: int = 1
    alibi: bool = False
    alibi_bias_max: float = 8.0
    rope: bool = False
    rope_full_precision: bool = True
    flash_attention: bool = False
    attention_dropout: float = 0.1
    multi_query_attention: bool | None = None
    attention_layer_norm: bool = False
    residual_dropout: float = 0.1
    embedding_dropout: float = 0.1
    input_emb_norm: bool = False
    layer_norm_type: str = "default"
    layer_norm_with_affine: bool = True
    rms_norm_eps: float = 1e-05
    attention_layer_norm_with_affine: bool = True
    max_sequence_length: int = 1024
    rope_theta: float | None = None  # unset: rope_parameters' or 10000.0 (take_rope_keys)
    include_qkv_bias: bool | None = False
    include_bias: bool = False
    bias_for_layer_norm: bool | None = None
    scale_logits: bool = False
    vocab_size: int = 50257
    embedding_size: int | None = 50304
    weight_tying: bool = True
    eos_token_id: int | None = 50256
    pad_token_id: int | None = 50256
    mask_token_id: int | None = 50256
    init_device: str | None = None
    init_fn: str = "normal"
    init_std: float = 0.02
    init_cutoff_factor: float | None = None
    precision: str | None = None
    use_cache: bool = False

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs):
        """``PreTrainedConfig.from_dict``, except that LLaDA-MoE's dict (its released ``config.json`` says
        ``model_type`` ``"llada"`` too; ``is_llada_moe_config``) gives an ``LLaDAMoEConfig``: ``AutoConfig`` and every
        ``from_pretrained`` load through here."""
        from ..llada_moe.configuration_llada_moe import LLaDAMoEConfig, is_llada_moe_config

        if cls is LLaDAConfig and is_llada_moe_config(config_dict):
            return LLaDAMoEConfig.from_dict(config_dict, **kwargs)
        return super().from_dict(config_dict, **kwargs)

    def __post_init__(self, **kwargs: Any):
        self.take_rope_keys(kwargs, default_theta=10000.0)
        if self.architectures is None:
            self.architectures = ["LLaDAModelLM"]
        super().__post_init__(**kwargs)
        if not hasattr(self, "auto_map"):  # TRL's create_model_from_path reads config.auto_map
            self.auto_map = {}

    @property
    def effective_n_kv_heads(self) -> int:
        if self.multi_query_attention:
            return 1
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def effective_mlp_hidden_size(self) -> int:
        return self.mlp_hidden_size if self.mlp_hidden_size is not None else self.mlp_ratio * self.d_model

    @property
    def tie_word_embeddings(self) -> bool:
        return bool(self.weight_tying)

    @tie_word_embeddings.setter
    def tie_word_embeddings(self, value) -> None:
        """Accepted and ignored, as the release's ``LLaDAModelLM`` ignores it: LLaDA ties its head by ``weight_tying``.
        A ``config.json`` may carry the generic key (transformers 4.x's ``PretrainedConfig`` kept it as a plain
        attribute, ``True`` by default), and ``from_pretrained(..., tie_word_embeddings=...)`` passes it here."""
        if value is not None and bool(value) != bool(self.weight_tying):
            logger.warning(
                f"LLaDAConfig: tie_word_embeddings={value!r} is ignored; LLaDA ties its output layer to the "
                f"embedding by weight_tying (here {self.weight_tying!r}), as the released modeling code does. Set "
                "weight_tying to change it (the checkpoint must then have, or lack, model.transformer.ff_out)."
            )
