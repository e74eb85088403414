"""Elementwise functions computed in vector lanes whatever the batch (batch invariance:
docs/models.md).

aten's CPU loops run an elementwise op over a tensor two vectors at a time and finish the last
elements with the scalar function, and the two round exp, log1p and rsqrt differently. A tensor
of a few values per row (a decode step's gates and decays, one per head) falls in the scalar tail
alone and in the vector body beside other rows, so a row's bits changed with the batch. Padding
each row to a whole number of vector pairs puts every element in a lane in any batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from celerytp.core.switches import INVARIANT_ENV, switch

ROW_MULTIPLE = 64  # two vectors of bfloat16 on AVX-512 (the widest step an aten loop takes)


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise `fn`, each of x's rows (first dim) padded to a multiple of
    ROW_MULTIPLE elements while it runs. CUDA, or CELERYTP_BATCH_INVARIANT=0: fn(x) as it is."""
    if x.device.type != "cpu" or switch(INVARIANT_ENV) == "0":
        return fn(x)
    # contiguous rows (a strided x, as a split of a projection is, runs the scalar loop throughout)
    rows = x.reshape(x.shape[0], -1) if x.dim() else x.reshape(1, 1)
    width = rows.shape[1]
    if width % ROW_MULTIPLE == 0:
        return fn(rows.contiguous()).reshape(x.shape)
    return fn(F.pad(rows, (0, -width % ROW_MULTIPLE)))[:, :width].reshape(x.shape)
