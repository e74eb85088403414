"""Generation speed: fused vs step mode vs a bare SPMD loop vs transformers, and batching.

Run: python benchmarks/generate.py [--tokens 64] [--threads 2] [--tp 1 2] [--quant f32|keep|q8_0]
All in one run, on the default model (SmolLM2-135M-Instruct, GGUF; celerytp's weights in float32
like transformers' unless --quant says otherwise) and the same thread budget (--threads cores
shared by the ranks):

- transformers: greedy `generate` on the same GGUF (dequantized to float32 by transformers);
- bare SPMD: the same model code and the same serving loop (celerytp.worker.serving) driven directly by
  torch.distributed in spawned processes, no Celery, no Redis;
- fused: `Leader.generate` (queued for the serving loop), end to end from the leader;
- step: `Leader.generate(mode="step")` (one chord per token);
- time to first token of a streamed fused request;
- aggregate tokens/s with 1, 4, 8 and 16 concurrent fused requests (continuous batching).

Every request runs to --tokens (ignore_eos), so counts do not depend on where EOS falls.

Tokens/s of one request = generated tokens / wall time of the whole request (prefill included),
so dispatch overheads count. Prints one JSON object and a readable table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from celerytp.cluster import LocalCluster
from celerytp.core.model_files import default_model_path
from celerytp.core.protocol import GenSpec
from celerytp.core.tokenizer import load_tokenizer
from celerytp.distributed.control import ControlGroup
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.serving import ListSource, ServingLoop

PROMPT = "Tensor parallelism splits each layer of a neural network across devices so that"


def transformers_tokens_per_s(prompt_ids: list[int], tokens: int, threads: int, repeats: int) -> float:
    from transformers import AutoModelForCausalLM

    path = Path(default_model_path())
    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)  # warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            times.append(time.perf_counter() - start)
    return tokens / statistics.median(times)


def _spmd_rank(rank: int, world_size: int, init_file: str, threads: int, prompt_ids, tokens, repeats, quant, out) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    tp = TPContext(rank, world_size)
    model = load_model(default_model_path(), tp, max_batch=1, quant=quant)
    spec = GenSpec(request_id="bare", prompt=prompt_ids, max_tokens=tokens)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        source = ListSource([spec]) if rank == 0 else None
        ServingLoop(model, ControlGroup.on_default_group(tp.rank, tp.world_size), {}, prefill_budget=256, idle_s=0.0, source=source).run()
        times.append(time.perf_counter() - start)
    if rank == 0:
        out.put(tokens / statistics.median(times[1:]))  # the first run warms up
    dist.destroy_process_group()


def bare_spmd_tokens_per_s(world_size: int, threads: int, prompt_ids, tokens: int, repeats: int, quant) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    init_file = tempfile.mktemp(prefix="celerytp-spmd-")
    mp.start_processes(
        _spmd_rank, args=(world_size, init_file, threads, prompt_ids, tokens, repeats, quant, out),
        nprocs=world_size, start_method="spawn",
    )
    return out.get()


def concurrent_tokens_per_s(leader, clients: int, tokens: int) -> float:
    """Aggregate generated tokens/s of `clients` requests sent at once (different prompts)."""
    done = []

    def one(i: int) -> None:
        r = leader.generate(
            "smol", prompt=f"{PROMPT} (variant {i})", max_tokens=tokens, temperature=0.8, seed=i, ignore_eos=True
        )
        done.append(r.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / (time.perf_counter() - start)


def celerytp_figures(world_size: int, threads: int, tokens: int, repeats: int, quant: str | None) -> dict:
    with LocalCluster(world_size=world_size, group=f"gen{world_size}", threads=max(1, threads // world_size)) as cluster:
        leader = cluster.leader
        leader.load("smol", None, max_batch=16, quant=quant)
        greedy = dict(prompt=PROMPT, max_tokens=tokens, temperature=0, ignore_eos=True)  # as the bare loop
        leader.generate("smol", **greedy)  # warm up
        fused = [leader.generate("smol", **greedy) for _ in range(repeats)]
        step = [leader.generate("smol", mode="step", **greedy) for _ in range(repeats)]
        ttfts = []
        for _ in range(repeats):
            stream = leader.stream("smol", prompt=PROMPT, max_tokens=4, temperature=0)
            for _ in stream:
                pass
            ttfts.append(stream.ttft_s)
        concurrency = {c: concurrent_tokens_per_s(leader, c, tokens) for c in (1, 4, 8, 16)}
    return {
        "fused_tokens_per_s": round(tokens / statistics.median(r.total_s for r in fused), 2),
        "step_tokens_per_s": round(tokens / statistics.median(r.total_s for r in step), 2),
        "fused_ttft_ms": round(statistics.median(ttfts) * 1000, 1),
        "concurrent_tokens_per_s": {str(c): round(v, 2) for c, v in concurrency.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quant", default="f32", help="celerytp's weights: f32 (as transformers), or 'keep' the file's Q4_1")
    args = parser.parse_args()
    quant = None if args.quant == "keep" else args.quant
    prompt_ids = load_tokenizer(default_model_path()).encode(PROMPT)
    report: dict = {
        "model": Path(default_model_path()).name, "quant": args.quant, "threads": args.threads, "tokens": args.tokens
    }
    report["transformers_tokens_per_s"] = round(
        transformers_tokens_per_s(prompt_ids, args.tokens, args.threads, args.repeats), 2
    )
    for tp in args.tp:
        figures = celerytp_figures(tp, args.threads, args.tokens, args.repeats, quant)
        figures["bare_spmd_tokens_per_s"] = round(
            bare_spmd_tokens_per_s(tp, max(1, args.threads // tp), prompt_ids, args.tokens, args.repeats, quant), 2
        )
        figures["fused_over_bare_spmd"] = round(figures["fused_tokens_per_s"] / figures["bare_spmd_tokens_per_s"], 3)
        figures["fused_over_transformers"] = round(figures["fused_tokens_per_s"] / report["transformers_tokens_per_s"], 3)
        c = figures["concurrent_tokens_per_s"]
        figures["concurrent_8_over_1"] = round(c["8"] / c["1"], 2)
        figures["concurrent_16_over_1"] = round(c["16"] / c["1"], 2)
        report[f"tp{tp}"] = figures
    print(json.dumps(report))
    print(f"transformers generate: {report['transformers_tokens_per_s']} tokens/s ({args.threads} threads)")
    for tp in args.tp:
        f = report[f"tp{tp}"]
        c = f["concurrent_tokens_per_s"]
        print(f"TP={tp}: fused {f['fused_tokens_per_s']}  step {f['step_tokens_per_s']}  bare SPMD "
              f"{f['bare_spmd_tokens_per_s']} tokens/s; fused/bare {f['fused_over_bare_spmd']} (goal >= 0.95), "
              f"fused/transformers {f['fused_over_transformers']} (goal >= 1.3 at TP=1); TTFT {f['fused_ttft_ms']} ms")
        print(f"       concurrent 1/4/8/16: {c['1']} / {c['4']} / {c['8']} / {c['16']} tokens/s; 8 over 1 = "
              f"{f['concurrent_8_over_1']}x (goal >= 4), 16 over 1 = {f['concurrent_16_over_1']}x (goal >= 6)")


if __name__ == "__main__":
    main()
