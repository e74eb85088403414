"""Checkpoint readers: resolve a path to a Hugging Face directory or a GGUF file, read slices."""

from __future__ import annotations

import os
from pathlib import Path

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.model_files import check_model_directory, is_gguf_file
from celerytp.loading.checkpoint import Checkpoint, ReadRecord, TensorSource
from celerytp.loading.gguf_file import GGUFCheckpoint
from celerytp.loading.safetensors_dir import SafetensorsCheckpoint

__all__ = [
    "Checkpoint",
    "GGUFCheckpoint",
    "ReadRecord",
    "SafetensorsCheckpoint",
    "TensorSource",
    "open_checkpoint",
]

def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a .gguf file or a Hugging Face directory (config.json + safetensors).

    A directory holding a FIFO, socket or device is refused (CeleryTPError, load_failed) before
    any of its files is opened, and every file is opened as a regular file only.
    """
    p = Path(path)
    if p.is_dir():
        check_model_directory(p)
    if p.is_file() and is_gguf_file(p):
        return GGUFCheckpoint(p)
    if p.is_dir() and (p / "config.json").is_file():
        return SafetensorsCheckpoint(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFCheckpoint(ggufs[0])
    raise CeleryTPError(
        ErrorKind.UNSUPPORTED_ARCH,
        f"{path}: not a .gguf file nor a directory with config.json" + ("" if p.exists() else " (no such path)"),
    )
