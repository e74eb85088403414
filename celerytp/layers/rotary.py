"""Rotary position embeddings (default, linear and llama3 scaling), half-split layout."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' `rope_parameters`).

    Args:
        theta: base of the frequencies.
        rope_type: "default", "linear" or "llama3".
        factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: scaling
            parameters of the linear and llama3 types.
        freq_factors: per-frequency divisors stored by llama.cpp (GGUF `rope_freqs`); they
            replace the llama3 computation when present.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None


def inv_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, computed as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.freq_factors is not None:
        factors = torch.tensor(rope.freq_factors, dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, head_dim/2 is {inv_freq.numel()}")
        return inv_freq / factors
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_positions-1, kept in float32.

    Args:
        head_dim: rotated size of each head.
        max_positions: table length (the model's max_context).
        rope: frequency parameters.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, *, device: torch.device) -> None:
        super().__init__()
        inv_freq = inv_frequencies(rope, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # (P, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)  # (T, hd) each


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hd) rotated by cos/sin (T, hd)."""
    return x * cos + rotate_half(x) * sin
