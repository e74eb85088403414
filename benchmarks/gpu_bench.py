"""The prepared GPU measurement: what a step costs on a GPU and where, in one run of a few minutes.

Run: bash scripts/gpu_bench.sh   (or python benchmarks/gpu_bench.py [--device cpu] [--budget-s 280]
     [--parts NAME ...]: some of the parts below, in the order given)

Parts, in this order, each in a process of its own with its own time limit; one that fails or
runs out of time is reported and the next runs, and parts that no longer fit the budget are
skipped (named in the table):
1. loop: the tiny 2-layer model through a LocalCluster's serving loop (benchmarks/step_cost.py,
   rank on cuda:0), batch 1 and 16: as shipped (decode compiled, attention SDPA held to its
   memory-efficient backend), with torch's own SDPA pick (CELERYTP_BATCH_INVARIANT=0: cuDNN on
   sm90, which builds a plan per shape), and eager (CELERYTP_COMPILE=0).
2. syncs: the tiny model's bare serving loop (world size 1) with CELERYTP_SYNC_CHECK=1: the host's
   waits for the device per step, by kind (worker/host_syncs.py); a step over budget fails it.
   moe: the same for a small Qwen3-MoE in bfloat16, after checking that torch's grouped kernel
   runs its experts' products (layers/moe.py `grouped_linear`) and agrees with one product each.
3. smol: SmolLM2 in bfloat16 (the shipped GGUF dequantized through celerytp's GGUF reader into a
   Hugging Face directory, the same weights for both): decode tokens/s at batch 1 and 16, our decode steps
   (compiled, as a CUDA rank loads it) against transformers' `generate` with a static cache and
   `torch.compile(mode="reduce-overhead")`; and our load time again with the compile cache warm.
4. invariance: benchmarks/invariance.py on the device (the shipped model, as a CUDA rank loads
   it): a row's logits alone against beside 15 others, and prefilled against decoded, bit for
   bit, each way of CELERYTP_BATCH_INVARIANT (on: cuBLAS held to one order per shape,
   layers/cuda_blas.py; whether that holds on this GPU is what a CUDA load's batch_invariant
   waits on), with the decode and prefill speeds (what holding cuBLAS costs).
5. tp2: TP=2 on one GPU, two processes whose model group is gloo over CUDA tensors (the sharded
   CUDA path without a second GPU): the tiny model's decode step at batch 1 and 16.
6. profile: benchmarks/gpu_step.py, torch.profiler's most expensive ops of a decode step.

`--device cpu` runs the same parts on the CPU, small, to check the script itself. Prints a table
and writes it as JSON to $OUT/gpu_bench.json when $OUT is set.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
LOOP_VARIANTS = {  # name -> environment of the cluster's rank
    "as shipped": {},
    "torch's SDPA pick": {"CELERYTP_BATCH_INVARIANT": "0"},
    "eager": {"CELERYTP_COMPILE": "0"},
}
PART_LIMIT_S = {"loop": 75, "syncs": 60, "moe": 45, "invariance": 90, "smol": 150, "tp2": 60, "profile": 45}


ORDER = ("loop", "syncs", "moe", "smol", "invariance", "tp2", "profile")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu: a small run that checks the script")
    parser.add_argument("--budget-s", type=float, default=280.0, help="skip the parts that no longer fit")
    parser.add_argument("--parts", nargs="+", choices=ORDER, default=list(ORDER),
                        help="which parts, in this order (default: all, in the order above)")
    parser.add_argument("--part", default=None, help=argparse.SUPPRESS)  # run one part (in its own process)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)  # a loop variant, a tp2 rank
    parser.add_argument("--init", default=None, help=argparse.SUPPRESS)  # tp2: the ranks' rendezvous file
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)  # tp2: the tiny model's directory; smol_hf: the weights
    args = parser.parse_args()
    if args.part is not None:
        print(json.dumps(PARTS[args.part](args)), flush=True)
        return 0
    deadline = time.monotonic() + args.budget_s
    rows = []
    for name in args.parts:
        jobs = [(f"loop: {variant}", ["--part", "loop", "--index", str(i)]) for i, variant in enumerate(LOOP_VARIANTS)] \
            if name == "loop" else [(name, ["--part", name])]
        if args.device == "cpu" and name == "loop":
            jobs = jobs[:1]
        for label, part_args in jobs:
            limit = min(PART_LIMIT_S[name], deadline - time.monotonic())
            if limit < 15:
                rows.append((label, "skipped", "the time budget is spent"))
                continue
            rows.append((label, *run_part(part_args + ["--device", args.device], limit)))
            print(f"{rows[-1][0]}: {rows[-1][1]} {rows[-1][2]}", file=sys.stderr, flush=True)
    width = max(len(label) for label, *_ in rows)
    print("\n".join(f"{label:<{width}}  {status:<7}  {figures}" for label, status, figures in rows))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_bench.json").write_text(json.dumps(rows, indent=1))
    return 0 if all(status != "failed" for _, status, _ in rows) else 1


def run_part(part_args: list[str], limit: float) -> tuple[str, str]:
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, __file__, *part_args], capture_output=True, text=True, timeout=limit,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    except subprocess.TimeoutExpired:
        return "failed", f"over its {limit:.0f} s"
    took = f"({time.monotonic() - started:.0f} s)"
    if done.returncode != 0:
        return "failed", f"{took} " + " | ".join(done.stderr.strip().splitlines()[-3:])
    return "ok", f"{took} {done.stdout.strip().splitlines()[-1]}"


def tiny() -> Path:
    from step_cost import tiny_model

    return tiny_model(Path(tempfile.mkdtemp(prefix="gpubench-")) / "tiny")


def part_loop(args: argparse.Namespace) -> dict:
    """The tiny model through a LocalCluster, rank on cuda:0 (--device auto), one variant."""
    variant = list(LOOP_VARIANTS)[args.index]
    env = {**os.environ, **LOOP_VARIANTS[variant]}
    device = "auto" if args.device == "cuda" else "cpu"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_cost.py"), "--device", device, "--tp", "1",
                           "--batch", "1", "16", "--tokens", "48"], capture_output=True, text=True, env=env, check=True)
    report = next(iter(json.loads(done.stdout.strip().splitlines()[-1]).values()))
    return {key: {"step_ms": row["step_ms"], "model_us": row["profile_us"].get("model")} for key, row in report.items()}


def part_syncs(args: argparse.Namespace) -> dict:
    """The bare serving loop in this process (world size 1) with the sync check on."""
    return host_waits(tiny(), args.device)


def host_waits(path: Path, device: str, dtype: str = "float32") -> dict:
    """The host's waits per step of the bare serving loop (world size 1, the sync check on) over
    16 requests of the model at `path`, greedy and drawn."""
    os.environ["CELERYTP_SYNC_CHECK"] = "1"
    import torch
    import torch.distributed as dist

    from celerytp.core.protocol import GenSpec
    from celerytp.distributed.control import ControlGroup
    from celerytp.distributed.tp import TPContext
    from celerytp.models import load_model
    from celerytp.worker.serving import ListSource, ServingLoop

    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/init", rank=0, world_size=1)
    model = load_model(str(path), TPContext(), device=torch.device(device), dtype=getattr(torch, dtype), max_batch=16)
    specs = [GenSpec(request_id=f"r{i}", prompt=list(range(5, 12 + i)), max_tokens=24,
                     sampling={"temperature": 0.0 if i % 2 else 0.8, "seed": i}) for i in range(16)]
    loop = ServingLoop(model, ControlGroup.on_default_group(0, 1), {}, 64, 0.0, ListSource(specs))
    stats = loop.run()
    return {"steps": stats["steps"], "per_step": {kind: round(n / stats["steps"], 2) for kind, n in loop.host_waits.items()},
            "new_decode_shapes": stats["new_decode_shapes"]}


def part_moe(args: argparse.Namespace) -> dict:
    """A small random Qwen3-MoE in bfloat16 (float32 on a CPU): whether torch's grouped kernel
    runs the experts' products (layers/moe.py `grouped_linear`) and how far it is from one
    product per expert, then the bare loop's host waits per step (none for the routing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from celerytp.layers import moe

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    if args.device == "cpu":
        os.environ["CELERYTP_DEVICE_PATH_ON_CPU"] = "1"  # a CUDA rank's path, which keeps routing on the device
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 256, generator=g), torch.randn(16, 384, 256, generator=g) / 16
    ends = torch.tensor(sorted(torch.randint(0, 65, (15,), generator=g).tolist()) + [64], dtype=torch.int32)
    x, w = x.to(args.device, dtype), w.to(args.device, dtype)
    kernel = moe._grouped_kernel(x, w)
    grouped = torch.ops.celerytp.grouped_linear(x, w, ends.to(args.device)).float()
    starts = [0, *ends[:-1].tolist()]
    one_by_one = torch.cat([x[a:b].float() @ w[e].float().T for e, (a, b) in enumerate(zip(starts, ends.tolist()))])
    error = float((grouped - one_by_one).abs().max() / one_by_one.abs().max())
    config = AutoConfig.for_model("qwen3_moe", vocab_size=1024, hidden_size=256, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                                  moe_intermediate_size=128, num_experts=16, num_experts_per_tok=4,
                                  max_position_embeddings=512)
    torch.manual_seed(0)
    path = Path(tempfile.mkdtemp(prefix="gpubench-moe-")) / "moe"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return {"grouped_kernel": kernel, "relative_error": round(error, 5),
            **host_waits(path, args.device, str(dtype).removeprefix("torch."))}


