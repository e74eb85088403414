"""Serving under open-loop load: the continuous-batching loop against the old static batcher.

Run: python benchmarks/serving.py [--tp 1 2] [--rates 0.1 0.2 0.4 0.8] [--duration 40] [--old-ref REF]

Poisson arrivals at each rate for a fixed duration; every request's prompt (16-1,024 tokens)
and output length (8-256 tokens, ignore_eos) are drawn with a fixed seed from log-uniform
distributions, the same for both implementations. Each request streams, so time to first
token and the gaps between tokens are measured at the client. Per implementation, TP size and
rate: output tokens/s, TTFT p50/p95, inter-token latency p50/p95; and the highest rate whose
p95 TTFT stays under 2 s. Then the TTFT of a follow-up chat turn after a ~400-token history,
with and without prefix reuse, and the output tokens/s of 16 streams started together against
one alone (new implementation only).

The old static batcher is run from git (`--old-ref`, default: the commit before it was
removed), checked out into a temporary worktree and imported from there, in the same run.
SmolLM2-135M-Instruct in float32 (`quant="f32"`), the machine's cores shared by the ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = (
    "Tensor parallelism splits every layer of a neural network across several devices, so that a model too "
    "large for one of them can still answer requests. Each device holds a slice of every weight matrix and "
    "the devices exchange partial results after each layer. "
)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(math.ceil(q / 100 * len(ordered))) - 1)]


def workload(rate: float, duration: float, seed: int) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) of each request."""
    rng = random.Random(seed)
    out, t = [], rng.expovariate(rate)
    while t < duration:
        prompt = int(math.exp(rng.uniform(math.log(16), math.log(1024))))
        output = int(math.exp(rng.uniform(math.log(8), math.log(256))))
        out.append((t, prompt, output))
        t += rng.expovariate(rate)
    return out


# ---- the driver: runs inside one implementation's tree --------------------------------------


def drive(args: argparse.Namespace) -> dict:
    from celerytp.cluster import LocalCluster

    try:
        from celerytp.core.model_files import default_model_path
        from celerytp.core.tokenizer import load_tokenizer
    except ImportError:  # the old tree's layout
        from celerytp.tokenizer import load_tokenizer

        from celerytp.loading import default_model_path

    tokenizer = load_tokenizer(default_model_path())
    corpus = tokenizer.encode(TEXT * 40)

    def prompt_of(n: int) -> str:
        return tokenizer.decode(corpus[:n])

    report: dict = {}
    tp = args.tp[0]
    with LocalCluster(world_size=tp, group=f"bench{tp}") as cluster:
        leader = cluster.leader
        leader.load("smol", None, quant="f32", max_batch=16)
        leader.generate("smol", prompt="warm up", max_tokens=4)
        for rate in args.rates:
            report[str(rate)] = run_rate(leader, prompt_of, workload(rate, args.duration, args.seed))
        if args.reuse:
            report["follow_up"] = follow_up(leader, prompt_of)
            report["concurrency"] = concurrency(leader, prompt_of)
    return report


