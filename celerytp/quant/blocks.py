"""ggml block codecs in torch, bit-identical to the gguf package's `gguf.quants` reference.

A block tensor is uint8 (rows, cols / block_size * type_size): each row is the ggml blocks of
one weight row, exactly as a GGUF file stores it. `unpack_blocks` gives the integer codes and
per-group scale/zero the kernels use; w = scale * (q - offset) + zero reproduces gguf's float32
dequantization bit for bit (same operations in the same order; a - b is a + (-b) in IEEE).

Quantizers: Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 are bit-identical to gguf.quants.quantize. gguf has
no quantizer for the K-quants; ours are plain min/max ones (llama.cpp searches for better
scales) whose blocks gguf's dequantizer reads. gguf has no codec at all for Q8_1 and Q8_K (they
are llama.cpp's activation formats); ours follow ggml's reference quantize_row_q8_1/q8_K.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
QK = 32  # group width of the 32-element formats and of the int4 kernel
QK_K = 256  # K-quant super-block
BLOCK_FORMATS = (T.Q8_0, T.Q8_1, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K)


@dataclass
class Unpacked:
    """Integer codes and per-group affine terms: w = scale * (q - offset) + zero.

    Args:
        q: (R, C) codes: int8 for the 8-bit formats, else uint8 (0..2^bits - 1).
        scale: (R, C / group) float32.
        zero: (R, C / group) float32, or None when the format has none.
        offset: subtracted from the codes before scaling.
        group: weights per scale.
    """

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    offset: int
    group: int = QK

    def dequantize(self) -> torch.Tensor:
        R, C = self.q.shape
        q = self.q.view(R, C // self.group, self.group).float()
        if self.offset:
            q = q - self.offset
        w = self.scale[..., None] * q
        if self.zero is not None:
            w = w + self.zero[..., None]
        return w.view(R, C)


def _check(qtype: GGMLQuantizationType) -> tuple[int, int]:
    if qtype not in BLOCK_FORMATS:
        raise ValueError(f"no torch codec for {qtype.name}; have {[t.name for t in BLOCK_FORMATS]}")
    return GGML_QUANT_SIZES[qtype]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(..., 2) uint8 -> (...) float32 via float16."""
    return b.contiguous().view(torch.float16)[..., 0].float()


def _f32(b: torch.Tensor) -> torch.Tensor:
    """(..., 4) uint8 -> (...) float32."""
    return b.contiguous().view(torch.float32)[..., 0]


