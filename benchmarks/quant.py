"""Quantized shards: per-rank resident memory after load and decode tokens/s, per quant type.

Each type runs in a fresh process (clean RSS) on the same model and thread count:
    python benchmarks/quant.py [--model PATH] [--threads 2] [--tokens 32] [--types f32,q8_0,q4_0,q4_1,q4_k]
Default model: the SmolLM2-135M Q4_1 GGUF (quant=f32 dequantizes it; other types requantize
its float weights, except q4_1, which keeps the file's blocks). TP=1, in-process.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(path: str, quant: str, threads: int, tokens: int, kernel: str) -> dict:
    import torch

    from celerytp.distributed.tp import TPContext
    from celerytp.layers.quantized import QuantizedWeight
    from celerytp.models import load_model

    os.environ["CELERYTP_QUANT_KERNEL"] = kernel
    torch.set_num_threads(threads)
    base = _rss()
    t0 = time.perf_counter()
    model = load_model(path, TPContext(), quant=quant, max_context=256)
    load_s = time.perf_counter() - t0
    import gc

    gc.collect()
    rss = _rss()
    q = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    linear_bytes = sum(b.nbytes for m in q for b in m.buffers())
    linear_f32 = sum(4 * m.out_features * m.in_features for m in q)
    prompt = torch.arange(1, 17)
    model.forward_tokens(prompt, 0)
    nxt = torch.tensor([1])
    t0 = time.perf_counter()
    for _ in range(tokens):
        nxt = model.forward_tokens(nxt, model.cache_len)[-1:].argmax(-1)
    tps = tokens / (time.perf_counter() - t0)
    return {
        "quant": quant,
        "kernel": sorted({m.kernel for m in q}) or ["float"],
        "load_s": round(load_s, 2),
        "rss_mib": round((rss - base) / 2**20, 1),
        "linear_mib": round(linear_bytes / 2**20, 1),
        "linear_vs_f32": round(linear_bytes / linear_f32, 3) if q else 1.0,
        "sharded_mib": round(model.memory_report()["sharded_bytes"] / 2**20, 1),
        "decode_tok_s": round(tps, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--types", default="f32,q8_0,q4_0,q4_1,q4_k")
    ap.add_argument("--kernel", default="auto", help="auto (fast torch kernels) or dequant (exact)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from celerytp.core.model_files import default_model_path

        args.model = default_model_path()
    if args.one:
        print(json.dumps(one(args.model, args.one, args.threads, args.tokens, args.kernel)))
        return
    print(f"model {args.model}, threads {args.threads}, {args.tokens} decode tokens, load avg {os.getloadavg()[0]:.2f}")
    for quant in args.types.split(","):
        cmd = [sys.executable, __file__, "--model", args.model, "--threads", str(args.threads), "--tokens",
               str(args.tokens), "--kernel", args.kernel, "--one", quant]
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = out.stdout.strip().splitlines()[-1] if out.returncode == 0 else f"{quant}: failed: {out.stderr.strip().splitlines()[-1]}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
