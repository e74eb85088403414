"""QuantizedWeight: a linear layer's local weight kept quantized, and the kernels that run it.

The parallel linears (celerytp/layers/linear.py) hold one when built with a QuantPlan. Loading
stages each checkpoint slice in its format (GGUF bytes sliced as they are, or floats quantized
here; see QuantPlan.format_for for per-tensor types and block fallbacks); `finish_loading`
converts each run of rows sharing a format once into the layout of the kernel chosen for it:

| kernel      | formats                                   | layout                                  | activations |
|-------------|-------------------------------------------|-----------------------------------------|-------------|
| int4pack    | q4_0, q4_1, q4_k                          | torch's tinygemm int4 pack, group 32    | bfloat16    |
| int4split   | q8_0, q8_1, q8_k, q5_0, q5_1, q5_k, q6_k, | the codes as 4-bit codes over 2K inputs | bfloat16    |
|             | q2_k, q3_k (SPLIT_TYPES)                  | in tinygemm's pack, each block's scale  |             |
|             |                                           | kept (1.25 bytes/weight; see _split)    |             |
| int8pack    | the same, for a weight also read by rows  | int8 + one scale per row (requantized)  | bfloat16    |
|             | (a tied embedding), or when forced        |                                         |             |
| dequant     | every block format                        | codes + float32 scale/zero per group    | compute     |
| float       | f16, bf16, f32                            | the weight in that dtype                | compute     |

int4pack and int4split are exact for the weights up to bfloat16 scales (and, for the formats
with a zero, the zero); both add bfloat16 activations and outputs (tests/test_quant_precision.py
holds int4split within u (|x| |W|^T + |y|) of the exact product, u = 2^-8). int8pack re-rounds
each row to one int8 scale (error <= half that step, max|row| / 254): on real weights, whose
rows carry outliers, that moved the logits of q8_0, q5_* and q6_k files ~3x as far as int4pack's
(docs/performance.md, "Quantized kernels"), so it is kept only where rows are looked up.
dequant is bit-exact (gguf's float32 weights), rebuilt tile by tile every forward.
CELERYTP_QUANT_KERNEL=dequant forces the exact path; =int8pack runs the int8pack types of before
(one scale per row: 1.0 byte/weight instead of int4split's 1.25). Each fast kernel is checked
once per process against dequant on a probe matrix; on an error or a mismatch the layer takes
the next kernel (int4split -> int8pack -> dequant, logged).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.switches import KERNEL_ENV, switch
from celerytp.layers.packed_linear import float_linear
from celerytp.loading.checkpoint import Range, TensorSource
from celerytp.quant.blocks import QK, Unpacked, quantize_blocks, unpack_blocks
from celerytp.quant.formats import GGML_TYPES, TILED_FORMATS, QuantFormat, QuantPlan

log = logging.getLogger(__name__)
T = GGMLQuantizationType
INT4_TYPES = tuple(GGML_TYPES[name] for name in TILED_FORMATS)
# Block types whose fast kernel keeps the block scales (int4split; measured by benchmarks/quant.py
# --files, docs/performance.md "Quantized kernels"); a weight also read by rows takes int8pack.
SPLIT_TYPES = (T.Q8_0, T.Q8_1, T.Q8_K, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K)
PROBE_RTOL = 0.02  # bf16 activations and scales: ~3 significant digits
# int4split keeps every block scale: on the probe it is within 0.005 (int8pack's row re-rounding:
# 0.006-0.011), so a layout that lost a scale or a zero fails it and the next kernel runs instead.
PROBE_RTOL_KERNEL = {"int4split": 0.01}
TILE_ELEMENTS = 1 << 22  # the dequant kernel rebuilds at most this many weights at a time


def _mark(t: torch.Tensor, sharded: bool) -> torch.Tensor:
    t.tp_sharded = sharded  # read by CausalLM.memory_report (buffers too)
    return t


@dataclass
class _Staged:
    start: int  # first local row
    fmt: QuantFormat
    data: torch.Tensor  # uint8 blocks, or the float weight
    names: list[str]  # checkpoint tensors in these rows


class QuantizedWeight(nn.Module):
    """A (out_features, in_features) weight kept per checkpoint slice in its plan's format,
    applied as y = x W^T (+ b).

    Args:
        plan: the load's QuantPlan (one target format, or each tensor's GGUF type).
        out_features, in_features: this rank's local shape.
        dtype: the compute dtype (activations and outputs).
        sharded: this rank holds a slice (False for a replicated lm_head), for memory reports.
    """

    def __init__(
        self,
        plan: QuantPlan,
        out_features: int,
        in_features: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        sharded: bool = True,
    ) -> None:
        super().__init__()
        self.plan, self.out_features, self.in_features = plan, out_features, in_features
        self.dtype, self.device, self.sharded = dtype, device, sharded
        self._staged: list[_Staged] = []
        self.fallbacks: list[str] = []  # "<tensor>: q4_k -> q5_0 (why)"
        self.parts = nn.ModuleList()

    def extra_repr(self) -> str:
        return f"out={self.out_features}, in={self.in_features}"

    # ---- loading -----------------------------------------------------------------------------

    def load(self, source: TensorSource, row_offset: int, rows: Range | None = None, cols: Range | None = None) -> None:
        """Stage a checkpoint slice for rows row_offset.. of this weight, in its storage format."""
        start, stop = cols if cols is not None else (0, source.shape[1])
        fmt, fallback = self.plan.format_for(source.ggml_type, self.dtype, start, stop - start)
        if fallback:
            self.fallbacks.append(f"{source.name}: {fallback}")
        if fmt.float_dtype is not None:
            value = source.read(rows, cols).to(device=self.device, dtype=fmt.float_dtype)
        else:
            value = source.read_blocks(fmt.ggml_type, rows, cols).to(self.device)
        expected = stop - start if fmt.float_dtype is not None else (stop - start) // fmt.block_size * fmt.type_size
        if (
            stop - start != self.in_features
            or value.shape[1] != expected
            or row_offset + value.shape[0] > self.out_features
        ):
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"{source.name}: slice {tuple(value.shape)} does not fit rows {row_offset}: of ({self.out_features}, {self.in_features})",
            )
        self._staged.append(_Staged(row_offset, fmt, value, [source.name]))

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Convert the staged slices into kernel layouts (once, after every shard is loaded)."""
        if not self._staged:
            return
        runs: list[_Staged] = []
        for s in sorted(self._staged, key=lambda s: s.start):
            last = runs[-1] if runs else None
            expect = last.start + last.data.shape[0] if last else 0
            if s.start != expect:
                raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{s.names}: rows from {s.start} loaded, expected {expect}")
            if last is not None and last.fmt == s.fmt:  # one kernel call for rows sharing a format
                runs[-1] = _Staged(last.start, last.fmt, torch.cat([last.data, s.data]), last.names + s.names)
            else:
                runs.append(s)
        self._staged = []
        if runs[-1].start + runs[-1].data.shape[0] != self.out_features:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"{runs[-1].names}: only {runs[-1].start + runs[-1].data.shape[0]} of {self.out_features} rows loaded",
            )
        for run in runs:
            self.parts.append(
                _Part(run.fmt, run.data, run.names, self.dtype, self.sharded, self.plan.exact, self.plan.row_lookup)
            )

    def summary(self) -> list[tuple[str, list[str], int]]:
        """(format, checkpoint tensors, bytes) per part."""
        return [(p.fmt.name, p.names, sum(b.nbytes for b in p.buffers())) for p in self.parts]

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        ys = [part(x2) for part in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out_features)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of the weight in the compute dtype, dequantizing only those rows
        (an embedding lookup). Needs one part whose layout has row access (not int4pack's tiles)."""
        if len(self.parts) != 1:
            raise ValueError(f"row lookup needs one format, this weight has {len(self.parts)}")
        return self.parts[0].lookup(ids.reshape(-1)).to(self.dtype).view(*ids.shape, self.in_features)


class _Part(nn.Module):
    """Consecutive output rows of a QuantizedWeight in one format and kernel layout."""

    def __init__(
        self,
        fmt: QuantFormat,
        data: torch.Tensor,
        names: list[str],
        dtype: torch.dtype,
        sharded: bool,
        exact: bool,
        row_lookup: bool = False,
    ) -> None:
        super().__init__()
        self.fmt, self.names, self.rows = fmt, names, data.shape[0]
        if fmt.float_dtype is not None:
            self.kernel = "float"
            self.register_buffer("w", _mark(data.contiguous(), sharded))
            return
        qtype = fmt.ggml_type
        unpacked = unpack_blocks(data, qtype)
        self.offset, self.group, self.in_features = unpacked.offset, unpacked.group, unpacked.q.shape[1]
        kernels = ["dequant"] if exact else _candidates(qtype, data.device, dtype, row_lookup)
        for kernel in kernels:
            try:
                layout = make_layout(kernel, unpacked)
                break
            except (RuntimeError, ValueError) as exc:  # a shape (or codes) the kernel does not take
                if kernel == "dequant":
                    raise
                log.warning("%s %s: %s kernel refused (%s); trying the next", fmt.name, names, kernel, exc)
        self.kernel = kernel
        for name, value in layout.items():
            self.register_buffer(name, _mark(value, sharded) if value is not None else None)

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, rows={self.rows}, kernel={self.kernel}"

    def lookup(self, flat: torch.Tensor) -> torch.Tensor:
        """Rows `flat` (1-D) of this part's weight, dequantized (float32 or the float dtype)."""
        if self.kernel == "float":
            return self.w[flat]
        if self.kernel == "int8pack":
            return self.q[flat].float() * self.scale[flat].float()[:, None]
        if self.kernel == "dequant":
            b = {k: None if v is None else v[flat] for k, v in self._buffers.items()}
            return dequantize_layout(b, self.offset, self.group, self.in_features)
        raise ValueError(f"{self.kernel} layout has no row lookup")

    def forward(self, x2: torch.Tensor) -> torch.Tensor:
        if self.kernel == "float":
            return float_linear(x2, self.w.to(x2.dtype), None)
        if self.kernel != "dequant":
            return run_kernel(self.kernel, self._buffers, x2, self.rows)
        step = max(1, TILE_ELEMENTS // self.in_features)
        if step >= self.rows:
            return float_linear(
                x2, dequantize_layout(self._buffers, self.offset, self.group, self.in_features).to(x2.dtype), None
            )
        tiles = []
        for r in range(0, self.rows, step):
            w = dequantize_layout(
                self._buffers, self.offset, self.group, self.in_features, (r, min(r + step, self.rows))
            )
            tiles.append(float_linear(x2, w.to(x2.dtype), None))
        return torch.cat(tiles, dim=-1)


# ---- layouts and kernels (pure functions of tensors, testable alone) -----------------------------


def preferred_kernel(
    qtype: GGMLQuantizationType, device: torch.device, dtype: torch.dtype, row_lookup: bool = False
) -> str:
    """The kernel a part of this type takes: the first of `_candidates` whose probe passed in this
    process for (type, device) (int4split before int8pack: same speed, block scales kept)."""
    return _candidates(qtype, device, dtype, row_lookup)[0]


def _candidates(qtype: GGMLQuantizationType, device: torch.device, dtype: torch.dtype, row_lookup: bool) -> list[str]:
    """Kernels to try for a part, best first, each having passed its probe; dequant always last.

    int4pack for the 4-bit types; int4split (block scales kept) for SPLIT_TYPES unless the weight
    is also read by rows (a tied embedding: int8pack, which has row access) or
    CELERYTP_QUANT_KERNEL=int8pack; int8pack for any other block type.
    """
    mode = switch(KERNEL_ENV)  # auto, dequant or int8pack (a typo fails the load: core/switches.py)
    if mode == "dequant":
        return ["dequant"]
    if qtype in INT4_TYPES:
        wanted = ["int4pack"]
    elif qtype in SPLIT_TYPES and not row_lookup and mode != "int8pack":
        wanted = ["int4split", "int8pack"]
    else:
        wanted = ["int8pack"]
    return [k for k in wanted if _probe(k, qtype, str(device))] + ["dequant"]


@functools.cache
def _probe(kernel: str, qtype: GGMLQuantizationType, device: str) -> bool:
    """Run `kernel` on a small random matrix and compare with the exact dequantized product."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 512, generator=g)
    x = torch.randn(3, 512, generator=g)
    u = unpack_blocks(quantize_blocks(w, qtype), qtype)
    ref = x @ u.dequantize().T
    try:
        u = Unpacked(*(t.to(device) if t is not None else None for t in (u.q, u.scale, u.zero)), u.offset, u.group)
        y = run_kernel(kernel, make_layout(kernel, u), x.to(device), 64).float().cpu()
    except (RuntimeError, ValueError, NotImplementedError) as exc:
        log.warning("quant kernel %s for %s on %s unavailable (%s); not used", kernel, qtype.name, device, exc)
        return False
    err = float((y - ref).abs().max() / ref.abs().max())
    if err > PROBE_RTOL_KERNEL.get(kernel, PROBE_RTOL):
        log.warning("quant kernel %s for %s on %s is off by %.3g (relative); not used", kernel, qtype.name, device, err)
        return False
    return True


def make_layout(kernel: str, u: Unpacked) -> dict[str, torch.Tensor | None]:
    """The buffers `kernel` reads, built from unpacked codes and scales."""
    K = u.q.shape[1]
    if kernel == "dequant":
        q = u.q
        if q.dtype == torch.uint8 and int(q.max()) < 16 and K % 2 == 0:  # two codes per byte
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        return {
            "q": q.contiguous(),
            "scale": u.scale.contiguous(),
            "zero": None if u.zero is None else u.zero.contiguous(),
        }
    if kernel == "int8pack":
        # One scale per row, max|w| / 127 (a q8_0 row's widest block keeps its codes).
        w = u.dequantize()  # (N, K)
        scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        q = torch.round(w / scale.float()[:, None]).clamp(-128, 127).to(torch.int8)
        return {"q": q, "scale": scale}
    if kernel == "int4pack":
        if u.group != QK:
            raise ValueError(f"int4pack takes groups of {QK}, not {u.group}")
        # tinygemm: w = s * (q - 8) + z, so z = zero + 8 s when the codes are not centred.
        zero = torch.zeros_like(u.scale) if u.zero is None else u.zero
        if u.offset == 0:
            zero = zero + 8 * u.scale
        return {"packed": _pack_int4(u.q), "sz": _sz(u.scale, zero)}
    if kernel == "int4split":
        codes, scale, zero, xmul = _split(u)
        return {"packed": _pack_int4(codes), "sz": _sz(scale, zero), "xmul": xmul}
    raise ValueError(f"unknown quant kernel {kernel!r}")


def _sz(scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """tinygemm's (groups, N, 2) bfloat16 scales and zeros from (N, groups) ones."""
    return torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """tinygemm's packing of (N, K) codes 0..15."""
    if codes.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    codes = codes.to(torch.uint8)
    pairs = (codes[:, 0::2] << 4 | codes[:, 1::2]).contiguous()
    return torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(codes.shape[1]))


def _split(u: Unpacked) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4split's layout: a block's codes as 4-bit codes over 2K inputs in 32-groups, each with
    its own scale and zero (tinygemm: w = s * (c - 8) + z), and the input multipliers xmul (2, W):
    input j of width-W chunk i feeds K' columns (i, 0, j) and (i, 1, j), times xmul[:, j].

    With w = s * (u - off) + zero the format's weight (u the unsigned code; int8 codes as
    u = q + 128, off + 128):
    - 32-groups (q8_0, q8_1, q8_k, q5_0, q5_1, q5_k): u = lo + 16 hi. Per 32-block two groups
      over the same inputs: lo with scale s and zero 8 s, hi with scale 16 s, code hi - c + 8 and
      zero `zero + s (16 c - off)`; they sum to s (u - off) + zero.
    - 16-groups whose codes fit a nibble (q2_k, q3_k): per group one 32-group, code u - c + 8 and
      zero `zero + s (c - off)`, then 16 columns fed zeros (xmul 0).
    - 16-groups of 6-bit codes (q6_k: off 32, no zero): per group lo over the inputs and
      2 hi + 5 over 8 times them: s (lo - 8) + 8 s (2 hi + 5 - 8) = s (u - 32).
    Without a zero, c = off / 16 (32-groups) or off (16-groups): every scale, zero and multiplier
    is then a power of two times s, or 0, so the weights are exact given s in bfloat16. With one
    (q5_1, q5_k, q2_k), c is the codes' middle, so the zero rounded to bfloat16 is the block's
    middle weight rather than its minimum, which is smaller (int4pack's zero + 8 s for q4_1 does
    the same; on the probe matrix it halves q5_1's error).
    """
    N, K = u.q.shape
    signed = u.q.dtype == torch.int8
    code = u.q.to(torch.int32) + (128 if signed else 0)
    off = u.offset + (128 if signed else 0)
    scale, zero = u.scale, u.zero
    ones = torch.ones(32)
    if u.group % QK == 0:
        r = u.group // QK
        scale = scale.repeat_interleave(r, 1)  # (N, K/32)
        hi = code >> 4
        if zero is None:
            if off % 16:
                raise ValueError(f"int4split needs an offset that is a multiple of 16, not {off}")
            c, zero = off // 16, torch.zeros_like(scale)
        else:
            c = (int(hi.max()) + 1) // 2
            zero = zero.repeat_interleave(r, 1) + scale * (16 * c - off)
        codes = torch.stack([(code & 15).view(N, K // QK, QK), (hi - c + 8).view(N, K // QK, QK)], 2)
        scales = torch.stack([scale, 16 * scale], -1)
        zeros = torch.stack([8 * scale, zero], -1)
        xmul = torch.stack([ones, ones])
    elif u.group == 16:
        g = code.view(N, K // 16, 16)
        lo, top = int(code.min()), int(code.max())
        c = off if zero is None else (lo + top + 1) // 2
        if top - c + 8 <= 15 and lo - c + 8 >= 0:  # one nibble
            codes = torch.stack([g - c + 8, torch.full_like(g, 8)], 2)
            zero = torch.zeros_like(scale) if zero is None else zero + scale * (c - off)
            scales, zeros, xmul = scale, zero, torch.stack([ones[:16], 0 * ones[:16]])
        else:
            if zero is not None or off != 32:
                raise ValueError(f"int4split takes 16-groups of 6-bit codes at offset 32 without zero, not {off}")
            codes = torch.stack([g & 15, 2 * (g >> 4) + 5], 2)
            scales, zeros, xmul = scale, torch.zeros_like(scale), torch.stack([ones[:16], 8 * ones[:16]])
    else:
        raise ValueError(f"int4split takes groups of 16 or multiples of {QK}, not {u.group}")
    codes = codes.reshape(N, 2 * K)
    if int(codes.min()) < 0 or int(codes.max()) > 15:
        raise ValueError("int4split: codes out of 0..15")
    return codes, scales.reshape(N, -1), zeros.reshape(N, -1), xmul.to(torch.bfloat16).to(u.q.device)


def _inner_k_tiles(K: int) -> int:
    return next((t for t in (8, 4, 2) if K % (t * 16) == 0), 2)


def dequantize_layout(
    b: dict[str, torch.Tensor | None], offset: int, group: int, in_features: int, rows: Range | None = None
) -> torch.Tensor:
    """float32 (rows, K) of a dequant layout, bit-identical to gguf's dequantization."""
    r = slice(*rows) if rows is not None else slice(None)
    q = b["q"][r]
    if q.shape[1] != in_features:  # nibble pairs
        q = torch.stack([q & 0x0F, q >> 4], dim=-1).view(q.shape[0], -1)
    zero = b["zero"]
    return Unpacked(q, b["scale"][r], None if zero is None else zero[r], offset, group).dequantize()


def run_kernel(kernel: str, b: dict[str, torch.Tensor | None], x: torch.Tensor, n: int) -> torch.Tensor:
    """y (M, n) = x (M, K) W^T with a torch weight-only kernel (bfloat16 activations)."""
    xb = x.to(torch.bfloat16).contiguous()  # the kernels read rows densely
    if kernel == "int4split":  # each input feeds two columns (see _split)
        M, K = xb.shape
        W = b["xmul"].shape[1]
        xb = (xb.view(M, K // W, 1, W) * b["xmul"]).view(M, 2 * K)
    if kernel == "int8pack":
        y = torch.ops.aten._weight_int8pack_mm(xb, b["q"], b["scale"])
    elif x.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, b["packed"], QK, b["sz"])
    else:
        y = torch.ops.aten._weight_int4pack_mm(xb, b["packed"], QK, b["sz"])
    return y.to(x.dtype)