def _f32_bytes(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous()[..., None].view(torch.uint8)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(...) float32 -> (..., 2) uint8 of its float16 (round to nearest even, as numpy)."""
    return x.to(torch.float16).contiguous()[..., None].view(torch.uint8)


def _bits(x: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """(..., n) uint8 -> (..., count, n): field k of each byte is bits width*k.. (ggml's chunk order)."""
    shifts = torch.arange(0, width * count, width, dtype=torch.uint8, device=x.device)
    return (x[..., None, :] >> shifts[:, None]) & ((1 << width) - 1)


def _pack_bits(u: torch.Tensor, width: int) -> torch.Tensor:
    """Inverse of _bits: (..., count, n) -> (..., n)."""
    out = torch.zeros_like(u[..., 0, :])
    for k in range(u.shape[-2]):
        out |= u[..., k, :] << (width * k)
    return out


def _bits_le(x: torch.Tensor) -> torch.Tensor:
    """(..., 4) uint8 of a little-endian uint32 -> (..., 32) of its bits (Q5_0/Q5_1's qh)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=x.device)
    return ((x[..., :, None] >> shifts) & 1).flatten(-2)


def _pack_bits_le(bits: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    return (bits.unflatten(-1, (-1, 8)) << shifts).sum(-1, dtype=torch.uint8)


def unpack_blocks(blocks: torch.Tensor, qtype: GGMLQuantizationType) -> Unpacked:
    """Codes and per-group scale/zero of ggml blocks (R, bytes)."""
    block, size = _check(qtype)
    R = blocks.shape[0]
    b = blocks.view(R, -1, size)  # (R, nb, size)
    nb = b.shape[1]
    C = nb * block

    def codes(q: torch.Tensor) -> torch.Tensor:
        return q.reshape(R, C)

    if qtype == T.Q8_0:
        return Unpacked(codes(b[..., 2:].contiguous().view(torch.int8)), _f16(b[..., 0:2]), None, 0)
    if qtype == T.Q8_1:  # float32 d, then d * sum(q), which no dequantizer reads
        return Unpacked(codes(b[..., 8:].contiguous().view(torch.int8)), _f32(b[..., 0:4]), None, 0)
    if qtype == T.Q4_0:
        return Unpacked(codes(_bits(b[..., 2:], 4, 2)), _f16(b[..., 0:2]), None, 8)
    if qtype == T.Q4_1:
        return Unpacked(codes(_bits(b[..., 4:], 4, 2)), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 0)
    if qtype in (T.Q5_0, T.Q5_1):
        at = 2 if qtype == T.Q5_0 else 4
        q = _bits(b[..., at + 4 :], 4, 2).flatten(-2) | (_bits_le(b[..., at : at + 4]) << 4)
        zero = _f16(b[..., 2:4]) if qtype == T.Q5_1 else None
        return Unpacked(codes(q), _f16(b[..., 0:2]), zero, 16 if qtype == T.Q5_0 else 0)
    if qtype == T.Q8_K:
        return Unpacked(codes(b[..., 4:260].contiguous().view(torch.int8)), _f32(b[..., 0:4]), None, 0, QK_K)
    if qtype == T.Q2_K:
        sc, qs = b[..., 0:16], b[..., 16:80]
        d, dmin = _f16(b[..., 80:82]), _f16(b[..., 82:84])
        q = _bits(qs.reshape(R, nb, 2, 32), 2, 4)  # element 128 c + 32 s + j
        scale = (d[..., None] * (sc & 0x0F).float()).view(R, nb * 16)
        zero = -(dmin[..., None] * (sc >> 4).float()).view(R, nb * 16)
        return Unpacked(codes(q), scale, zero, 0, 16)
    if qtype == T.Q3_K:
        hmask, qs, packed, d = b[..., 0:32], b[..., 32:96], b[..., 96:108], _f16(b[..., 108:110])
        low = _bits(qs.reshape(R, nb, 2, 32), 2, 4).reshape(R, nb, 256)
        high = _bits(hmask, 1, 8).reshape(R, nb, 256)  # set: no -4 (ggml stores the complement)
        lsc = _bits(packed[..., 0:8], 4, 2).flatten(-2)
        hsc = _bits(packed[..., 8:12], 2, 4).flatten(-2)
        sc = ((lsc | (hsc << 4)).to(torch.int8) - 32).float()
        return Unpacked(codes(low | (high << 2)), (d[..., None] * sc).view(R, nb * 16), None, 4, 16)
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (R, nb)
        sc, mn = _k_scale_min(b[..., 4:16])  # (R, nb, 8) each
        at = 16 if qtype == T.Q4_K else 48
        q = _bits(b[..., at:].reshape(R, nb, 4, 32), 4, 2).reshape(R, nb, 256)  # element 64 c + 32 h + j
        if qtype == T.Q5_K:
            q = q | (_bits(b[..., 16:48], 1, 8).reshape(R, nb, 256) << 4)  # bit s of byte j: element 32 s + j
        scale = (d[..., None] * sc.float()).view(R, nb * 8)
        zero = -(dmin[..., None] * mn.float()).view(R, nb * 8)
        return Unpacked(codes(q), scale, zero, 0)
    # Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d.
    low = _bits(b[..., 0:128].reshape(R, nb, 2, 64), 4, 2).reshape(R, nb, 256)  # 128 c + 64 h + j
    high = _bits(b[..., 128:192].reshape(R, nb, 2, 32), 2, 4).reshape(R, nb, 256)  # 128 c + 32 s + j
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    scale = (_f16(b[..., 208:210])[..., None] * sc).view(R, nb * 16)
    return Unpacked(codes(low | (high << 4)), scale, None, 32, 16)


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


def _signed_max(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude along the last dim (first on ties), keepdim."""
    return torch.gather(x, -1, x.abs().argmax(-1, keepdim=True))


def quantize_blocks(w: torch.Tensor, qtype: GGMLQuantizationType) -> torch.Tensor:
    """ggml blocks uint8 (R, C / block * size) of float weights (R, C) (see the module doc)."""
    block, size = _check(qtype)
    R, C = w.shape
    if C % block:
        raise ValueError(f"{C} columns are not a multiple of the {qtype.name} block size {block}")
    x = w.float().reshape(R, C // block, block)
    out = _QUANTIZERS[qtype](x)
    return out.reshape(R, C // block * size).contiguous()


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(-1, keepdim=True) / 127
    qs = _roundf(x * _inverse(d)).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d[..., 0]), qs], dim=-1)


def _q8_1(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_1_reference in gguf's 40-byte layout: float32 d = amax / 127, float32
    s = d * sum(q), then Q8_0's codes (today's ggml packs d and s as float16; gguf-py sizes it so)."""
    d = x.abs().amax(-1, keepdim=True) / 127
    q = _roundf(x * _inverse(d))
    s = q.sum(-1) * d[..., 0]
    return torch.cat([_f32_bytes(d[..., 0]), _f32_bytes(s), q.to(torch.int8).view(torch.uint8)], dim=-1)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """ggml's quantize_row_q8_K_ref: iscale = -127 / signed max, round to nearest even, d = 1 / iscale."""
    top = _signed_max(x)
    # A true division (torch's scalar / tensor multiplies by a reciprocal); all-zero block: d = 0, q = 0.
    iscale = torch.where(top == 0, torch.zeros_like(top), torch.full_like(top, -127.0) / top)
    q = torch.round(iscale * x).clamp(max=127).to(torch.int8)
    bsums = q.view(*q.shape[:-1], 16, 16).sum(-1, dtype=torch.int16)
    return torch.cat([_f32_bytes(_inverse(iscale)[..., 0]), q.view(torch.uint8), bsums.view(torch.uint8)], dim=-1)


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_max(x) / -8
    q = torch.trunc(x * _inverse(d) + 8.5).to(torch.uint8).clamp(0, 15)
    return torch.cat([_f16_bytes(d[..., 0]), _pack_bits(q.unflatten(-1, (2, 16)), 4)], dim=-1)


def _q4_1(x: torch.Tensor) -> torch.Tensor:
    hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    d = (hi - lo) / 15
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 15)
    return torch.cat([_f16_bytes(d[..., 0]), _f16_bytes(lo[..., 0]), _pack_bits(q.unflatten(-1, (2, 16)), 4)], dim=-1)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_max(x) / -16
    q = torch.trunc(x * _inverse(d) + 16.5).to(torch.uint8).clamp(0, 31)
    qs = _pack_bits((q & 0x0F).unflatten(-1, (2, 16)), 4)
    return torch.cat([_f16_bytes(d[..., 0]), _pack_bits_le(q >> 4), qs], dim=-1)


