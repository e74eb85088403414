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
# What this version executes; every other accepted name is refused with bad_request.
EXECUTABLE = ("q8_0", "q4_0", "q4_1", "q4_k", "f16", "bf16", "f32")
FLOAT_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
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


def parse_quant(name: str) -> QuantFormat:
    """The format a `quant` string names; CeleryTPError(ErrorKind.BAD_REQUEST) for unknown or unexecutable names."""
    canonical = _BY_KEY.get(name.strip().lower().replace("_", ""))
    if canonical is None:
        raise CeleryTPError(
            ErrorKind.BAD_REQUEST, f"unknown quant {name!r}; accepted (case-insensitive, '_' optional): {', '.join(ACCEPTED_NAMES)}"
        )
    if canonical not in EXECUTABLE:
        raise CeleryTPError(
            ErrorKind.BAD_REQUEST,
            f"quant {name!r} ({canonical}) is a ggml type this version cannot execute; executable: {', '.join(EXECUTABLE)}",
        )
    return QuantFormat.of(canonical)
