"""Ops that compiled decode runs as torch's own eager kernels, so a token decoded by a compiled
graph gets the bits an eager prefill gives it (batch invariance: docs/models.md).

Inductor fuses the ops around its kernels into C++ loops of its own. Pure arithmetic (adds,
products, casts) rounds there as in eager code, element by element (it compiles with
-ffp-contract=off), but a reduction sums in another order and an activation may be rewritten
(silu as x * sigmoid(x)): the norms' mean of squares and the MLP activation come out a few ulps
apart, and the bfloat16 activations of the quantized kernels turn those into other tokens. As
custom ops they are one opaque call each in the graph and the same aten kernels in both paths.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from celerytp.core.switches import INVARIANT_ENV, switch

_LIB = torch.library.Library("celerytp", "FRAGMENT")
_LIB.define("mean_square(Tensor x) -> Tensor")
_LIB.define("activation(Tensor x, str name) -> Tensor")
# config.json's hidden_act -> the function applied to the MLP's gate.
ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


def _mean_square(x: torch.Tensor) -> torch.Tensor:
    return x.pow(2).mean(-1, keepdim=True)


def _activation(x: torch.Tensor, name: str) -> torch.Tensor:
    return ACTIVATIONS[name](x)


_LIB.impl("mean_square", _mean_square, "CompositeExplicitAutograd")
_LIB.impl("activation", _activation, "CompositeExplicitAutograd")


@torch.library.register_fake("celerytp::mean_square", lib=_LIB)
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], 1)


@torch.library.register_fake("celerytp::activation", lib=_LIB)
def _(x: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(x)


def mean_square(x: torch.Tensor) -> torch.Tensor:
    """x² averaged over the last dim (kept), in aten's summation order (CELERYTP_BATCH_INVARIANT=0:
    as the compiler likes)."""
    if switch(INVARIANT_ENV) == "0":
        return _mean_square(x)
    return torch.ops.celerytp.mean_square(x)


def activation(name: str, x: torch.Tensor) -> torch.Tensor:
    """ACTIVATIONS[name](x) as aten computes it (CELERYTP_BATCH_INVARIANT=0: as the compiler likes)."""
    if switch(INVARIANT_ENV) == "0":
        return _activation(x, name)
    return torch.ops.celerytp.activation(x, name)
