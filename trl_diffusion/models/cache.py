"""A small key/value cache for diffusion decoding.

Block diffusion re-denoises the current block many times against a fixed prefix: those passes must *read*
the cached prefix without *writing* to it, and one final pass commits the finished block. ``store`` on the
forward call selects which. The cache also keeps each cached key's position and validity so that the model
can build the right attention mask for new queries by itself.
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

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        if len(self.keys) <= layer_idx:
            return None
        return self.keys[layer_idx], self.values[layer_idx]

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

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only the given batch rows (used when finished rows leave a batch)."""
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        if self.positions is not None:
            self.positions, self.valid = self.positions[rows], self.valid[rows]

    def keep_columns(self, columns: torch.Tensor) -> None:
        """Keep only the given cached key positions (column indices), e.g. to drop the block being denoised."""
        self.keys = [k[:, :, columns] for k in self.keys]
        self.values = [v[:, :, columns] for v in self.values]
        if self.positions is not None:
            self.positions, self.valid = self.positions[:, columns], self.valid[:, columns]
