"""Dispatch latency: one trivial task to one rank vs. one trivial chord over all ranks.

Run: python benchmarks/dispatch.py [--ops 300] [--tp 2] [--gap-ms 3]
The three kinds of op run in turn within one loop (drift on a noisy machine hits them alike),
each after --gap-ms of idle time. Prints one JSON object (medians in ms, the ratio) and a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from celerytp.cluster import LocalCluster
from celerytp.core.app import op_task_name, queue_name
from celerytp.core.keys import seq_key


def interleaved_medians_ms(fns: dict, ops: int, gap_s: float) -> dict[str, float]:
    """Median latency of each fn, run in turn in one loop so drift on a noisy machine hits all alike."""
    for _ in range(20):  # warm connections and pools
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(ops):
        for name, fn in fns.items():
            time.sleep(gap_s)  # let the previous op's trailing work (acks, bookkeeping) finish
            start = time.perf_counter()
            timed = fn()  # a fn may time its own critical part
            samples[name].append(timed if isinstance(timed, float) else time.perf_counter() - start)
    return {name: statistics.median(values) * 1000 for name, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--gap-ms", type=float, default=3.0, help="idle time before each op")
    args = parser.parse_args()
    with LocalCluster(world_size=args.tp) as cluster:
        leader = cluster.leader
        app = leader.app
        def single_task() -> float:
            # Rank 0 wants increasing sequence numbers: take one from the group's counter
            # outside the timed part (a bare task needs no lock and no counter).
            request = {"op": "ping", "seq": int(leader.redis.incr(seq_key(cluster.group)))}
            start = time.perf_counter()
            result = app.send_task(op_task_name("ping"), args=(request,), queue=queue_name(cluster.group, 0))
            result.get(timeout=10, interval=0.005)
            result.forget()
            return time.perf_counter() - start

        medians = interleaved_medians_ms(
            {"single": single_task, "chord_ping": leader.ping, "chord_sanity": leader.sanity_check}, args.ops,
            args.gap_ms / 1000,
        )
        single, chord_ping, chord_sanity = medians["single"], medians["chord_ping"], medians["chord_sanity"]
    report = {
        "tp": args.tp,
        "ops": args.ops,
        "gap_ms": args.gap_ms,
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
