"""A GGUF file's key-value metadata, read without its tensors (tokenizer and config on the leader),
and the bounded scan every GGUF reader runs first.

The `gguf` package's reader parses every field and tensor description into numpy views, which
takes seconds for a tokenizer's 50k-entry arrays; the leader needs only the metadata, so this
reads the key-value section with `struct` in one pass (the layout of GGUF versions 2 and 3).

Every count in the header is bounded by the bytes left in the file before anything is allocated
or looped over: a key-value count, an array's item count or a string's length that the rest of
the file cannot hold, a tensor whose data would lie past the file's end, arrays nested deeper
than MAX_ARRAY_DEPTH, more than MAX_DIMS dimensions: each is refused at once, as
CeleryTPError(load_failed) naming the file. `check_gguf_layout` runs the same scan over the
tensor descriptions too, before the `gguf` package's reader (which loops over whatever count a
header states) is handed the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.model_files import open_regular
from celerytp.core.read_deadline import within

_MAGIC = b"GGUF"
# GGUF value type -> struct format of one scalar (8: string, 9: array are handled apart).
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_ITEMS = 1 << 24  # no real tokenizer comes near; a corrupt count must not allocate gigabytes
MAX_ARRAY_DEPTH = 4  # arrays of arrays, nested: llama.cpp reads none; deeper is a recursion bomb
MAX_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes one item of a type takes: a string its 8-byte length, an array its type and count.
_MIN_SIZE = {**{k: struct.calcsize(f"<{f}") for k, f in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_DEFAULT_ALIGNMENT = 32


class _Cursor:
    def __init__(self, data: Any, order: str = "<"):
        self.data = data
        self.pos = 0
        self.order = order

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, fmt: str, count: int = 1) -> tuple:
        layout = f"{self.order}{count}{fmt}" if len(fmt) == 1 else f"{self.order}{fmt}"
        size = struct.calcsize(layout)
        if size > self.left():
            raise ValueError(f"truncated at byte {self.pos}")
        values = struct.unpack_from(layout, self.data, self.pos)
        self.pos += size
        return values

    def skip(self, size: int) -> None:
        if size > self.left():
            raise ValueError(f"truncated at byte {self.pos}")
        self.pos += size

    def raw_string(self) -> bytes:
        (length,) = self.take("Q")
        if length > self.left():
            raise ValueError(f"a string of {length} bytes at byte {self.pos - 8}, past the end of the file")
        raw = self.data[self.pos : self.pos + length]
        self.pos += length
        return bytes(raw)

    def string(self) -> str:
        return self.raw_string().decode("utf-8", errors="replace")

    def name(self, what: str) -> str:
        """A key or tensor name: strict UTF-8, as the `gguf` package reads it."""
        at = self.pos
        try:
            return self.raw_string().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"the {what} at byte {at} is not UTF-8") from None

    def count(self, item_size: int, what: str) -> int:
        """A uint64 count of items taking at least `item_size` bytes each, bounded by the file."""
        at = self.pos
        (count,) = self.take("Q")
        if count * item_size > self.left():
            raise ValueError(f"{what} of {count} at byte {at}: the {self.left()} bytes left cannot hold them")
        return count

    def value(self, kind: int, keep: bool = True, depth: int = 0) -> Any:
        """One value of GGUF type `kind` (None, only stepped over, where not `keep`)."""
        if kind == _STRING:
            return self.string() if keep else self.skip(self.count(1, "a string"))
        if kind == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise ValueError(f"arrays nested more than {MAX_ARRAY_DEPTH} deep at byte {self.pos}")
            (item_kind,) = self.take("I")
            if item_kind not in _MIN_SIZE:
                raise ValueError(f"unknown array item type {item_kind} at byte {self.pos - 4}")
            count = self.count(_MIN_SIZE[item_kind], "an array")
            if keep and count > _MAX_ITEMS:
                raise ValueError(f"an array of {count} items")
            if item_kind in _SCALARS:
                if not keep:
                    return self.skip(count * _MIN_SIZE[item_kind])
                return list(self.take(_SCALARS[item_kind], count))
            items = [self.value(item_kind, keep, depth + 1) for _ in range(count)]
            return items if keep else None
        if kind not in _SCALARS:
            raise ValueError(f"unknown value type {kind} at byte {self.pos - 4}")
        value = self.take(_SCALARS[kind])[0]
        return value if keep else None


def _header(data: Any) -> tuple[_Cursor, int, int]:
    """A cursor past the header of `data`, the tensor count and the key-value count (both bounded)."""
    if bytes(data[:4]) != _MAGIC:
        raise ValueError("not a GGUF file (bad magic)")
    cursor = _Cursor(data)
    cursor.pos = 4
    (version,) = cursor.take("I")
    if version & 0xFFFF == 0:  # written on a big-endian host, as the `gguf` package reads it
        cursor.order = ">"
        version = struct.unpack(">I", struct.pack("<I", version))[0]
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version} is not supported")
    tensors = cursor.count(_MIN_TENSOR_INFO, "a tensor count")
    kvs = cursor.count(_MIN_KV, "a key-value count")
    if tensors * _MIN_TENSOR_INFO + kvs * _MIN_KV > cursor.left():
        raise ValueError(f"{kvs} key-value pairs and {tensors} tensors cannot fit in the {cursor.left()} bytes left")
    return cursor, tensors, kvs


def _key_values(cursor: _Cursor, count: int, keep: bool) -> dict[str, Any]:
    metadata: dict[str, Any] = {}
    for _ in range(count):
        key = cursor.name("key")
        if key in metadata:
            raise ValueError(f"key {key!r} appears twice")
        (kind,) = cursor.take("I")
        if key == "general.alignment" and kind != 4:  # as the `gguf` package reads it: uint32 only
            raise ValueError("general.alignment is not a uint32")
        metadata[key] = cursor.value(kind, keep=keep or key == "general.alignment")
    return metadata


def _tensors(cursor: _Cursor, count: int, alignment: Any, type_sizes: Mapping[int, tuple[int, int]]) -> None:
    """Check each tensor description, and that its data lies inside the file."""
    if count * _MIN_TENSOR_INFO > cursor.left():
        raise ValueError(f"a tensor count of {count}: the {cursor.left()} bytes left cannot hold their descriptions")
    if alignment is None:
        alignment = _DEFAULT_ALIGNMENT
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    described = []
    names = set()
    for _ in range(count):
        name = cursor.name("tensor name")
        if name in names:
            raise ValueError(f"tensor {name!r} appears twice")
        names.add(name)
        (n_dims,) = cursor.take("I")
        if n_dims > MAX_DIMS:
            raise ValueError(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
        dims = cursor.take("Q", n_dims)
        kind, offset = cursor.take("IQ")
        if kind not in type_sizes:
            raise ValueError(f"tensor {name!r} has unknown type {kind}")
        described.append((name, dims, kind, offset))
    data_start = -(-cursor.pos // alignment) * alignment
    for name, dims, kind, offset in described:
        block, type_size = type_sizes[kind]
        elements = 1
        for d in dims:
            elements *= d
        if dims and dims[0] % block:
            raise ValueError(f"tensor {name!r}: a row of {dims[0]} is not whole blocks of {block}")
        end = data_start + offset + elements // block * type_size
        if end > len(cursor.data):
            raise ValueError(f"tensor {name!r} ends at byte {end}, past the end of the file ({len(cursor.data)} bytes)")


def _refuse(path: str | os.PathLike[str], exc: Exception) -> CeleryTPError:
    return CeleryTPError(ErrorKind.LOAD_FAILED, f"{path}: not a readable GGUF file: {exc}")


def _mapped(path: str | os.PathLike[str]) -> tuple[Any, mmap.mmap]:
    """The file (a regular one, opened without blocking) and its read-only memory map."""
    file = open_regular(path)
    try:
        if os.fstat(file.fileno()).st_size == 0:
            raise ValueError("the file is empty")
        return file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    except BaseException:
        file.close()
        raise


def read_gguf_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Every key-value pair of a GGUF file's header (arrays as lists).

    Raises CeleryTPError(load_failed) naming the file for a file that is not a readable GGUF,
    and for a FIFO, socket or device (never opened for reading).
    """
    try:
        file, data = _mapped(path)
        with file, data:
            # The metadata comes before the tensors: only its pages are read (under a load's deadline).
            def scan() -> dict[str, Any]:
                cursor, _tensor_count, count = _header(data)
                return _key_values(cursor, count, keep=True)

            return within(f"{Path(path).name}'s metadata", scan)
    except OSError as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{path}: cannot read: {exc}") from exc
    except (ValueError, struct.error, OverflowError) as exc:
        raise _refuse(path, exc) from exc


