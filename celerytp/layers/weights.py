"""Weight loaders: copy a checkpoint slice into a parameter, checking shapes (vLLM style).

Each parameter carries `weight_loader(param, source, shard_id)`; the model loader only looks
up (param, shard_id) for a checkpoint name and calls it.
"""

from __future__ import annotations

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import TensorSource


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device, sharded: bool = True) -> nn.Parameter:
    """An uninitialised, frozen parameter to load into; `sharded` (this rank holds a slice, not a
    replica) is read by CausalLM.memory_report."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.tp_sharded = sharded
    return p


def check_shape(source: TensorSource, expected: tuple[int, ...]) -> None:
    if tuple(source.shape) != tuple(expected):
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"{source.name}: checkpoint shape {tuple(source.shape)}, model expects {tuple(expected)}"
        )


def copy_into(dest: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if dest.shape != value.shape:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"{name}: slice shape {tuple(value.shape)} != parameter shape {tuple(dest.shape)}"
        )
    dest.copy_(value)


def replicated_loader(param: torch.Tensor, source: TensorSource, shard_id: str | None = None) -> None:
    """Every rank holds the whole tensor (embeddings, norms, lm_head)."""
    check_shape(source, tuple(param.shape))
    copy_into(param.data, source.read(), source.name)