def concurrency(leader, prompt_of, streams: int = 16, tokens: int = 64) -> dict:
    """Output tokens/s of one stream alone and of `streams` started together (same prompt length)."""

    def run(n: int) -> float:
        results: list = []

        def one() -> None:
            results.append(leader.generate("smol", prompt=prompt_of(32), max_tokens=tokens, ignore_eos=True))

        threads = [threading.Thread(target=one) for _ in range(n)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(r.completion_tokens for r in results) / (time.perf_counter() - start)

    alone, together = run(1), run(streams)
    return {"streams": streams, "tokens_per_s_1": round(alone, 2), f"tokens_per_s_{streams}": round(together, 2),
            "ratio": round(together / alone, 2)}


def run_rate(leader, prompt_of, requests: list[tuple[float, int, int]]) -> dict:
    records: list[dict] = []
    failures: list[str] = []
    lock = threading.Lock()
    start = time.perf_counter()

    def one(arrival: float, prompt: int, output: int) -> None:
        time.sleep(max(0.0, start + arrival - time.perf_counter()))
        sent = time.perf_counter()
        stream = leader.stream("smol", prompt=prompt_of(prompt), max_tokens=output, temperature=0, ignore_eos=True)
        arrivals = []
        try:
            for _ in stream:
                arrivals.append(time.perf_counter())
        except Exception as exc:  # counted, not fatal: the figures say how many failed
            with lock:
                failures.append(repr(exc)[:200])
            return
        with lock:
            records.append({"ttft": arrivals[0] - sent if arrivals else float("nan"), "arrivals": arrivals,
                            "tokens": stream.result.completion_tokens, "end": time.perf_counter()})

    threads = [threading.Thread(target=one, args=r) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = max(r["end"] for r in records) - start
    gaps = [b - a for r in records for a, b in zip(r["arrivals"], r["arrivals"][1:])]
    ttfts = [r["ttft"] for r in records]
    return {
        "requests": len(records), "failed": len(failures), "failures": failures[:3],
        "tokens_per_s": round(sum(r["tokens"] for r in records) / elapsed, 2),
        "ttft_p50_s": round(percentile(ttfts, 50), 3), "ttft_p95_s": round(percentile(ttfts, 95), 3),
        "itl_p50_ms": round(percentile(gaps, 50) * 1000, 1), "itl_p95_ms": round(percentile(gaps, 95) * 1000, 1),
    }


def follow_up(leader, prompt_of) -> dict:
    """TTFT of a chat's next turn after a ~400-token history: reusing its cached prefix, and not."""
    history = [{"role": "user", "content": prompt_of(380)}]
    first = leader.generate("smol", messages=history, max_tokens=24, temperature=0)
    turn = [*history, {"role": "assistant", "content": first.text}, {"role": "user", "content": "Say it shorter."}]

    def ttft() -> tuple[float, int]:
        stream = leader.stream("smol", messages=turn, max_tokens=4, temperature=0)
        sent = time.perf_counter()
        it = iter(stream)
        next(it)
        seen = time.perf_counter() - sent
        for _ in it:
            pass
        return seen, stream.result.reused_tokens

    reused_ttft, reused = ttft()
    leader.clear_kv_cache("smol")
    fresh_ttft, _ = ttft()
    return {"history_tokens": first.prompt_tokens + first.completion_tokens, "reused_tokens": reused,
            "ttft_reuse_s": round(reused_ttft, 3), "ttft_no_reuse_s": round(fresh_ttft, 3),
            "speedup": round(fresh_ttft / reused_ttft, 2)}


# ---- the comparison ----------------------------------------------------------------------------


def old_ref() -> str:
    """The commit before the static batcher was removed."""
    removed = subprocess.run(
        ["git", "log", "--format=%H", "-1", "--diff-filter=D", "--", "celerytp/client/batching.py"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.strip()
    return f"{removed}^"


def run_impl(tree: Path, args: argparse.Namespace, tp: int, reuse: bool) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--drive", "--tp", str(tp), "--duration", str(args.duration),
           "--seed", str(args.seed), "--rates", *map(str, args.rates)] + (["--reuse"] if reuse else [])
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{tree} tp={tp} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def sustained(figures: dict, rates: list[float]) -> float:
    ok = [r for r in rates if figures[str(r)]["ttft_p95_s"] < 2.0]
    return max(ok, default=0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.4, 0.8])
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--old-ref", default=None)
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reuse", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        print(json.dumps(drive(args)))
        return
    ref = args.old_ref or old_ref()
    report: dict = {"rates": args.rates, "duration_s": args.duration, "old_ref": ref}
    with tempfile.TemporaryDirectory(prefix="celerytp-old-") as tmp:
        old_tree = Path(tmp) / "old"
        subprocess.run(["git", "worktree", "add", "--detach", str(old_tree), ref], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for tp in args.tp:
                new = run_impl(ROOT, args, tp, reuse=True)
                old = run_impl(old_tree, args, tp, reuse=False)
                report[f"tp{tp}"] = {
                    "new": new, "old": old,
                    "sustained_rate_new": sustained(new, args.rates), "sustained_rate_old": sustained(old, args.rates),
                }
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, capture_output=True)
    print(json.dumps(report))
    for tp in args.tp:
        figures = report[f"tp{tp}"]
        print(f"TP={tp}: sustained rate (p95 TTFT < 2 s): new {figures['sustained_rate_new']} req/s, "
              f"old {figures['sustained_rate_old']} req/s")
        for rate in args.rates:
            for impl in ("new", "old"):
                f = figures[impl][str(rate)]
                print(f"  {rate:>5} req/s {impl}: {f['tokens_per_s']:>7} tok/s  TTFT p50/p95 {f['ttft_p50_s']}/"
                      f"{f['ttft_p95_s']} s  ITL p50/p95 {f['itl_p50_ms']}/{f['itl_p95_ms']} ms  ({f['requests']} req)")
        print(f"  follow-up turn: {figures['new']['follow_up']}")
        print(f"  concurrent streams: {figures['new']['concurrency']}")


if __name__ == "__main__":
    main()
