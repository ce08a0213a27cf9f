"""DreamConfig: the config of Dream-v0-*-7B and DiffuCoder-7B-* (Qwen2 layout, full attention)."""

from __future__ import annotations

from transformers import PreTrainedConfig

from ..common import UnscaledRopeConfig
from ..remote_code import CarryRemoteCodeConfig


class DreamConfig(UnscaledRopeConfig, CarryRemoteCodeConfig, PreTrainedConfig):
    """Field names and defaults follow the released ``configuration_dream.py``. ``model_type`` is ``"Dream"``
    (capital D) as in the released ``config.json``. ``rope_theta`` (default 10000.0) may come from a transformers-5
    ``rope_parameters`` instead; RoPE scaling is refused (``UnscaledRopeConfig``)."""

    model_type = "Dream"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the output field before / since transformers 5.24

    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = False
    tie_word_embeddings: bool = False
    rope_theta: float | None = None  # unset: rope_parameters' or 10000.0 (take_rope_keys)
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    attention_dropout: float = 0.0
    mask_token_id: int | None = 151666
    pad_token_id: int | None = 151643
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if not self.use_sliding_window:
            self.sliding_window = None
        self.take_rope_keys(kwargs, default_theta=10000.0)
        super().__post_init__(**kwargs)
        if not hasattr(self, "auto_map"):  # TRL's create_model_from_path reads config.auto_map
            self.auto_map = {}
