"""cuBLAS held to one summation order per product shape on CUDA (batch invariance, docs/models.md).

A float product's row on a GPU can change with the rows beside it where cuBLAS picks a kernel by
the row count: split-K (the inner dimension cut across blocks and the pieces summed) for some
counts and not others, and a GEMV kernel for a single row. On Hopper split-K is the only source
(vLLM's batch-invariant mode holds cuBLAS so on sm90 rather than replacing it). With invariance
on (CELERYTP_BATCH_INVARIANT, the default) a CUDA load (models/loader.py: a rank's first product
is its load's) turns off split-K and reduced-precision reductions for bfloat16 and float16, leaves cuBLASLt no workspace
for split-K (CUBLASLT_WORKSPACE_SIZE) and cuBLAS a fixed small one (CUBLAS_WORKSPACE_CONFIG), and
prefers cuBLASLt; `float_linear` computes a lone row as two (layers/packed_linear.py). Settings
the environment already has are kept. Not yet checked on a GPU: CUDA loads still say
`batch_invariant: false` until benchmarks/invariance.py (scripts/gpu_bench.sh) shows it holds.
"""

from __future__ import annotations

import logging
import os

import torch

from celerytp.core.switches import INVARIANT_ENV, switch

log = logging.getLogger(__name__)
SETTINGS = {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"}  # read once per process, at cuBLAS's first use
held = False  # set once the settings are in: float_linear then computes a lone CUDA row as two


def hold_cublas_to_one_order() -> None:
    """Apply the settings above when invariance is on. Call before the process's first CUDA product."""
    global held
    if switch(INVARIANT_ENV) != "1":
        return
    for name, value in SETTINGS.items():
        os.environ.setdefault(name, value)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)  # (reduced precision, split-K)
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
    except RuntimeError as exc:  # a build without cuBLASLt: cuBLAS, with split-K off all the same
        log.info("cuBLASLt not preferred: %s", exc)
    held = True
