"""RMSNorm, computed in float32 like the reference implementations."""

from __future__ import annotations

import torch
from torch import nn

from celerytp.layers.eager_ops import mean_square
from celerytp.layers.weights import replicated_loader


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim (replicated on every rank).

    Args:
        size: the normalized dim (hidden_size, or head_dim for qwen3's q_norm/k_norm).
        eps: added to the mean square.
    """

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = replicated_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics: bf16 mean squares lose too much precision over thousands of dims
        h = x.float()
        h = h * torch.rsqrt(mean_square(h) + self.eps)
        return self.weight * h.to(x.dtype)
