"""The Qwen3-Next family's norms: zero-centred RMSNorm (scale 1 + w) and the gated RMSNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.layers.lanewise import lanewise
from celerytp.layers.weights import replicated_loader


def _weight(size: int, fill: float, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    p = nn.Parameter(torch.full((size,), fill, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = replicated_loader
    return p


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm whose checkpoint weight is stored minus one: y = norm(x) * (1 + w), in float32.

    Replicated: it acts on hidden_size (layer norms) or one head_dim (q_norm / k_norm).
    """

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _weight(size, 0.0, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * lanewise(torch.rsqrt, h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """y = RMSNorm(x) * w * silu(gate) over one value head (head_v_dim), replicated on every rank."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _weight(size, 1.0, dtype, device)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * lanewise(torch.rsqrt, h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * lanewise(F.silu, gate.float())).to(x.dtype)