def check_gguf_layout(data: Any, type_sizes: Mapping[int, tuple[int, int]], path: str | os.PathLike[str]) -> None:
    """Walk a GGUF file's header and tensor descriptions in `data` (bytes or a memory map) with
    every count bounded by the bytes left; values are stepped over, not built.

    type_sizes: GGML type -> (block size, bytes per block), `gguf.GGML_QUANT_SIZES`.
    Raises CeleryTPError(load_failed) naming `path` for anything a reader could not safely read.
    """
    try:
        cursor, tensor_count, count = _header(data)
        metadata = _key_values(cursor, count, keep=False)
        _tensors(cursor, tensor_count, metadata.get("general.alignment"), type_sizes)
    except (ValueError, struct.error, OverflowError) as exc:
        raise _refuse(path, exc) from exc


def check_gguf_file(path: str | os.PathLike[str]) -> None:
    """check_gguf_layout over the file at `path` (a regular file: a FIFO or device is refused),
    for a reader we do not control (transformers' GGUF tokenizer reads through `gguf`)."""
    import gguf  # only here: the metadata reader above needs nothing beyond the standard library

    try:
        file, data = _mapped(path)
        with file, data:
            check_gguf_layout(data, gguf.GGML_QUANT_SIZES, path)
    except OSError as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{path}: cannot read: {exc}") from exc
    except ValueError as exc:
        raise _refuse(path, exc) from exc
