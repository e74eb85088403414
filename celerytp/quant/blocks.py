"""ggml block codecs in torch, bit-identical to the gguf package's `gguf.quants` reference.

A block tensor is uint8 (rows, cols / block_size * type_size): each row is the ggml blocks of
one weight row, exactly as a GGUF file stores it. `unpack_blocks` gives the integer codes and
per-32-column scale/zero the kernels use; w = scale * (q - offset) + zero reproduces gguf's
float32 dequantization bit for bit (same operations in the same order).

Q4_K has no quantizer in gguf.quants; ours is a plain min/max one (llama.cpp searches for
better scales). Its blocks are valid Q4_K: gguf's dequantizer reads them bit-identically.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

T = GGMLQuantizationType
QK = 32  # sub-block width of every format here; the kernels' group size
QK_K = 256  # Q4_K super-block
BLOCK_FORMATS = (T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K)
_SIZES = {T.Q8_0: (32, 34), T.Q4_0: (32, 18), T.Q4_1: (32, 20), T.Q4_K: (256, 144)}


@dataclass
class Unpacked:
    """Integer codes and per-group affine terms: w = scale * (q - offset) + zero.

    Args:
        q: (R, C) codes: int8 for Q8_0, uint8 0..15 for the 4-bit formats.
        scale: (R, C / 32) float32.
        zero: (R, C / 32) float32, or None when the format has none (Q8_0, Q4_0).
        offset: subtracted from the codes before scaling (8 for Q4_0, else 0).
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    offset: int

    def dequantize(self) -> torch.Tensor:
        R, C = self.q.shape
        q = self.q.view(R, C // QK, QK).float()
        if self.offset:
            q = q - self.offset
        w = self.scale[..., None] * q
        if self.zero is not None:
            w = w + self.zero[..., None]
        return w.view(R, C)


def _check(qtype: GGMLQuantizationType) -> tuple[int, int]:
    if qtype not in _SIZES:
        raise ValueError(f"no torch codec for {qtype.name}; have {[t.name for t in BLOCK_FORMATS]}")
    return _SIZES[qtype]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (...) float32 via float16."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(...) float32 -> (..., 2) uint8 of its float16 (round to nearest even, as numpy)."""
    return x.to(torch.float16).contiguous()[..., None].view(torch.uint8)


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """ggml's 4-bit packing: byte i of a group holds element i (low) and i + width (high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)  # (..., 2 * width)


def _pack_nibbles(q: torch.Tensor, width: int) -> torch.Tensor:
    return q[..., :width] | (q[..., width:] << 4)


def unpack_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> Unpacked:
    """Codes and per-32 scale/zero of ggml blocks (R, bytes)."""
    block, size = _check(qtype)
    R = blocks.shape[0]
    b = blocks.view(R, -1, size)  # (R, nb, size)
    nb = b.shape[1]
    if qtype == T.Q8_0:
        return Unpacked(b[..., 2:].contiguous().view(torch.int8).view(R, nb * 32), _f16(b[..., 0:2]), None, 0)
    if qtype == T.Q4_0:
        return Unpacked(_nibbles(b[..., 2:], 16).view(R, nb * 32), _f16(b[..., 0:2]), None, 8)
    if qtype == T.Q4_1:
        return Unpacked(_nibbles(b[..., 4:], 16).view(R, nb * 32), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 0)
    # Q4_K: d, dmin, 12 bytes of 6-bit scales/mins for 8 sub-blocks, 128 bytes of nibbles.
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (R, nb)
    sc, mn = _k_scale_min(b[..., 4:16])  # (R, nb, 8) each
    qs = b[..., 16:].reshape(R, nb, 4, 32)  # chunk c: sub-blocks 2c (low) and 2c+1 (high)
    q = _nibbles(qs, 32).view(R, nb * QK_K)
    scale = (d[..., None] * sc.float()).view(R, nb * 8)
    zero = -(dmin[..., None] * mn.float()).view(R, nb * 8)
    return Unpacked(q, scale, zero, 0)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf's Q4_K.get_scale_min: 12 bytes -> 8 six-bit scales and 8 six-bit mins."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _pack_k_scale_min(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    d = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    m = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    m_d = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return torch.cat([d, m, m_d], dim=-1)


def dequantize_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """float32 (R, C) of ggml blocks, bit-identical to gguf.quants.dequantize."""
    return unpack_blocks(blocks, qtype).dequantize()


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """gguf's np_roundf: round half away from zero, computed the same way."""
    a = x.abs()
    floored = torch.floor(a)
    return torch.sign(x) * (floored + torch.floor(2 * (a - floored)))


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def quantize_blocks(w: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """ggml blocks uint8 (R, C / block * size) of float weights (R, C).

    Q8_0, Q4_0 and Q4_1 are bit-identical to gguf.quants.quantize (float32 arithmetic in
    its order, no fused multiply-adds).
    """
    block, size = _check(qtype)
    R, C = w.shape
    if C % block:
        raise ValueError(f"{C} columns are not a multiple of the {qtype.name} block size {block}")
    x = w.float().reshape(R, C // block, block)
    if qtype == T.Q8_0:
        d = x.abs().amax(-1, keepdim=True) / 127
        qs = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
        out = torch.cat([_f16_bytes(d[..., 0]), qs], dim=-1)
    elif qtype == T.Q4_0:
        imax = x.abs().argmax(-1, keepdim=True)
        d = torch.gather(x, -1, imax) / -8
        q = torch.trunc(x * _inverse(d) + 8.5).to(torch.uint8).clamp(0, 15)
        out = torch.cat([_f16_bytes(d[..., 0]), _pack_nibbles(q, 16)], dim=-1)
    elif qtype == T.Q4_1:
        hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
        d = (hi - lo) / 15
        q = torch.trunc((x - lo) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 15)
        out = torch.cat([_f16_bytes(d[..., 0]), _f16_bytes(lo[..., 0]), _pack_nibbles(q, 16)], dim=-1)
    else:
        out = _quantize_q4_k(x)
    return out.reshape(R, C // block * size).contiguous()


def _quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """Min/max Q4_K: per 32-wide sub-block scale = (max - min) / 15, min clamped to <= 0,
    both coded as 6-bit multiples of per-super-block d and dmin (float16)."""
    R, nb, _ = x.shape
    s = x.view(R, nb, 8, QK)
    lo = s.amin(-1).clamp(max=0)  # (R, nb, 8)
    scale = (s.amax(-1) - lo) / 15
    d = (scale.amax(-1) / 63).half().float()  # what the dequantizer will read
    dmin = ((-lo).amax(-1) / 63).half().float()
    sc = torch.round(scale * _inverse(d)[..., None]).clamp(0, 63)
    mn = torch.round(-lo * _inverse(dmin)[..., None]).clamp(0, 63)
    step = d[..., None] * sc  # (R, nb, 8): the dequantizer's scale and min
    low = dmin[..., None] * mn
    q = torch.round((s + low[..., None]) * _inverse(step)[..., None]).clamp(0, 15).to(torch.uint8)
    qs = _pack_nibbles(q.view(R, nb, 4, 2 * QK), QK).view(R, nb, 128)
    scales = _pack_k_scale_min(sc.to(torch.uint8), mn.to(torch.uint8))
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), scales, qs], dim=-1)
