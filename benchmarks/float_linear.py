"""Float linears on this CPU: F.linear (MKL) against oneDNN with a packed weight (layers/packed_linear.py).

Run: python benchmarks/float_linear.py [--threads 2] [--rows 1 16]

For each weight shape (SmolLM2-135M's layers and LM head, the tiny model's LM head of
benchmarks/step_cost.py, and small matrices around the packing threshold), dtype (float32,
bfloat16) and number of rows: µs per product through each kernel, best of 3. Weights are read
from memory, as decode reads them: the product cycles through enough copies of the matrix to
exceed the last-level cache. Both kernels in one run, so the ratios hold on a noisy machine.
Prints one JSON object and a table.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from celerytp.layers.packed_linear import BATCH_HINT, MIN_ELEMENTS, float_linear, kernel_works

SHAPES = [(128, 128), (192, 576), (576, 576), (960, 576), (3072, 576), (576, 1536), (49152, 64), (49152, 576)]
CACHE_BYTES = 64 << 20  # past this CPU's 32 MiB L3


def product_us(weights: list[torch.Tensor], packed: list[torch.Tensor | None], x: torch.Tensor) -> float:
    """µs per product, cycling through `weights` (best of 3 passes, after one to warm up)."""
    best = float("inf")
    for attempt in range(4):
        start = time.perf_counter()
        for w, p in zip(weights, packed):
            float_linear(x, w, p)
        if attempt:
            best = min(best, (time.perf_counter() - start) / len(weights))
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        if not kernel_works(dtype, "cpu"):
            print(f"no packed {dtype} kernel on this CPU; skipped")
            continue
        for n, k in SHAPES:
            copies = max(4, CACHE_BYTES // (n * k * dtype.itemsize))
            weights = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT) for w in weights]
            for rows in args.rows:
                x = torch.randn(rows, k).to(dtype)
                plain, onednn = product_us(weights, [None] * copies, x), product_us(weights, packed, x)
                results.append({"dtype": str(dtype).removeprefix("torch."), "shape": [n, k], "rows": rows,
                                "f_linear_us": round(plain, 1), "packed_us": round(onednn, 1)})
    print(json.dumps({"threads": args.threads, "min_elements": MIN_ELEMENTS, "results": results}))
    print(f"\n{'dtype':9s} {'shape':>12s} {'rows':>4s} {'F.linear':>10s} {'packed':>10s} {'speed-up':>8s}")
    for r in results:
        shape = "x".join(map(str, r["shape"]))
        print(f"{r['dtype']:9s} {shape:>12s} {r['rows']:4d} {r['f_linear_us']:8.1f}us {r['packed_us']:8.1f}us"
              f" {r['f_linear_us'] / r['packed_us']:7.2f}x")


if __name__ == "__main__":
    main()
