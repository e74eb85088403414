"""HTTP overhead of `celerytp serve`: streaming clients through the API vs. the Leader directly.

Run: python benchmarks/http_overhead.py [--clients 1 4 8] [--tokens 32] [--rounds 3] [--tp 2]
One LocalCluster with SmolLM2 loaded; `celerytp serve --broker` attached to it in a subprocess.
For each client count, rounds alternate direct (threads calling Leader.stream) and HTTP (threads
streaming /v1/completions with httpx), same prompts, greedy, ignore_eos, so both modes decode
the same tokens. TTFT: request start to the first text delta; tokens/s: all clients' tokens over
the round's wall time. Prints one JSON line per client count.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from celerytp.cluster import LocalCluster
from celerytp.core.model_files import default_model_path

MODEL = "smol"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct(leader, prompt: str, tokens: int) -> float:
    start = time.perf_counter()
    ttft = None
    for _ in leader.stream(MODEL, prompt=prompt, max_tokens=tokens, temperature=0, ignore_eos=True):
        ttft = ttft or time.perf_counter() - start
    return ttft


def over_http(url: str, prompt: str, tokens: int) -> float:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    ttft = None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and ttft is None and json.loads(line[6:])["choices"][0]["text"]:
                ttft = time.perf_counter() - start
    return ttft


def round_of(fn, clients: int, prompts: list[str]) -> tuple[list[float], float]:
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        ttfts = list(pool.map(fn, prompts[:clients]))
    return ttfts, time.perf_counter() - start


def p(values: list[float], q: float) -> float:
    return round(1000 * statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 1) if len(values) > 1 \
        else round(1000 * values[0], 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    prompts = [f"Story number {i}: once upon a time, in a land far away," for i in range(max(args.clients))]
    roots = [os.path.dirname(default_model_path())]
    with LocalCluster(world_size=args.tp, group="bench", model_roots=roots) as cluster:
        leader = cluster.leader
        leader.load(MODEL, None, max_batch=max(args.clients))
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "celerytp", "serve", "--broker", cluster.broker_url, "--group", "bench",
             "--tp", str(args.tp), "--port", str(port), "--model-id", MODEL, "--no-frontend"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    if httpx.get(f"{url}/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            over_http(url, prompts[0], 4)  # warm both paths
            direct(leader, prompts[0], 4)
            for clients in args.clients:
                runs = {"direct": ([], []), "http": ([], [])}
                for _ in range(args.rounds):
                    for name, fn in (("direct", lambda pr: direct(leader, pr, args.tokens)),
                                     ("http", lambda pr: over_http(url, pr, args.tokens))):
                        ttfts, wall = round_of(fn, clients, prompts)
                        runs[name][0].extend(ttfts)
                        runs[name][1].append(clients * args.tokens / wall)
                out = {"clients": clients, "tokens": args.tokens, "rounds": args.rounds}
                for name, (ttfts, rates) in runs.items():
                    out[name] = {"ttft_p50_ms": p(ttfts, 50), "ttft_p95_ms": p(ttfts, 95),
                                 "tokens_per_s": round(statistics.median(rates), 2)}
                out["tokens_per_s_overhead_pct"] = round(
                    100 * (1 - out["http"]["tokens_per_s"] / out["direct"]["tokens_per_s"]), 1)
                print(json.dumps(out), flush=True)
        finally:
            server.send_signal(signal.SIGINT)
            server.wait(30)


if __name__ == "__main__":
    main()
