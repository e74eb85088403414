"""QuantizedWeight: a linear layer's local weight kept quantized, and the kernels that run it.

The parallel linears (celerytp/layers/linear.py) hold one when built with `quant`. Loading
stages each shard's raw ggml blocks (GGUF bytes sliced as they are, or floats quantized here);
`finish_loading` converts them once into the layout of the kernel chosen for this device:

| kernel      | formats            | layout                                   | activations |
|-------------|--------------------|------------------------------------------|-------------|
| int4pack    | q4_0, q4_1, q4_k   | torch's tinygemm int4 pack, group 32     | bfloat16    |
| int8pack    | q8_0               | int8 + one scale per row (requantized)   | bfloat16    |
| dequant     | q8_0, q4_*         | codes + float32 scale/zero per 32        | compute     |
| float       | f16, bf16, f32     | the weight in that dtype                 | compute     |

int4pack is exact for the weights up to bfloat16 scales/zeros; int8pack re-rounds each q8_0
row to one scale (error <= half that step); dequant is bit-exact (gguf's float32 weights)
but rebuilds the matrix every forward. CELERYTP_QUANT_KERNEL=dequant forces the exact path.
Each fast kernel is checked once per process against dequant on a probe matrix and on any
error or mismatch the layer falls back to dequant (logged).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import Range, TensorSource
from celerytp.quant.blocks import QK, Unpacked, quantize_blocks, unpack_blocks
from celerytp.quant.formats import QuantFormat

log = logging.getLogger(__name__)
T = GGMLQuantizationType
KERNEL_ENV = "CELERYTP_QUANT_KERNEL"
INT4_TYPES = (T.Q4_0, T.Q4_1, T.Q4_K)
PROBE_RTOL = 0.02  # bf16 activations and scales: ~3 significant digits


def check_block_aligned(start: int, size: int, total: int, fmt: QuantFormat, what: str) -> None:
    """A row-parallel slice of the input dim must not cut a quant block."""
    if start % fmt.block_size or size % fmt.block_size:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"{what}: this rank's input columns {start}:{start + size} of {total} cut {fmt.name} blocks of "
            f"{fmt.block_size} (start {start} and size {size} must be multiples of {fmt.block_size})",
        )


def _mark(t: torch.Tensor, sharded: bool) -> torch.Tensor:
    t.tp_sharded = sharded  # read by CausalLM.memory_report (buffers too)
    return t


class QuantizedWeight(nn.Module):
    """A (out_features, in_features) weight stored in `fmt`, applied as y = x W^T (+ b).

    Args:
        fmt: the storage format (a block format or f16/bf16/f32).
        out_features, in_features: this rank's local shape.
        dtype: the compute dtype (activations and outputs).
        sharded: this rank holds a slice (False for a replicated lm_head), for memory reports.
    """

    def __init__(
        self,
        fmt: QuantFormat,
        out_features: int,
        in_features: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        sharded: bool = True,
    ) -> None:
        super().__init__()
        if in_features % fmt.block_size:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"in_features {in_features} is not a multiple of the {fmt.name} block size {fmt.block_size}"
            )
        self.fmt, self.out_features, self.in_features = fmt, out_features, in_features
        self.dtype, self.sharded, self.kernel = dtype, sharded, "float" if fmt.float_dtype else "staged"
        if fmt.float_dtype is not None:
            self.register_buffer("w", _mark(torch.empty(out_features, in_features, dtype=fmt.float_dtype, device=device), sharded))
        else:
            nbytes = in_features // fmt.block_size * fmt.type_size
            self.register_buffer("staged", torch.empty(out_features, nbytes, dtype=torch.uint8, device=device))

    def extra_repr(self) -> str:
        return f"{self.fmt.name}, out={self.out_features}, in={self.in_features}, kernel={self.kernel}"

    # ---- loading -----------------------------------------------------------------------------

    def load(self, source: TensorSource, row_offset: int, rows: Range | None = None, cols: Range | None = None) -> None:
        """Copy a checkpoint slice into rows row_offset.. of this weight, in the storage format."""
        if self.kernel == "float":
            value = source.read(rows, cols).to(self.fmt.float_dtype)
            dest = self.w
        else:
            value = source.read_blocks(self.fmt.ggml_type, rows, cols)
            dest = self.staged
        stop = row_offset + value.shape[0]
        if value.shape[1] != dest.shape[1] or stop > dest.shape[0]:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"{source.name}: slice {tuple(value.shape)} does not fit rows {row_offset}:{stop} of {tuple(dest.shape)}"
            )
        dest[row_offset:stop].copy_(value)

    @torch.no_grad()
    def finish_loading(self) -> None:
        """Convert the staged blocks into the kernel's layout (once, after every shard is loaded)."""
        if self.kernel != "staged":
            return
        qtype = self.fmt.ggml_type
        unpacked = unpack_blocks(self.staged, qtype)
        del self.staged
        kernel = preferred_kernel(qtype, unpacked.q.device, self.dtype)
        if kernel != "dequant":
            try:
                self._set_layout(kernel, unpacked)
                self.kernel = kernel
                return
            except RuntimeError as exc:  # a shape the kernel does not take
                log.warning("%s %s: %s kernel refused (%s); using dequant", self.fmt.name, self.extra_repr(), kernel, exc)
        self._set_layout("dequant", unpacked)
        self.kernel = "dequant"

    def _set_layout(self, kernel: str, u: Unpacked) -> None:
        for name, value in make_layout(kernel, u).items():
            self.register_buffer(name, _mark(value, self.sharded) if value is not None else None)
        self.offset = u.offset

    # ---- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])  # (M, K)
        if self.kernel in ("float", "dequant"):
            w = self.w if self.kernel == "float" else dequantize_layout(self._buffers, self.offset)
            y = F.linear(x2, w.to(x2.dtype))
        else:
            y = run_kernel(self.kernel, self._buffers, x2, self.out_features)
        if bias is not None:
            y = y + bias
        return y.reshape(*shape[:-1], self.out_features)


    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (any shape) of the weight in the compute dtype, dequantizing only those rows
        (an embedding lookup). int4pack's tiled layout has no row access: not offered for it."""
        flat = ids.reshape(-1)
        if self.kernel == "float":
            w = self.w[flat]
        elif self.kernel == "int8pack":
            w = self.q[flat].float() * self.scale[flat].float()[:, None]
        elif self.kernel == "dequant":
            b = {k: None if v is None else v[flat] for k, v in self._buffers.items() if k in ("q", "scale", "zero")}
            w = dequantize_layout(b, self.offset)
        else:
            raise ValueError(f"{self.kernel} layout has no row lookup")
        return w.to(self.dtype).view(*ids.shape, self.in_features)


