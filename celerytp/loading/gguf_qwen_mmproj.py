"""Qwen2.5-VL's vision encoder and patch merger from llama.cpp's mmproj GGUF, under the names
transformers saves them by (`visual.*`: models/qwen_vision.py QwenVisionTower.checkpoint_table).

convert_hf_to_gguf.py --mmproj (Qwen2VLVisionModel, projector "qwen2.5vl_merger") names the
tensors by gguf-py's tensor_mapping.py for MODEL_ARCH.MMPROJ and rewrites two, undone here:

- `visual.patch_embed.proj.weight`, the Conv3d (hidden, C, T=2, P, P), is split along T into two
  Conv2d weights (hidden, C, P, P): `v.patch_embd.weight` (frame 0) and `v.patch_embd.weight.1`
  (frame 1), which clip.cpp convolves separately and adds. Stacked back along T here. F32, or F16
  with --outtype f16 (MmprojModel.tensor_force_quant).
- each block's fused `attn.qkv` ([q; k; v] rows, weight and bias) is split into
  `v.blk.N.attn_q/attn_k/attn_v`. Concatenated back here.

The rest is renamed only: attn.proj -> attn_out, norm1/norm2 -> ln1/ln2 (RMSNorm weights, no
+1), mlp.gate_proj/up_proj/down_proj -> ffn_gate/ffn_up/ffn_down, merger.ln_q -> v.post_ln,
merger.mlp.0/2 -> mm.0/mm.2; every matrix in transformers' (out, in) orientation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import Range, ReadRecord, TensorSource
from celerytp.loading.gguf_source import GGUFSource

SourceFactory = Callable[[str, list[ReadRecord]], TensorSource]

PREFIX = "visual."  # transformers' saved layout (qwen_vision_layout of these names)
GLOBAL = {
    "v.post_ln": "merger.ln_q",
    "mm.0": "merger.mlp.0",
    "mm.2": "merger.mlp.2",
}
BLOCK = {
    "attn_out": "attn.proj",
    "ln1": "norm1",
    "ln2": "norm2",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
PATCH_FRAMES = ("v.patch_embd.weight", "v.patch_embd.weight.1")  # temporal slices 0 and 1
QKV = ("attn_q", "attn_k", "attn_v")  # row blocks of transformers' attn.qkv
_BLOCK_RE = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")


class JoinedSource(TensorSource):
    """Tensors the converter split, read as the one transformers holds: `parts` concatenated along
    `dim`, or stacked along a new `dim` (`stack`). Read whole (the tower is replicated), then sliced;
    the read is logged once under the joined name.

    Args:
        parts: the split tensors, in order (their own reads are not logged).
    """

    def __init__(self, name: str, log: list[ReadRecord], parts: list[TensorSource], dim: int, stack: bool) -> None:
        shapes = [p.shape for p in parts]
        if stack:
            shape = (*shapes[0][:dim], len(parts), *shapes[0][dim:])
        else:
            shape = (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1 :])
        super().__init__(name, shape, log)
        self._parts, self._dim, self._stack = parts, dim, stack
        self._check(shapes)

    def _check(self, shapes: list[tuple[int, ...]]) -> None:
        same = [s if self._stack else (*s[: self._dim], *s[self._dim + 1 :]) for s in shapes]
        if any(s != same[0] for s in same):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{self.name}: its mmproj parts' shapes {shapes} do not join")

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        whole = [p.read() for p in self._parts]
        out = torch.stack(whole, self._dim) if self._stack else torch.cat(whole, self._dim)
        out = out[rows[0] : rows[1]]
        return out if cols is None else out[:, cols[0] : cols[1]]


def qwen_mmproj_name(gguf_name: str) -> str:
    """The transformers name of a renamed mmproj tensor (the split ones and unknown names pass
    through, for qwen_mmproj_sources and the loader's report)."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, stem, kind = m.groups()
        return f"{PREFIX}blocks.{layer}.{BLOCK[stem]}.{kind}" if stem in BLOCK else gguf_name
    stem, _, kind = gguf_name.rpartition(".")
    return f"{PREFIX}{GLOBAL[stem]}.{kind}" if stem in GLOBAL else gguf_name


def qwen_mmproj_sources(tensors: dict[str, Any]) -> dict[str, SourceFactory]:
    """transformers name -> how to build its source, for every tensor of a qwen2.5vl_merger mmproj
    (LOAD_FAILED naming the part missing where a split tensor is incomplete)."""
    table: dict[str, SourceFactory] = {}
    joins: dict[str, tuple[list[str], int, bool]] = {}  # name -> (its mmproj parts in order, dim, stack)
    for gguf_name, tensor in tensors.items():
        m = _BLOCK_RE.fullmatch(gguf_name)
        if gguf_name in PATCH_FRAMES:
            joins[f"{PREFIX}patch_embed.proj.weight"] = (list(PATCH_FRAMES), 2, True)
        elif m is not None and m.group(2) in QKV:
            layer, _, kind = m.groups()
            joins[f"{PREFIX}blocks.{layer}.attn.qkv.{kind}"] = ([f"v.blk.{layer}.{s}.{kind}" for s in QKV], 0, False)
        else:
            table[qwen_mmproj_name(gguf_name)] = lambda name, log, t=tensor: GGUFSource(t, name, log)
    for name, (parts, dim, stack) in joins.items():
        if absent := [p for p in parts if p not in tensors]:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"mmproj: {name} is split into {', '.join(parts)}; "
                                                       f"{', '.join(absent)} is missing")
        picked = [tensors[p] for p in parts]
        table[name] = lambda n, log, ts=picked, d=dim, st=stack: JoinedSource(
            n, log, [GGUFSource(t, n, []) for t in ts], d, st)
    return table
