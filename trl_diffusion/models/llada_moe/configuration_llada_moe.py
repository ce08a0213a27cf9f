"""LLaDAMoEConfig: the config of LLaDA-MoE-7B-A1B-Base / -Instruct (an OLMoE-like Qwen-style layout, full attention).

The released ``config.json`` says ``"model_type": "llada"`` like dense LLaDA's (its ``configuration_lladamoe.py`` class
is named ``LLaDAConfig``); ``LLaDAConfig``'s loading hands such dicts to this class (``is_llada_moe_config``), and
``"lladamoe"``, the ``model_type`` dllm tells its users to write instead, is registered for it too. It saves as
``"llada"``, the released value.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedConfig
from transformers.utils import logging

from ..common import UnscaledRopeConfig
from ..remote_code import CarryRemoteCodeConfig

logger = logging.get_logger(__name__)

LLADA_MOE_MASK_TOKEN_ID = 156895
"""``<|mask|>`` of the released tokenizer: the id llama.cpp's converter writes for LLaDA-MoE and inclusionAI's dInfer
samples with (the released config.json is reported not to carry a ``mask_token_id``)."""

_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts",
             "num_experts_per_tok", "rope_theta")
# fields the released modeling code reads from the config but never uses, with the values that mean what it does
_IGNORED = {
    "norm_topk_prob": (None, False),  # its sparse block hard-codes norm_topk_prob = False
    "moe_router_score_function": (None, "softmax"),  # always a softmax
    "routed_scaling_factor": (None, 1),  # never applied
    "router_num_group": (None, -2, -1, 0, 1),  # no grouped routing
    "router_topk_group": (None, -2, -1, 0, 1),
}


def is_llada_moe_config(config_dict: dict) -> bool:
    """Whether a ``config.json`` dict with ``model_type`` ``"llada"`` is LLaDA-MoE's: it has experts
    (``num_experts``) or names an MoE architecture (``LLaDAMoEModelLM``)."""
    architectures = config_dict.get("architectures") or []
    return bool(config_dict.get("num_experts")) or any("MoE" in str(a) for a in architectures)


class LLaDAMoEConfig(UnscaledRopeConfig, CarryRemoteCodeConfig, PreTrainedConfig):
    """Field names follow the released ``configuration_lladamoe.py`` (dllm's copy: ``LLaDAMoEConfig``; inclusionAI's
    dInfer copy: ``LLaDAConfig``). Its defaults are OLMoE's where they are values and ``-1`` where every
    ``config.json`` must set the field; those are ``None`` here (unset), and building a model needs them
    (``check_buildable``). Beyond the release:

    * ``moe_layer_freq`` (one entry per layer, 0 = dense MLP of ``dense_intermediate_size``, else sparse) may be
      omitted: every layer is then sparse (the released code would fail on its default ``[]``);
    * ``partial_rotary_factor`` defaults to 1.0 (the release's -1 would rotate nothing) and only 1.0 is supported;
    * ``mask_token_id`` (absent from the released config.json) defaults to ``LLADA_MOE_MASK_TOKEN_ID`` when the
      vocabulary holds it.

    The released router ignores ``norm_topk_prob``, ``moe_router_score_function``, ``routed_scaling_factor``,
    ``router_num_group`` and ``router_topk_group`` (softmax, top-k, no renormalisation, no scaling, no groups); they
    are kept, ignored as well, with a warning when they ask for something else. RoPE scaling (``rope_scaling`` or a
    ``rope_parameters`` of another rope type than ``"default"``), ``attention_bias=True`` and a ``hidden_act`` other
    than ``"silu"`` are refused; ``rope_theta`` may come from a transformers-5 ``rope_parameters``
    (``UnscaledRopeConfig``).

    ``output_router_logits`` (default ``False``, the released value): whether a forward that does not say returns the
    sparse layers' router logits and the auxiliary load-balancing loss ``aux_loss`` (the release's function,
    transformers' OLMoE ``load_balancing_loss_func``: ``moe.load_balancing_loss``; decoding never asks for them).
    ``router_aux_loss_coef`` (0.01) weighs ``aux_loss`` in a loss computed from ``labels`` (as OLMoE; the release
    computes no loss) and is the coefficient TRL's trainers (and ours) use when their ``router_aux_loss_coef`` is
    unset; a config with ``output_router_logits`` is what they take for a mixture-of-experts model.
    """

    model_type = "llada"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]  # the output field before / since transformers 5.24

    vocab_size: int | None = None
    hidden_size: int | None = None
    dense_intermediate_size: int | None = None
    expert_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    num_hidden_layers: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-05
    use_cache: bool = False
    pad_token_id: int | None = 1
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 50279
    tie_word_embeddings: bool = False
    rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    attention_bias: bool = False
    attention_dropout: float = 0.0
    clip_qkv: float | None = None
    num_experts_per_tok: int | None = None
    num_experts: int | None = None
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.01
    norm_topk_prob: bool | None = None
    qk_layernorm: bool | None = None
    moe_layer_freq: list[int] | None = None
    moe_router_enable_expert_bias: bool | None = None
    moe_router_score_function: str | None = None
    routed_scaling_factor: float | None = 1
    router_num_group: int | None = -2
    router_topk_group: int | None = -2
    mask_token_id: int | None = None

    def __post_init__(self, **kwargs: Any):
        kwargs.pop("model_type", None)  # "llada" (released) or "lladamoe" (dllm): the class attribute says "llada"
        self.take_rope_keys(kwargs, default_theta=None)  # rope_theta, or rope_parameters' (no default: required)
        head_dim = kwargs.pop("head_dim", None)  # not a field of the release (it uses hidden_size // heads)
        for field in _REQUIRED + ("dense_intermediate_size", "expert_intermediate_size"):
            if getattr(self, field) == -1:  # the released class's "unset"
                setattr(self, field, None)
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.moe_layer_freq is not None:
            self.moe_layer_freq = [int(x) for x in self.moe_layer_freq]
        if (self.mask_token_id is None and isinstance(self.vocab_size, int)
                and self.vocab_size > LLADA_MOE_MASK_TOKEN_ID):
            self.mask_token_id = LLADA_MOE_MASK_TOKEN_ID
        if self.architectures is None:
            self.architectures = ["LLaDAMoEModelLM"]
        self._check_fields()
        if head_dim is not None and self.hidden_size and self.num_attention_heads and \
                head_dim != self.hidden_size // self.num_attention_heads:
            raise ValueError(f"LLaDAMoEConfig: head_dim={head_dim} differs from hidden_size // num_attention_heads = "
                             f"{self.hidden_size // self.num_attention_heads}, the head size LLaDA-MoE uses.")
        ignored = {k: getattr(self, k) for k, neutral in _IGNORED.items() if getattr(self, k) not in neutral}
        if ignored:
            logger.warning_once(
                f"LLaDAMoEConfig: {ignored} are ignored, as LLaDA-MoE's released modeling code ignores them: the "
                "router takes the softmax of its logits (+ expert_bias), the top-k, no renormalisation, no scaling."
            )
        super().__post_init__(**kwargs)
        if not hasattr(self, "auto_map"):  # TRL's create_model_from_path reads config.auto_map
            self.auto_map = {}

    @property
    def head_dim(self) -> int | None:
        """``hidden_size // num_attention_heads``, the released attention's head size (not a config.json field)."""
        if self.hidden_size is None or self.num_attention_heads is None:
            return None
        return self.hidden_size // self.num_attention_heads

    def layer_is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a mixture-of-experts layer (``moe_layer_freq[i] != 0``; all of them when
        ``moe_layer_freq`` is unset), else it has the dense MLP."""
        return self.moe_layer_freq is None or self.moe_layer_freq[layer_idx] != 0

    def check_buildable(self) -> None:
        """Raise unless a model can be built: every size set, and consistent."""
        missing = [f for f in _REQUIRED if getattr(self, f) is None]
        if missing:
            raise ValueError(f"LLaDAMoEConfig: {missing} are not set; every LLaDA-MoE config.json sets them.")
        for field, needed in (("expert_intermediate_size", True), ("dense_intermediate_size", False)):
            if any(self.layer_is_sparse(i) == needed for i in range(self.num_hidden_layers)) and \
                    getattr(self, field) is None:
                raise ValueError(f"LLaDAMoEConfig: {field} is not set, and the layers of moe_layer_freq = "
                                 f"{self.moe_layer_freq} need it.")
        self._check_fields()

    def _check_fields(self) -> None:
        """The checks whose fields are set (a default config, all sizes unset, passes)."""
        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for field in _REQUIRED[:-1] + ("dense_intermediate_size", "expert_intermediate_size", "num_key_value_heads"):
            value = getattr(self, field)
            if value is not None and (not integer(value) or value < 1):
                raise ValueError(f"LLaDAMoEConfig.{field} must be a positive integer, got {value!r}.")
        shared = self.shared_expert_intermediate_size
        if shared is not None and (not integer(shared) or shared < 1):
            raise ValueError(f"LLaDAMoEConfig.shared_expert_intermediate_size must be null (no shared expert) or a "
                             f"positive integer, got {shared!r}.")
        if self.hidden_act != "silu":
            raise ValueError(f"LLaDAMoEConfig: only hidden_act='silu' is supported, got {self.hidden_act!r}.")
        if self.attention_bias:
            raise ValueError("LLaDAMoEConfig: attention_bias=True is not supported (the released checkpoints have "
                             "no attention biases).")
        if self.partial_rotary_factor != 1:
            raise ValueError(f"LLaDAMoEConfig: partial_rotary_factor={self.partial_rotary_factor!r} is not supported; "
                             "RoPE rotates whole heads (1.0), as in the released checkpoints.")
        if self.clip_qkv is not None and not self.clip_qkv > 0:
            raise ValueError(f"LLaDAMoEConfig.clip_qkv must be null or positive, got {self.clip_qkv!r}.")
        heads, kv_heads, hidden = self.num_attention_heads, self.num_key_value_heads, self.hidden_size
        if hidden is not None and heads is not None and hidden % heads:
            raise ValueError(f"LLaDAMoEConfig: hidden_size ({hidden}) must be divisible by num_attention_heads "
                             f"({heads}).")
        if heads is not None and kv_heads is not None and heads % kv_heads:
            raise ValueError(f"LLaDAMoEConfig: num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads}).")
        if self.num_experts is not None and self.num_experts_per_tok is not None and \
                not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"LLaDAMoEConfig.num_experts_per_tok must be in [1, num_experts = {self.num_experts}], "
                             f"got {self.num_experts_per_tok!r}.")
        if self.moe_layer_freq is not None and self.num_hidden_layers is not None and \
                len(self.moe_layer_freq) < self.num_hidden_layers:
            raise ValueError(f"LLaDAMoEConfig.moe_layer_freq has {len(self.moe_layer_freq)} entries for "
                             f"{self.num_hidden_layers} layers (one per layer: 0 = dense MLP, 1 = mixture of "
                             "experts).")
