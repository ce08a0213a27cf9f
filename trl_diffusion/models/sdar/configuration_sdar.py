"""SDARConfig: the config of SDAR-*-Chat and TraDo-* (Qwen3 layout, block-causal attention)."""

from __future__ import annotations

from transformers import PreTrainedConfig

from ..common import UnscaledRopeConfig
from ..remote_code import CarryRemoteCodeConfig


class SDARConfig(UnscaledRopeConfig, CarryRemoteCodeConfig, PreTrainedConfig):
    """Field names and defaults follow the released ``configuration_sdar.py`` (the Qwen3 config of transformers
    4.52); ``block_size``, ``mask_token_id`` and ``fuse_cross_entropy`` come from the released ``config.json``.
    ``fuse_cross_entropy`` (released: ``True``) switches the released modeling's fused linear + cross-entropy training
    loss, and that code reads it on every forward, so a config built here must have it; our model ignores it. Other
    released extras (``debug``, ``ep_size``, ``micro_forward``, ``skip_checkpoint``, ``use_deepep``) are accepted and
    kept as attributes. ``rope_theta`` (default 10000.0) may come from a transformers-5
    ``rope_parameters`` instead; RoPE scaling is refused (``UnscaledRopeConfig``)."""

    model_type = "sdar"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the output field before / since transformers 5.24

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_theta: float | None = None  # unset: rope_parameters' or 10000.0 (take_rope_keys)
    attention_bias: bool = False
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    attention_dropout: float = 0.0
    block_size: int = 4
    mask_token_id: int | None = None
    fuse_cross_entropy: bool = True  # read by the released modeling only
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.take_rope_keys(kwargs, default_theta=10000.0)
        self.check_buildable()
        super().__post_init__(**kwargs)
        if not hasattr(self, "auto_map"):  # TRL's create_model_from_path reads config.auto_map
            self.auto_map = {}

    def check_buildable(self) -> None:
        """Raise unless a model can be built from this config. Run by the config and again by the model:
        ``from_pretrained``'s keyword arguments are set after the config's own checks."""
        block_size_of(self)
        if self.attention_bias:
            raise ValueError(f"{type(self).__name__}: attention_bias=True is not supported (released SDAR has no "
                             "biases).")


def block_size_of(config: SDARConfig) -> int:
    """``config.block_size``, checked where it is read (the config can be edited after it was built): ``None`` would
    read as full attention, a different model, silently."""
    size = config.block_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"{type(config).__name__}.block_size must be a positive integer (the attention block of a "
                         f"block-causal model), got {size!r}.")
    return size
