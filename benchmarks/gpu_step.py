"""A decode step outside the cluster: where a step's time goes on one device, op by op.

Run: python benchmarks/gpu_step.py [--device cuda] [--model DIR] [--batch 1 16] [--steps 50]

Through the cluster on an H200 (benchmarks/step_cost.py --device auto, docs/benchmarks.md "GPU
check") a step of the tiny 2-layer model took 46 ms eager, where the loop's own phases took under
1 ms: the time was inside the "model" phase (the forward, the top candidates and their copy to the
host). This script times the same model in one plain process, no Celery, no Redis, world size 1,
with the device synchronized after each part, then prints torch.profiler's table of the most
expensive ops over a few steps. If the step is fast here, the worker process is the cause
(threads, the GIL, the environment); if it is slow here too, the table names the op.
`--model` is a directory saved by benchmarks/step_cost.py `tiny_model` (made here when absent).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def timed_steps(model, batch: int, steps: int, sync, part: str) -> float:
    """Median µs of one decode step of `batch` rows, through `part`: forward, candidates or host."""
    import torch

    model.clear_cache()
    for row in range(batch):
        model.forward_tokens(torch.tensor([1, 2, 3]), 0, last_only=True, row=row, gather=False)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        local = model.decode([5] * batch, [True] * batch, gather=False)
        if part != "forward":
            values, ids, lse, _ = model.top_candidates(local, 1)
            if part == "host":
                values, ids, lse = values.cpu(), ids.cpu(), lse.cpu()
        sync()
        times.append((time.perf_counter() - started) * 1e6)
    return statistics.median(times[steps // 5:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default=None, help="a tiny model directory (benchmarks/step_cost.py tiny_model)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--compile", default="0", help="CELERYTP_COMPILE for the load (0, 1 or auto)")
    args = parser.parse_args()
    os.environ["CELERYTP_COMPILE"] = args.compile
    import torch

    from celerytp.distributed.tp import TPContext
    from celerytp.models import load_model

    path = Path(args.model) if args.model else None
    if path is None:
        from step_cost import tiny_model

        path = tiny_model(Path(tempfile.mkdtemp(prefix="gpustep-")) / "tiny")
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    model = load_model(str(path), TPContext(), dtype=dtype, device=device, max_context=2048, max_batch=max(args.batch))
    print(f"load {time.perf_counter() - started:.1f} s on {device} ({dtype}, CELERYTP_COMPILE={args.compile}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads)", flush=True)
    with torch.inference_mode():
        for batch in args.batch:
            figures = {part: timed_steps(model, batch, args.steps, sync, part) for part in ("forward", "candidates", "host")}
            print(f"batch {batch}: " + ", ".join(f"{part} {us:.0f} us" for part, us in figures.items()), flush=True)
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            timed_steps(model, args.batch[0], 10, sync, "host")
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        print(prof.key_averages().table(sort_by=key, row_limit=10))


if __name__ == "__main__":
    main()
