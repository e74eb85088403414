"""Collectives: gloo vs shared memory between processes.

Run: python benchmarks/collectives.py

All-reduce median latency of float32 tensors of 2 KiB, 64 KiB and 1 MiB between 2 and 3
spawned processes (one intra-op thread each), gloo and shared memory on the same group, in
one run. What it does to decode speed: benchmarks/decode.py. At 3 ranks also 4 MiB (too large
for the segment), gloo's ring against the model group's gather and fold in rank order, which
keeps a row's sum the same bits whatever travels beside it (distributed/tp.py).

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

from celerytp.distributed import shm
from celerytp.distributed.tp import TPContext

SIZES = {"2KiB": 2 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20}
ITERS = {"2KiB": 2000, "64KiB": 500, "1MiB": 100, "4MiB": 30}


def _init(rank: int, world_size: int, init_file: str, use_shm: bool, threads: int) -> TPContext:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    if use_shm:
        assert shm.attach("bench", os.path.basename(init_file), rank, world_size, 60.0) is not None
    return TPContext(rank, world_size)


def _latency_rank(rank: int, world_size: int, init_file: str, out) -> None:
    tp = _init(rank, world_size, init_file, True, 1)
    group = shm.active()
    result = {}
    for label, nbytes in SIZES.items():
        x = torch.randn(nbytes // 4)
        ops = [("gloo", lambda t: dist.all_reduce(t))]
        ops += [("shm", group.all_reduce)] if group.fits(x) else []
        ops += [("rank order", tp._all_reduce_in_rank_order)] if world_size > 2 else []
        for name, op in ops:
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


def _spawn(fn, world_size: int, *args):
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    init_file = tempfile.mktemp(prefix="celerytp-coll-")
    mp.start_processes(fn, args=(world_size, init_file, *args, out), nprocs=world_size, start_method="spawn")
    return out.get()


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    figures = {world_size: _spawn(_latency_rank, world_size) for world_size in (2, 3)}
    print(json.dumps(figures))
    print("\nall-reduce median latency (us), float32")
    for world_size, row in figures.items():
        print(f"  {world_size} ranks: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))


if __name__ == "__main__":
    main()
