"""Fault injection on a live two-rank group: one row per fault, what the client got, what was lost,
and how soon the group served again with no person involved.

Run: python benchmarks/faults.py [--kill-runs 10] [--stop-s 15 90]

Rows (SmolLM2 float32 at TP=2 on LocalCluster; default heartbeat: TTL 4 s, refresh 1 s):
- SIGSTOP of rank 1 for 15 s during a generation, LocalCluster's supervisor as it ships (it kills
  a worker whose heartbeat lapsed while its process lives): serving again after SIGCONT (a short
  request answered beside the resumed stream), and when that stream finished.
- SIGSTOP of rank 1 for 90 s with a supervisor that restarts only on exit (systemd, compose):
  how soon the client hears of it, and serving again after SIGCONT.
- SIGKILL of rank 1 during 4 streams, `--kill-runs` times: serving again after the kill, every run.
- Abandoned requests: a stream iterator dropped after 3 tokens, and a generate that timed out.
  How many loop steps until its row is free, and the latency of a short request right after,
  against the same request on the idle group.
- A ping from the loading Leader and from a second Leader while a model loads, against idle.
- What rank 0 does alone fails: its Redis refuses a write in the serving loop (the stats key
  made another type), and the model's tokenizer file is corrupted in place after the load. What
  the client got and how soon, and whether the next request works once the cause is gone.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil

from celerytp import Leader
from celerytp.cluster import LocalCluster
from celerytp.core.errors import CeleryTPError
from celerytp.core.keys import loop_stats_key
from celerytp.core.model_files import default_model_path

SHORT = dict(prompt="The capital of France is", max_tokens=8, temperature=0)
LONG = dict(prompt="Once upon a time", max_tokens=300, ignore_eos=True)


def streaming(leader: Leader, n: int = 1) -> tuple[list[threading.Thread], list]:
    """`n` long streams in threads, returned once each has its first tokens; outcomes collect as
    ("completed" | (monotonic time, error))."""
    outcomes: list = []
    started = [threading.Event() for _ in range(n)]

    def run(i: int) -> None:
        try:
            for _ in leader.stream("smol", **LONG):
                started[i].set()
            outcomes.append("completed")
        except CeleryTPError as exc:
            outcomes.append((time.monotonic(), exc))
        started[i].set()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for event in started:
        event.wait(120)
    return threads, outcomes


def serve_again(leader: Leader, expected: list[int], limit_s: float = 300) -> float:
    """Send short requests until one succeeds with the expected tokens; when it finished."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            result = leader.generate("smol", **SHORT)
            assert result.token_ids == expected, "the healed group gives other tokens"
            return time.monotonic()
        except CeleryTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def client_saw(outcomes: list, at: float) -> str:
    if not outcomes:
        return "nothing yet"
    first = outcomes[0]
    if first == "completed":
        return "completed"
    when, error = first
    return f"{when - at:.1f} s: `{error.kind}`"


def sigstop(cluster: LocalCluster, expected: list[int], seconds: float) -> dict:
    leader = cluster.leader
    threads, outcomes = streaming(leader)
    proc = psutil.Process(cluster.workers[1].pid)
    at = time.monotonic()
    proc.suspend()
    time.sleep(seconds)
    try:
        proc.resume()
    except psutil.NoSuchProcess:
        pass  # the supervisor killed it (and started a replacement) while it was stopped
    resumed = time.monotonic()
    done = serve_again(leader, expected)  # beside the resumed stream, as after a SIGKILL
    for t in threads:
        t.join(300)
    return {"saw": client_saw(outcomes, at), "again": done - resumed, "finished": time.monotonic() - resumed,
            "lost": lost(outcomes, 1)}


def sigkill_during_streams(cluster: LocalCluster, expected: list[int]) -> dict:
    leader = cluster.leader
    threads, outcomes = streaming(leader, 4)
    at = time.monotonic()
    os.killpg(cluster.workers[1].pid, signal.SIGKILL)
    done = serve_again(leader, expected)
    for t in threads:
        t.join(300)
    return {"saw": client_saw(sorted(outcomes, key=str), at), "again": done - at, "lost": lost(outcomes, 4)}


def lost(outcomes: list, requests: int) -> str:
    """The requests in flight that did not complete (they resume on the healed group)."""
    failed = requests - outcomes.count("completed")
    return "nothing (resumed)" if not failed else f"{failed} of {requests} requests in flight"


def latency(leader: Leader) -> float:
    started = time.perf_counter()
    leader.generate("smol", **SHORT)
    return time.perf_counter() - started


def steps_until_free(leader: Leader, abandon) -> tuple[int, float]:
    """Loop steps from the moment the caller gave up until no row runs, and the next short
    request's latency."""
    abandon()
    before = leader.serving_stats("smol")["steps"]
    while leader.serving_stats("smol").get("running_rows", 0):
        time.sleep(0.002)
    steps = leader.serving_stats("smol")["steps"] - before
    return steps, latency(leader)


