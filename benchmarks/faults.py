"""Fault injection on a live two-rank group: how long detection and recovery take, what the client sees.

Run: python benchmarks/faults.py [--repeat 3]

Faults: SIGKILL of rank 1 and of rank 0 during a long streamed generation, SIGKILL of rank 1
while idle, SIGSTOP of rank 1 during a generation, and a Redis restart between two requests.
For each: detection = from the fault to the client's first error (the in-flight request's, or
for idle faults the next request's); recovery = from the fault to the end of the first successful
request after it (the supervisor restarts the rank,
the leader re-forms the group and reloads SmolLM2). Default heartbeat: TTL 4 s, refresh 1 s.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import threading
import time

import psutil

from celerytp.cluster import LocalCluster
from celerytp.core.errors import CeleryTPError

PROMPT = dict(prompt="The capital of France is", max_tokens=8, temperature=0)


def in_flight(leader) -> tuple[threading.Thread, list]:
    """A long streamed generation in a thread, once its first tokens arrived."""
    outcome: list = []
    started = threading.Event()

    def run():
        try:
            for _ in leader.stream("smol", prompt="Once upon a time", max_tokens=2000, ignore_eos=True):
                started.set()
            outcome.append("completed")
        except CeleryTPError as exc:
            outcome.append((time.monotonic(), exc))
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    started.wait(60)
    return thread, outcome


def inject(cluster, fault: str) -> float:
    if fault == "redis restart":
        at = time.monotonic()
        cluster.restart_redis()
        return at
    rank = 0 if "rank 0" in fault else 1
    at = time.monotonic()
    if "SIGSTOP" in fault:
        psutil.Process(cluster.workers[rank].pid).suspend()
    else:
        os.killpg(cluster.workers[rank].pid, signal.SIGKILL)
    return at


def one(cluster, fault: str, expected: list[int]) -> dict:
    leader = cluster.leader
    busy = "idle" not in fault and "redis" not in fault
    thread, outcome = in_flight(leader) if busy else (None, [])
    at = inject(cluster, fault)
    seen = None
    if thread is not None:
        thread.join(60)
        when, error = outcome[0]
        seen = (when - at, f"{error.kind}: {error.message[:90]}")
    while True:  # the next requests, until one succeeds; the first may fail naming the rank (idle faults)
        try:
            result = leader.generate("smol", **PROMPT)
            break
        except CeleryTPError as error:
            seen = seen or (time.monotonic() - at, f"{error.kind}: {error.message[:90]}")
    assert result.token_ids == expected, "recovered group gives other tokens"
    return {"detect": seen, "recover": time.monotonic() - at}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    faults = ["SIGKILL rank 1 mid-stream", "SIGKILL rank 0 mid-stream", "SIGKILL rank 1 idle",
              "SIGSTOP rank 1 mid-stream", "redis restart"]
    with LocalCluster(world_size=2, group="faults") as cluster:
        cluster.leader.load("smol", None, idle_s=0.2)
        expected = cluster.leader.generate("smol", **PROMPT).token_ids
        print("| fault | detection (client error) | what the client saw | recovery (next request done) |")
        print("|---|---|---|---|")
        for fault in faults:
            runs = [one(cluster, fault, expected) for _ in range(args.repeat)]
            detects = [r["detect"][0] for r in runs if r["detect"]]
            seen = runs[0]["detect"][1] if runs[0]["detect"] else "no error: the next request succeeded"
            detect = f"{statistics.median(detects):.1f} s (max {max(detects):.1f})" if detects else "-"
            recover = [r["recover"] for r in runs]
            print(f"| {fault} | {detect} | `{seen}` | {statistics.median(recover):.1f} s (max {max(recover):.1f}) |", flush=True)


if __name__ == "__main__":
    main()
