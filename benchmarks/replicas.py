"""Replicas: one model served by several groups behind one shared request queue, and what the
queue survives. One run per row; one JSON line per row, then a markdown table.

Run: python benchmarks/replicas.py [--requests 32] [--tokens 24] [--rows split rank_kill ...] [--threads N]

SmolLM2-135M GGUF (`load("smol", None)`), greedy, ignore_eos, fixed max_tokens, distinct prompts.
Rows that check texts against a clean run load it as float32 (`quant="f32"`): with the file's
own Q4_1 weights a greedy text can change with the rows it was batched with, so a clean run
does not even agree with itself. Rows:
- split: 1 group of TP=1 against 2 groups of TP=1 (replicas, one queue), `--requests` concurrent
  `generate` calls of `--tokens` tokens, max_batch=16 per group. Equal cores in total: the lone
  group's rank gets every core (`--threads`), each of the two half of them. On a machine that
  other work shares, a rank with every core can run many times slower (its torch threads wait
  on each other), so `--threads` below the core count is the fairer lone group there. The
  other rows give each TP=1 rank half the cores. Wall time, output tokens/s, their
  ratio (2 groups / 1), and the requests each group took in the 2-group run (its serving loop's
  `requests`, read before and after; idle_s=30 keeps one loop alive for the whole run).
- rank_kill: 2 groups of TP=1, max_batch=4 each, 24 streams (`Leader.stream` of group b, text
  deltas collected); once 8 have their first delta, group a's only worker is SIGKILLed. Every
  stream must complete with the text of a clean run (`generate`); `mismatched` counts streams
  whose deltas ever left the clean text (a duplicated, missing or different token). Wall time
  against a clean streamed run of the same 24 (`clean_runs_identical`: that run against the
  clean `generate` run, the noise floor).
- redis_kill: 1 group of TP=1, max_batch=4, 16 requests (4 running, 12 queued); 1.1 s after
  they start (past the append-only file's one-second fsync) Redis is SIGKILLed and restarted
  0.5 s later from that file. Through the Leader, then through `celerytp serve --broker` (a
  subprocess, non-streaming /v1/completions over httpx): completed, identical, HTTP statuses.
- wipe_then_kill: 1 group of TP=2; Redis restarted with no data, then (once every rank's
  heartbeat is back) rank 1 SIGKILLed: seconds until a `generate` succeeds again, with no
  init or load by hand.
- redis_commands: Redis commands (INFO commandstats, sum of calls) per generated token (8
  requests x 32 tokens, 1 group of TP=1, once as `generate` and once as `stream`; also per
  second of that run, as waiters poll while they wait) and per second of an idle but live
  serving loop (idle_s=30; counted over 5 s), with the busiest commands. The counting's own
  INFO commands are included.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx

from celerytp import Leader
from celerytp.cluster import LocalCluster
from celerytp.core.errors import CeleryTPError

MODEL = "smol"
ROWS = ("split", "rank_kill", "redis_kill", "wipe_then_kill", "redis_commands")
CORES = os.cpu_count() or 2
HALF = max(1, CORES // 2)  # torch threads of a TP=1 rank that shares the machine with another rank
EXACT = "f32"  # rows that compare texts: the Q4_1 file's greedy text can change with a row's batch mates


def prompts(n: int) -> list[str]:
    return [f"Story number {i}: once upon a time, in a land far away," for i in range(n)]


def options(tokens: int) -> dict:
    return dict(max_tokens=tokens, temperature=0, ignore_eos=True)


def generate_all(leader: Leader, texts: list[str], tokens: int) -> tuple[list, float]:
    """Each prompt as a `generate` in its own thread: (text or CeleryTPError per prompt, wall s)."""

    def one(prompt: str):
        try:
            return leader.generate(MODEL, prompt=prompt, **options(tokens)).text
        except CeleryTPError as exc:
            return exc

    started = time.perf_counter()
    with ThreadPoolExecutor(len(texts)) as pool:
        out = list(pool.map(one, texts))
    return out, time.perf_counter() - started


def stream_all(leader: Leader, texts: list[str], tokens: int, on_running=None, running: int = 8) -> tuple[list, float]:
    """Each prompt as a stream in its own thread: (its deltas, or a CeleryTPError, per prompt; wall s).
    `on_running()` is called once `running` streams have their first delta."""
    out: list = [None] * len(texts)
    first = threading.Semaphore(0)

    def one(i: int) -> None:
        deltas: list[str] = []
        try:
            for delta in leader.stream(MODEL, prompt=texts[i], **options(tokens)):
                if not deltas:
                    first.release()
                deltas.append(delta)
            out[i] = deltas
        except CeleryTPError as exc:
            out[i] = exc
            first.release()

    started = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(texts))]
    for t in threads:
        t.start()
    if on_running is not None:
        for _ in range(running):
            if not first.acquire(timeout=120):
                raise RuntimeError(f"{running} streams did not start within 120 s")
        on_running()
    for t in threads:
        t.join(600)
    return out, time.perf_counter() - started


def diverged(deltas: list[str], clean: str) -> bool:
    """True when the text a client had at some point was not a start of the clean text."""
    text = ""
    for delta in deltas:
        text += delta
        if not clean.startswith(text):
            return True
    return text != clean


def errors_of(outcomes: list) -> list[str]:
    return [f"{e.kind}: {e.message[:120]}" for e in outcomes if isinstance(e, CeleryTPError)]


def taken(leader: Leader) -> int:
    """Requests this group's current serving loop admitted so far."""
    return leader.serving_stats(MODEL).get("requests", 0)


