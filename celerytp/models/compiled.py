"""Compiled decode: the decoder layers' decode step through torch.compile, where it pays.

An eager decode step of a 30-layer model dispatches ~1,800 small torch ops; compiling fuses the
elementwise ones (norms, rotary, SwiGLU, residuals, dtype casts) around the matmul and attention
kernels. The collectives are custom ops (celerytp/distributed/tp.py), so layers stay one graph;
so are, with batch invariance on, attention, the norms' mean of squares and the MLP activation
(layers/invariant_attention.py, layers/eager_ops.py), so that a compiled step rounds as an eager
prefill does.
The layers compile in runs of about LAYERS_PER_GRAPH consecutive ones (`run_layers` over each
run): every call into a compiled graph pays ~50 µs of guards and wrappers, 30 times a step when
each layer was its own graph; a run of 5 pays it 6 times and compiles in the time one layer did,
where the whole stack as one graph took minutes (docs/benchmarks.md). Shapes are dynamic (the
attended length grows every step, the batch with the running rows) and parameters are graph
inputs, so one graph serves every step, every batch width and every run of the same layers.
torch specializes a width of 1 apart from the others, so a load warms up both (widths 1 and 2),
with a mask always given and no size traced equal to another by chance: no request pays a compile.

`CELERYTP_COMPILE` in the worker's environment: `auto` (default) compiles dense models whose
linears are kept quantized, and every dense model on CUDA; `1` compiles every dense model, `0`
none. On 2-core CPU machines compiling speeds up q4 decode 1.2-1.5x and float32 not at all
(docs/benchmarks.md), hence `auto`. The compiler's cache (`TORCHINDUCTOR_CACHE_DIR`, set here
under the worker's cache directory unless the environment sets it) keeps the cost to the first
start on a machine: ~30 s there, a few seconds on later starts. On a CPU the graphs' wrapper is
C++ (`cpp_wrapper`: ~0.5 ms a step less than Python); on CUDA the same call uses
mode="reduce-overhead" (CUDA graphs). A CUDA graph replays one recorded shape, so there decode
pads its batch width and the keys it reads to powers of two (`CausalLM.decode_buckets`): a
graph per bucket, recorded once, instead of one per step as the attended length grows. The width
buckets are recorded at load; a keys bucket when a row first reaches it, logged and counted
(the serving loop's `new_decode_shapes`). The KV cache is a static input (recorded where it
lies, never copied in). Prefill and hybrid (Gated DeltaNet) layers stay eager.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch.fx.experimental import _config as fx_config

from celerytp.core.cache_dir import cache_dir
from celerytp.core.switches import COMPILE_ENV, switch
from celerytp.distributed.control import CollectiveFailed
from celerytp.distributed.tp import collective_failure, forget_collective_failure
from celerytp.layers.kv_cache import bucket
from celerytp.models.decoder import run_layers

if TYPE_CHECKING:
    from celerytp.models.base import CausalLM

log = logging.getLogger(__name__)
LAYERS_PER_GRAPH = 5  # 5 to 10 decode alike on the shipped model; 10 compiles twice as long
WARM_UP_POSITION = 5  # where the warm-up's rows decode (any length but 0 and 1, which torch specializes)


def compile_requested(model: CausalLM) -> bool:
    """Whether this load compiles decode (CELERYTP_COMPILE: auto, 1 or 0; see the module docstring).
    An unknown value is refused (core/switches.py), so a typo does not silently pick a mode."""
    mode = switch(COMPILE_ENV)
    if mode != "auto":
        return mode == "1"
    return model.device.type == "cuda" or model.quant not in (None, "f32", "f16", "bf16")  # block formats


def use_persistent_cache() -> None:
    """Point inductor's on-disk cache into the worker's cache directory (unless set), so compiled
    graphs outlive /tmp and a restarted worker loads them instead of compiling again."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        path = cache_dir() / "inductor"
        path.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)


