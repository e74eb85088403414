"""Decode speed and memory per rank of SmolLM2-135M, against llama.cpp on the same GGUF.

Run: python benchmarks/decode.py [--threads 2] [--tokens 64] [--repeats 3] [--tp 1 2 3]
                                 [--weights f32 bf16 keep] [--compile] [--no-shm]

All in one run, with the same total intra-op threads everywhere (--threads, divided among the
ranks):
- celerytp at each TP size with the default GGUF loaded as float32 (`f32`: every block
  dequantized), as bfloat16 (`bf16`: weights and activations; a worker refuses it on a CPU where
  it is slower than float32, models/half_precision.py) and as it ships (`keep`: Q4_1 linears,
  Q8_0 embedding/LM head), shared-memory collectives on (--no-shm: gloo), driven through the
  bare SPMD serving loop
  (celerytp.worker.serving with torch.distributed directly: no Celery, no Redis);
- with --compile, the same with CELERYTP_COMPILE=1, and the load time that includes compiling;
- llama.cpp (llama-cpp-python) on the same file with --threads threads, when it is installed
  (`pip install llama-cpp-python` builds it from source, ~15 min on 2 cores); skipped with a
  message otherwise.

Decode tokens/s = (N - 1) / (t(N tokens) - t(1 token)) for one greedy request of the same
prompt (medians of --repeats after a warm-up), so prefill and start-up cancel out. Memory: each
rank's whole RSS growth from before the load to after the runs, with the load defaults
(max_batch 16, the default KV cache budget), so the KV pages the runs touched are included;
freed heap is handed back after the load, as a worker's load does.

Prints one JSON object and a readable table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from celerytp.core.model_files import default_model_path
from celerytp.core.protocol import GenSpec
from celerytp.core.tokenizer import load_tokenizer
from celerytp.distributed import shm
from celerytp.distributed.control import ControlGroup
from celerytp.distributed.tp import TPContext

PROMPT = "Tensor parallelism splits each layer of a neural network across devices so that"
MIB = 2**20


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _request_seconds(model, tp: TPContext, rank: int, prompt: list[int], tokens: int) -> float:
    from celerytp.worker.serving import ListSource, ServingLoop

    spec = GenSpec(request_id="bench", prompt=prompt, max_tokens=tokens)  # no eos ids: runs to `tokens`
    dist.barrier()
    start = time.perf_counter()
    source = ListSource([spec]) if rank == 0 else None
    ServingLoop(model, ControlGroup.on_default_group(tp.rank, tp.world_size), {}, prefill_budget=256, idle_s=0.0, source=source).run()
    return time.perf_counter() - start


def _celerytp_rank(rank: int, world_size: int, init_file: str, run: argparse.Namespace, out) -> None:
    os.environ["CELERYTP_COMPILE"] = "1" if run.compile else "0"
    torch.set_num_threads(max(1, run.threads // world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    if run.shm and world_size > 1:
        assert shm.attach("bench", os.path.basename(init_file), rank, world_size, 120.0) is not None
    tp = TPContext(rank, world_size)
    from celerytp.models import load_model
    from celerytp.worker.loaded_model import release_memory

    prompt = load_tokenizer(default_model_path()).encode(PROMPT)
    before = _rss()
    started = time.perf_counter()
    dtype = torch.bfloat16 if run.weights == "bf16" else torch.float32
    quant = None if run.weights == "keep" else run.weights
    model = load_model(default_model_path(), tp, max_batch=16, quant=quant, dtype=dtype)
    release_memory()  # as a worker's load does: loading temporaries back to the OS
    load_s = time.perf_counter() - started
    times: dict[int, list[float]] = {1: [], run.tokens: []}
    for i in range(run.repeats + 1):
        for n in times:
            seconds = _request_seconds(model, tp, rank, prompt, n)
            if i:  # the first round warms up
                times[n].append(seconds)
    decode_s = statistics.median(times[run.tokens]) - statistics.median(times[1])
    report = model.memory_report()
    out.put({
        "rank": rank,
        "tokens_per_s": (run.tokens - 1) / decode_s,
        "rss_growth_mib": (_rss() - before) / MIB,
        "weights_mib": (report["sharded_bytes"] + report["replicated_bytes"]) / MIB,
        "kv_cache_mib": report["kv_cache_bytes"] / MIB,
        "load_s": load_s,
        "quant": model.quant,
    })
    shm.detach()
    dist.destroy_process_group()


def celerytp_figures(world_size: int, run: argparse.Namespace) -> dict:
    """Rank 0's speed, and every rank's memory (the largest growth counts)."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    init_file = tempfile.mktemp(prefix="celerytp-decode-")
    mp.start_processes(_celerytp_rank, args=(world_size, init_file, run, out), nprocs=world_size, start_method="spawn")
    ranks = sorted((out.get() for _ in range(world_size)), key=lambda r: r["rank"])
    return {
        **{k: ranks[0][k] for k in ("tokens_per_s", "weights_mib", "kv_cache_mib", "load_s", "quant")},
        "rss_growth_mib_per_rank": [round(r["rss_growth_mib"], 1) for r in ranks],
    }


