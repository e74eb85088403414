"""Compiled decode by default: what a start costs, what it holds in memory and what decode gains,
on the shipped model.

Run: python benchmarks/compile_start.py [--tp 1] [--tokens 64]

Three LocalClusters one after the other, each loading the default model (SmolLM2 Q4_1 GGUF, kept
quantized) and generating `tokens` greedy tokens (ignore_eos, best of 3), alone and as 8
concurrent requests: eager (CELERYTP_COMPILE=0); compiled with an empty compile cache (the first
start on a machine); and compiled again with that cache (a later start). Per run: seconds from
start to loaded, to the first token, the ranks' resident memory grown by the load (MiB, all ranks
together: the ping's RSS before, the load reply's after), and decode tokens/s (one stream; 8
streams together).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from celerytp.cluster import LocalCluster


def run(tp: int, tokens: int, env: dict[str, str]) -> dict:
    started = time.perf_counter()
    with LocalCluster(world_size=tp, group=f"compile{tp}", env=env) as cluster:
        up = time.perf_counter()
        before = sum(pong.rss_bytes for pong in cluster.leader.ping())
        after = sum(reply.rss_bytes for reply in cluster.leader.load("smol", None, max_batch=8))
        loaded = time.perf_counter()
        first = cluster.leader.generate("smol", prompt="Hello", max_tokens=1)
        first_token = time.perf_counter()
        best = max(
            cluster.leader.generate("smol", prompt="The history of Rome:", max_tokens=tokens, temperature=0,
                                    ignore_eos=True).tokens_per_s
            for _ in range(3)
        )
        batched = max(_together(cluster.leader, tokens, 8) for _ in range(2))
    assert first.completion_tokens == 1
    return {"workers_up_s": round(up - started, 1), "load_s": round(loaded - up, 1),
            "start_to_first_token_s": round(first_token - started, 1), "rss_growth_mib": round((after - before) / 2**20),
            "decode_tokens_per_s": round(best, 1), "tokens_per_s_8_streams": round(batched, 1)}


def _together(leader, tokens: int, streams: int) -> float:
    """Tokens/s of `streams` greedy requests sent at once (wall time from the first sent to the last done)."""
    def one(i: int) -> int:
        return leader.generate("smol", prompt=f"Story number {i}:", max_tokens=tokens, temperature=0,
                               ignore_eos=True).completion_tokens

    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        done = sum(pool.map(one, range(streams)))
    return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    cache = tempfile.mkdtemp(prefix="celerytp-cache-")
    report = {
        "eager": run(args.tp, args.tokens, {"CELERYTP_COMPILE": "0"}),
        "compiled_first_start": run(args.tp, args.tokens, {"CELERYTP_COMPILE": "auto", "CELERYTP_CACHE_DIR": cache}),
        "compiled_later_start": run(args.tp, args.tokens, {"CELERYTP_COMPILE": "auto", "CELERYTP_CACHE_DIR": cache}),
    }
    for name, figures in report.items():
        print(f"{name:22} {figures}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
