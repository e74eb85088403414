"""Half-precision weights on a CPU: loaded only where they decode at least as fast as float32.

Many CPUs have no fast half-precision matrix-vector path; decode reads every weight once per
token, so there such a load would halve the memory and cut the speed several-fold. On the 2-core
AVX-512 machines this project tests on, bfloat16 through F.linear was once measured at ~10x
float32's time; through oneDNN with a packed weight (layers/packed_linear.py, what a load uses
where it works) it takes ~0.7x; float16 has no packed kernel there (no AVX512-FP16). The
first half-precision load on a CPU measures the same product in both dtypes, each through the
kernel a load would give it, and is refused with the figures when half is slower.
CELERYTP_ALLOW_SLOW_HALF=1 loads anyway (memory over speed).
"""

from __future__ import annotations

import functools
import time

import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.switches import ALLOW_SLOW_HALF_ENV, switch
from celerytp.layers.packed_linear import float_linear, packed_copy

_SHAPE = (1536, 576)  # SmolLM2's MLP: the size of matrix a small model's decode reads most
_TOLERANCE = 1.1  # within 10% of float32 counts as as fast (the measurement is short)


def check_half_precision(dtype: torch.dtype, device: torch.device) -> None:
    """Raise CeleryTPError(bad_request) for half-precision weights that decode slower than float32 here."""
    if device.type != "cpu" or dtype not in (torch.float16, torch.bfloat16):
        return
    if switch(ALLOW_SLOW_HALF_ENV) == "1":
        return
    half_us, float_us = matvec_us(dtype)
    if half_us > float_us * _TOLERANCE:
        name = str(dtype).removeprefix("torch.")
        raise CeleryTPError(
            ErrorKind.BAD_REQUEST,
            f"field 'dtype': {name} weights would decode slower than float32 on this CPU (a {_SHAPE[0]}x{_SHAPE[1]} "
            f"matrix-vector product: {half_us:.0f} µs in {name}, {float_us:.0f} µs in float32); load in float32, or "
            f"in a quant format such as q8_0 to save memory ({ALLOW_SLOW_HALF_ENV}=1 loads {name} anyway)",
        )


@functools.cache
def matvec_us(dtype: torch.dtype) -> tuple[float, float]:
    """µs per decode-sized matrix-vector product on this CPU in `dtype` and in float32, each through
    the kernel a load gives it (packed where that works): the best of 5 short runs each,
    alternating, so that a burst of load elsewhere slows both alike."""
    x = torch.randn(1, _SHAPE[1])
    weights = {d: torch.randn(_SHAPE).to(d) for d in (dtype, torch.float32)}
    packed = {d: packed_copy(weight) for d, weight in weights.items()}
    best = dict.fromkeys(weights, float("inf"))
    for _ in range(5):
        for d, weight in weights.items():
            xd = x.to(d)
            start = time.perf_counter()
            for _ in range(10):
                float_linear(xd, weight, packed[d])
            best[d] = min(best[d], (time.perf_counter() - start) / 10)
    return best[dtype] * 1e6, best[torch.float32] * 1e6
