"""Checkpoints whose tensors are stored fused, presented under the names our layers load.

- Phi-3 stores `self_attn.qkv_proj` ([q; k; v] rows) and `mlp.gate_up_proj` ([gate; up] rows), in
  safetensors and (as `attn_qkv` / `ffn_up`) in GGUF. `UnfusedCheckpoint` presents each as its
  parts, row ranges of the fused tensor (`RowRangeSource`), so a rank still reads only its rows
  (for GGUF, its rows' blocks, kept quantized when the plan keeps them).
- transformers 5 keeps a MoE block's experts as `mlp.experts.gate_up_proj` (E, 2 I, H: each
  expert's gate rows, then its up rows) and `mlp.experts.down_proj` (E, H, I); `save_pretrained`
  writes them so with `save_original_format=False`. `unfuse_experts` presents them as the hub's
  `mlp.experts.{e}.{gate,up,down}_proj.weight`, each read as the rows and columns a rank asks for.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import Checkpoint, Range, ReadRecord, TensorSource

_FUSED_EXPERTS = re.compile(r"(.+\.experts)\.(gate_up_proj|down_proj)(?:\.weight)?")


class RowRangeSource(TensorSource):
    """Rows first..first+size of another source, as a tensor of its own (named
    "<fused name>[first:stop]" in messages).

    Reads go through the fused source, which logs them under the checkpoint's own name.
    """

    def __init__(self, name: str, inner: TensorSource, first: int, size: int) -> None:
        super().__init__(name, (size, *inner.shape[1:]), [])
        self._inner, self._first = inner, first

    @property
    def ggml_type(self) -> Any:
        return self._inner.ggml_type

    def column_block(self) -> int:
        return self._inner.column_block()

    def read(self, rows: Range | None = None, cols: Range | None = None) -> Any:
        r = self._check_range(rows, 0)
        return self._inner.read(self._shift(r), cols)

    def read_blocks(self, qtype: Any, rows: Range | None = None, cols: Range | None = None) -> Any:
        r = self._check_range(rows, 0)
        return self._inner.read_blocks(qtype, self._shift(r), cols)

    def _read(self, rows: Range, cols: Range | None) -> Any:  # read() is overridden; kept for the ABC
        return self._inner.read(self._shift(rows), cols)

    def _shift(self, rows: Range) -> Range:
        return rows[0] + self._first, rows[1] + self._first


class ExpertSliceSource(TensorSource):
    """Rows [first, first + rows) of expert `expert` in a fused (E, out, in) tensor, as a 2-D tensor."""

    def __init__(
        self, name: str, log: list[ReadRecord], fused: TensorSource, expert: int, first: int, rows: int
    ) -> None:
        super().__init__(name, (rows, fused.shape[2]), log)
        self._fused, self._expert, self._first = fused, expert, first

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        r0, r1 = self._first + rows[0], self._first + rows[1]
        c0, c1 = cols if cols is not None else (0, self.shape[1])
        # A safetensors slice reads any 3-D box, so only this rank's part leaves the file; other
        # sources read 3-D tensors by whole leading rows (one expert), cropped here.
        box = getattr(self._fused, "_slice", None)
        if box is not None:
            return box[self._expert : self._expert + 1, r0:r1, c0:c1][0]
        return self._fused.read((self._expert, self._expert + 1))[0, r0:r1, c0:c1]


class PartsCheckpoint(Checkpoint):
    """`inner` with some tensors replaced by parts of them.

    Args:
        inner: the opened checkpoint (its reads log is shared).
        parts: a replaced tensor's name -> its parts' names and how to open each, in order.
    """

    def __init__(self, inner: Checkpoint, parts: Mapping[str, list[tuple[str, Callable[[], TensorSource]]]]) -> None:
        super().__init__(inner.path, inner.hf_config, inner.reads)
        self._inner = inner
        self._names = [part for name in inner.names() for part, _ in parts.get(name, [(name, None)])]
        self._parts = {part: open_part for listed in parts.values() for part, open_part in listed}

    def names(self) -> list[str]:
        return list(self._names)

    def source(self, name: str) -> TensorSource:
        return self._parts[name]() if name in self._parts else self._inner.source(name)

    def close(self) -> None:
        self._inner.close()


class UnfusedCheckpoint(PartsCheckpoint):
    """`inner` with each fused tensor replaced by its row ranges.

    Args:
        inner: the opened checkpoint.
        fused: fused module name (last component, e.g. "qkv_proj") -> (part module, rows) in
            row order, e.g. {"qkv_proj": (("q_proj", 256), ("k_proj", 64), ("v_proj", 64))}.
            A fused tensor whose row count is not their sum is LOAD_FAILED naming it.
    """

    def __init__(self, inner: Checkpoint, fused: Mapping[str, tuple[tuple[str, int], ...]]) -> None:
        parts: dict[str, list[tuple[str, Callable[[], TensorSource]]]] = {}
        for name in inner.names():
            module, _, kind = name.rpartition(".")
            prefix, _, leaf = module.rpartition(".")
            if leaf in fused and kind in ("weight", "bias"):
                layout, first = fused[leaf], 0
                parts[name] = []
                for part, rows in layout:
                    parts[name].append((f"{prefix}.{part}.{kind}", self._opener(inner, name, layout, first, rows)))
                    first += rows
        super().__init__(inner, parts)

    @staticmethod
    def _opener(
        inner: Checkpoint, name: str, layout: tuple[tuple[str, int], ...], first: int, rows: int
    ) -> Callable[[], TensorSource]:
        def open_part() -> TensorSource:
            fused = inner.source(name)
            total = sum(n for _, n in layout)
            if not fused.shape or fused.shape[0] != total:
                raise CeleryTPError(
                    ErrorKind.LOAD_FAILED,
                    f"{name}: checkpoint shape {tuple(fused.shape)}, the model expects {total} rows"
                    f" ({' + '.join(str(n) for _, n in layout)})",
                )
            return RowRangeSource(f"{name}[{first}:{first + rows}]", fused, first, rows)

        return open_part


def unfuse_experts(checkpoint: Checkpoint) -> Checkpoint:
    """`checkpoint` itself when no expert tensor is fused, else a view with per-expert names.

    Raises CeleryTPError(LOAD_FAILED) naming a fused tensor that is not 3-D (or, for gate_up_proj,
    has an odd number of rows per expert).
    """
    parts: dict[str, list[tuple[str, Callable[[], TensorSource]]]] = {}
    for name in checkpoint.names():
        m = _FUSED_EXPERTS.fullmatch(name)
        if m is None:
            continue
        prefix, kind = m.groups()
        shape = checkpoint.source(name).shape
        if len(shape) != 3 or (kind == "gate_up_proj" and shape[1] % 2):
            what = "2 x intermediate" if kind == "gate_up_proj" else "hidden"
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"{name}: shape {tuple(shape)} is not fused experts (E, {what}, in)"
            )
        experts, rows = shape[0], shape[1]
        half = rows // 2
        layout = [("down_proj", 0, rows)] if kind == "down_proj" else [("gate_proj", 0, half), ("up_proj", half, half)]
        parts[name] = []
        for e in range(experts):
            for proj, first, n in layout:
                part = f"{prefix}.{e}.{proj}.weight"
                parts[name].append((part, _expert_opener(checkpoint, name, part, e, first, n)))
    return PartsCheckpoint(checkpoint, parts) if parts else checkpoint


def _expert_opener(
    checkpoint: Checkpoint, fused: str, part: str, expert: int, first: int, rows: int
) -> Callable[[], TensorSource]:
    return lambda: ExpertSliceSource(part, checkpoint.reads, checkpoint.source(fused), expert, first, rows)