# ---- rows -------------------------------------------------------------------------------


def split(n: int, tokens: int, threads: int) -> dict:
    texts = prompts(n)
    with LocalCluster(world_size=1, group="solo", threads=threads) as solo:
        solo.leader.load(MODEL, None, max_batch=16, idle_s=30)
        generate_all(solo.leader, texts[:4], 4)  # warm
        one, one_s = generate_all(solo.leader, texts, tokens)
    with LocalCluster(world_size=1, group="ra", threads=HALF) as a, \
            LocalCluster(world_size=1, group="rb", threads=HALF, broker_url=a.broker_url) as b:
        for cluster in (a, b):
            cluster.leader.load(MODEL, None, max_batch=16, idle_s=30)
        generate_all(a.leader, texts[:8], 4)  # warm both
        before = [taken(c.leader) for c in (a, b)]
        two, two_s = generate_all(a.leader, texts, tokens)
        after = [taken(c.leader) for c in (a, b)]
    per_group = [y - x for x, y in zip(before, after, strict=True)]
    return {
        "requests": n, "tokens": tokens, "threads": {"one_group": threads, "each_of_two": HALF},
        "one_group_s": round(one_s, 2), "one_group_tok_s": round(n * tokens / one_s, 1),
        "two_groups_s": round(two_s, 2), "two_groups_tok_s": round(n * tokens / two_s, 1),
        "ratio": round(one_s / two_s, 2), "taken_by_group": {"ra": per_group[0], "rb": per_group[1]},
        "both_took_work": all(k > 0 for k in per_group),
        "same_text_as_one_group": sum(x == y for x, y in zip(one, two, strict=True) if isinstance(x, str)),
        "errors": errors_of(one + two),
    }


def rank_kill(tokens: int, n: int = 24) -> dict:
    texts = prompts(n)
    with LocalCluster(world_size=1, group="ka", threads=HALF) as a, \
            LocalCluster(world_size=1, group="kb", threads=HALF, broker_url=a.broker_url) as b:
        for cluster in (a, b):
            cluster.leader.load(MODEL, None, quant=EXACT, max_batch=4, idle_s=5)
        clean, _ = generate_all(b.leader, texts, tokens)
        if errors_of(clean):
            raise RuntimeError(f"the clean run failed: {errors_of(clean)[:3]}")
        plain, clean_s = stream_all(b.leader, texts, tokens)
        faulted, faulted_s = stream_all(
            b.leader, texts, tokens, on_running=lambda: os.killpg(a.workers[0].pid, signal.SIGKILL), running=8
        )
        restarts = a.restarts[0]
    done = [(d, c) for d, c in zip(faulted, clean, strict=True) if isinstance(d, list)]
    return {
        "streams": n, "tokens": tokens, "clean_s": round(clean_s, 2), "faulted_s": round(faulted_s, 2),
        "added_s": round(faulted_s - clean_s, 2), "completed": len(done),
        "identical": sum("".join(d) == c for d, c in done), "mismatched": sum(diverged(d, c) for d, c in done),
        # the noise floor: a clean streamed run against the clean generate run (batch composition)
        "clean_runs_identical": sum(isinstance(d, list) and "".join(d) == c for d, c in zip(plain, clean, strict=True)),
        "mismatch_examples": [where_differs("".join(d), c) for d, c in done if "".join(d) != c][:3],
        "group_a_restarts": restarts, "errors": errors_of(faulted),
    }


