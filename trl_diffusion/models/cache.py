"""Key/value caches for diffusion decoding.

Block diffusion re-denoises the current block many times against a fixed context. Two caches share one small
interface (``update`` / ``key_length``) that ``attend`` reads:

* ``DiffusionCache`` grows: passes *read* the cached prefix, and only a pass with ``store`` appends to it. It
  also keeps each cached key's position and validity so that the model can build attention masks by itself.
  This is the general ``forward(past_key_values=...)`` cache.
* ``StaticDiffusionCache`` is preallocated, one slot per canvas column: every pass writes its keys into their
  slots in place and attends over a fixed window of slots. Nothing is concatenated or reallocated per step, and
  shapes can stay the same from step to step (what CUDA-graph replay needs). The sampler owns positions and
  masks, so a forward with this cache must be given both.
"""

from __future__ import annotations

import torch


class DiffusionCache:
    """Per-layer post-RoPE keys and values ``[B, kv_heads, S, head_dim]`` plus key positions and validity."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.positions: torch.Tensor | None = None
        self.valid: torch.Tensor | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if len(self.keys) <= layer_idx else self.keys[layer_idx].shape[-2]

    def key_length(self, q_len: int) -> int:
        """Keys a forward of ``q_len`` new tokens attends over: the cached ones, then the new ones."""
        return self.get_seq_length() + q_len

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(self.keys) <= layer_idx:
            return None
        return self.keys[layer_idx], self.values[layer_idx]

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[cached | new]`` keys and values to attend over; the new ones are appended only if ``store``."""
        past = self.layer(layer_idx)
        if store:
            self.append(layer_idx, keys, values)
        if past is None:
            return keys, values
        return torch.cat([past[0], keys], dim=-2), torch.cat([past[1], values], dim=-2)

    def append(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        if len(self.keys) == layer_idx:
            self.keys.append(keys)
            self.values.append(values)
        elif len(self.keys) > layer_idx:
            self.keys[layer_idx] = torch.cat([self.keys[layer_idx], keys], dim=-2)
            self.values[layer_idx] = torch.cat([self.values[layer_idx], values], dim=-2)
        else:
            raise RuntimeError(f"cache layers must be filled in order; got layer {layer_idx} after {len(self.keys)}")

    def append_positions(self, positions: torch.Tensor, valid: torch.Tensor) -> None:
        if self.positions is None:
            self.positions, self.valid = positions, valid.bool()
        else:
            self.positions = torch.cat([self.positions, positions], dim=-1)
            self.valid = torch.cat([self.valid, valid.bool()], dim=-1)

    def keep_columns(self, columns: torch.Tensor) -> None:
        """Keep only the given cached key positions (column indices), e.g. to drop the block being denoised."""
        self.keys = [k[:, :, columns] for k in self.keys]
        self.values = [v[:, :, columns] for v in self.values]
        if self.positions is not None:
            self.positions, self.valid = self.positions[:, columns], self.valid[:, columns]


class StaticDiffusionCache:
    """Preallocated per-layer keys and values ``[B, kv_heads, capacity, head_dim]`` (slot = canvas column).

    Before a forward, ``place(slots, read)`` says where the forward's new keys go (``slots``, a device index
    tensor with one entry per query) and how many leading slots it attends over (``read``). Every forward
    writes in place (``store`` is ignored): a denoising pass writes keys that a later pass of the same block
    overwrites, and the block's last (commit) pass leaves its clean keys behind. The mask passed with the
    forward decides which of the ``read`` slots are visible. Buffers are allocated on the first write of each
    layer, with that write's dtype and device.
    """

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}.")
        self.capacity = capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.slots: torch.Tensor | None = None
        self.read = 0

    def place(self, slots: torch.Tensor, read: int) -> None:
        """Set the write slots and the read window of the next forward(s)."""
        if not 0 < read <= self.capacity:
            raise ValueError(f"read window {read} must be in (0, {self.capacity}].")
        self.slots, self.read = slots, read

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.read

    def key_length(self, q_len: int) -> int:
        return self.read

    def update(
        self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, store: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``keys``/``values`` ``[B, kv_heads, Q, D]`` at the placed slots; return the read window (views)."""
        if self.slots is None:
            raise RuntimeError("StaticDiffusionCache.place(slots, read) must be called before a forward.")
        if len(self.keys) == layer_idx:
            batch, heads, _, dim = keys.shape
            shape = (batch, heads, self.capacity, dim)
            self.keys.append(keys.new_zeros(shape))
            self.values.append(values.new_zeros(shape))
        elif len(self.keys) < layer_idx:
            raise RuntimeError(f"cache layers must be filled in order; got layer {layer_idx} after {len(self.keys)}")
        self.keys[layer_idx].index_copy_(2, self.slots, keys)
        self.values[layer_idx].index_copy_(2, self.slots, values)
        return self.keys[layer_idx][:, :, : self.read], self.values[layer_idx][:, :, : self.read]

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (finished rows leaving the batch); reallocates the buffers."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