# ---- layouts and kernels (pure functions of tensors, testable alone) -----------------------------


def preferred_kernel(qtype: GGMLQuantizationType, device: torch.device, dtype: torch.dtype) -> str:
    """The fastest kernel that passed this process's probe for (type, device), else dequant."""
    if os.environ.get(KERNEL_ENV, "auto") == "dequant":
        return "dequant"
    kernel = "int4pack" if qtype in INT4_TYPES else "int8pack" if qtype == T.Q8_0 else "dequant"
    if kernel != "dequant" and not _probe(kernel, qtype, str(device)):
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
        u = Unpacked(*(t.to(device) if t is not None else None for t in (u.q, u.scale, u.zero)), u.offset)
        y = run_kernel(kernel, make_layout(kernel, u), x.to(device), 64).float().cpu()
    except (RuntimeError, NotImplementedError) as exc:
        log.warning("quant kernel %s for %s on %s unavailable (%s); using dequant", kernel, qtype.name, device, exc)
        return False
    err = float((y - ref).abs().max() / ref.abs().max())
    if err > PROBE_RTOL:
        log.warning("quant kernel %s for %s on %s is off by %.3g (relative); using dequant", kernel, qtype.name, device, err)
        return False
    return True


def make_layout(kernel: str, u: Unpacked) -> dict[str, torch.Tensor | None]:
    """The buffers `kernel` reads, built from unpacked codes and scales."""
    N, K = u.q.shape
    if kernel == "dequant":
        q = u.q if u.q.dtype == torch.int8 else u.q[:, 0::2] | (u.q[:, 1::2] << 4)  # two codes per byte
        return {"q": q.contiguous(), "scale": u.scale.contiguous(), "zero": None if u.zero is None else u.zero.contiguous()}
    if kernel == "int8pack":
        # One scale per row: the row's largest block scale, so the widest block keeps its codes.
        w = u.dequantize()  # (N, K)
        scale = u.scale.amax(1).clamp(min=torch.finfo(torch.float32).tiny).to(torch.bfloat16)
        q = torch.round(w / scale.float()[:, None]).clamp(-128, 127).to(torch.int8)
        return {"q": q, "scale": scale}
    if kernel == "int4pack":
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


def dequantize_layout(b: dict[str, torch.Tensor | None], offset: int) -> torch.Tensor:
    """float32 (N, K) of a dequant layout, bit-identical to gguf's dequantization."""
    q = b["q"]
    if q.dtype == torch.uint8:  # nibble pairs
        q = torch.stack([q & 0x0F, q >> 4], dim=-1).view(q.shape[0], -1)
    scale, zero = b["scale"], b["zero"]
    return Unpacked(q, scale, zero, offset).dequantize()


def run_kernel(kernel: str, b: dict[str, torch.Tensor | None], x: torch.Tensor, n: int) -> torch.Tensor:
    """y (M, n) = x (M, K) W^T with a torch weight-only kernel (bfloat16 activations)."""
    xb = x.to(torch.bfloat16)
    if kernel == "int8pack":
        y = torch.ops.aten._weight_int8pack_mm(xb, b["q"], b["scale"])
    elif x.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, b["packed"], QK, b["sz"])
    else:
        y = torch.ops.aten._weight_int4pack_mm(xb, b["packed"], QK, b["sz"])
    return y.to(x.dtype)