def where_differs(got: str, clean: str) -> dict:
    """Where a text first leaves the clean one, and what follows in each."""
    at = next((i for i, (x, y) in enumerate(zip(got, clean)) if x != y), min(len(got), len(clean)))
    return {"at_char": at, "got": got[max(0, at - 10):at + 30], "clean": clean[max(0, at - 10):at + 30]}


def redis_kill(tokens: int, n: int = 16) -> dict:
    texts = prompts(n)
    with LocalCluster(world_size=1, group="rk", threads=HALF) as cluster:
        leader = cluster.leader
        leader.load(MODEL, None, quant=EXACT, max_batch=4, idle_s=5)
        generate_all(leader, texts[:4], 4)  # warm
        clean, clean_s = generate_all(leader, texts, tokens)
        direct, direct_s = _with_redis_kill(cluster, lambda: generate_all(leader, texts, tokens))
        with serving(cluster) as url:
            body = [{"model": MODEL, "prompt": t, **options(tokens)} for t in texts]
            replies, http_s = _with_redis_kill(cluster, lambda: post_all(url, body))
    statuses = Counter(str(status) for status, _ in replies)
    return {
        "requests": n, "tokens": tokens, "clean_s": round(clean_s, 2),
        "leader": {"completed": sum(isinstance(t, str) for t in direct),
                   "identical": sum(x == y for x, y in zip(direct, clean, strict=True)),
                   "wall_s": round(direct_s, 2), "errors": errors_of(direct)},
        "http": {"completed": statuses.get("200", 0),
                 "identical": sum(text == c for (_, text), c in zip(replies, clean, strict=True)),
                 "wall_s": round(http_s, 2), "statuses": dict(statuses),
                 "errors": [text[:200] for status, text in replies if status != 200][:3]},
    }


