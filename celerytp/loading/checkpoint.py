"""The checkpoint interface the model loader reads through: names, shapes and slice reads."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from celerytp.core.errors import CeleryTPError, ErrorKind

Range = tuple[int, int]  # [start, stop)


@dataclass(frozen=True)
class ReadRecord:
    """One slice read, kept so tests (and curious operators) can see what a rank touched."""

    name: str
    shape: tuple[int, ...]  # the slice that was read
    full_shape: tuple[int, ...]  # the whole tensor in the checkpoint


class TensorSource(ABC):
    """One checkpoint tensor, in Hugging Face orientation ((out, in) for a linear weight).

    `read` returns only the requested rows/columns; subclasses never materialize more of a
    2-D tensor than that slice (GGUF widens a column slice to whole quant blocks, then crops).
    """

    def __init__(self, name: str, shape: tuple[int, ...], log: list[ReadRecord]) -> None:
        self.name = name
        self.shape = shape
        self._log = log

    def read(self, rows: Range | None = None, cols: Range | None = None) -> torch.Tensor:
        """The slice [rows, cols] of this tensor (whole dimension where None)."""
        # 3-D and up (a conv1d weight): whole trailing dims, rows only.
        if not self.shape or (len(self.shape) != 2 and cols is not None):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{self.name}: cannot slice a tensor of shape {self.shape}")
        r = self._check_range(rows, 0)
        c = self._check_range(cols, 1) if len(self.shape) == 2 else None
        out = self._read(r, c)
        expected = (r[1] - r[0], *self.shape[1:]) if c is None else (r[1] - r[0], c[1] - c[0])
        if tuple(out.shape) != expected:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{self.name}: read shape {tuple(out.shape)}, expected {expected}")
        self._log.append(ReadRecord(self.name, expected, self.shape))
        return out

    def _check_range(self, rng: Range | None, dim: int) -> Range:
        size = self.shape[dim]
        start, stop = rng if rng is not None else (0, size)
        if not 0 <= start <= stop <= size:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{self.name}: range {start}:{stop} outside dim {dim} of size {size}")
        return start, stop

    @abstractmethod
    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor: ...

    def column_block(self) -> int:
        """Column slices must start and stop on multiples of this (quant block size)."""
        return 1

    @property
    def ggml_type(self) -> GGMLQuantizationType | None:
        """How the checkpoint stores this tensor, for GGUF; None for other checkpoints."""
        return None

    def read_blocks(self, qtype: GGMLQuantizationType, rows: Range | None = None, cols: Range | None = None) -> torch.Tensor:
        """The slice as raw ggml blocks of `qtype`: uint8 (rows, cols / block * type_size).

        This base version quantizes the float slice; GGUF sources holding `qtype` already
        return their bytes untouched (no dequantize/requantize round trip).
        """
        from celerytp.quant.blocks import quantize_blocks  # the codec imports nothing of loading

        return quantize_blocks(self.read(rows, cols), qtype)


@dataclass
class Checkpoint(ABC):
    """An opened checkpoint: its config as a Hugging Face config dict, and its tensors.

    Args:
        path: the file or directory it came from.
        hf_config: config.json's contents, or the GGUF metadata translated to those keys.
        reads: every slice read so far (see ReadRecord).
    """

    path: Path
    hf_config: dict[str, Any]
    reads: list[ReadRecord] = field(default_factory=list)

    @abstractmethod
    def names(self) -> list[str]:
        """Tensor names, in Hugging Face naming (`model.layers.0.self_attn.q_proj.weight`)."""

    @abstractmethod
    def source(self, name: str) -> TensorSource: ...

    def close(self) -> None:
        """Drop file handles and memory maps."""

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
