"""Compiled decode (opt-in): each decoder layer's decode step through torch.compile.

An eager decode step of a 30-layer model dispatches ~1,800 small torch ops; compiling fuses the
elementwise ones (norms, rotary, SwiGLU, residuals, dtype casts) around the matmul and attention
kernels. The collectives are custom ops (celerytp/distributed/tp.py), so a layer is one graph.
Shapes are dynamic (the attended length grows every step), so one graph per layer kind serves
every step and every layer (the layers share their code; parameters are graph inputs).

Off by default (docs/benchmarks.md, "Decode speed and memory per rank"): on 2-core CPU
machines it speeds up q4 decode 1.2-1.5x and float32 not at all, a load compiles for 8-15 s
with inductor's on-disk cache warm (~40 s cold), and it costs ~100 MiB per rank. `CELERYTP_COMPILE=1` in the worker's environment turns it on
at load. On CUDA the same call uses mode="reduce-overhead" (CUDA graphs); that path is not yet
verified on a GPU. Prefill and hybrid (Gated DeltaNet) layers stay eager.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from celerytp.models.base import CausalLM

log = logging.getLogger(__name__)
COMPILE_ENV = "CELERYTP_COMPILE"


def compile_requested() -> bool:
    return os.environ.get(COMPILE_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def compile_decode(model: CausalLM) -> bool:
    """Give `model` compiled decode layers and compile them now, with one decode step of row 0
    (every rank loads at once, so their collectives meet). A graph break or a compiler failure
    leaves decode eager (logged) and returns False. The same code and shapes fail alike on
    every rank, so the ranks stay in step."""
    decoder = model.model
    if not hasattr(decoder, "decode_layers"):
        log.info("%s: %s decodes eagerly (only dense models compile)", COMPILE_ENV, type(model).__name__)
        return False
    mode = "reduce-overhead" if model.device.type == "cuda" else None
    decoder.decode_layers = [torch.compile(layer, dynamic=True, fullgraph=True, mode=mode) for layer in decoder.layers]
    started = time.monotonic()
    try:
        model.decode([0], [True])
    except Exception as exc:  # noqa: BLE001 - any compiler failure: run eagerly, as without the switch
        log.warning("%s: compiling decode failed, decoding eagerly: %s: %s", COMPILE_ENV, type(exc).__name__, exc)
        decoder.decode_layers = None
        return False
    finally:
        model.clear_cache(0)
    log.info("compiled decode in %.1f s (mode=%s)", time.monotonic() - started, mode)
    return True
