"""Hugging Face model directories: config.json plus one or many safetensors files."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.model_files import check_model_directory, open_regular, read_json_object
from celerytp.core.read_deadline import within
from celerytp.loading.checkpoint import Checkpoint, Range, ReadRecord, TensorSource

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsSource(TensorSource):
    """A tensor read through `get_slice`, so only the requested slice leaves the file."""

    def __init__(self, name: str, handle: Any, log: list[ReadRecord]) -> None:
        self._slice = handle.get_slice(name)
        super().__init__(name, tuple(self._slice.get_shape()), log)

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        if cols is None:
            return within(self.name, lambda: self._slice[rows[0] : rows[1]])
        return within(self.name, lambda: self._slice[rows[0] : rows[1], cols[0] : cols[1]])


class SafetensorsCheckpoint(Checkpoint):
    """A directory with config.json and model.safetensors or a sharded index."""

    def __init__(self, directory: Path) -> None:
        check_model_directory(directory)  # no FIFO, socket or device: nothing blocks an open
        super().__init__(directory, read_json_object(directory / "config.json", required=True))
        self._weight_map = _weight_map(directory)
        self._handles: dict[str, Any] = {}

    def names(self) -> list[str]:
        return list(self._weight_map)

    def source(self, name: str) -> TensorSource:
        file = self._weight_map[name]
        if file not in self._handles:
            self._handles[file] = _safe_open(self.path / file, file)
        return SafetensorsSource(name, self._handles[file], self.reads)

    def close(self) -> None:
        self._handles.clear()


def _check_shard_name(directory: Path, file: object) -> None:
    """A shard the index names must be a file of this directory: no paths, no links out of it."""
    if not isinstance(file, str) or not file or Path(file).name != file or file in (".", ".."):
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"{INDEX_FILE}: shard {file!r} is not a file name in the model directory")
    if (directory / file).resolve().parent != directory.resolve():
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"{INDEX_FILE}: shard {file!r} links outside the model directory")


def _weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index or by listing the single file."""
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{index} has no weight_map")
        for file in set(weight_map.values()):
            _check_shard_name(directory, file)
        return dict(weight_map)
    single = directory / SINGLE_FILE
    if not single.is_file():
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{directory} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    with _safe_open(single, SINGLE_FILE) as handle:
        return {name: SINGLE_FILE for name in handle.keys()}


def _safe_open(path: Path, name: str) -> Any:
    """safetensors' handle on `path`, a regular file: opened first by us without blocking and
    checked (a FIFO, socket or device is refused, typed), then handed over as that very file
    (/proc/self/fd, where there is one) so no swap can slip in between check and open."""
    try:
        file = open_regular(path, name)
    except OSError as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"cannot open {path}: {exc}") from exc
    with file:
        same_file = f"/proc/self/fd/{file.fileno()}"
        try:
            return safe_open(same_file if os.path.exists(same_file) else str(path), framework="pt")
        except Exception as exc:  # safetensors raises its own error types
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"cannot open {path}: {exc}") from exc
