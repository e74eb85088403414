"""Preallocated per-layer key/value cache for this rank's KV heads."""

from __future__ import annotations

import torch
from torch import nn


class KVCache(nn.Module):
    """Keys and values of positions 0..max_context-1.

    Args:
        batch: batch slots (1 for now; batching will use more).
        num_kv_heads: this rank's KV heads.
        max_context: positions preallocated.
        head_dim: per-head size.
    """

    def __init__(
        self,
        batch: int,
        num_kv_heads: int,
        max_context: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        shape = (batch, num_kv_heads, max_context, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, offset: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nkv, T, hd) at offset..offset+T-1; return keys/values 0..offset+T-1."""
        end = offset + k.shape[2]
        self.k[:, :, offset:end] = k
        self.v[:, :, offset:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]  # (B, nkv, end, hd)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
