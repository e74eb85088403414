"""Dispatch latency: one trivial task to one rank vs. one trivial chord over all ranks.

Run: python benchmarks/dispatch.py [--ops 300] [--tp 2]
Prints one JSON object (medians in ms and the ratio) and a readable table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from celerytp.app import queue_name
from celerytp.cluster import LocalCluster
from celerytp.worker.tasks import op_task_name


def median_ms(fn, ops: int) -> float:
    for _ in range(20):  # warm connections and pools
        fn()
    samples = []
    for _ in range(ops):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    with LocalCluster(world_size=args.tp) as cluster:
        leader = cluster.leader
        app = leader.app
        seq = iter(range(10**9, 2 * 10**9))  # a bare task needs no dispatch lock or counter

        def single_task() -> None:
            request = {"op": "ping", "seq": next(seq)}
            result = app.send_task(op_task_name("ping"), args=(request,), queue=queue_name(cluster.group, 0))
            result.get(timeout=10, interval=0.005)
            result.forget()

        chord_ping = median_ms(leader.ping, args.ops)
        chord_sanity = median_ms(leader.sanity_check, args.ops)
        single = median_ms(single_task, args.ops)  # last: its seqs jump past the group's
    report = {
        "tp": args.tp,
        "ops": args.ops,
        "single_task_ms": round(single, 3),
        "chord_ping_ms": round(chord_ping, 3),
        "chord_sanity_check_ms": round(chord_sanity, 3),
        "chord_over_single": round(chord_ping / single, 3),
    }
    print(json.dumps(report))
    print(f"{'one task, one rank':<34}{single:8.2f} ms")
    print(f"{f'chord over {args.tp} ranks (ping)':<34}{chord_ping:8.2f} ms")
    print(f"{f'chord over {args.tp} ranks (all-reduce)':<34}{chord_sanity:8.2f} ms")
    print(f"{'chord / single':<34}{chord_ping / single:8.2f} x  (goal <= 2.0)")


if __name__ == "__main__":
    main()