def layer_runs(layers: Sequence[torch.nn.Module], size: int) -> list[tuple[torch.nn.Module, ...]]:
    """`layers` in order, cut into ceil(n / size) consecutive runs as even as can be: at most two
    run lengths, so at most two graphs per batch width for a model whose layers are alike."""
    if not layers:
        return []
    count = -(-len(layers) // size)
    bounds = [len(layers) * i // count for i in range(count + 1)]
    return [tuple(layers[bounds[i]:bounds[i + 1]]) for i in range(count)]


def run_compiled(step: Callable[..., torch.Tensor], layers: tuple[torch.nn.Module, ...], *args: object) -> torch.Tensor:
    """`step` (compiled `run_layers`) over `layers`. Its C++ wrapper reports an exception of a
    collective op as a RuntimeError naming the op: the collectives' own CollectiveFailed is raised
    instead, which the worker marks its group broken on (worker/state.py)."""
    forget_collective_failure()
    try:
        return step(layers, *args)
    except RuntimeError as exc:
        failure = collective_failure()
        if failure is None or isinstance(exc, CollectiveFailed):
            raise
        raise failure from exc


def compile_decode(model: CausalLM, progress: Callable[[str], None] | None = None) -> bool:
    """Give `model` compiled runs of decode layers and compile them now, with decode steps of
    widths 1 and 2 (every rank loads at once, so their collectives meet). A graph break or a
    compiler failure leaves decode eager (logged) and returns False. The same code and shapes
    fail alike on every rank, so the ranks stay in step."""
    decoder = model.model
    if not hasattr(decoder, "decode_runs"):
        log.info("%s: %s decodes eagerly (only dense models compile)", COMPILE_ENV, type(model).__name__)
        return False
    use_persistent_cache()
    # A size that equals another when traced (a warm-up's 2 keys and 2 rows) would otherwise share
    # its symbol, and the graph would hold only while they stay equal: a recompile in serving.
    fx_config.use_duck_shape = False
    graphs = model.device.type == "cuda"
    # CUDA: graphs. CPU: the code around a graph's kernels in C++, ~0.5 ms a step less than Python.
    mode, options = ("reduce-overhead", None) if graphs else (None, {"cpp_wrapper": True})
    runs = layer_runs(decoder.layers, LAYERS_PER_GRAPH)
    # Runs whose layers differ (sliding and global attention) are graphs of their own: up to two per
    # run (widths 1 and more). Isolated, so that other models loaded here do not count against it.
    step = torch.compile(run_layers, dynamic=True, fullgraph=True, mode=mode, options=options,
                         isolate_recompiles=True, recompile_limit=max(8, 2 * len(runs)))
    decoder.decode_runs = [partial(run_compiled, step, run) for run in runs]
    # CUDA graphs replay one recorded shape each: decode shapes are bucketed (models/base.py), and
    # every width bucket is recorded now (a key-length bucket when a row first reaches it).
    eager_buckets = model.decode_buckets  # the device path's (layers/host_transfer.py `takes_device_path`)
    model.decode_buckets, model.decode_masked = graphs or eager_buckets, True
    if graphs:  # the KV cache stays where the graphs recorded it: static inputs, never copied in per replay
        for cache in model.kv_caches():
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
    started = time.monotonic()
    try:
        _warm_up(model, progress, "compiling decode (batch width {}; the first start on a machine takes longest)")
    except Exception as exc:  # noqa: BLE001 - any compiler failure: run eagerly, as without the switch
        log.warning("%s: compiling decode failed, decoding eagerly: %s: %s", COMPILE_ENV, type(exc).__name__, exc)
        decoder.decode_runs = None
        model.decode_buckets, model.decode_masked = eager_buckets, False
        return False
    log.info("compiled decode in %.1f s (%d runs of layers, mode=%s, options=%s, cache %s)",
             time.monotonic() - started, len(runs), mode, options, os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
    return True


def _warm_up(model: CausalLM, progress: Callable[[str], None] | None, stage: str) -> None:
    """Decode steps of every width that has a graph of its own: every width bucket with CUDA
    graphs; else widths 1 and 2 (torch gives a width of 1 its own graph; 2 stands for the rest)."""
    graphs = model.device.type == "cuda"
    widths = sorted({min(bucket(w), model.max_batch) for w in range(1, model.max_batch + 1)}) if graphs else (1, 2)
    # Warm-up rows sit a few positions in: a graph traced with 1 key would hold for 1 key only.
    position = min(WARM_UP_POSITION, model.max_context - 1)
    try:
        for width in widths:
            if progress is not None:
                progress(stage.format(width))
            model.cache_lens[:width] = [position] * width
            model.decode([0] * width, [True] * width)
    finally:
        model.clear_cache()


def rejoin_decode(model: CausalLM, progress: Callable[[str], None] | None = None) -> None:
    """Ready the decode of a model this rank kept for a new group (a heal): it runs the model
    collectives that a rank loading the model afresh runs in `prepare_decode`, so that they meet.
    CUDA graphs recorded the old communicator's collectives, so there decode is compiled again;
    elsewhere the compiled graphs stay, and only their warm-up steps run again."""
    if getattr(model.model, "decode_runs", None) is None:
        return  # eager: a fresh load's prepare_decode runs no collective either
    if model.device.type == "cuda":
        compile_decode(model, progress)
    else:
        _warm_up(model, progress, "warming up decode in the new group (batch width {})")