def smol_setting(args: argparse.Namespace) -> tuple:
    """part_smol's device, dtype, device sync and batch widths (small on a CPU)."""
    import torch

    device = torch.device(args.device)
    if device.type == "cuda":
        return device, torch.bfloat16, torch.cuda.synchronize, (1, 16)
    return device, torch.float32, lambda: None, (1, 4)


def part_smol(args: argparse.Namespace) -> dict:
    """SmolLM2 in bfloat16: ours against transformers' compiled static-cache generate."""
    import torch
    from gpu_step import timed_steps

    from celerytp.distributed.tp import TPContext
    from celerytp.models import load_model

    device, dtype, sync, batches = smol_setting(args)
    folder = hf_directory(Path(tempfile.mkdtemp(prefix="smol-hf-")), dtype)
    out: dict = {}
    for attempt in ("load", "load, compile cache warm"):
        started = time.perf_counter()
        ours = load_model(str(folder), TPContext(), dtype=dtype, device=device, max_batch=max(batches), max_context=512)
        out[f"ours {attempt} s"] = round(time.perf_counter() - started, 1)
    with torch.inference_mode():
        for batch in batches:
            us = timed_steps(ours, batch, 40 if device.type == "cuda" else 8, sync, "host")
            out[f"ours b{batch} tok/s"] = round(batch / us * 1e6)
    del ours
    # transformers as its users run it, in a process of its own: ours held cuBLAS to one order per
    # shape in this one (layers/cuda_blas.py), and cuBLAS reads some of that once per process
    done = subprocess.run([sys.executable, __file__, "--part", "smol_hf", "--device", args.device, "--model", str(folder)],
                          capture_output=True, text=True, check=True, timeout=PART_LIMIT_S["smol"])
    out.update(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def part_smol_hf(args: argparse.Namespace) -> dict:
    """transformers' compiled static-cache generate on part_smol's weights (--model)."""
    import torch
    from transformers import AutoModelForCausalLM

    device, dtype, sync, batches = smol_setting(args)
    out: dict = {}
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device).eval()
    hf.generation_config.cache_implementation = "static"
    if device.type == "cuda":
        hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
    new = 64 if device.type == "cuda" else 8
    for batch in batches:
        ids = torch.full((batch, 8), 1, device=device)
        kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        for _ in range(2):  # compile and record
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
        times = []
        for _ in range(3):
            sync()
            started = time.perf_counter()
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs)
            sync()
            times.append(time.perf_counter() - started)
        out[f"transformers b{batch} tok/s"] = round(batch * new / statistics.median(times))
    return out


