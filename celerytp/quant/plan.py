"""Which format a load keeps its linear weights in: the `quant` a request names, else a GGUF's own."""

from __future__ import annotations

import math

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import Checkpoint
from celerytp.quant.formats import QuantFormat, parse_quant

# Architectures whose every linear takes BuildOptions.quant (others would silently ignore it).
QUANT_MODEL_TYPES = ("llama", "qwen3")
_LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight")


def resolve_quant(quant: str | None, checkpoint: Checkpoint, model_type: str, dtype: torch.dtype) -> QuantFormat | None:
    """The storage format of this load's linears; None = plain weights in the compute dtype.

    `quant` names a format (CeleryTPError "bad_request" if unknown or not executable). None keeps
    a GGUF file's type when all its linear weights share one executable block type; mixed or
    other types are dequantized as before (pass `quant` to requantize them).
    """
    if quant is None:
        fmt = _file_format(checkpoint)
    else:
        fmt = parse_quant(quant)
    if fmt is None or fmt.float_dtype == dtype:
        return None  # f32 on a float32 load (or bf16 on bf16) is the plain, unquantized model
    if model_type not in QUANT_MODEL_TYPES:
        raise CeleryTPError(
            ErrorKind.BAD_REQUEST, f"quant {fmt.name!r} is not supported for model_type {model_type!r} (only {', '.join(QUANT_MODEL_TYPES)})"
        )
    return fmt


def _file_format(checkpoint: Checkpoint) -> QuantFormat | None:
    types = {checkpoint.source(n).ggml_type for n in checkpoint.names() if n.endswith(_LINEAR_SUFFIXES)}
    if len(types) != 1 or None in types:
        return None
    fmt = QuantFormat.of_type(types.pop())
    return fmt if fmt is not None and fmt.executable and fmt.float_dtype is None else None


def mlp_block(checkpoint_block: int, fmt: QuantFormat | None) -> int:
    """MLP shards must start on both the file's blocks and the storage format's."""
    return checkpoint_block if fmt is None else math.lcm(checkpoint_block, fmt.block_size)


def finish_loading(model: nn.Module) -> None:
    """Convert every staged quantized weight into its kernel layout (after all shards loaded)."""
    from celerytp.layers.quantized import QuantizedWeight

    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            module.finish_loading()