def abandoned(cluster: LocalCluster) -> list[tuple[str, str]]:
    leader = cluster.leader
    idle = statistics.median(latency(leader) for _ in range(3))

    def dropped_stream() -> None:
        stream = iter(leader.stream("smol", **LONG))
        for _ in range(3):
            next(stream)
        del stream
        gc.collect()

    def timed_out() -> None:
        saved = leader.generate_timeout
        leader.generate_timeout = 1.0
        try:
            leader.generate("smol", **LONG)
        except CeleryTPError:
            pass
        finally:
            leader.generate_timeout = saved

    rows = []
    for name, abandon in (("stream iterator dropped after 3 tokens", dropped_stream), ("generate timed out (1 s)", timed_out)):
        steps, after = steps_until_free(leader, abandon)
        rows.append((name, f"row free after {steps} step(s); next short request {after * 1000:.0f} ms (idle {idle * 1000:.0f} ms)"))
    return rows


def ping_during_load(cluster: LocalCluster) -> str:
    leader = cluster.leader
    other = Leader(cluster.broker_url, cluster.group, cluster.world_size)
    idle = statistics.median(_timed(leader.ping) for _ in range(5))
    loading = threading.Thread(target=lambda: leader.load("smol-b", None, quant="f32"))
    started = time.monotonic()
    loading.start()
    time.sleep(1.0)
    same, second = [], []
    while loading.is_alive():
        same.append(_timed(leader.ping))
        second.append(_timed(other.ping))
        time.sleep(0.2)
    load_s = time.monotonic() - started
    leader.unload("smol-b")
    return (f"during a {load_s:.1f} s load: same Leader max {max(same) * 1000:.0f} ms, second Leader max "
            f"{max(second) * 1000:.0f} ms ({len(same)} pings each; idle {idle * 1000:.0f} ms)")


def rank0_alone(cluster: LocalCluster, tmp: Path) -> list[tuple[str, str]]:
    leader = cluster.leader
    rows = []
    key = loop_stats_key(cluster.group, "smol")
    leader.redis.set(key, "not a hash")
    started = time.monotonic()
    try:
        leader.generate("smol", **SHORT)
        saw = "no error"
    except CeleryTPError as exc:
        saw = f"{time.monotonic() - started:.2f} s: `{exc.kind}`"
    leader.redis.delete(key)
    ok = _timed(lambda: leader.generate("smol", **SHORT))
    rows.append(("rank 0's Redis refuses a write in the serving loop",
                 f"client: {saw}; every rank free; once the key is fixed the next request took {ok * 1000:.0f} ms"))
    model = tmp / "smol-copy.gguf"
    shutil.copy(default_model_path(), model)
    leader.load("copy", str(model), idle_s=0.5)
    with open(model, "r+b") as f:  # the tokenizer lives in the GGUF's metadata, near its start
        f.seek(64)
        f.write(b"\xff" * 4096)
    try:
        result = leader.generate("copy", **SHORT)
        saw = f"answered ({result.finish_reason}): rank 0 read and checked the tokenizer at load"
    except CeleryTPError as exc:
        saw = f"`{exc.kind}`: {exc.message[:80]}"
    leader.unload("copy")
    rows.append(("a loaded model's tokenizer file corrupted in place", f"client: {saw}"))
    return rows


def _timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill-runs", type=int, default=10)
    parser.add_argument("--stop-s", type=float, nargs=2, default=[15.0, 90.0])
    args = parser.parse_args()
    rows: list[tuple[str, str, str]] = []

    with tempfile.TemporaryDirectory() as roots, LocalCluster(world_size=2, group="faults", model_roots=[roots]) as cluster:
        cluster.leader.load("smol", None, quant="f32", idle_s=0.5)
        expected = cluster.leader.generate("smol", **SHORT).token_ids
        rows.append(("ping while a model loads", ping_during_load(cluster), "nothing"))
        for name, outcome in abandoned(cluster):
            rows.append((f"abandoned: {name}", outcome, "nothing"))
        for name, outcome in rank0_alone(cluster, Path(roots)):
                rows.append((name, outcome, "the request it hit"))
        r = sigstop(cluster, expected, args.stop_s[0])
        rows.append((f"SIGSTOP rank 1 for {args.stop_s[0]:.0f} s mid-generation (supervisor kills stuck workers)",
                     f"client: {r['saw']}; serving again {r['again']:.1f} s after SIGCONT (the interrupted "
                     f"stream finished after {r['finished']:.1f} s)", r["lost"]))
        runs = [sigkill_during_streams(cluster, expected) for _ in range(args.kill_runs)]
        again = [r["again"] for r in runs]
        rows.append((f"SIGKILL rank 1 during 4 streams ({args.kill_runs} runs)",
                     f"client: {runs[0]['saw']}; serving again after median {statistics.median(again):.1f} s, "
                     f"max {max(again):.1f} s", max((r["lost"] for r in runs), key=len)))

    with LocalCluster(world_size=2, group="faults2", kill_stuck=False) as cluster:
        cluster.leader.load("smol", None, quant="f32", idle_s=0.5)
        expected = cluster.leader.generate("smol", **SHORT).token_ids
        r = sigstop(cluster, expected, args.stop_s[1])
        rows.append((f"SIGSTOP rank 1 for {args.stop_s[1]:.0f} s mid-generation (supervisor restarts on exit only)",
                     f"client: {r['saw']}; serving again {r['again']:.1f} s after SIGCONT (the interrupted "
                     f"stream finished after {r['finished']:.1f} s)", r["lost"]))

    print("| fault | what the client got, recovery | lost |")
    print("|---|---|---|")
    for fault, outcome, lost in rows:
        print(f"| {fault} | {outcome} | {lost} |", flush=True)


if __name__ == "__main__":
    main()
