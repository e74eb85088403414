"""Float linears on a CPU through oneDNN, with each weight reordered once at load.

`F.linear` on a CPU multiplies by the (out, in) weight as stored (MKL). For decode's 1-16 rows
that is far from what these cores can do: one row times a 49,152 x 576 float32 LM head took
9.9 ms (~11 GB/s, one thread), 16 rows 17.7 ms, and bfloat16 4.2 and 6.6 ms. oneDNN's matmul on
a weight reordered once into its own blocked layout (what inductor's freezing does to the float
linears of a CPU graph) took 4.5 and 9.3 ms in float32, 2.7 and 3.8 in bfloat16, and was as fast
or faster at the sizes of a small model's layers, prefill's too, but for a fixed cost of ~15 µs
a call that a small matrix does not win back (MIN_ELEMENTS; benchmarks/float_linear.py,
docs/performance.md "Float linears on a CPU").

After a load (models/loader.py) `pack_linears` gives every float parallel linear and LM head on
a CPU with at least MIN_ELEMENTS weights a copy of its weight in that layout (`onednn_weight`)
and drops the plain weight unless another module shares it (a tied LM head: the embedding looks
its rows up), so memory stays as it was but for a tied head's copy. Layers that compiled decode
traces stay plain: inductor does not lower the op with a packed weight as a graph input. The
kernel is checked once per process and dtype against `F.linear`; where oneDNN is missing,
refuses the dtype (float16 without AVX512-FP16) or disagrees, linears stay plain.
`CELERYTP_PACK_LINEARS=0` keeps them all plain, `=1` packs small ones too.
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.core.switches import INVARIANT_ENV, PACK_ENV, switch
from celerytp.layers import cuda_blas

log = logging.getLogger(__name__)
BATCH_HINT = 1  # the rows oneDNN's layout is chosen for: decode's (measured alike for 16)
# A packed product costs ~15 µs a call before any work. One float32 row times a weight read from
# memory (as decode reads them, one after the other): 128 x 128 took 14 µs plain against 24
# packed, 192 x 576 53 against 48, 576 x 576 139 against 117 (bfloat16 gains from 128 x 128 up).
MIN_ELEMENTS = 1 << 16
PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def float_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x W^T + b, through the packed weight when there is one. With batch invariance on
    (CELERYTP_BATCH_INVARIANT, the default) a CPU takes oneDNN for every float weight, packed or
    not: MKL's F.linear sums a row in an order that changes with the rows beside it (one, 2-15,
    16 and more), oneDNN's in one order for any number of rows from two; a lone row is
    computed as two (docs/models.md, "Batch invariance")."""
    if weight.is_cuda:  # cuBLAS, held to one order per shape where invariance is on (layers/cuda_blas.py)
        if cuda_blas.held and x.numel() == x.shape[-1]:  # one row: a GEMV kernel's order otherwise
            return _as_two_rows(lambda rows: F.linear(rows, weight, bias), x)
        return F.linear(x, weight, bias)
    if packed is None and (torch.compiler.is_compiling() or not _invariant(weight)):
        return F.linear(x, weight, bias)  # a compiled graph's own matmul (models/base.py `batch_invariant`)
    w = weight if packed is None else packed
    if x.numel() == x.shape[-1] and _invariant(weight):  # one row
        return _as_two_rows(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, w, bias, "none", [], ""), x)
    return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")


def _as_two_rows(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`product` of the one row `x` computed as the product of two copies of it, so that it takes
    the kernel and order of any other number of rows, not the one a lone row gets."""
    y = product(x.reshape(1, -1).expand(2, -1).contiguous())
    return y[:1].reshape(*x.shape[:-1], y.shape[-1])


def _invariant(weight: torch.Tensor) -> bool:
    """Whether float linears of this weight's dtype and device run batch-invariant (oneDNN)."""
    return switch(INVARIANT_ENV) == "1" and kernel_works(weight.dtype, str(weight.device))


def packed_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` (out, in) in oneDNN's layout, or None where that does not pay or does not work here."""
    mode = switch(PACK_ENV)
    if weight.dim() != 2 or weight.numel() == 0 or mode == "0" or (mode == "auto" and weight.numel() < MIN_ELEMENTS):
        return None
    if not kernel_works(weight.dtype, str(weight.device)):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def pack_linears(model: nn.Module, exclude: nn.Module | None = None) -> None:
    """Pack the float weight of every module of `model` with an `onednn_weight` buffer slot (the
    parallel linears and the LM head), except those under `exclude`."""
    skip = set(exclude.modules()) if exclude is not None else set()
    owners = Counter(id(p) for m in model.modules() for p in m._parameters.values() if p is not None)
    for module in model.modules():
        if module in skip or "onednn_weight" not in module._buffers or getattr(module, "qweight", None) is not None:
            continue
        weight = module.weight
        if (packed := packed_copy(weight)) is None:
            continue
        packed.tp_sharded = getattr(weight, "tp_sharded", False)  # read by CausalLM.memory_report
        module.onednn_weight = packed
        if owners[id(weight)] == 1:  # nobody else reads the plain weight: free it
            weight.data = weight.data.new_empty(0)


@functools.cache
def kernel_works(dtype: torch.dtype, device: str) -> bool:
    """Whether the packed kernel runs here in `dtype` and agrees with F.linear on a small matrix."""
    if device != "cpu" or dtype not in PROBE_RTOL or not torch.backends.mkldnn.is_available():
        return False
    g = torch.Generator().manual_seed(0)
    w, x, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((96, 128), (3, 128), (96,)))
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "").float()
    except (RuntimeError, NotImplementedError) as exc:  # no oneDNN kernel for this dtype on this CPU
        log.info("packed float linears in %s unavailable here (%s); using F.linear", dtype, exc)
        return False
    ref = F.linear(x.float(), w.float(), b.float())
    err = float((y - ref).abs().max() / ref.abs().max())
    if err > PROBE_RTOL[dtype]:
        log.warning("packed float linears in %s are off by %.3g (relative); using F.linear", dtype, err)
        return False
    return True
