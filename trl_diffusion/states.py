"""Blocks, trajectories, states and attention masks: the one source of truth.

A diffusion rollout is a *trajectory*: for every generated position, the index of the denoising step at which
its token was committed (``unmask_step``; -1 for prompt and padding, and for generated positions the sampler
never committed). The *state before step t* shows every token committed before ``t`` and the mask token at
every other generated position. The sampler walks these states forward and every trainer scores tokens given
one of them, so block alignment, states and masks live here and nowhere else.

Block alignment follows each family's published sampler:

* block-causal models (SDAR / TraDo) align blocks from absolute position 0, because their attention is
  block-causal in absolute positions;
* full-attention models (LLaDA, Dream) align blocks from the end of the prompt.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import numbers
import re
import types
import typing
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

NOT_COMMITTED = -1
"""``unmask_step`` value of prompt, padding and never-committed positions."""


def block_index(position_ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block of each position for block-causal attention (blocks aligned from absolute position 0)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}.")
    return torch.div(position_ids, block_size, rounding_mode="floor")


def attention_mask_from_positions(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None = None,
    block_size: int | None = None,
) -> torch.Tensor:
    """Boolean attention mask ``[B, 1, Q, K]`` (True = may attend).

    With ``block_size`` a query sees keys in its own block and earlier blocks (block-causal, blocks from
    absolute position 0); without it every query sees every key (full bidirectional). ``key_valid`` ``[B, K]``
    hides padding keys. A query row left with no visible key (a padding query) is opened to every key so that
    attention stays finite; its output is never used.
    """
    batch = max(query_positions.shape[0], key_positions.shape[0])
    q_len, k_len = query_positions.shape[-1], key_positions.shape[-1]
    if block_size is None:
        mask = torch.ones(batch, 1, q_len, k_len, dtype=torch.bool, device=query_positions.device)
    else:
        q_block = block_index(query_positions, block_size)[:, None, :, None]
        k_block = block_index(key_positions, block_size)[:, None, None, :]
        mask = (k_block <= q_block).expand(batch, 1, q_len, k_len)
    if key_valid is not None:
        mask = mask & key_valid.bool()[:, None, None, :]
    empty_rows = ~mask.any(dim=-1, keepdim=True)
    return mask | empty_rows


def positions_from_padding(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that count real tokens only (left padding gets position 0), so a padded row is placed
    exactly as it would be alone."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def left_pad(rows: list[list[int]], pad_id: int = 0,
             device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` for token-id rows of different lengths, left-padded with ``pad_id``: the
    layout ``generate`` takes (every row's last token in the last column)."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(row)) + list(row) for row in rows], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], dtype=torch.long, device=device)
    return ids, mask


def through_first_stop(ids: torch.Tensor, valid: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """``valid`` ``[B, L]`` less every column after the first valid stop token of its row (``stop_ids``: a 1-D
    tensor of ids); the stop token itself stays. How a completion is cut where its answer ends."""
    is_stop = torch.isin(ids, stop_ids) & valid
    return valid & ((is_stop.long().cumsum(-1) - is_stop.long()) == 0)


def state_before_step(
    sequences: torch.Tensor,
    unmask_step: torch.Tensor,
    generated: torch.Tensor,
    step: int | torch.Tensor,
    mask_token_id: int,
) -> torch.Tensor:
    """The sequence as the sampler saw it just before ``step``.

    ``generated`` marks positions that belong to the generated canvas (not prompt, not left padding). A
    generated position is visible iff it was committed at a step earlier than ``step``; generated positions the
    sampler never committed (``unmask_step == -1``) are masks in every state.
    """
    step = torch.as_tensor(step, device=sequences.device)
    if step.dim() == 1:
        step = step[:, None]
    visible = (unmask_step >= 0) & (unmask_step < step)
    hidden = generated & ~visible
    return torch.where(hidden, torch.full_like(sequences, mask_token_id), sequences)


def step_groups(
    unmask_step: torch.Tensor, shrinkage: int, blocks: torch.Tensor | None = None
) -> torch.Tensor:
    """Group id of every position (-1 where nothing was committed); ids are increasing in denoising order.

    ``shrinkage`` consecutive distinct steps form a group; with ``blocks`` (block index per position) a group
    never spans two blocks. With ``shrinkage=1`` every step is its own group (exact per-step scoring). Groups of a
    row are numbered by their first step (ties: lower block first). Vectorised over the batch (no Python loop).
    """
    if shrinkage < 1:
        raise ValueError(f"shrinkage must be >= 1, got {shrinkage}.")
    committed = unmask_step >= 0
    groups = torch.full_like(unmask_step, NOT_COMMITTED)
    if not bool(committed.any()):
        return groups
    device = unmask_step.device
    rows = torch.arange(unmask_step.shape[0], device=device)[:, None].expand_as(unmask_step)[committed]
    steps = unmask_step[committed]
    block = blocks[committed] if blocks is not None else torch.zeros_like(steps)
    n_steps, n_blocks = int(steps.max()) + 1, int(block.max()) + 1
    # distinct (row, block, step) triples, sorted, and the rank of each step among its block's distinct steps
    triples, triple_of = torch.unique((rows * n_blocks + block) * n_steps + steps, return_inverse=True)
    row_block = torch.div(triples, n_steps, rounding_mode="floor")
    rank = _rank_in_run(row_block)
    # `shrinkage` consecutive steps of a block form a group; a group's order key is its first step
    merged, group_of = torch.unique(row_block * n_steps + rank // shrinkage, return_inverse=True)
    first = torch.full_like(merged, n_steps).scatter_reduce(0, group_of, triples % n_steps, reduce="amin")
    group_row = torch.div(merged, n_steps * n_blocks, rounding_mode="floor")
    order = torch.argsort((group_row * n_steps + first) * len(merged) + torch.arange(len(merged), device=device))
    group_id = torch.empty_like(order)
    group_id[order] = _rank_in_run(group_row[order])
    groups[committed] = group_id[group_of[triple_of]]
    return groups


def _rank_in_run(keys: torch.Tensor) -> torch.Tensor:
    """Index of every element inside its run of equal consecutive ``keys`` (0, 1, 2, ... restarting per run)."""
    index = torch.arange(len(keys), device=keys.device)
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = keys[1:] != keys[:-1]
    return index - torch.cummax(torch.where(starts, index, 0), 0).values


def completion_blocks(prompt_mask: torch.Tensor, width: int, block_size: int | None) -> torch.Tensor | None:
    """Block index of every completion column of ``[left-padded prompt | width completion columns]`` (blocks from
    each row's absolute position 0, as the sampler aligns them), or None for full attention."""
    if block_size is None:
        return None
    completion = torch.ones(prompt_mask.shape[0], width, dtype=torch.bool, device=prompt_mask.device)
    positions = positions_from_padding(torch.cat([prompt_mask.bool(), completion], dim=1))
    return block_index(positions[:, prompt_mask.shape[1]:], block_size)


def trajectory_groups(
    unmask_step: torch.Tensor, prompt_mask: torch.Tensor, shrinkage: int, block_size: int | None
) -> torch.Tensor:
    """Merged-step group of every completion column of ``[left-padded prompt | canvas]`` rollouts: ``step_groups``
    within the blocks the sampler used (``block_size``; None = full attention, merged over the whole response).
    The trajectory estimator, TraceRL's loss weights and the value model all group states through this."""
    return step_groups(unmask_step, shrinkage, completion_blocks(prompt_mask, unmask_step.shape[1], block_size))


class CanvasLayout:
    """Where each row's prompt and generated tokens sit in the sampler's working canvas, and its blocks.

    Block-causal models: a row's blocks are aligned from its own position 0, so rows are left-padded by whole
    blocks such that every row's first generation block (which also holds the row's prompt tail) falls on the
    same canvas columns; a row generates up to the end of the block holding its last new token. Full-attention
    models: rows are left-padded to the longest prompt and blocks start at the end of the prompt.
    """

    def __init__(self, prompt_lengths: list[int], max_new_tokens: int, block_length: int, block_causal: bool):
        if block_length <= 0:
            raise ValueError(f"block_length must be positive, got {block_length}.")
        self.block_length = block_length
        self.block_causal = block_causal
        b = block_length
        if block_causal:
            first_block = max(p // b for p in prompt_lengths)
            self.left_pad = [b * (first_block - p // b) for p in prompt_lengths]
            self.gen_end = [-(-(p + max_new_tokens) // b) * b + pad for p, pad in zip(prompt_lengths, self.left_pad)]
            self.prefill_end = first_block * b
            self.block_starts = list(range(first_block * b, max(self.gen_end), b))
        else:
            width = max(prompt_lengths)
            self.left_pad = [width - p for p in prompt_lengths]
            self.gen_end = [width + max_new_tokens] * len(prompt_lengths)
            self.prefill_end = width
            self.block_starts = list(range(width, width + max_new_tokens, b))
        self.gen_start = [pad + p for pad, p in zip(self.left_pad, prompt_lengths)]
        self.width = max(self.gen_end)

    def block_end(self, start: int) -> int:
        return min(start + self.block_length, self.width)

    def row_positions(self) -> list[int]:
        """The positions each row takes (prompt + its generation, a block model's rounded up to whole blocks): what
        the model's ``max_position_embeddings`` must hold; a row's own, whatever the other rows."""
        return [end - pad for end, pad in zip(self.gen_end, self.left_pad)]

    def masks(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``generated`` (positions the sampler fills) and ``valid`` (prompt or generated) ``[B, width]``."""
        cols = torch.arange(self.width, device=device)
        pad = torch.tensor(self.left_pad, device=device)[:, None]
        start = torch.tensor(self.gen_start, device=device)[:, None]
        end = torch.tensor(self.gen_end, device=device)[:, None]
        generated = (cols >= start) & (cols < end)
        valid = (cols >= pad) & (cols < end)
        return generated, valid

    def positions(self, device) -> torch.Tensor:
        """Each column's position in its row (0 at the row's first prompt token; 0 on padding)."""
        cols = torch.arange(self.width, device=device)
        return (cols - torch.tensor(self.left_pad, device=device)[:, None]).clamp(min=0)


# ----------------------------------------------------------------------------------------------------------
# Training layouts: the masks and block partitions the SFT objectives score under
# ----------------------------------------------------------------------------------------------------------


CLEAN = -1
"""``AttentionLayout.copy`` value of a clean token (one that belongs to no noisy copy)."""

ATTENTION_BACKENDS = ("auto", "sdpa", "flex")


def may_attend(
    q_block: torch.Tensor,
    q_copy: torch.Tensor,
    k_block: torch.Tensor,
    k_copy: torch.Tensor,
    k_valid: torch.Tensor,
    same_document: torch.Tensor | bool = True,
) -> torch.Tensor:
    """The one attention rule of every training layout (elementwise, broadcastable; True = may attend).

    Clean tokens (``copy == CLEAN``) are block-causal among themselves and never see a noisy copy. A token of a
    noisy copy sees its own copy and the clean tokens of strictly earlier blocks. Invalid (padding) keys are
    hidden, and so are keys of another document of a packed row (``same_document``). With every token clean and
    in block 0 this is plain full attention over the valid keys.
    """
    clean_q, clean_k = q_copy == CLEAN, k_copy == CLEAN
    clean_to_clean = clean_q & clean_k & (k_block <= q_block)
    copy_to_clean = ~clean_q & clean_k & (k_block < q_block)
    within_copy = ~clean_q & (k_copy == q_copy)
    return (clean_to_clean | copy_to_clean | within_copy) & k_valid & same_document


@dataclass
class AttentionLayout:
    """Per-token description of a (packed) training row from which its attention mask follows (``may_attend``).

    ``block`` ``[B, N]``: block index (0 everywhere for full attention); ``copy`` ``[B, N]``: ``CLEAN`` or the id
    of the noisy copy the token belongs to; ``valid`` ``[B, N]``: real token (False = padding); ``document``
    ``[B, N]`` (packed rows only, None otherwise): which document of the row the token belongs to, no token
    seeing another document's. Keeping the layout, not an ``N x N`` mask, lets the mask be built either dense
    (SDPA) or as a flex-attention ``BlockMask`` that never materialises it.
    """

    block: torch.Tensor
    copy: torch.Tensor
    valid: torch.Tensor
    document: torch.Tensor | None = None

    @classmethod
    def plain(cls, positions: torch.Tensor, valid: torch.Tensor, block_size: int | None,
              documents: torch.Tensor | None = None) -> AttentionLayout:
        """One clean row: block-causal (blocks from each document's position 0) or, without ``block_size``, full
        (within each document of a packed row)."""
        block = block_index(positions, block_size) if block_size is not None else torch.zeros_like(positions)
        return cls(block, torch.full_like(positions, CLEAN), valid.bool(), documents)

    def rows(self, first: int, last: int) -> AttentionLayout:
        """The layout of rows ``first:last``."""
        document = None if self.document is None else self.document[first:last]
        return AttentionLayout(self.block[first:last], self.copy[first:last], self.valid[first:last], document)

    def dense(self) -> torch.Tensor:
        """Boolean mask ``[B, 1, N, N]``; padding queries are opened to every key (finite, never read)."""
        full = self.document is None and self.block.device.type == "cpu"  # the checks would sync a GPU
        if full and bool((self.copy == CLEAN).all()) and bool((self.block == 0).all()):
            # plain full attention (LLaDA / Dream states): the rule reduces to "the key is real", one [N, N] op
            return (self.valid[:, None, :] | ~self.valid[:, :, None])[:, None]
        same = True if self.document is None else self.document[:, :, None] == self.document[:, None, :]
        mask = may_attend(self.block[:, :, None], self.copy[:, :, None], self.block[:, None, :],
                          self.copy[:, None, :], self.valid[:, None, :], same)
        return (mask | ~self.valid[:, :, None])[:, None]

    def block_mask(self):
        """The same rule as a flex-attention ``BlockMask`` (built block-sparse, compiled on CUDA). Padding queries
        see nothing (flex attention returns zeros for them), so blocks of padding are skipped."""
        from torch.nn.attention.flex_attention import create_block_mask

        block, copy, valid, document = self.block, self.copy, self.valid, self.document

        def mask_mod(b, h, q, k):
            same = True if document is None else document[b, q] == document[b, k]
            return may_attend(block[b, q], copy[b, q], block[b, k], copy[b, k], valid[b, k], same) & valid[b, q]

        batch, length = block.shape
        return create_block_mask(mask_mod, batch, None, length, length, device=block.device,
                                 _compile=block.device.type == "cuda")

    def attention_mask(self, backend: str = "auto"):
        """The mask the model reads: a ``BlockMask`` for ``flex``, the dense boolean mask for ``sdpa``. Scorers
        resolve ``auto`` with the model's facts first (``resolve_model_attention_backend``); here, without them,
        ``auto`` is SDPA."""
        if resolve_attention_backend(backend, self.block.device) == "flex":
            return self.block_mask()
        return self.dense()


def check_attention_backend(backend: str) -> None:
    """Raise a clear error for a name not in ``ATTENTION_BACKENDS`` (configs call it at construction)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}.")


@dataclass(frozen=True)
class FieldKind:
    """What a config field's annotation allows: a ``bool`` / ``int`` / ``float`` (``scalar``), optionally ``None``,
    optionally a list of them."""

    scalar: type
    optional: bool = False
    listed: bool = False

    def admits(self, value: object) -> bool:
        """Whether ``value`` fits: bool is not an int, an int is a float, a list field takes a list or tuple."""
        if value is None:
            return self.optional
        if self.listed:
            return isinstance(value, (list, tuple)) and all(self._admits_scalar(item) for item in value)
        return self._admits_scalar(value)

    def _admits_scalar(self, value: object) -> bool:
        if self.scalar is bool:
            return isinstance(value, bool)
        kind = numbers.Integral if self.scalar is int else numbers.Real
        return isinstance(value, kind) and not isinstance(value, bool)

    def __str__(self) -> str:
        name = self.scalar.__name__
        text = f"a list of {name}" if self.listed else f"{'an' if name == 'int' else 'a'} {name}"
        return text + (" or None" if self.optional else "")


def field_kind(annotation: object) -> FieldKind | None:
    """The ``FieldKind`` of a resolved annotation (``bool``, ``int``, ``float``, ``X | None``, ``list[X]``,
    ``list[X] | None``), or None for any other annotation (strings, dicts, unions of several types)."""
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(members) != 1:
            return None
        optional, annotation = True, members[0]
    listed = typing.get_origin(annotation) is list
    if listed:
        (annotation,) = typing.get_args(annotation) or (None,)
    if annotation not in (bool, int, float):
        return None
    return FieldKind(annotation, optional, listed)


@functools.cache
def own_field_kinds(cls: type, base: type | None = None) -> dict[str, FieldKind]:
    """The ``FieldKind`` of every bool / int / float field that dataclass ``cls`` or a class between it and ``base``
    (a TRL config it extends; None = no base) declares, including base fields it redeclares (e.g. TraceRL's ``beta``
    with its own default)."""
    ours = cls.__mro__[: cls.__mro__.index(base)] if base is not None else cls.__mro__
    declared = set().union(*(vars(klass).get("__annotations__", {}) for klass in ours))
    hints = typing.get_type_hints(cls)
    kinds = {f.name: field_kind(hints[f.name]) for f in dataclasses.fields(cls) if f.name in declared}
    return {name: kind for name, kind in kinds.items() if kind is not None}


def check_field_types(config: object, base: type | None = None) -> None:
    """Raise a ValueError naming the field, the value and the expected type for a value of one of ``config``'s own
    fields (see ``own_field_kinds``) that does not match its annotation: ``mask_eps="1e-3"``,
    ``value_batch_size=64.0`` or ``truncate_at_eos="false"`` would otherwise fail late or misbehave silently.
    Configs call it in ``__post_init__``; the command line and config files convert values before."""
    for name, kind in own_field_kinds(type(config), base).items():
        value = getattr(config, name)
        if not kind.admits(value):
            raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__}).")


def check_chat_template_kwargs(value: dict | str | None) -> dict | None:
    """``chat_template_kwargs`` as ``GRPOConfig`` takes it (keyword arguments of ``apply_chat_template``, e.g.
    ``{"enable_thinking": False}`` for the Qwen3 template of SDAR / TraDo): a dict, or on the command line a JSON
    object. Anything else is refused here, not as a TypeError inside the first chat-template call."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"chat_template_kwargs must be a JSON object, got {value!r} ({exc.msg}).") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"chat_template_kwargs must be a dict (a JSON object on the command line), got {value!r}.")
    reserved = sorted(set(value or {}) & _CHAT_TEMPLATE_CALL_ARGUMENTS)
    if reserved:
        raise ValueError(f"chat_template_kwargs sets {reserved}, which the trainers and eval pass to "
                         "apply_chat_template themselves (a prompt ends with the generation prompt, as text); give "
                         "only the template's own variables, e.g. {'enable_thinking': False}.")
    return value


_CHAT_TEMPLATE_CALL_ARGUMENTS = frozenset({"conversation", "messages", "add_generation_prompt", "tokenize",
                                           "return_dict", "return_tensors", "chat_template", "tools",
                                           "continue_final_message"})
"""``apply_chat_template`` arguments the callers set themselves (TRL too), or that change what the call returns."""


def max_positions(config) -> int | None:
    """The positions a model can attend over (SDAR / Dream ``max_position_embeddings``, LLaDA
    ``max_sequence_length``), None when the config names none."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "max_sequence_length", None)


def check_block_size_applies(name: str, value: int | None, model_block_size: int | None) -> None:
    """Refuse a configured block size (the field ``name``) for a full-attention model (``model_block_size`` None:
    LLaDA, Dream), which trainers score and train without blocks, so that the value would be silently ignored."""
    if value is not None and model_block_size is None:
        raise ValueError(f"{name}={value} was set, but the model has full attention (LLaDA / Dream: no blocks to "
                         f"train or score with); leave {name} at None.")


def check_no_liger_kernel(use_liger_kernel: bool) -> None:
    """Refuse ``use_liger_kernel`` (configs call it at construction): Liger has no kernels for these model types,
    so it would patch nothing, and the diffusion losses compute their own log-softmax."""
    if use_liger_kernel:
        raise ValueError("use_liger_kernel=True is not supported: Liger has no kernels for the sdar / llada / Dream "
                         "model types, so it would patch nothing, and the diffusion losses compute their own "
                         "log-softmax. Set use_liger_kernel=False.")


def check_max_steps(max_steps: int) -> None:
    """Refuse ``max_steps=0`` (configs call it at construction): transformers' ``Trainer`` does not read it as "no
    training" but still runs one optimizer step and saves the result; -1 means "train for ``num_train_epochs``"."""
    if max_steps == 0:
        raise ValueError("max_steps=0 would still run one optimizer step (transformers' Trainer stops only after a "
                         "step); pass max_steps >= 1, or -1 to train for num_train_epochs.")


def take_checkpointing_old_name(args) -> None:
    """Before transformers' ``__post_init__``: where ``TrainingArguments`` has ``activation_checkpointing`` (5.23 on),
    a ``gradient_checkpointing`` set while the new name is unset moves to the new name. transformers then reads it
    as it would have (it reads the old name only while the new one is unset), without its FutureWarning, which
    otherwise came with every config built: TRL 1.16 sets the old name's default (True) on ``GRPOConfig``,
    ``SFTConfig`` and its base config, and the shipped recipes set the old name, which transformers before 5.23 (also
    supported) needs."""
    if getattr(args, "activation_checkpointing", None) is None and hasattr(args, "activation_checkpointing"):
        if args.gradient_checkpointing is not None:
            args.activation_checkpointing, args.gradient_checkpointing = args.gradient_checkpointing, None


def check_optimization_numbers(args) -> None:
    """Refuse, when a config is built, the optimisation numbers transformers takes unchecked: a ``learning_rate``
    that is infinite made every weight NaN after the first step while the logged loss looked fine (NaN and negative
    ones failed only inside ``train()``); batch sizes and accumulation steps below 1 failed later, or in ways that
    did not name the field; a NaN ``weight_decay`` or Adam number made the weights NaN, a NaN ``max_grad_norm`` turned
    clipping off."""
    rate = args.learning_rate
    if isinstance(rate, bool) or not isinstance(rate, numbers.Real) or not (math.isfinite(rate) and rate >= 0):
        raise ValueError(f"learning_rate must be a finite number >= 0, got {rate!r}.")
    args.learning_rate = float(rate)  # a numpy scalar would not serialise with the arguments and trainer state
    # a NaN or infinite weight decay or Adam number makes the weights NaN; a NaN max_grad_norm silently turns clipping
    # off (NaN > 0 is False), an infinite one is transformers' own "no clipping"
    for name in ("max_grad_norm", "weight_decay", "adam_epsilon", "adam_beta1", "adam_beta2"):
        value = getattr(args, name)
        if value is None or (name == "max_grad_norm" and value == math.inf):
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"{name} must be a finite number{' (or inf: no clipping)' * (name == 'max_grad_norm')}, "
                             f"got {value!r}.")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        setattr(args, name, int(value))


FLEX_MIN_TORCH = (2, 5)
"""First torch release whose flex attention takes a ``BlockMask`` with grouped-query heads (``enable_gqa``)."""
FLEX_MIN_HEAD_DIM = 16
"""torch's compiled (Triton) flex-attention kernel rejects smaller heads: ``tl.dot`` needs an inner size >= 16."""
FLEX_AUTO_HEAD_DIMS = (64, 128, 256)
FLEX_AUTO_DTYPES = (torch.bfloat16, torch.float16)
"""What ``auto`` picks compiled flex attention for on CUDA: half-precision activations and these head sizes (the
released SDAR / TraDo models have head_dim 128). Compiling a smaller head in float32 was seen to fail ("No choices
to select", the embedded tiny model: head_dim 32), so everything outside this set runs SDPA under ``auto``."""


@dataclass(frozen=True)
class AttentionFacts:
    """What decides which attention kernel can run a model's training forwards: the device type, the head size
    and the dtype attention runs in (None = unknown)."""

    device_type: str
    head_dim: int | None = None
    dtype: torch.dtype | None = None


def attention_facts(model, device=None) -> AttentionFacts:
    """The ``AttentionFacts`` of ``model`` (any of our models, or a wrapper that forwards ``config``/``dtype``):
    head size from its config, device from its weights unless given, dtype from its weights. The weights' dtype, not
    an autocast one: under bf16 autocast a float32 model's normalised queries stay float32 (SDPA casts them, flex
    does not)."""
    model = getattr(model, "module", model)  # DistributedDataParallel and friends
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    device_type = torch.device(device if device is not None else next(model.parameters()).device).type
    return AttentionFacts(device_type, int(head_dim), model.dtype)


def _torch_release(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def flex_attention_problem(facts: AttentionFacts, torch_version: str | None = None) -> tuple[str | None, bool]:
    """Why compiled flex attention should not run with ``facts``: ``(reason, fatal)``; ``(None, False)`` when it
    is the verified choice. ``fatal`` means it cannot run at all (an explicit ``"flex"`` is an error); otherwise it
    is unverified (``auto`` avoids it, an explicit ``"flex"`` is tried). Pure: depends only on its arguments."""
    version = torch_version or torch.__version__
    if _torch_release(version) < FLEX_MIN_TORCH:
        needed = ".".join(map(str, FLEX_MIN_TORCH))
        return f"torch {version} has no flex attention with grouped-query heads (needs >= {needed})", True
    if facts.device_type != "cuda":
        return f"flex attention is compiled only on CUDA (device: {facts.device_type})", False
    if facts.head_dim is None or facts.dtype is None:
        return "the model's head size and dtype are unknown", False
    if facts.head_dim < FLEX_MIN_HEAD_DIM:
        return (f"torch's compiled flex attention needs head_dim >= {FLEX_MIN_HEAD_DIM} (the model has "
                f"{facts.head_dim})"), True
    if facts.head_dim not in FLEX_AUTO_HEAD_DIMS or facts.dtype not in FLEX_AUTO_DTYPES:
        dtypes = "/".join(str(d).removeprefix("torch.") for d in FLEX_AUTO_DTYPES)
        return (f"compiled flex attention is verified for head_dim in {FLEX_AUTO_HEAD_DIMS} with {dtypes} "
                f"activations; the model has head_dim {facts.head_dim} in {str(facts.dtype).removeprefix('torch.')} "
                "(a float32 head_dim-32 model failed to compile: 'No choices to select')"), False
    return None, False


def resolve_attention_backend(
    backend: str,
    device,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    *,
    training: bool | None = None,
    torch_version: str | None = None,
) -> str:
    """The kernel that runs: ``"flex"`` or ``"sdpa"``; the one place this is decided.

    ``auto`` takes compiled flex attention (block-sparse, no dense mask) on CUDA when ``flex_attention_problem``
    finds nothing against it, and SDPA otherwise, saying why in one warning (once per reason). An explicit
    ``"flex"`` that cannot run raises a ValueError saying why; one that is merely unverified is tried with a
    warning. ``training`` (default: ``torch.is_grad_enabled()``): flex attention has no CPU backward, so training on
    CPU with ``"flex"`` is an error (forward-only CPU scoring works). ``head_dim`` / ``dtype`` unknown: ``auto`` is
    SDPA on CUDA too.
    """
    check_attention_backend(backend)
    if backend == "sdpa":
        return backend
    facts = AttentionFacts(torch.device(device).type, head_dim, dtype)
    reason, fatal = flex_attention_problem(facts, torch_version)
    if backend == "auto":
        if reason is not None and facts.device_type == "cuda":
            _log_once(f"attention_backend='auto' runs SDPA, not flex attention: {reason}.")
        return "sdpa" if reason is not None else "flex"
    if fatal:
        raise ValueError(f"attention_backend='flex' cannot run: {reason}. Use 'auto' or 'sdpa'.")
    training = torch.is_grad_enabled() if training is None else training
    if facts.device_type == "cpu" and training:
        raise ValueError("attention_backend='flex' cannot train on CPU: torch's flex attention has no CPU backward. "
                         "Use 'auto' or 'sdpa' on CPU (flex works there for no-grad scoring).")
    if reason is not None and facts.device_type == "cuda":
        _log_once(f"attention_backend='flex' is not verified here: {reason}. If compiling fails, use 'auto' or "
                  "'sdpa'.")
    return backend


def resolve_model_attention_backend(backend: str, model, device=None, training: bool | None = None) -> str:
    """``resolve_attention_backend`` for ``model`` (see ``attention_facts``). ``sdpa`` needs no facts."""
    if backend == "sdpa":
        return backend
    facts = attention_facts(model, device)
    return resolve_attention_backend(backend, facts.device_type, facts.head_dim, facts.dtype, training=training)


@functools.cache
def _log_once(message: str) -> None:
    logger.warning(message)


def noisy_columns(keep: torch.Tensor) -> torch.Tensor:
    """Source columns ``[B, W]`` of a noisy copy that builds only the ``keep`` ``[B, L]`` columns of each row: its
    kept columns in order, left-aligned, then -1 (a padding slot) up to ``W``, the most any row keeps (at least 1)."""
    width = max(1, int(keep.sum(-1).max()) if keep.numel() else 0)
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[:, :width]
    return torch.where(keep.gather(-1, order), order, -1)


def document_blocks(positions: torch.Tensor, block_size: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Block of each position ``[B, L]`` (blocks from each document's position 0), numbered along the row so that
    blocks of different documents of a packed row get different ids (``documents``; None: one document a row,
    where this is ``block_index``). Ids increase along the row, so block order within a document is kept."""
    block = block_index(positions, block_size)
    if documents is None:
        return block
    starts = torch.ones_like(block, dtype=torch.bool)
    starts[:, 1:] = (block[:, 1:] != block[:, :-1]) | (documents[:, 1:] != documents[:, :-1])
    return starts.long().cumsum(-1) - 1


def noisy_clean_attention_layout(
    positions: torch.Tensor, valid: torch.Tensor, block_size: int, columns: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> AttentionLayout:
    """BD3-LM layout of ``[x_t[columns] | x_0]``: the noisy copy of each block is its own copy (it sees itself and
    the clean blocks before it), the clean row is block-causal.

    ``positions`` / ``valid`` ``[B, L]`` describe the clean row. ``columns`` (``noisy_columns``; default: all) says
    which noisy tokens are built: noisy blocks with nothing to score can be left out, since nothing attends to
    them. Blocks are aligned from each row's position 0, as the block-causal sampler aligns them; in a packed row
    (``documents``, position ids restarting at 0 per document) from each document's, and no token sees another
    document.
    """
    block = document_blocks(positions, block_size, documents)
    if columns is None:
        columns = torch.arange(block.shape[-1], device=block.device).expand_as(block)
    source = columns.clamp(min=0)
    noisy_block = block.gather(-1, source)
    return AttentionLayout(
        block=torch.cat([noisy_block, block], dim=-1),
        copy=torch.cat([noisy_block, torch.full_like(block, CLEAN)], dim=-1),
        valid=torch.cat([valid.bool().gather(-1, source) & (columns >= 0), valid.bool()], dim=-1),
        document=None if documents is None else torch.cat([documents.gather(-1, source), documents], dim=-1),
    )


def noisy_clean_layout(
    noisy_ids: torch.Tensor,
    clean_ids: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    block_size: int,
    columns: torch.Tensor | None = None,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, AttentionLayout]:
    """``[x_t[columns] | x_0]`` in one row: ``(input_ids, position_ids, attention layout)``.

    Both halves carry the clean row's position ids, so the noisy copy of a block is placed exactly where the
    sampler denoises it, with every earlier block clean (see ``noisy_clean_attention_layout``)."""
    if columns is None:
        columns = torch.arange(clean_ids.shape[-1], device=clean_ids.device).expand_as(clean_ids)
    source = columns.clamp(min=0)
    ids = torch.cat([noisy_ids.gather(-1, source), clean_ids], dim=-1)
    pos = torch.cat([positions.gather(-1, source), positions], dim=-1)
    return ids, pos, noisy_clean_attention_layout(positions, valid, block_size, columns, documents)


def blocks_with(scored: torch.Tensor, positions: torch.Tensor, block_size: int,
                documents: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, L]``: whether the block of each position (``document_blocks``) holds a ``scored`` position of its
    row."""
    block = document_blocks(positions, block_size, documents)
    width = int(block.max()) + 1 if block.numel() else 0
    has = torch.zeros(block.shape[0], width, dtype=torch.long, device=block.device)
    has = has.scatter_reduce(1, block, scored.long(), "amax")
    return has.gather(1, block).bool()


def blocks_from_prompt_end(completion: torch.Tensor, block_length: int) -> torch.Tensor:
    """Semi-autoregressive block of each position ``[B, L]`` for full-attention models: blocks start at each
    row's first completion position (the end of its prompt), as LLaDA / Dream samplers align them, and end at
    its last completion position; -1 outside that span."""
    if block_length <= 0:
        raise ValueError(f"block_length must be positive, got {block_length}.")
    length = completion.shape[-1]
    cols = torch.arange(length, device=completion.device).expand_as(completion)
    has_completion = completion.any(-1, keepdim=True)
    first = torch.where(completion, cols, length).min(-1, keepdim=True).values
    last = torch.where(completion, cols, -1).max(-1, keepdim=True).values
    inside = has_completion & (cols >= first) & (cols <= last)
    return torch.where(inside, torch.div(cols - first, block_length, rounding_mode="floor"), -1)
