"""celerytp against llama.cpp on the shipped GGUF: decode and 512-token prefill, end to end.

Run: python benchmarks/peer.py [--peer-python PATH] [--tp 1 2] [--tokens 64] [--prefill 512] [--repeats 3]

The default model (SmolLM2-135M-Instruct, Q4_1 linears, Q8_0 embedding) with 2 threads in all:
- llama.cpp through llama-cpp-python (`--peer-python`: an interpreter that has it; it builds from
  source in ~15 min, so keep it in a venv of its own): greedy decode of `--tokens` tokens after a
  short prompt (no EOS stop) and `llm.eval` of a `--prefill`-token prompt, best of `--repeats`;
- celerytp through a LocalCluster (Celery workers, Redis, the serving loop) at each `--tp`, loaded
  with the defaults as a user gets them (`leader.load("smol", None)`: the file's blocks kept,
  compiled decode): a greedy stream of `--tokens` tokens (`ignore_eos`), decode tokens/s from the
  result's own decode time; and a `--prefill`-token prompt of fresh random token ids (no prefix
  reuse) with `max_tokens=1`, prefill tokens/s from its time to the first token (queue and the
  default 256-token prefill budget per step included), best of `--repeats`.
Both in one run, one after the other, so the ratios hold on a noisy machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The history of tensor parallelism, in three paragraphs:"

PEER = """
import json, sys, time
from llama_cpp import Llama
path, tokens, prefill, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
llm = Llama(model_path=path, n_threads=2, n_threads_batch=2, n_ctx=2048, n_batch=512, verbose=False)
prompt = llm.tokenize(sys.argv[5].encode())
decode, fill = [], []
for _ in range(repeats + 1):  # the first round warms up
    llm.reset()
    llm.eval(prompt)
    start = time.perf_counter()
    for _ in range(tokens - 1):
        llm.eval([llm.sample(temp=0.0)])  # greedy, no EOS stop
    decode.append((tokens - 1) / (time.perf_counter() - start))
    ids = [llm.token_bos()] + [7 + (i * 7919) % 40000 for i in range(prefill - 1)]
    llm.reset()
    start = time.perf_counter()
    llm.eval(ids)
    fill.append(prefill / (time.perf_counter() - start))
print(json.dumps({"decode_tok_s": max(decode[1:]), "prefill_tok_s": max(fill[1:])}))
"""


def peer(args: argparse.Namespace) -> dict:
    from celerytp.core.model_files import default_model_path

    run = subprocess.run([args.peer_python, "-c", PEER, str(default_model_path()), str(args.tokens), str(args.prefill),
                          str(args.repeats), PROMPT], capture_output=True, text=True)
    if run.returncode:
        raise SystemExit(f"llama.cpp: {run.stderr[-2000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def ours(tp: int, args: argparse.Namespace) -> dict:
    from celerytp.cluster import LocalCluster

    with LocalCluster(world_size=tp, group=f"peer{tp}") as cluster:
        leader = cluster.leader
        started = time.perf_counter()
        leader.load("smol", None)
        load_s = time.perf_counter() - started
        leader.generate("smol", prompt="warm up", max_tokens=8)
        vocab = leader.models()["smol"]["vocab_size"]
        rng = random.Random(tp)
        decode, fill = [], []
        for _ in range(args.repeats):
            result = leader.generate("smol", prompt=PROMPT, max_tokens=args.tokens, temperature=0, ignore_eos=True)
            decode.append((result.completion_tokens - 1) / result.decode_s)
            ids = [rng.randrange(vocab) for _ in range(args.prefill)]  # fresh every time: nothing cached
            row = leader.submit("smol", {"request_id": f"fill-{rng.randrange(1 << 30)}", "prompt": ids, "max_tokens": 1}).result()
            fill.append(args.prefill / row.ttft_s)
        return {"decode_tok_s": max(decode), "prefill_tok_s": max(fill), "load_s": load_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-python", default=sys.executable, help="a Python with llama-cpp-python installed")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    figures = {"load_average": os.getloadavg(), "llama_cpp": peer(args)}
    print("llama.cpp", figures["llama_cpp"], flush=True)
    for tp in args.tp:
        figures[f"celerytp_tp{tp}"] = ours(tp, args)
        print(f"celerytp TP={tp}", figures[f"celerytp_tp{tp}"], flush=True)
    base = figures["llama_cpp"]
    for tp in args.tp:
        mine = figures[f"celerytp_tp{tp}"]
        print(f"TP={tp} / llama.cpp: decode {mine['decode_tok_s'] / base['decode_tok_s']:.2f}x, "
              f"prefill {mine['prefill_tok_s'] / base['prefill_tok_s']:.2f}x")
    if 1 in args.tp and 2 in args.tp:
        print(f"TP=2 / TP=1 decode: {figures['celerytp_tp2']['decode_tok_s'] / figures['celerytp_tp1']['decode_tok_s']:.2f}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
