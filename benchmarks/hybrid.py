"""Decode speed of a small random Qwen3-Next model: celerytp TP=1 and TP=2 against transformers.

Run: python benchmarks/hybrid.py [--tokens 64] [--prompt 64] [--threads 2] [--repeats 3]
In one run, on the same random weights (float32) and the same thread budget (--threads cores
in all: transformers and TP=1 get them all, each of the two TP=2 ranks half): prefill the
prompt, then time greedy decoding of --tokens tokens one forward at a time (transformers
through its own cache, i.e. its recurrent delta-rule path; celerytp through forward_tokens,
TP=2 on a gloo group, no Celery). Transformers and TP=1 share one process and alternate run by
run, so load from other processes hits both alike; the best of --repeats runs counts, and the
TP=1 ratio is also given as the median of the per-repeat ratios. Prints JSON and a table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Small but not toy: 8 layers (3 linear : 1 full), MoE with a shared expert on every layer.
CONFIG: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    intermediate_size=1024,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
    max_position_embeddings=1024,
)


@dataclass
class Args:
    tokens: int
    prompt: int
    threads: int
    repeats: int


def make_checkpoint(directory: Path) -> Any:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    model = Qwen3NextForCausalLM(Qwen3NextConfig(**CONFIG)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


def prompt_ids(n: int) -> list[int]:
    return torch.randint(0, CONFIG["vocab_size"], (n,), generator=torch.Generator().manual_seed(1)).tolist()


@torch.inference_mode()
def transformers_run(model: Any, args: Args) -> tuple[float, list[int]]:
    """Decode tokens/s of transformers' cached forward after a prefill, and its greedy tokens."""
    out = model(torch.tensor([prompt_ids(args.prompt)]), use_cache=True)
    nxt, tokens = int(out.logits[0, -1].argmax()), []
    start = time.perf_counter()
    for _ in range(args.tokens):
        tokens.append(nxt)
        out = model(torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
    return args.tokens / (time.perf_counter() - start), tokens


def celerytp_run(model: Any, args: Args) -> tuple[float, list[int]]:
    model.clear_cache()
    logits = model.forward_tokens(torch.tensor(prompt_ids(args.prompt)), 0, last_only=True)
    nxt, tokens = int(logits[-1].argmax()), []
    start = time.perf_counter()
    for _ in range(args.tokens):
        tokens.append(nxt)
        nxt = int(model.forward_tokens(torch.tensor([nxt]), model.cache_len, last_only=True)[-1].argmax())
    return args.tokens / (time.perf_counter() - start), tokens


def load(path: str, tp: Any, args: Args) -> Any:
    from celerytp.models import load_model

    return load_model(path, tp, max_context=args.prompt + args.tokens + 1)


def alternate_tp1(hf_model: Any, path: str, args: Args) -> dict[str, Any]:
    """Transformers and celerytp TP=1 in this process, alternating run by run."""
    from celerytp.distributed.tp import TPContext

    torch.set_num_threads(args.threads)
    ours = load(path, TPContext(), args)
    hf_runs, our_runs = [], []
    for _ in range(args.repeats):
        hf_runs.append(transformers_run(hf_model, args))
        our_runs.append(celerytp_run(ours, args))
    ratios = sorted(o[0] / h[0] for o, h in zip(our_runs, hf_runs, strict=True))
    return {
        "transformers": max(r[0] for r in hf_runs),
        "celerytp_tp1": max(r[0] for r in our_runs),
        "tp1_median_ratio": ratios[len(ratios) // 2],
        "tp1_tokens_match": our_runs[0][1] == hf_runs[0][1],
        "hf_tokens": hf_runs[0][1],
    }


def _rank(rank: int, world_size: int, init_file: str, path: str, args: Args, out: str) -> None:
    from celerytp.distributed.tp import TPContext

    torch.set_num_threads(max(1, args.threads // world_size))
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
    )
    model = load(path, TPContext(rank, world_size), args)
    runs = [celerytp_run(model, args) for _ in range(args.repeats)]
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps((max(r[0] for r in runs), runs[0][1])))


def run_tp(world_size: int, path: str, args: Args, workdir: Path) -> tuple[float, list[int]]:
    init_file, out = workdir / f"pg{world_size}", workdir / f"out{world_size}.json"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_rank, args=(r, world_size, str(init_file), path, args, str(out)))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"TP={world_size} ranks exited with {[p.exitcode for p in procs]}")
    tps, tokens = json.loads(out.read_text())
    return tps, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = Args(**vars(parser.parse_args()))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        path = str(workdir / "model")
        results = alternate_tp1(make_checkpoint(workdir / "model"), path, args)
        hf_tokens = results.pop("hf_tokens")
        results["celerytp_tp2"], tokens = run_tp(2, path, args, workdir)
        results["tp2_tokens_match"] = tokens == hf_tokens
    hf_tps = results["transformers"]
    print(json.dumps({"args": asdict(args), "config": CONFIG, **results}))
    print(f"{'':<16}{'decode tok/s':>14}{'vs transformers':>17}")
    for name in ("transformers", "celerytp_tp1", "celerytp_tp2"):
        print(f"{name:<16}{results[name]:>14.1f}{results[name] / hf_tps:>16.2f}x")


if __name__ == "__main__":
    main()
