"""The `quant` names a load accepts, the ggml type each names, and which of them execute."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from celerytp.core.errors import CeleryTPError, ErrorKind

T = GGMLQuantizationType
# Canonical name -> ggml type. Names are matched case-insensitively, underscores optional.
GGML_TYPES: dict[str, GGMLQuantizationType] = {
    "q4_0": T.Q4_0,
    "q4_1": T.Q4_1,
    "q5_0": T.Q5_0,
    "q5_1": T.Q5_1,
    "q8_0": T.Q8_0,
    "q8_1": T.Q8_1,
    "q2_k": T.Q2_K,
    "q3_k": T.Q3_K,
    "q4_k": T.Q4_K,
    "q5_k": T.Q5_K,
    "q6_k": T.Q6_K,
    "q8_k": T.Q8_K,
    "f16": T.F16,
    "bf16": T.BF16,
    "f32": T.F32,
}
ALIASES = {"q4_k_m": "q4_k", "q5_k_m": "q5_k"}  # llama.cpp's file-type names for the same tensors
ACCEPTED_NAMES = (*GGML_TYPES, *ALIASES)
# What this version executes: every name (see layers/quantized.py for which kernel runs each).
EXECUTABLE = tuple(GGML_TYPES)
# When a rank's slice of a row is not whole blocks: llama.cpp's choice for tensors whose rows are
# not whole K super-blocks (llama-quant.cpp; IQ4_NL, its pick for Q2_K/Q3_K, is not a type here,
# so its same-size sibling Q4_0), then float in the compute dtype.
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q8_k": "q8_0"}

# Run by the int4pack kernel, whose tiled packing has no row access: a weight also read by rows
# (a quantized embedding) keeps these as q8_0 instead.
TILED_FORMATS = ("q4_0", "q4_1", "q4_k")

FLOAT_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
DTYPE_FORMATS = {dtype: name for name, dtype in FLOAT_DTYPES.items()}
_BY_KEY = {name.replace("_", ""): name for name in GGML_TYPES} | {a.replace("_", ""): c for a, c in ALIASES.items()}


@dataclass(frozen=True)
class QuantFormat:
    """How a linear layer's weight is stored.

    Args:
        name: canonical ggml name ("q4_k", "f16", ...).
        ggml_type: the gguf package's type.
        block_size: weights per block along the input dimension (1 for float types).
        type_size: bytes per block.
    """

    name: str
    ggml_type: GGMLQuantizationType
    block_size: int
    type_size: int

    @classmethod
    def of(cls, name: str) -> QuantFormat:
        qtype = GGML_TYPES[name]
        block, size = GGML_QUANT_SIZES[qtype]
        return cls(name, qtype, block, size)

    @classmethod
    def of_type(cls, qtype: GGMLQuantizationType) -> QuantFormat | None:
        name = next((n for n, t in GGML_TYPES.items() if t == qtype), None)
        return None if name is None else cls.of(name)

    @property
    def float_dtype(self) -> torch.dtype | None:
        """The torch dtype of a float format; None for block formats."""
        return FLOAT_DTYPES.get(self.name)

    @property
    def executable(self) -> bool:
        return self.name in EXECUTABLE

    def fits(self, start: int, size: int) -> bool:
        """Whether columns start:start+size of a row are whole blocks of this format."""
        return start % self.block_size == 0 and size % self.block_size == 0


@dataclass(frozen=True)
class QuantPlan:
    """How a load keeps its linear weights.

    Args:
        target: every linear in this format (requantized as needed); None: each tensor keeps
            its GGUF type (float ones stay float in the compute dtype).
        row_lookup: the weight is also read by rows (an embedding), so formats whose kernel packs
            tiles (TILED_FORMATS) are kept as q8_0.
        exact: keep the exact dequant layout instead of a fast kernel's (an untied embedding is
            only read by rows, and a fast layout's re-rounding would cost accuracy for nothing).
    """

    target: QuantFormat | None = None
    row_lookup: bool = False  # the weight is also read by rows (an embedding): no tiled formats
    exact: bool = False  # keep the exact dequant layout (a weight only read by rows needs no matmul kernel)

    def format_for(
        self, file_type: GGMLQuantizationType | None, dtype: torch.dtype, start: int, size: int
    ) -> tuple[QuantFormat, str | None]:
        """The format of one rank's slice (columns start:start+size of each row) and, when that is
        not the wanted one because its blocks do not fit, why (a fallback to report)."""
        wanted = self.target or (QuantFormat.of_type(file_type) if file_type is not None else None)
        if wanted is None or (wanted.float_dtype is not None and self.target is None):
            wanted = QuantFormat.of(DTYPE_FORMATS[dtype])  # a float tensor of the file: the compute dtype
        if self.row_lookup and wanted.name in TILED_FORMATS:
            wanted = QuantFormat.of("q8_0")
        fmt = wanted
        while not fmt.fits(start, size):
            fmt = QuantFormat.of(FALLBACK.get(fmt.name, DTYPE_FORMATS[dtype]))
        if fmt is wanted:
            return fmt, None
        return (
            fmt,
            f"{wanted.name} -> {fmt.name} (columns {start}:{start + size} are not whole {wanted.block_size}-blocks)",
        )


def parse_quant(name: str) -> QuantFormat:
    """The format a `quant` string names; CeleryTPError(ErrorKind.BAD_REQUEST) for a name that is
    not a weight format, listing the executable ones."""
    canonical = _BY_KEY.get(name.strip().lower().replace("_", ""))
    if canonical is None or canonical not in EXECUTABLE:
        raise CeleryTPError(
            ErrorKind.BAD_REQUEST,
            f"unknown quant {name!r}; executable (case-insensitive, '_' optional): {', '.join((*EXECUTABLE, *ALIASES))}",
        )
    return QuantFormat.of(canonical)
