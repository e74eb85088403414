"""The GPU check: NCCL ranks on cuda:0..N-1 through every path that matters, as a pass/fail table.

Run: bash scripts/gpu_check.sh   (or python benchmarks/gpu_check.py [--device cpu] [--tp 2])

Starts a LocalCluster with one rank per CUDA device (at most --tp), `device="auto"` so rank r
takes cuda:r, which makes the model group NCCL and the control group gloo. Checks: init (backend
nccl), the sanity check on both channels, loading the default SmolLM2 GGUF, 4 concurrent
generations (one batch) with greedy tokens equal to a lone run, a stream, a cancel mid-stream
(the row frees), a SIGKILL of rank 1 followed by a request that succeeds after the group heals.
Exit 0 when every check passes, 1 when one fails, 2 when there is no CUDA device (unless
`--device cpu`, a smoke run of the same logic on gloo).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

SHORT = dict(prompt="The capital of France is", max_tokens=12, temperature=0)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="auto", help="auto: one CUDA device per rank; cpu: a smoke run")
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    import torch

    from celerytp.cluster import LocalCluster

    if args.device != "cpu":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); --device cpu runs a smoke check")
            return 2
        args.tp = min(args.tp, torch.cuda.device_count())
    rows: list[tuple[str, bool, float, str]] = []

    def check(name: str, fn: Callable[[], str]) -> bool:
        started = time.monotonic()
        try:
            detail, ok = fn(), True
        except Exception as exc:  # report, go on with the next check
            detail, ok = f"{type(exc).__name__}: {exc}"[:160], False
        rows.append((name, ok, time.monotonic() - started, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    with LocalCluster(world_size=args.tp, group="gpucheck", device=args.device) as cluster:
        leader = cluster.leader
        expected: list[int] = []

        def init() -> str:
            backends = {r.backend for r in leader.init()}
            want = "gloo" if args.device == "cpu" else "nccl"
            assert backends == {want}, f"model group backend {backends}, expected {want}"
            return f"{args.tp} ranks, model group {want}, control group gloo"

        def sanity() -> str:
            sums = [r.observed_sum for r in leader.sanity_check()]
            assert sums == [args.tp] * args.tp, sums
            return f"all-reduce of 1 on both channels = {sums}"

        def load() -> str:
            reply = leader.load("smol", None, idle_s=0.5)[0]
            return f"{reply.model_type} {reply.dtype} in {reply.load_s:.1f} s"

        def batched() -> str:
            expected[:] = leader.generate("smol", **SHORT).token_ids
            with ThreadPoolExecutor(4) as pool:
                results = list(pool.map(lambda _: leader.generate("smol", **SHORT), range(4)))
            assert all(r.token_ids == expected for r in results), "a batched row differs from the lone run"
            return f"4 concurrent = lone run ({leader.serving_stats('smol')['peak_rows']} rows at peak)"

        def stream() -> str:
            text = "".join(leader.stream("smol", **SHORT))
            assert text, "empty stream"
            return repr(text[:40])

        def cancel() -> str:
            stream = leader.stream("smol", prompt="Once upon a time", max_tokens=2000, ignore_eos=True)
            pieces = iter(stream)
            next(pieces)
            leader.cancel(stream.request_id)
            for _ in pieces:
                pass
            assert stream.result.finish_reason == "cancelled", stream.result.finish_reason
            return "finish_reason cancelled"

        def rank_kill() -> str:
            killed = time.monotonic()
            os.killpg(cluster.workers[args.tp - 1].pid, signal.SIGKILL)
            deadline = killed + 180
            while True:
                try:
                    assert leader.generate("smol", **SHORT).token_ids == expected
                    return f"served again {time.monotonic() - killed:.1f} s after the kill"
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.2)

        for name, fn in [("init", init), ("sanity_check", sanity), ("load SmolLM2", load), ("generate x4 batched", batched),
                         ("stream", stream), ("cancel mid-stream", cancel), ("SIGKILL rank, heal, serve", rank_kill)]:
            if not check(name, fn) and name in ("init", "load SmolLM2"):
                break

    print("\n| check | result | seconds | detail |\n|---|---|---|---|")
    for name, ok, seconds, detail in rows:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {seconds:.1f} | {detail} |")
    return 0 if len(rows) == 7 and all(ok for _, ok, _, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