def _q5_1(x: torch.Tensor) -> torch.Tensor:
    hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    d = (hi - lo) / 31
    q = torch.trunc((x - lo) * _inverse(d) + 0.5).to(torch.uint8).clamp(0, 31)
    qs = _pack_bits((q & 0x0F).unflatten(-1, (2, 16)), 4)
    return torch.cat([_f16_bytes(d[..., 0]), _f16_bytes(lo[..., 0]), _pack_bits_le(q >> 4), qs], dim=-1)


def _affine_k(s: torch.Tensor, levels: int, scale_levels: int) -> tuple[torch.Tensor, ...]:
    """Min/max K-quant groups s (R, nb, groups, width): codes 0..levels with w = d sc q - dmin m,
    sc and m integers 0..scale_levels, d and dmin float16 per super-block."""
    lo = s.amin(-1).clamp(max=0)  # (R, nb, groups)
    scale = (s.amax(-1) - lo) / levels
    d = (scale.amax(-1) / scale_levels).half().float()  # what the dequantizer will read
    dmin = ((-lo).amax(-1) / scale_levels).half().float()
    sc = torch.round(scale * _inverse(d)[..., None]).clamp(0, scale_levels)
    mn = torch.round(-lo * _inverse(dmin)[..., None]).clamp(0, scale_levels)
    step, low = d[..., None] * sc, dmin[..., None] * mn
    q = torch.round((s + low[..., None]) * _inverse(step)[..., None]).clamp(0, levels).to(torch.uint8)
    return q, sc.to(torch.uint8), mn.to(torch.uint8), d, dmin