def hf_directory(folder: Path, dtype) -> Path:
    """The shipped GGUF as a Hugging Face directory (config.json and safetensors, dequantized),
    through celerytp's reader, which names tensors as transformers does (transformers' own GGUF
    loading needs accelerate)."""
    from safetensors.torch import save_file

    from celerytp.core.model_files import default_model_path
    from celerytp.loading import open_checkpoint

    with open_checkpoint(default_model_path()) as checkpoint:
        config = {**checkpoint.hf_config, "architectures": ["LlamaForCausalLM"]}
        tensors = {name: checkpoint.source(name).read().to(dtype).contiguous() for name in checkpoint.names()}
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def part_tp2(args: argparse.Namespace) -> dict:
    """Two ranks on one device, the model group gloo (over CUDA tensors on a GPU)."""
    path = tiny()
    init = path.parent / "init"  # the ranks' rendezvous file
    ranks = [subprocess.Popen([sys.executable, __file__, "--part", "tp2_rank", "--index", str(r), "--init", init,
                               "--device", args.device, "--model", str(path)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [rank.communicate(timeout=PART_LIMIT_S["tp2"] - 5)[0] for rank in ranks]
    if any(rank.returncode for rank in ranks):
        raise SystemExit(f"a rank failed: {[rank.returncode for rank in ranks]}")
    return json.loads(outs[0].strip().splitlines()[-1])


def part_tp2_rank(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from gpu_step import timed_steps

    from celerytp.distributed.tp import TPContext
    from celerytp.models import load_model

    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=args.index, world_size=2)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = load_model(args.model, TPContext(args.index, 2), device=device, max_batch=16, max_context=512)
    with torch.inference_mode():
        figures = {f"b{batch} step_us": round(timed_steps(model, batch, 30, sync, "host")) for batch in (1, 16)}
    print(json.dumps(figures), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo left to the interpreter's exit can abort the process


def part_invariance(args: argparse.Namespace) -> dict:
    """benchmarks/invariance.py on the device, once each way: whether a row's logits are the same
    bits alone and beside 15 others, prefilled and decoded (CUDA loads say batch_invariant: false
    until this holds there), and what invariance costs."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "invariance.py"), "--device", args.device,
                           "--repeats", "1", "--prompt", "256", "--steps", "16"], capture_output=True, text=True, check=True)
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))  # a table follows it
    keep = ("batched_equal_steps", "prefill_equal_steps", "decode_b1_tok_s", "decode_b16_tok_s", "prefill_tok_s")
    return {name: {key: result[name][key] for key in keep} for name in ("invariant", "sdpa")}


def part_profile(args: argparse.Namespace) -> dict:
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--device", args.device,
                           "--batch", "1", "16", "--steps", "30"], capture_output=True, text=True, check=True)
    print(done.stdout, file=sys.stderr)  # the profiler's tables, for the log
    return {"steps": [line for line in done.stdout.splitlines() if line.startswith(("load", "batch"))]}


PARTS = {"loop": part_loop, "syncs": part_syncs, "moe": part_moe, "invariance": part_invariance, "smol": part_smol, "smol_hf": part_smol_hf, "tp2": part_tp2, "tp2_rank": part_tp2_rank,
         "profile": part_profile}

if __name__ == "__main__":
    sys.exit(main())
