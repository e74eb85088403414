"""Collectives: gloo vs shared memory between processes, and what it does to TP decode speed.

Run: python benchmarks/collectives.py [--threads 2] [--tokens 64] [--repeats 3] [--quant f32 keep] [--skip-decode]

All in one run:
- all-reduce median latency of float32 tensors of 2 KiB, 64 KiB and 1 MiB between 2 and 3
  spawned processes (one intra-op thread each), gloo and shared memory on the same group;
- SmolLM2-135M decode tokens/s at TP 1, 2 and 3, shared memory on and off, float32 and the
  file's Q4_1 blocks kept (--quant f32 keep), with the same total threads (--threads divided
  among the ranks), through the bare SPMD serving loop (celerytp.worker.serving driven by
  torch.distributed directly: no Celery, no Redis): one greedy request of --tokens tokens
  (prefill included), median of --repeats after a warm-up; with rank 0's weight bytes.

Prints one JSON object and a readable table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from celerytp.core.model_files import default_model_path
from celerytp.core.protocol import GenSpec
from celerytp.core.tokenizer import load_tokenizer
from celerytp.distributed import shm
from celerytp.distributed.tp import TPContext

SIZES = {"2KiB": 2 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20}
ITERS = {"2KiB": 2000, "64KiB": 500, "1MiB": 100}
PROMPT = "Tensor parallelism splits each layer of a neural network across devices so that"


def _init(rank: int, world_size: int, init_file: str, use_shm: bool, threads: int) -> TPContext:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    if use_shm:
        assert shm.attach("bench", os.path.basename(init_file), rank, world_size, 60.0) is not None
    return TPContext(rank, world_size)


def _latency_rank(rank: int, world_size: int, init_file: str, out) -> None:
    _init(rank, world_size, init_file, True, 1)
    group = shm.active()
    result = {}
    for label, nbytes in SIZES.items():
        x = torch.randn(nbytes // 4)
        for name, op in (("gloo", lambda t: dist.all_reduce(t)), ("shm", group.all_reduce)):
            times = []
            for i in range(ITERS[label] + 50):
                start = time.perf_counter()
                op(x)
                if i >= 50:  # warm-up
                    times.append(time.perf_counter() - start)
                x.div_(world_size)  # keep values bounded
            result[f"{name} {label}"] = statistics.median(times) * 1e6
    if rank == 0:
        out.put(result)
    shm.detach()
    dist.destroy_process_group()


def _decode_rank(rank: int, world_size: int, init_file: str, use_shm: bool, threads: int, args, out) -> None:
    """One greedy request through the serving loop; `args.quant` f32 or keep (the file's blocks)."""
    from celerytp.models import load_model
    from celerytp.worker.serving import ListSource, ServingLoop

    tp = _init(rank, world_size, init_file, use_shm and world_size > 1, threads)
    model = load_model(default_model_path(), tp, max_batch=1, quant=None if args.quant == "keep" else args.quant)
    prompt = load_tokenizer(default_model_path()).encode(PROMPT)
    spec = GenSpec(request_id="bench", prompt=prompt, max_tokens=args.tokens)  # no eos ids: runs to --tokens
    times = []
    for _ in range(args.repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        ServingLoop(
            model, tp, {}, prefill_budget=256, idle_s=0.0, source=ListSource([spec]) if rank == 0 else None
        ).run()
        times.append(time.perf_counter() - start)
    if rank == 0:  # the first run warms up
        report = model.memory_report()
        weights = (report["sharded_bytes"] + report["replicated_bytes"]) / 2**20
        out.put({"tokens_per_s": args.tokens / statistics.median(times[1:]), "rank0_weights_mib": weights})
    shm.detach()
    dist.destroy_process_group()


def _spawn(fn, world_size: int, *args):
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    init_file = tempfile.mktemp(prefix="celerytp-coll-")
    mp.start_processes(fn, args=(world_size, init_file, *args, out), nprocs=world_size, start_method="spawn")
    return out.get()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2, help="total intra-op threads of the decode runs")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--quant", nargs="+", default=["f32", "keep"], help="decode weights: f32 and/or keep (Q4_1)")
    args = parser.parse_args()
    figures: dict = {"latency_us": {}, "decode_tokens_per_s": {}, "threads": args.threads, "tokens": args.tokens}
    for world_size in (2, 3):
        figures["latency_us"][world_size] = _spawn(_latency_rank, world_size)
    if not args.skip_decode:
        for quant in args.quant:
            for world_size in (1, 2, 3):
                for use_shm in (False, True) if world_size > 1 else (False,):
                    threads = max(1, args.threads // world_size)
                    run = argparse.Namespace(**{**vars(args), "quant": quant})
                    name = f"{quant} tp{world_size}{' shm' if use_shm else ''}"
                    figures["decode_tokens_per_s"][name] = _spawn(_decode_rank, world_size, use_shm, threads, run)
    print(json.dumps(figures))
    print("\nall-reduce median latency (us), float32")
    for world_size, row in figures["latency_us"].items():
        print(f"  {world_size} ranks: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))
    if figures["decode_tokens_per_s"]:
        print(f"\nSmolLM2-135M decode, {args.tokens} tokens, {args.threads} threads in all (tokens/s)")
        for name, row in figures["decode_tokens_per_s"].items():
            print(f"  {name:16s} {row['tokens_per_s']:6.1f}   rank 0 weights {row['rank0_weights_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
