"""Attention whose result for a query depends on that query's inputs only (batch invariance).

torch's SDPA on a CPU splits the keys into blocks whose size follows the number of keys read and
of queries, and rescales between blocks: a token decoded alone, beside a longer row (the batch
reads up to the longest row's keys) or inside a prefill chunk gets results a few ulps apart, and
through a model's bfloat16-activation int4 kernels those become different tokens (docs/models.md,
"Batch invariance"). celerytp/kernels/invariant_attention.c sums in one fixed order per query,
skipping masked keys, so every way of computing a token gives the same bits.

The kernel is C, built once per machine with the C compiler compiled decode already needs
(`cc`, into the worker's cache directory) and called through ctypes from a torch custom op, so
compiled decode keeps it as one opaque call. `CELERYTP_BATCH_INVARIANT=0` uses SDPA instead (the
cost each way: docs/benchmarks.md); where the kernel cannot be built or the device is not a CPU,
attention is SDPA too, and the load reply's `batch_invariant` is false.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from celerytp.core.cache_dir import cache_dir
from celerytp.core.switches import INVARIANT_ENV, switch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).resolve().parent.parent / "kernels" / "invariant_attention.c"
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
BUILD_TIMEOUT_S = 120
_I64 = ctypes.c_int64
_STRIDES = _I64 * 15


def attention_kind(device: torch.device) -> str:
    """What `attention` runs on `device` (the load reply's `attention`): "invariant" (our kernel,
    on a CPU); "sdpa_efficient" on CUDA: SDPA held to its memory-efficient backend, which takes
    any mask, builds no plan per shape (cuDNN's rebuilds one per new shape, tens of ms each) and
    computes each query block over the keys in order, whatever the batch (not verified on a GPU
    yet: the load reply's `batch_invariant` stays false there); "sdpa" (torch's own pick) where
    invariance is off or the kernel cannot be built."""
    if switch(INVARIANT_ENV) == "0":
        return "sdpa"
    if device.type == "cuda":
        return "sdpa_efficient"
    return "invariant" if device.type == "cpu" and _library() is not None else "sdpa"


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, kind: str
) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v for q (B, H, T, D) and k, v (B, KVH, L, D), H a multiple
    of KVH; `mask` bool, broadcastable to (B, 1, T, L). `kind` from `attention_kind`."""
    if kind == "sdpa":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
        )
    if kind == "sdpa_efficient":
        with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
            return grouped_sdpa(q, k, v, mask, scale)
    return torch.ops.celerytp.invariant_attention(q, k, v, mask, scale)


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """SDPA with the query heads that share a KV head folded into its query positions, (B, KVH,
    rep * T, D): the same sums as `enable_gqa`, for backends without it (memory-efficient), and
    no key or value copied per query head."""
    B, H, T, D = q.shape
    kvh = k.shape[1]
    if H == kvh:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    rep = H // kvh
    folded = q.reshape(B, kvh, rep * T, D)  # query heads h = g * rep + i sit in group g
    if mask is not None:  # (B or 1, 1, T, L) -> (B or 1, 1, rep * T, L), the same keys for each folded head
        mask = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1])  # a prefill's (T, L) too
        mask = mask.expand(mask.shape[0], 1, T, mask.shape[-1]).repeat(1, 1, rep, 1)
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask, scale=scale).view(B, H, T, v.shape[-1])


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built kernel, building it on first use (None, logged, where it cannot be built)."""
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_model().encode()).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"invariant_attention-{tag}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            # Ranks starting together each build their own copy and rename it in place.
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run(
                    [os.environ.get("CC", "cc"), *FLAGS, "-o", str(built), str(SOURCE), "-lm"],
                    check=True, capture_output=True, timeout=BUILD_TIMEOUT_S,
                )  # fmt: skip
                os.replace(built, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode(errors="replace")[:500]
        log.warning("batch-invariant attention unavailable (%s %s); using SDPA", exc, detail)
        return None
    fn = lib.invariant_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 5 + [_I64] * 6 + [ctypes.POINTER(_I64), ctypes.c_float, ctypes.c_int]
    return lib


def _cpu_model() -> str:
    """The CPU's model line (the kernel is built for this machine's instruction set)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _invariant_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    dtype = q.dtype
    if dtype != torch.float32 or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t.float().contiguous() for t in (q, k, v))
    B, H, T, D = q.shape
    KVH, L = k.shape[1], k.shape[2]
    out = torch.empty(B, H, T, D, dtype=torch.float32)
    mq, mt, mk = 0, 0, 0
    if mask is not None:
        mask = mask.expand(B, 1, T, L)
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mq, _, mt, mk = mask.stride()
    strides = _STRIDES(*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], mq, mt, mk, *out.stride()[:3])
    code = _library().invariant_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), None if mask is None else mask.data_ptr(), out.data_ptr(),
        B, H, T, D, KVH, L, strides, scale, torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise MemoryError(f"invariant attention: no scratch memory for {L} keys")
    return out.to(dtype)


_LIB = torch.library.Library("celerytp", "FRAGMENT")
_LIB.define("invariant_attention(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale) -> Tensor")
_LIB.impl("invariant_attention", _invariant_attention, "CPU")


@torch.library.register_fake("celerytp::invariant_attention", lib=_LIB)
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    return q.new_empty(q.shape)
