"""Step-mode decode speed and per-rank memory on the default model, against transformers.

Run: python benchmarks/step_generate.py [--tokens 48] [--threads 2]
In one run, on the same weights (SmolLM2-135M-Instruct Q4_1, dequantized to float32) and the
same thread budget (--threads cores in all: one rank gets them all, two ranks half each):
transformers' greedy generate; celerytp TP=1 and TP=2 through step chords, with each step's
round trip split into rank 0's forward time and the rest (dispatch overhead); and per-rank
RSS growth after load against the bytes of that rank's shard, replicated weights and KV cache.
Prints one JSON object and a readable table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from celerytp.cluster import LocalCluster
from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import load_tokenizer

PROMPT = "Tensor parallelism splits each layer of a neural network across devices so that"


def transformers_tokens_per_s(path: str, prompt_ids: list[int], tokens: int, threads: int) -> float:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        str(Path(path).parent), gguf_file=Path(path).name, torch_dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm up
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        total = time.perf_counter() - start
    return (tokens - 1) / (total - prefill)


def celerytp_step_mode(world_size: int, threads: int, prompt_ids: list[int], tokens: int) -> dict:
    with LocalCluster(world_size=world_size, group=f"bench{world_size}", threads=max(1, threads // world_size)) as cluster:
        leader = cluster.leader
        baseline = [p.rss_bytes for p in leader.ping()]
        loaded = leader.load("smol", None, quant="f32")  # float32, as transformers runs it
        leader.generate("smol", prompt="warm up", max_tokens=4, temperature=0)
        reply = leader.step("smol", prompt_ids, 0)
        round_trips, computes = [], []
        offset, token = len(prompt_ids), reply.token
        for _ in range(tokens):
            start = time.perf_counter()
            reply = leader.step("smol", [token], offset)
            round_trips.append(time.perf_counter() - start)
            computes.append(reply.compute_s)
            offset, token = offset + 1, reply.token
        memory = []
        for rank, (before, r) in enumerate(zip(baseline, loaded)):
            expected = r.sharded_bytes + r.replicated_bytes + r.kv_cache_bytes
            memory.append({
                "rank": rank, "rss_growth_mb": round((r.rss_bytes - before) / 2**20, 1),
                "shard_mb": round(r.sharded_bytes / 2**20, 1), "replicated_mb": round(r.replicated_bytes / 2**20, 1),
                "kv_cache_mb": round(r.kv_cache_bytes / 2**20, 1),
                "ratio": round((r.rss_bytes - before) / expected, 3),
            })
    step = statistics.median(round_trips)
    compute = statistics.median(computes)
    return {
        "tokens_per_s": round(1 / step, 2), "step_ms": round(step * 1000, 2),
        "rank0_forward_ms": round(compute * 1000, 2), "overhead_ms": round((step - compute) * 1000, 2),
        "memory": memory,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = default_model_path()
    prompt_ids = load_tokenizer(path).encode(PROMPT)
    report = {"model": Path(path).name, "threads": args.threads, "decode_tokens": args.tokens}
    report["tp1"] = celerytp_step_mode(1, args.threads, prompt_ids, args.tokens)
    report["tp2"] = celerytp_step_mode(2, args.threads, prompt_ids, args.tokens)
    report["transformers_tokens_per_s"] = round(transformers_tokens_per_s(path, prompt_ids, args.tokens, args.threads), 2)
    print(json.dumps(report))
    print(f"{'':28}{'tokens/s':>10}{'step ms':>10}{'forward ms':>12}{'overhead ms':>13}")
    print(f"{'transformers generate':28}{report['transformers_tokens_per_s']:>10}")
    for tp in ("tp1", "tp2"):
        r = report[tp]
        print(f"{'celerytp step mode ' + tp:28}{r['tokens_per_s']:>10}{r['step_ms']:>10}{r['rank0_forward_ms']:>12}{r['overhead_ms']:>13}")
    print("per-rank memory (RSS growth after load / (shard + replicated + KV cache)):")
    for tp in ("tp1", "tp2"):
        for m in report[tp]["memory"]:
            print(f"  {tp} rank {m['rank']}: {m['rss_growth_mb']} MB / ({m['shard_mb']} + {m['replicated_mb']} + "
                  f"{m['kv_cache_mb']}) MB = {m['ratio']}  (goal <= 1.15)")


if __name__ == "__main__":
    main()