def _with_redis_kill(cluster: LocalCluster, run) -> tuple:
    """`run()` in a thread; 1.1 s after it starts, Redis is SIGKILLed and restarted 0.5 s later."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(run()), daemon=True)
    worker.start()
    time.sleep(1.1)
    cluster.restart_redis(kill=True, down_s=0.5)
    worker.join(600)
    if not box:
        raise RuntimeError("the requests did not return within 600 s of the Redis restart")
    return box[0]


def post_all(url: str, bodies: list[dict]) -> tuple[list[tuple[int | str, str]], float]:
    """Each body as a non-streaming /v1/completions: ((status, text or error body) per body, wall s)."""

    def one(body: dict) -> tuple[int | str, str]:
        try:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        except httpx.HTTPError as exc:
            return type(exc).__name__, str(exc)
        if response.status_code != 200:
            return response.status_code, response.text
        return 200, response.json()["choices"][0]["text"]

    started = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        out = list(pool.map(one, bodies))
    return out, time.perf_counter() - started


class serving:
    """`celerytp serve --broker` attached to `cluster` (broker URL in its environment), its URL."""

    def __init__(self, cluster: LocalCluster):
        self.cluster = cluster
        self.port = free_port()
        self.log = tempfile.TemporaryFile()
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> str:
        env = {**os.environ, "CELERYTP_BROKER": self.cluster.broker_url, "CELERYTP_GROUP": self.cluster.group}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celerytp", "serve", "--tp", str(self.cluster.world_size), "--port", str(self.port),
             "--model-id", MODEL, "--max-batch", "4", "--no-frontend"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )
        url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"celerytp serve did not come up: {self.output()[-2000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wipe_then_kill(tokens: int) -> dict:
    with LocalCluster(world_size=2, group="wk") as cluster:
        leader = cluster.leader
        leader.load(MODEL, None)
        expected = leader.generate(MODEL, prompt=prompts(1)[0], **options(tokens)).token_ids
        wiped = time.perf_counter()
        cluster.restart_redis(wipe=True)
        deadline = time.monotonic() + 60
        while None in leader.health():  # the workers reconnect and write their heartbeats again
            if time.monotonic() > deadline:
                raise RuntimeError("the ranks' heartbeats did not come back within 60 s of the wipe")
            time.sleep(0.1)
        back = time.perf_counter()
        os.killpg(cluster.workers[1].pid, signal.SIGKILL)
        failures: list[str] = []
        deadline = time.monotonic() + 300
        while True:
            try:
                result = leader.generate(MODEL, prompt=prompts(1)[0], **options(tokens))
                break
            except CeleryTPError as exc:
                failures.append(str(exc.kind))
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        served_s = time.perf_counter() - back
        models = leader.models()
    return {
        "heartbeats_back_s": round(back - wiped, 2), "serving_again_s": round(served_s, 2),
        "same_tokens": result.token_ids == expected, "failed_attempts": dict(Counter(failures)),
        "registered_again": MODEL in models,
    }


def commands(leader: Leader) -> Counter:
    """Calls so far, per Redis command."""
    stats = leader.redis.info("commandstats")
    return Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items() if k.startswith("cmdstat_")})


def redis_commands(n: int = 8, tokens: int = 32, idle_s: float = 5.0) -> dict:
    texts = prompts(n)
    row: dict = {"requests": n, "tokens": tokens}
    with LocalCluster(world_size=1, group="rc", threads=HALF) as cluster:
        leader = cluster.leader
        leader.load(MODEL, None, max_batch=n, idle_s=30)
        generate_all(leader, texts, 4)  # warm; the loop now runs (idle_s=30)
        errors = []
        for name, run in (("generate", generate_all), ("stream", stream_all)):
            before, started = commands(leader), time.perf_counter()
            outcomes, _ = run(leader, texts, tokens)
            busy, busy_s = commands(leader) - before, time.perf_counter() - started
            errors += errors_of(outcomes)
            row[name] = {"commands_per_token": round(busy.total() / (n * tokens), 2), "wall_s": round(busy_s, 2),
                         "commands_per_s": round(busy.total() / busy_s, 1), "top": dict(busy.most_common(6))}
        time.sleep(1.0)  # the last request's clean-up is over
        before = commands(leader)
        time.sleep(idle_s)
        idle = commands(leader) - before
        row["idle"] = {"commands_per_s": round(idle.total() / idle_s, 1),
                       "loop_alive": leader.serving_stats(MODEL)["loop_running"] == 1,
                       "top_per_s": {k: round(v / idle_s, 1) for k, v in idle.most_common(6)}}
    return {**row, "errors": errors}


# ---- main -------------------------------------------------------------------------------


def summary(row: dict) -> str:
    fields = {k: v for k, v in row.items() if k != "row"}
    return "; ".join(f"{k}={json.dumps(v)}" for k, v in fields.items()).replace("|", "\\|")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--threads", type=int, default=CORES, help="torch threads of split's lone group (default: all)")
    args = parser.parse_args()
    runs = {
        "split": lambda: split(args.requests, args.tokens, args.threads),
        "rank_kill": lambda: rank_kill(args.tokens),
        "redis_kill": lambda: redis_kill(args.tokens),
        "wipe_then_kill": lambda: wipe_then_kill(args.tokens),
        "redis_commands": lambda: redis_commands(),
    }
    rows = []
    for name in args.rows:
        started = time.perf_counter()
        try:
            row = {"row": name, **runs[name]()}
        except Exception as exc:  # one failing row still leaves the others
            row = {"row": name, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=6)}
        row["row_s"] = round(time.perf_counter() - started, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print("\n| row | result |")
    print("|---|---|")
    for row in rows:
        print(f"| {row['row']} | {summary({k: v for k, v in row.items() if k != 'traceback'})} |", flush=True)


if __name__ == "__main__":
    main()
