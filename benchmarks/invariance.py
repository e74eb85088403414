"""What batch invariance costs, and whether it holds: the shipped model with batch-invariant
attention and eager-rounded norms (CELERYTP_BATCH_INVARIANT=1, the default) against SDPA and
inductor-fused norms (=0), in one run.

Run: python benchmarks/invariance.py [--threads 1] [--repeats 3] [--prompt 512] [--steps 32] [--device cpu]

Each configuration loads SmolLM2-135M-Instruct Q4_1 (as it ships: compiled decode) at TP=1 in
a fresh process, --threads intra-op threads (1: what each rank of `serve --tp 2` gets on a
2-core machine); the configurations alternate --repeats times and the medians are reported.
Per configuration:
- decode tokens/s at batch 1 and 16 (rows at positions 64..79, --steps greedy steps);
- prefill tokens/s of one --prompt-token prompt;
- a resume of 200 streamed tokens after a 16-token prompt: seconds of model time to put them back
  in the cache, prefilled in one pass in chunks of the default prefill budget (what a resume does
  on a batch-invariant model) and replayed one decode step each (what it does otherwise);
- invariance: 12 greedy steps of one row alone against the same row beside 15 others of other
  lengths (steps whose logits are equal bit for bit), and a prompt plus its 12 decoded tokens
  prefilled in one pass against those decode steps.

Prints one JSON object and a readable table.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

STEPS_CHECKED = 12
RESUMED = 200
PREFILL_BUDGET = 256  # the load default (core/protocol.py LoadRequest.prefill_budget)


def measure(args: argparse.Namespace) -> dict:
    import torch

    from celerytp.core.model_files import default_model_path
    from celerytp.distributed.tp import TPContext
    from celerytp.models.loader import load_model

    torch.set_num_threads(args.threads)
    model = load_model(default_model_path(), TPContext(), device=args.device, max_batch=16, max_context=1024)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 40000) for _ in range(64 + i)] for i in range(16)]

    def prefill(rows: list[list[int]]) -> list[int]:
        model.clear_cache()
        return [int(model.forward_tokens(torch.tensor(p), 0, last_only=True, row=r)[-1].argmax()) for r, p in enumerate(rows)]

    def decode(rows: list[list[int]], steps: int) -> tuple[float, list[torch.Tensor]]:
        tokens, logits = prefill(rows), []
        started = time.perf_counter()
        for _ in range(steps):
            out = model.decode(tokens, [True] * len(rows))
            logits.append(out[0].clone())
            tokens = [int(t) for t in out.argmax(-1)]
        return time.perf_counter() - started, logits

    report = {}
    for width in (1, 16):
        decode(prompts[:width], 2)  # warm
        elapsed, _ = decode(prompts[:width], args.steps)
        report[f"decode_b{width}_tok_s"] = round(width * args.steps / elapsed, 1)
    long = [rng.randrange(1, 40000) for _ in range(args.prompt)]
    prefill([long[:32]])
    started = time.perf_counter()
    prefill([long])
    report["prefill_tok_s"] = round(args.prompt / (time.perf_counter() - started), 1)
    model.clear_cache()
    resumed = [rng.randrange(1, 40000) for _ in range(16 + RESUMED)]
    started = time.perf_counter()
    for start in range(0, len(resumed), PREFILL_BUDGET):
        model.forward_tokens(torch.tensor(resumed[start : start + PREFILL_BUDGET]), start, last_only=True, row=0)
    report["resume_200_prefill_s"] = round(time.perf_counter() - started, 3)
    model.clear_cache()
    model.forward_tokens(torch.tensor(resumed[:16]), 0, last_only=True, row=0)
    started = time.perf_counter()
    for token in resumed[16:]:
        model.decode([token], [True])
    report["resume_200_replay_s"] = round(time.perf_counter() - started, 3)
    _, alone = decode(prompts[:1], STEPS_CHECKED)
    _, batched = decode([prompts[0], *[p[: 20 + 7 * i] for i, p in enumerate(prompts[1:])]], STEPS_CHECKED)
    report["batched_equal_steps"] = sum(torch.equal(a, b) for a, b in zip(alone, batched))
    first = prefill(prompts[:1])[0]
    tokens, stepped = [first], []
    for _ in range(STEPS_CHECKED):
        out = model.decode([tokens[-1]], [True])
        stepped.append(out[0].clone())
        tokens.append(int(out[0].argmax()))
    model.clear_cache()
    whole = model.forward_tokens(torch.tensor(prompts[0] + tokens[:-1]), 0, row=0)[len(prompts[0]):]
    report["prefill_equal_steps"] = sum(torch.equal(whole[i], stepped[i]) for i in range(STEPS_CHECKED))
    report["compiled"] = model.model.decode_runs is not None
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--device", default="cpu", help="where the model runs: cpu, or cuda (scripts/gpu_bench.sh)")
    parser.add_argument("--child", choices=("1", "0"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    runs: dict[str, list[dict]] = {"1": [], "0": []}
    for _ in range(args.repeats):
        for value in runs:
            env = {**os.environ, "CELERYTP_BATCH_INVARIANT": value}
            argv = [sys.executable, __file__, "--child", value, "--threads", str(args.threads),
                    "--prompt", str(args.prompt), "--steps", str(args.steps), "--device", args.device]  # fmt: skip
            out = subprocess.run(argv, env=env, check=True, capture_output=True, text=True).stdout
            runs[value].append(json.loads(out.strip().splitlines()[-1]))
            print(value, runs[value][-1], file=sys.stderr, flush=True)
    result = {"threads": args.threads, "repeats": args.repeats, "prompt": args.prompt, "device": args.device}
    for value, name in (("1", "invariant"), ("0", "sdpa")):
        result[name] = {key: statistics.median(r[key] for r in runs[value]) for key in runs[value][0]}
    for key in ("decode_b1_tok_s", "decode_b16_tok_s", "prefill_tok_s"):
        result[f"{key}_ratio"] = round(result["invariant"][key] / result["sdpa"][key], 3)
    print(json.dumps(result))
    print(f"{'':22s}{'invariant':>12s}{'sdpa+fused':>12s}{'ratio':>8s}")
    for key in ("decode_b1_tok_s", "decode_b16_tok_s", "prefill_tok_s"):
        print(f"{key:22s}{result['invariant'][key]:12.1f}{result['sdpa'][key]:12.1f}{result[key + '_ratio']:8.3f}")
    for key in ("resume_200_prefill_s", "resume_200_replay_s"):
        print(f"{key:22s}{result['invariant'][key]:12.3f}{result['sdpa'][key]:12.3f}")
    for key in ("batched_equal_steps", "prefill_equal_steps"):
        print(f"{key:22s}{result['invariant'][key]:12d}{result['sdpa'][key]:12d}   of {STEPS_CHECKED}")


if __name__ == "__main__":
    main()
