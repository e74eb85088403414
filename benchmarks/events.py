"""Cost of Celery task events (on by default, for Flower) on the 2-rank chord latency.

Run: python benchmarks/events.py [--ops 300] [--tp 2] [--gap-ms 3]
Two LocalClusters run side by side, one with CELERYTP_EVENTS=0 on its workers, one with the
default (events on); a ping chord on each runs in turn within one loop, so drift hits both alike.
Prints one JSON object (median ms of each, the overhead in %).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from celerytp.cluster import LocalCluster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--gap-ms", type=float, default=3.0)
    args = parser.parse_args()
    with LocalCluster(world_size=args.tp, group="ev-off", env={"CELERYTP_EVENTS": "0"}) as off, \
            LocalCluster(world_size=args.tp, group="ev-on", env={"CELERYTP_EVENTS": "1"}) as on:
        leaders = {"events_off": off.leader, "events_on": on.leader}
        samples: dict[str, list[float]] = {name: [] for name in leaders}
        for i in range(20 + args.ops):
            for name, leader in leaders.items():
                time.sleep(args.gap_ms / 1000)
                start = time.perf_counter()
                leader.ping()
                if i >= 20:  # the first rounds warm connections and pools
                    samples[name].append((time.perf_counter() - start) * 1000)
    medians = {name: round(statistics.median(s), 3) for name, s in samples.items()}
    overhead = 100 * (medians["events_on"] / medians["events_off"] - 1)
    print(json.dumps({**medians, "overhead_pct": round(overhead, 1), "ops": args.ops, "tp": args.tp}))


if __name__ == "__main__":
    main()
