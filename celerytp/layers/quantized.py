"""QuantizedWeight: a linear layer's local weight kept quantized, and the kernels that run it.

The parallel linears (celerytp/layers/linear.py) hold one when built with a QuantPlan. Loading
stages each checkpoint slice in its format (GGUF bytes sliced as they are, or floats quantized
here; see QuantPlan.format_for for per-tensor types and block fallbacks); `finish_loading`
converts each run of rows sharing a format once into the layout of the kernel chosen for it:

| kernel      | formats                                   | layout                                  | activations |
|-------------|-------------------------------------------|-----------------------------------------|-------------|
| int4pack    | q4_0, q4_1, q4_k                          | torch's tinygemm int4 pack, group 32    | bfloat16    |
| int8pack    | q8_0, q8_1, q8_k, q5_0, q5_1, q5_k, q6_k, | int8 + one scale per row (requantized)  | bfloat16    |
|             | q2_k, q3_k                                |                                         |             |
| dequant     | every block format                        | codes + float32 scale/zero per group    | compute     |
| float       | f16, bf16, f32                            | the weight in that dtype                | compute     |

int4pack is exact for the weights up to bfloat16 scales/zeros; int8pack re-rounds each row to
one int8 scale (error <= half that step, max|row| / 254); dequant is bit-exact (gguf's float32
weights), rebuilt tile by tile every forward. CELERYTP_QUANT_KERNEL=dequant forces the exact
path. Each fast kernel is checked once per process against dequant on a probe matrix and on any
error or mismatch the layer falls back to dequant (logged).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import Range, TensorSource
from celerytp.quant.blocks import QK, Unpacked, quantize_blocks, unpack_blocks
from celerytp.quant.formats import GGML_TYPES, TILED_FORMATS, QuantFormat, QuantPlan

log = logging.getLogger(__name__)
T = GGMLQuantizationType
KERNEL_ENV = "CELERYTP_QUANT_KERNEL"
INT4_TYPES = tuple(GGML_TYPES[name] for name in TILED_FORMATS)
PROBE_RTOL = 0.02  # bf16 activations and scales: ~3 significant digits
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
            self.parts.append(_Part(run.fmt, run.data, run.names, self.dtype, self.sharded, self.plan.exact))

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
        self, fmt: QuantFormat, data: torch.Tensor, names: list[str], dtype: torch.dtype, sharded: bool, exact: bool
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
        kernel = "dequant" if exact else preferred_kernel(qtype, data.device, dtype)
        if kernel != "dequant":
            try:
                layout = make_layout(kernel, unpacked)
            except RuntimeError as exc:  # a shape the kernel does not take
                log.warning("%s %s: %s kernel refused (%s); using dequant", fmt.name, names, kernel, exc)
                kernel = "dequant"
        if kernel == "dequant":
            layout = make_layout("dequant", unpacked)
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
            return F.linear(x2, self.w.to(x2.dtype))
        if self.kernel != "dequant":
            return run_kernel(self.kernel, self._buffers, x2, self.rows)
        step = max(1, TILE_ELEMENTS // self.in_features)
        if step >= self.rows:
            return F.linear(
                x2, dequantize_layout(self._buffers, self.offset, self.group, self.in_features).to(x2.dtype)
            )
        tiles = []
        for r in range(0, self.rows, step):
            w = dequantize_layout(
                self._buffers, self.offset, self.group, self.in_features, (r, min(r + step, self.rows))
            )
            tiles.append(F.linear(x2, w.to(x2.dtype)))
        return torch.cat(tiles, dim=-1)


# ---- layouts and kernels (pure functions of tensors, testable alone) -----------------------------


def preferred_kernel(qtype: GGMLQuantizationType, device: torch.device, dtype: torch.dtype) -> str:
    """The fastest kernel that passed this process's probe for (type, device), else dequant."""
    if os.environ.get(KERNEL_ENV, "auto") == "dequant":
        return "dequant"
    kernel = "int4pack" if qtype in INT4_TYPES else "int8pack"
    if not _probe(kernel, qtype, str(device)):
        return "dequant"
    return kernel


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
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("quant kernel %s for %s on %s unavailable (%s); using dequant", kernel, qtype.name, device, exc)
        return False
    err = float((y - ref).abs().max() / ref.abs().max())
    if err > PROBE_RTOL:
        log.warning(
            "quant kernel %s for %s on %s is off by %.3g (relative); using dequant", kernel, qtype.name, device, err
        )
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
        sz = torch.stack([u.scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()  # (K/32, N, 2)
        if u.q.device.type == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.q.to(torch.int32).contiguous(), 1)
        else:
            pairs = (u.q[:, 0::2] << 4 | u.q[:, 1::2]).contiguous()
            packed = torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(K))
        return {"packed": packed, "sz": sz}
    raise ValueError(f"unknown quant kernel {kernel!r}")


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
    if kernel == "int8pack":
        y = torch.ops.aten._weight_int8pack_mm(xb, b["q"], b["scale"])
    elif x.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, b["packed"], QK, b["sz"])
    else:
        y = torch.ops.aten._weight_int4pack_mm(xb, b["packed"], QK, b["sz"])
    return y.to(x.dtype)
