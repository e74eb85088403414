"""Compiled decode by default: what a start costs and what decode gains, on the shipped model.

Run: python benchmarks/compile_start.py [--tp 1] [--tokens 64]

Three LocalClusters one after the other, each loading the default model (SmolLM2 Q4_1 GGUF, kept
quantized) and generating `tokens` greedy tokens (ignore_eos, best of 3): eager
(CELERYTP_COMPILE=0); compiled with an empty compile cache (the first start on a machine); and
compiled again with that cache (a later start). Per run: seconds from start to loaded, to the first
token, and decode tokens/s.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from celerytp.cluster import LocalCluster


def run(tp: int, tokens: int, env: dict[str, str]) -> dict:
    started = time.perf_counter()
    with LocalCluster(world_size=tp, group=f"compile{tp}", env=env) as cluster:
        up = time.perf_counter()
        cluster.leader.load("smol", None, max_batch=4)
        loaded = time.perf_counter()
        first = cluster.leader.generate("smol", prompt="Hello", max_tokens=1)
        first_token = time.perf_counter()
        best = max(
            cluster.leader.generate("smol", prompt="The history of Rome:", max_tokens=tokens, temperature=0,
                                    ignore_eos=True).tokens_per_s
            for _ in range(3)
        )
    assert first.completion_tokens == 1
    return {"workers_up_s": round(up - started, 1), "load_s": round(loaded - up, 1),
            "start_to_first_token_s": round(first_token - started, 1), "decode_tokens_per_s": round(best, 1)}


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