def llama_cpp_figures(run: argparse.Namespace) -> dict | str:
    """The same file, prompt and greedy decode through llama.cpp; a message when it is absent."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return "llama-cpp-python is not installed (pip install llama-cpp-python; it builds from source)"
    before = _rss()
    llm = Llama(model_path=default_model_path(), n_threads=run.threads, n_threads_batch=run.threads, n_ctx=512,
                verbose=False)
    prompt = llm.tokenize(PROMPT.encode())

    def seconds(n: int) -> float:
        llm.reset()  # no prefix reuse between runs: the same work as celerytp's fresh request
        start = time.perf_counter()
        produced = 0
        for _ in llm.generate(prompt, temp=0.0, reset=True):
            produced += 1
            if produced == n:
                break
        return time.perf_counter() - start

    times: dict[int, list[float]] = {1: [], run.tokens: []}
    for i in range(run.repeats + 1):
        for n in times:
            t = seconds(n)
            if i:
                times[n].append(t)
    decode_s = statistics.median(times[run.tokens]) - statistics.median(times[1])
    return {"tokens_per_s": (run.tokens - 1) / decode_s, "rss_growth_mib": (_rss() - before) / MIB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="total intra-op threads")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--weights", nargs="+", default=["f32", "keep"],
                        help="f32, bf16 and/or keep (the file's blocks)")
    parser.add_argument("--compile", action="store_true", help="also run with CELERYTP_COMPILE=1")
    parser.add_argument("--no-shm", dest="shm", action="store_false", help="collectives over gloo")
    args = parser.parse_args()
    figures: dict = {
        "threads": args.threads, "tokens": args.tokens, "shm": args.shm, "load_average": os.getloadavg(),
        "celerytp": {}, "llama_cpp": llama_cpp_figures(args),
    }
    for weights in args.weights:
        for compiled in (False, True) if args.compile else (False,):
            for world_size in args.tp:
                run = argparse.Namespace(**{**vars(args), "weights": weights, "compile": compiled})
                name = f"{weights}{' compiled' if compiled else ''} tp{world_size}"
                figures["celerytp"][name] = celerytp_figures(world_size, run)
    figures["load_average_after"] = os.getloadavg()
    print(json.dumps(figures))
    print(f"\nSmolLM2-135M decode, {args.tokens} tokens, {args.threads} threads in all")
    for name, row in figures["celerytp"].items():
        print(
            f"  {name:18s} {row['tokens_per_s']:6.1f} tok/s   weights {row['weights_mib']:6.1f} MiB (rank 0)"
            f"   RSS growth {row['rss_growth_mib_per_rank']} MiB   load {row['load_s']:.1f} s"
        )
    peer = figures["llama_cpp"]
    if isinstance(peer, dict):
        print(f"  {'llama.cpp':18s} {peer['tokens_per_s']:6.1f} tok/s   RSS growth {peer['rss_growth_mib']:.0f} MiB")
    else:
        print(f"  llama.cpp: skipped ({peer})")


if __name__ == "__main__":
    main()