def _symmetric_k(s: torch.Tensor, qmin: int, qmax: int, scale_max: int) -> tuple[torch.Tensor, ...]:
    """Symmetric K-quant groups s (R, nb, groups, width): signed codes qmin..qmax with w = d sc q,
    sc a signed integer within +-scale_max, d float16 per super-block."""
    scale = _signed_max(s)[..., 0] / qmin  # the largest weight lands on qmin, as ggml does
    d = (scale.abs().amax(-1) / scale_max).half().float()
    sc = torch.round(scale * _inverse(d)[..., None]).clamp(-scale_max, scale_max - 1)
    step = d[..., None] * sc
    q = torch.round(s * _inverse(step)[..., None]).clamp(qmin, qmax)
    return (q - qmin).to(torch.uint8), sc, d


def _q2_k(x: torch.Tensor) -> torch.Tensor:
    R, nb, _ = x.shape
    q, sc, mn, d, dmin = _affine_k(x.view(R, nb, 16, 16), 3, 15)
    qs = _pack_bits(q.reshape(R, nb, 2, 4, 32), 2).reshape(R, nb, 64)
    return torch.cat([sc | (mn << 4), qs, _f16_bytes(d), _f16_bytes(dmin)], dim=-1)


def _q3_k(x: torch.Tensor) -> torch.Tensor:
    R, nb, _ = x.shape
    u, sc, d = _symmetric_k(x.view(R, nb, 16, 16), -4, 3, 32)
    u = u.reshape(R, nb, 256)
    hmask = _pack_bits((u >> 2).reshape(R, nb, 8, 32), 1)
    qs = _pack_bits((u & 3).reshape(R, nb, 2, 4, 32), 2).reshape(R, nb, 64)
    sc6 = (sc + 32).to(torch.uint8)  # (R, nb, 16)
    scales = torch.cat(
        [_pack_bits((sc6 & 0x0F).unflatten(-1, (2, 8)), 4), _pack_bits((sc6 >> 4).unflatten(-1, (4, 4)), 2)], -1
    )
    return torch.cat([hmask, qs, scales, _f16_bytes(d)], dim=-1)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    R, nb, _ = x.shape
    q, sc, mn, d, dmin = _affine_k(x.view(R, nb, 8, QK), 15, 63)
    qs = _pack_bits(q.view(R, nb, 4, 2, QK), 4).view(R, nb, 128)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scale_min(sc, mn), qs], dim=-1)


def _q5_k(x: torch.Tensor) -> torch.Tensor:
    R, nb, _ = x.shape
    q, sc, mn, d, dmin = _affine_k(x.view(R, nb, 8, QK), 31, 63)
    qh = _pack_bits((q >> 4).view(R, nb, 8, QK), 1)
    qs = _pack_bits((q & 0x0F).view(R, nb, 4, 2, QK), 4).view(R, nb, 128)
    return torch.cat([_f16_bytes(d), _f16_bytes(dmin), _pack_k_scale_min(sc, mn), qh, qs], dim=-1)


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    R, nb, _ = x.shape
    u, sc, d = _symmetric_k(x.view(R, nb, 16, 16), -32, 31, 128)
    u = u.reshape(R, nb, 256)
    ql = _pack_bits((u & 0x0F).reshape(R, nb, 2, 2, 64), 4).reshape(R, nb, 128)
    qh = _pack_bits((u >> 4).reshape(R, nb, 2, 4, 32), 2).reshape(R, nb, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d)], dim=-1)


_QUANTIZERS = {
    T.Q8_0: _q8_0,
    T.Q8_1: _q8_1,
    T.Q8_K: _q8_k,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
