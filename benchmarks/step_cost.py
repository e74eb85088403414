"""The serving loop's fixed cost per step: everything a step spends around a model that costs nothing.

Run: python benchmarks/step_cost.py [--tp 1 2] [--batch 1 16] [--tokens 200] [--model tiny] [--device cpu|auto] [--tree PATH ...]

A random 2-layer, 64-wide llama with SmolLM2's 49,152-token vocabulary (and its tokenizer) goes
through a LocalCluster; `batch` greedy streaming requests (ignore_eos) run together and the time
per step is each row's decode time over its tokens (median of rows). With the model's compute
made this small, what is left is the loop: the plan on the control group, the logits' collectives,
sampling, bookkeeping and Redis. `--tree` runs the same measurement on other checkouts (e.g. a
`git worktree` of an older commit) in the same run, one after the other, so the ratios hold on a
noisy machine. `--model smol-f32` / `smol` run the shipped model instead (float32 / Q4_1 kept):
output tokens/s of 16 streams against one. With CELERYTP_STEP_PROFILE=1 (set here) rank 0 also reports where a step's time
went, in µs per step (`profile_us`, serving stats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_model(path: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from celerytp.core.model_files import default_model_path
    from celerytp.core.tokenizer import load_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).save(path)
    return path


def drive(args: argparse.Namespace) -> dict:
    """Runs inside one tree: every (tp, batch) of the arguments."""
    from celerytp.cluster import LocalCluster

    work = Path(tempfile.mkdtemp(prefix="stepcost-"))
    path = tiny_model(work / "tiny") if args.tiny is None else Path(args.tiny).resolve()
    work = path.parent
    report = {}
    for tp in args.tp:
        with LocalCluster(world_size=tp, group=f"stepcost{tp}", model_roots=[str(work)], device=args.device,
                          env={"CELERYTP_STEP_PROFILE": "1"}) as cluster:
            leader = cluster.leader
            if args.model == "tiny":
                leader.load("tiny", str(path), max_batch=max(args.batch), idle_s=2.0)
            else:  # the shipped model, as float32 or as it ships (Q4_1 kept)
                leader.load("tiny", None, max_batch=max(args.batch), idle_s=2.0, quant="f32" if args.model == "smol-f32" else None)
            leader.generate("tiny", prompt="warm up", max_tokens=8)
            for batch in args.batch:
                time.sleep(3)  # past idle_s: a new loop, whose profile covers this batch alone
                spec = dict(max_tokens=args.tokens, temperature=0, ignore_eos=True, stop=args.stop or None)
                with ThreadPoolExecutor(batch) as pool:
                    results = list(pool.map(lambda i: _run(leader, f"Row {i} says", spec), range(batch)))
                per_step = statistics.median(r.decode_s / max(1, r.completion_tokens - 1) for r in results)
                stats = leader.serving_stats("tiny")
                profile = {k[len("profile_us_"):]: v for k, v in stats.items() if k.startswith("profile_us_")}
                report[f"tp{tp}_b{batch}"] = {"step_ms": round(per_step * 1000, 3), "tokens_per_s": round(batch / per_step, 1),
                                              "profile_us": breakdown(profile)}
                print(f"tp{tp}_b{batch}", report[f"tp{tp}_b{batch}"], file=sys.stderr, flush=True)  # progress
    return report


def breakdown(raw: dict[str, int]) -> dict[str, int]:
    """Rank 0's µs per step by phase (core/step_clock.py), nested phases taken apart: the model's
    compute, its collectives (activations, logits), the plan on the control group (rank 0 also
    waits there for the slowest rank), sampling, Redis (publish hand-over, take) and the rest."""
    if not raw:
        return {}
    get = raw.get
    return {
        "step": get("step", 0), "model": get("forward", 0) - get("collectives", 0), "collectives": get("collectives", 0),
        "control": get("control", 0), "sampling": get("sampling", 0), "publish": get("publish", 0), "take": get("take", 0),
        "bookkeeping": get("step", 0) - get("forward", 0) - get("control", 0) - get("sampling", 0)
        - get("publish", 0) - get("take", 0),
    }


def _run(leader, prompt: str, spec: dict):
    stream = leader.stream("tiny", prompt=prompt, **spec)
    for _ in stream:
        pass
    return stream.result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--stop", nargs="*", default=[], help="stop strings every request carries")
    parser.add_argument("--model", choices=["tiny", "smol-f32", "smol"], default="tiny",
                        help="the tiny model (fixed cost), or the shipped model as float32 or as it ships")
    parser.add_argument("--device", default="cpu", help="cpu, or auto: rank r on cuda:r (NCCL)")
    parser.add_argument("--tiny", default=None, help="a tiny model directory saved by tiny_model (else made here)")
    parser.add_argument("--tree", nargs="*", default=[], help="other checkouts to measure in the same run")
    parser.add_argument("--drive", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        print(json.dumps(drive(args)))
        return
    out = {}
    for tree in [ROOT, *map(Path, args.tree)]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--drive", "--tp", *map(str, args.tp),
               "--batch", *map(str, args.batch), "--tokens", str(args.tokens), "--model", args.model, "--device", args.device]
        cmd += ["--tiny", args.tiny] if args.tiny else [] + (["--stop", *args.stop] if args.stop else [])
        started = time.perf_counter()
        run = subprocess.run(cmd, cwd=tree, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}, capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{tree}: {run.stderr[-3000:]}")
        out[str(tree)] = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"{tree} ({time.perf_counter() - started:.0f} s)")
        for key, figures in out[str(tree)].items():
            print(f"  {key}: {figures['step_ms']:.2f} ms/step {figures['tokens_per_s']:.0f} tok/s  {figures['profile_us']}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
