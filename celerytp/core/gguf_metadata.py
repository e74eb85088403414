"""A GGUF file's key-value metadata, read without its tensors (tokenizer and config on the leader).

The `gguf` package's reader parses every field and tensor description into numpy views, which
takes seconds for a tokenizer's 50k-entry arrays; the leader needs only the metadata, so this
reads the key-value section with `struct` in one pass (the layout of GGUF versions 2 and 3).
"""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind

_MAGIC = b"GGUF"
# GGUF value type -> struct format of one scalar (8: string, 9: array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_ITEMS = 1 << 24  # no real tokenizer comes near; a corrupt count must not allocate gigabytes


class _Cursor:
    def __init__(self, data: mmap.mmap):
        self.data = data
        self.pos = 0

    def take(self, fmt: str, count: int = 1) -> tuple:
        layout = f"<{count}{fmt}" if len(fmt) == 1 else f"<{fmt}"
        size = struct.calcsize(layout)
        if self.pos + size > len(self.data):
            raise ValueError(f"truncated at byte {self.pos}")
        values = struct.unpack_from(layout, self.data, self.pos)
        self.pos += size
        return values

    def string(self) -> str:
        (length,) = self.take("Q")
        if self.pos + length > len(self.data):
            raise ValueError(f"truncated string at byte {self.pos}")
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            (item_kind,) = self.take("I")
            (count,) = self.take("Q")
            if count > _MAX_ITEMS:
                raise ValueError(f"an array of {count} items")
            if item_kind in _SCALARS:
                return list(self.take(_SCALARS[item_kind], count))
            return [self.value(item_kind) for _ in range(count)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind}")
        return self.take(_SCALARS[kind])[0]


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every key-value pair of a GGUF file's header (arrays as lists).

    Raises CeleryTPError(load_failed) naming the file for a file that is not a readable GGUF.
    """
    try:
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            # The metadata comes before the tensors: only its pages are read.
            cursor = _Cursor(data)
            if bytes(data[:4]) != _MAGIC:
                raise ValueError("not a GGUF file (bad magic)")
            cursor.pos = 4
            version, _tensors, count = cursor.take("IQQ")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} is not supported")
            metadata: dict[str, Any] = {}
            for _ in range(count):
                key = cursor.string()
                (kind,) = cursor.take("I")
                metadata[key] = cursor.value(kind)
    except OSError as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{path}: cannot read: {exc}") from exc
    except (ValueError, struct.error) as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{path}: not a readable GGUF file: {exc}") from exc
    return metadata
