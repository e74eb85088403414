"""What batch invariance costs a hybrid model's prefill: Gated DeltaNet token by token (as decode
runs it, the default) against the chunked rule (CELERYTP_RECURRENT_PREFILL=chunks), and against
batch invariance off altogether (CELERYTP_BATCH_INVARIANT=0).

Run: python benchmarks/hybrid_prefill.py [--lengths 64 512] [--repeats 3] [--threads 2]

benchmarks/hybrid.py's random Qwen3-Next (float32, 8 layers: 6 Gated DeltaNet + 2 attention, MoE)
at TP=1, one process per setting, the two alternating run by run so that outside load hits both:
each run loads the model and times one prefill (`forward_tokens`) of each length, after a warm-up
prefill. Prints the median prefill tokens/s of each setting and each against the default, as JSON
and a table.
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

SETTINGS = {  # name -> environment
    "token by token (the default)": {},
    "chunked (CELERYTP_RECURRENT_PREFILL=chunks)": {"CELERYTP_RECURRENT_PREFILL": "chunks"},
    "invariance off (CELERYTP_BATCH_INVARIANT=0)": {"CELERYTP_BATCH_INVARIANT": "0"},
}


def measure(path: str, lengths: list[int], threads: int) -> dict[int, float]:
    import torch
    from hybrid import prompt_ids

    from celerytp.distributed.tp import TPContext
    from celerytp.models import load_model

    torch.set_num_threads(threads)
    model = load_model(path, TPContext(), max_batch=1, max_context=max(lengths) + 1)
    model.forward_tokens(torch.tensor(prompt_ids(16)), 0)  # warm-up
    out = {}
    for n in lengths:
        model.clear_cache()
        started = time.perf_counter()
        model.forward_tokens(torch.tensor(prompt_ids(n)), 0, last_only=True)
        out[n] = n / (time.perf_counter() - started)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # a checkpoint: measure it here
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.measure:
        print(json.dumps(measure(args.measure, args.lengths, args.threads)))
        return
    from hybrid import make_checkpoint

    path = Path(tempfile.mkdtemp(prefix="hybrid-prefill-")) / "qwen3next"
    make_checkpoint(path)
    runs: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, env in SETTINGS.items():
            done = subprocess.run([sys.executable, __file__, "--measure", str(path), "--threads", str(args.threads),
                                   "--lengths", *map(str, args.lengths)], capture_output=True, text=True, check=True,
                                  env={**os.environ, **env})
            runs[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = {name: {n: round(statistics.median(r[str(n)] for r in rs), 1) for n in args.lengths}
             for name, rs in runs.items()}
    default = table[next(iter(SETTINGS))]
    print(json.dumps({"prefill_tok_s": table}))
    print("| prompt tokens | " + " | ".join(SETTINGS) + " |")
    print("|---|" + "---|" * len(SETTINGS))
    for n in args.lengths:
        print(f"| {n} | " + " | ".join(f"{table[name][n]:.0f} tok/s ({table[name][n] / default[n]:.2f}x)"
                                      for name in SETTINGS) + " |")


if __name__ == "__main__":
    main()
