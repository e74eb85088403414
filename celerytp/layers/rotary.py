"""Rotary position embeddings, half-split layout, computed as transformers computes them.

Types (transformers' `rope_type`): default, linear, llama3 (or llama.cpp's `rope_freqs`
divisors), yarn, dynamic (NTK) and longrope. The maths ports transformers 5's
`modeling_rope_utils` (the `_compute_*_parameters` functions and `dynamic_rope_update`); the
model path never imports transformers.

default, linear, llama3 and yarn have one static inverse-frequency set, so their cos/sin are a
precomputed table indexed by position; yarn's attention factor multiplies cos and sin (its
`attention_scaling`). longrope and dynamic depend in transformers on the sequence length it
sees in a forward, `max(position_ids) + 1`, taken over the whole batch. We take it per row of
the batch instead, so a sequence gets the same embedding whatever it is batched with:

- longrope: a row whose largest position in this forward is >= original_max_position_embeddings
  uses the long factors for all its positions in this forward, any other row the short ones;
  both tables carry the attention factor.
- dynamic: a row whose largest position + 1 exceeds the original length (transformers:
  `max_position_embeddings`) gets cos/sin computed on the fly from a base rescaled for
  seq_len = that position + 1; other rows use the precomputed default table.

Per row, a whole sequence in one forward matches transformers without a cache, and prefill
then one token per forward matches transformers with its cache decoding that one sequence
(whose keys keep the embedding of the forward that wrote them). transformers' dynamic type also
keeps its grown frequencies until a forward falls back within the original length; per row has
no such memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' `rope_parameters`, defaults resolved).

    Args:
        theta: base of the frequencies.
        rope_type: "default", "linear", "llama3", "yarn", "dynamic" or "longrope".
        factor: scaling factor (linear, llama3, yarn, dynamic; longrope's sets its default
            attention factor).
        low_freq_factor, high_freq_factor: llama3's band edges.
        original_max_position_embeddings: the pretraining length (llama3, yarn, longrope; for
            dynamic, transformers' `max_position_embeddings`).
        freq_factors: per-frequency divisors stored by llama.cpp (GGUF `rope_freqs`); they
            replace the llama3 computation when present.
        beta_fast, beta_slow, truncate: yarn's correction range.
        attention_factor: multiplies cos and sin (yarn, longrope); None: derived as
            transformers does (from factor, mscale, mscale_all_dim for yarn).
        mscale, mscale_all_dim: yarn's attention-factor parameters.
        short_factor, long_factor: longrope's per-frequency divisors.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    freq_factors: tuple[float, ...] | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None


def scaled_context(rope: RopeConfig, max_position_embeddings: int) -> int:
    """The positions a model may run to: max_position_embeddings, or as far as its rope scaling
    stretches the pretraining length (vLLM's rule): yarn to original x factor, dynamic to
    max_position_embeddings x factor. Other types already count in max_position_embeddings."""
    if rope.rope_type == "yarn":
        return max(max_position_embeddings, int(rope.original_max_position_embeddings * rope.factor))
    if rope.rope_type == "dynamic":
        return int(max_position_embeddings * rope.factor)
    return max_position_embeddings


def _exponents(head_dim: int) -> torch.Tensor:
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # (hd/2,)


def inv_frequencies(rope: RopeConfig, head_dim: int, seq_len: int | None = None) -> torch.Tensor:
    """(head_dim/2,) float32 inverse frequencies, as transformers' ROPE_INIT_FUNCTIONS give them
    for a sequence of `seq_len` (only longrope and dynamic depend on it; None: initial)."""
    inv_freq = 1.0 / (rope.theta ** _exponents(head_dim))
    if rope.freq_factors is not None:
        return inv_freq / _factors(rope.freq_factors, head_dim, "rope freq_factors")
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    if rope.rope_type == "longrope":
        long = seq_len is not None and seq_len > rope.original_max_position_embeddings
        factors = rope.long_factor if long else rope.short_factor
        return 1.0 / (_factors(factors, head_dim, "longrope factors") * rope.theta ** _exponents(head_dim))
    if rope.rope_type == "dynamic":  # python floats, as transformers for an int (or no) seq_len
        old_len, factor = rope.original_max_position_embeddings, rope.factor
        length = max(seq_len or old_len, old_len)
        base = rope.theta * ((factor * length / old_len) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** _exponents(head_dim))
    return inv_freq


def attention_scaling(rope: RopeConfig) -> float:
    """The factor transformers multiplies cos and sin by (its `attention_scaling`)."""
    if rope.rope_type == "yarn":
        if rope.attention_factor is not None:
            return rope.attention_factor
        if rope.mscale and rope.mscale_all_dim:
            return float(_yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(rope.factor, rope.mscale_all_dim))
        return _yarn_mscale(rope.factor)
    if rope.rope_type == "longrope":
        if rope.attention_factor is not None:
            return rope.attention_factor
        if rope.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
    return 1.0


def _factors(values: tuple[float, ...] | None, head_dim: int, what: str) -> torch.Tensor:
    factors = torch.tensor(values if values is not None else (), dtype=torch.float32)
    if factors.numel() != head_dim // 2:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"{what} has {factors.numel()} entries, rotary dim / 2 is {head_dim // 2}"
        )
    return factors


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    # Frequencies that turn less than beta_slow times over the original length are interpolated
    # (divided by factor), those turning more than beta_fast times kept, with a linear ramp between.
    base, factor, old_len = rope.theta, rope.factor, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def _dynamic(rope: RopeConfig, dim: int, seq_len: torch.Tensor) -> torch.Tensor:
    """(*S, dim/2) inverse frequencies for int64 sequence lengths `seq_len` (*S): NTK-rescaled
    base, in float32 as transformers computes it from a tensor seq_len."""
    old_len, factor = rope.original_max_position_embeddings, rope.factor
    seq_len = torch.clamp(seq_len, min=old_len)
    base = rope.theta * ((factor * seq_len / old_len) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[..., None] ** _exponents(dim).to(seq_len.device))


def _cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[..., None].float() * inv_freq  # (..., hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (..., hd)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions 0..max_positions-1, kept in float32.

    Args:
        head_dim: rotated size of each head.
        max_positions: table length (the model's max_context).
        rope: frequency parameters.
        sections: multimodal rotary (`mrope_section`): the half's frequencies in consecutive
            sections, the i-th taken from position stream i % 3 (temporal, height, width), as
            Qwen2.5-VL's `recomposition_frequencies`; None: one position per token.
        interleaved: the sections' frequencies interleaved instead (Qwen3-VL): frequency f takes
            the height stream where f % 3 == 1 and f < 3 x sections[1], the width stream where
            f % 3 == 2 and f < 3 x sections[2], else the temporal one.
    """

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig, *, device: torch.device,
                 sections: tuple[int, ...] | None = None, interleaved: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.streams = None  # (hd,): the position stream each rotated dim takes
        if sections is not None:
            if sum(sections) * 2 != head_dim:
                raise CeleryTPError(ErrorKind.LOAD_FAILED, f"mrope_section {list(sections)} must sum to half the "
                                                           f"rotary dim {head_dim}")
            if interleaved:
                f = torch.arange(head_dim // 2)
                half = torch.zeros_like(f)
                for stream in (1, 2):
                    half[(f % 3 == stream) & (f < 3 * sections[stream])] = stream
            else:
                half = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
            self.streams = torch.cat([half, half]).to(device)
        # longrope and dynamic choose per row (module docstring); the others are one lookup.
        per_row = rope.rope_type in ("longrope", "dynamic") and rope.freq_factors is None
        self.per_row = rope.rope_type if per_row else None
        self.resize(max_positions, device)

    def resize(self, max_positions: int, device: torch.device | None = None) -> None:
        """Tables for positions 0..max_positions-1 (a load sizes its context once the weights are in)."""
        device = self.cos.device if device is None else device
        rope, head_dim = self.rope, self.head_dim
        positions = torch.arange(max_positions, dtype=torch.float32)
        scale = attention_scaling(rope)
        cos, sin = _cos_sin(inv_frequencies(rope, head_dim), positions, scale)  # (P, hd) each
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)
        if self.per_row == "longrope":
            long_inv_freq = inv_frequencies(rope, head_dim, seq_len=rope.original_max_position_embeddings + 1)
            long_cos, long_sin = _cos_sin(long_inv_freq, positions, scale)
            self.register_buffer("long_cos", long_cos.to(device), persistent=False)
            self.register_buffer("long_sin", long_sin.to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (B, T, hd) each for positions (B, T) (any leading dims; the last is a row), or
        with `sections`, for (3, B, T) temporal, height and width positions."""
        if self.streams is not None and positions.dim() == 3:
            pick = self.streams.view(1, 1, 1, -1).expand(1, *positions.shape[1:], -1)
            cos = self.cos[positions].gather(0, pick)[0]  # each dim from its stream's table row
            sin = self.sin[positions].gather(0, pick)[0]
            return cos.to(dtype), sin.to(dtype)
        cos, sin = self.cos[positions], self.sin[positions]
        if self.per_row is not None and positions.shape[-1] > 0:
            cos, sin = self._per_row(positions, cos, sin)
        return cos.to(dtype), sin.to(dtype)

    def _per_row(
        self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # No host sync: both candidates are computed and each row picks with torch.where.
        old_len = self.rope.original_max_position_embeddings
        seq_len = positions.amax(dim=-1, keepdim=True) + 1  # (B, 1): this forward's length per row
        beyond = (seq_len > old_len)[..., None]  # (B, 1, 1)
        if self.per_row == "longrope":
            scaled_cos, scaled_sin = self.long_cos[positions], self.long_sin[positions]
        else:
            scaled_cos, scaled_sin = _cos_sin(_dynamic(self.rope, self.head_dim, seq_len), positions, 1.0)
        return torch.where(beyond, scaled_cos, cos), torch.where(beyond, scaled_sin, sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, nh, T, hd) rotated by cos/sin (T, hd)."""
    return x * cos + rotate_half(x) * sin
