"""GGUFSource: one GGUF tensor presented as a TensorSource (HF orientation, per-rank slice reads).

GGUF stores a 2-D weight as rows of quant blocks; a rank's rows are a slice of the memory
map, its columns a block-aligned byte range of each row. Only that slice is dequantized.
Shared by gguf_file.py (dense architectures) and gguf_hybrid.py.
"""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.read_deadline import within
from celerytp.loading.checkpoint import Range, ReadRecord, TensorSource
from celerytp.quant.blocks import dequantize_blocks

_OWN_CODEC = (gguf.GGMLQuantizationType.Q8_1, gguf.GGMLQuantizationType.Q8_K)
_FLOAT_TYPES = {
    gguf.GGMLQuantizationType.F32: np.float32,
    gguf.GGMLQuantizationType.F16: np.float16,
}


class GGUFSource(TensorSource):
    """A tensor in the GGUF memory map.

    Args:
        unpermute_head_dim: for llama's q/k, llama.cpp's converter interleaved the two rotary
            halves of each head; pass head_dim to undo it (rows must then be whole heads).
    """

    def __init__(self, tensor: Any, name: str, log: list[ReadRecord], unpermute_head_dim: int | None = None) -> None:
        super().__init__(name, tuple(int(d) for d in reversed(tensor.shape)), log)
        self._tensor = tensor
        self._qtype = tensor.tensor_type
        self._head_dim = unpermute_head_dim

    def column_block(self) -> int:
        if self._qtype in _FLOAT_TYPES:
            return 1
        return gguf.GGML_QUANT_SIZES[self._qtype][0]

    @property
    def ggml_type(self) -> gguf.GGMLQuantizationType:
        return self._qtype

    def read_blocks(
        self, qtype: gguf.GGMLQuantizationType, rows: Range | None = None, cols: Range | None = None
    ) -> torch.Tensor:
        """The slice's own bytes when the file stores `qtype` (kept quantized), else quantized floats."""
        if qtype != self._qtype or self._qtype in _FLOAT_TYPES or len(self.shape) != 2:
            return super().read_blocks(qtype, rows, cols)
        r, c = self._check_range(rows, 0), self._check_range(cols, 1)
        out = torch.from_numpy(self._raw_slice(r, c))  # (rows, blocks * type_size) uint8
        if self._head_dim:
            out = _unpermute_rope_rows(out, self._head_dim)  # whole rows of blocks move
        self._log.append(ReadRecord(self.name, (r[1] - r[0], c[1] - c[0]), self.shape))
        return out

    def _raw_slice(self, rows: Range, cols: Range | None) -> np.ndarray:
        """A copy of just this slice's bytes out of the memory map."""
        raw = self._tensor.data  # memmap: (rows, row_bytes) for quant types, (rows, cols) for floats
        if self._head_dim and (rows[0] % self._head_dim or rows[1] % self._head_dim):
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"{self.name}: rows {rows[0]}:{rows[1]} are not whole heads of {self._head_dim}"
            )
        part = raw[rows[0] : rows[1]]
        if cols is not None:
            part = part[:, slice(*self._byte_range(cols))]
        return within(self.name, lambda: np.array(part, copy=True))

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        # Copy just this slice out of the memory map (widened to whole blocks), dequantize it alone.
        block = self.column_block()
        wide = None if cols is None else (cols[0] // block * block, -(-cols[1] // block) * block)
        raw = self._raw_slice(rows, wide)
        if self._qtype in _OWN_CODEC:  # gguf has no dequantizer for ggml's activation formats
            values = dequantize_blocks(torch.from_numpy(raw), self._qtype).numpy()
        else:
            values = gguf.quants.dequantize(raw, self._qtype)
        if cols is not None:
            values = values[:, cols[0] - wide[0] : cols[1] - wide[0]]
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
        if self._head_dim:
            out = _unpermute_rope_rows(out, self._head_dim)
        return out

    def _byte_range(self, cols: Range) -> Range:
        if self._qtype in _FLOAT_TYPES:
            return cols
        block, type_size = gguf.GGML_QUANT_SIZES[self._qtype]
        if cols[0] % block or cols[1] % block:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"{self.name}: columns {cols[0]}:{cols[1]} are not aligned to {self._qtype.name} blocks of {block}",
            )
        return cols[0] // block * type_size, cols[1] // block * type_size


def _unpermute_rope_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's `permute` for whole heads (see transformers' reverse_permute)."""
    shape = w.shape
    w = w.reshape(-1, head_dim // 2, 2, *shape[1:])  # (heads, hd/2, 2, ...)
    return w.transpose(1, 2).reshape(shape).contiguous()
