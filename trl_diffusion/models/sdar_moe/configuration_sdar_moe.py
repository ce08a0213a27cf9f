"""SDARMoeConfig: the config of SDAR-30B-A3B-Chat / SDAR-30B-A3B-Sci (Qwen3-MoE layout, block-causal attention)."""

from __future__ import annotations

from ..sdar.configuration_sdar import SDARConfig


class SDARMoeConfig(SDARConfig):
    """SDAR's config plus the mixture-of-experts fields the released ``modeling_sdar_moe.py`` reads (it is transformers
    4.52.4's Qwen3-MoE modeling made block-causal, with ``model_type`` ``"sdar_moe"``): ``num_experts``,
    ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``, ``decoder_sparse_step``,
    ``mlp_only_layers`` and ``router_aux_loss_coef``, with Qwen3-MoE's names and defaults, as are the dense-field
    defaults (the released ``config.json`` files set every field); ``head_dim`` defaults to
    ``hidden_size // num_attention_heads`` as the Qwen3-MoE code reads it.

    Layer ``i`` is sparse (router ``mlp.gate`` + experts ``mlp.experts.{E}.*`` of width ``moe_intermediate_size``)
    when ``i`` is not in ``mlp_only_layers``, ``num_experts > 0`` and ``(i + 1) % decoder_sparse_step == 0``; the
    other layers have the dense MLP of width ``intermediate_size``.

    ``output_router_logits`` (default ``False``, the released value) is Qwen3-MoE's: whether a forward that does not
    say returns the sparse layers' router logits and the auxiliary load-balancing loss ``aux_loss``
    (``moe.load_balancing_loss``; decoding never asks for them). ``router_aux_loss_coef`` (0.001) weighs ``aux_loss``
    in a loss computed from ``labels``, as in Qwen3-MoE, and is the coefficient TRL's trainers (and ours) use when
    their ``router_aux_loss_coef`` is unset; a config with ``output_router_logits`` is what they take for a
    mixture-of-experts model.
    """

    model_type = "sdar_moe"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 4
    head_dim: int | None = None
    decoder_sparse_step: int = 1
    moe_intermediate_size: int = 768
    num_experts_per_tok: int = 8
    num_experts: int = 128
    norm_topk_prob: bool = False
    output_router_logits: bool = False
    router_aux_loss_coef: float = 0.001
    mlp_only_layers: list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.mlp_only_layers = [] if self.mlp_only_layers is None else list(self.mlp_only_layers)
        super().__post_init__(**kwargs)  # SDARConfig's checks, and check_buildable's MoE ones

    def check_buildable(self) -> None:
        super().check_buildable()
        self._check_moe_fields()

    def _check_moe_fields(self) -> None:
        def integer(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not integer(self.num_experts) or self.num_experts < 0:
            raise ValueError(f"SDARMoeConfig.num_experts must be an integer >= 0, got {self.num_experts!r}.")
        if not integer(self.decoder_sparse_step) or self.decoder_sparse_step < 1:
            raise ValueError(f"SDARMoeConfig.decoder_sparse_step must be a positive integer, got "
                             f"{self.decoder_sparse_step!r}.")
        bad = [i for i in self.mlp_only_layers if not integer(i) or not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"SDARMoeConfig.mlp_only_layers holds {bad}, not layer indices in "
                             f"[0, {self.num_hidden_layers}).")
        if not any(self.layer_is_sparse(i) for i in range(self.num_hidden_layers)):
            return
        if not integer(self.num_experts_per_tok) or not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"SDARMoeConfig.num_experts_per_tok must be an integer in [1, num_experts = "
                             f"{self.num_experts}], got {self.num_experts_per_tok!r}.")
        if not integer(self.moe_intermediate_size) or self.moe_intermediate_size < 1:
            raise ValueError(f"SDARMoeConfig.moe_intermediate_size must be a positive integer, got "
                             f"{self.moe_intermediate_size!r}.")

    def layer_is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` is a mixture-of-experts layer (else it has the dense MLP)."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)
