"""What a grammar-constrained row costs a serving step: a json_schema row beside unconstrained ones.

Run: python benchmarks/grammar_step.py [--tp 1 2] [--batch 16] [--tokens 48] [--repeats 3]

SmolLM2-135M-Instruct (Q4_1, the default model) runs the serving loop directly on every rank
(worker/serving.py ServingLoop, a ListSource instead of Redis, gloo), `batch` rows decoding
together with no EOS (every row runs `tokens` steps), in three mixes: every row unconstrained,
one row constrained by a JSON schema, every row constrained. The schema is a string of at least
5,000 characters, so no constrained row ends early and every mix runs the same steps. A step's
time is the loop's time over its steps (the best of `repeats`, after a warm-up); with
CELERYTP_STEP_PROFILE=1 (set here) rank 0 also reports the sampling phase (mask, draw, matcher).
Prints one JSON line per TP size.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ["CELERYTP_STEP_PROFILE"] = "1"

from celerytp.core.model_files import default_model_path  # noqa: E402
from celerytp.core.protocol import GenSpec  # noqa: E402
from celerytp.core.tokenizer import load_tokenizer  # noqa: E402
from celerytp.distributed.control import ControlGroup  # noqa: E402
from celerytp.distributed.tp import TPContext  # noqa: E402

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 5000}}, "required": ["story"]}
PROMPT = [{"role": "user", "content": "Tell me a long story as JSON."}]


def _loop(model, tp: TPContext, rank: int, specs: list[GenSpec], tokenizer) -> tuple[float, dict]:
    from celerytp.worker.serving import ListSource, ServingLoop

    dist.barrier()
    source = ListSource(specs) if rank == 0 else None
    loop = ServingLoop(model, ControlGroup.on_default_group(tp.rank, tp.world_size), {}, prefill_budget=4096,
                       idle_s=0.0, source=source, decode=tokenizer.decode, tokenizer=tokenizer)
    started = time.perf_counter()
    stats = loop.run()
    elapsed = time.perf_counter() - started
    if rank == 0:
        assert all(r.result is not None and r.result.finish_reason == "length" for r in source.results.values()), \
            {k: (r.error, r.result and r.result.finish_reason) for k, r in source.results.items()}
    return elapsed / stats["steps"], loop._live_stats()


def _rank(rank: int, world_size: int, init_file: str, run: argparse.Namespace, out) -> None:
    torch.set_num_threads(max(1, run.threads // world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    tp = TPContext(rank, world_size)
    from celerytp.models import load_model

    tokenizer = load_tokenizer(default_model_path())
    prompt = tokenizer.apply_chat_template(PROMPT)
    model = load_model(default_model_path(), tp, max_batch=run.batch)

    def specs(constrained: int, i: int) -> list[GenSpec]:
        return [GenSpec(request_id=f"r{i}-{row}", prompt=prompt, max_tokens=run.tokens,
                        grammar={"json_schema": SCHEMA} if row < constrained else None) for row in range(run.batch)]

    mixes = {"unconstrained": 0, "one_constrained": 1, "all_constrained": run.batch}
    figures: dict[str, list[tuple[float, dict]]] = {name: [] for name in mixes}
    for i in range(run.repeats + 1):
        for name, constrained in mixes.items():
            step_s, stats = _loop(model, tp, rank, specs(constrained, i), tokenizer)
            if i:  # the first round warms up (and compiles the grammar once: it is cached)
                figures[name].append((step_s, stats))
    if rank == 0:
        report = {"tp": world_size, "batch": run.batch, "tokens": run.tokens}
        for name, runs in figures.items():
            # the best round: on a shared machine other jobs only ever add time
            report[f"{name}_step_ms"] = round(min(s for s, _ in runs) * 1e3, 2)
            report[f"{name}_rounds_ms"] = [round(s * 1e3, 1) for s, _ in runs]
            report[f"{name}_sampling_us"] = min(st.get("profile_us_sampling", 0) for _, st in runs)
            report[f"{name}_forward_us"] = min(st.get("profile_us_forward", 0) for _, st in runs)
        out.put(report)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    run = parser.parse_args()
    for world_size in run.tp:
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        init_file = tempfile.mktemp(prefix="celerytp-grammar-")
        mp.start_processes(_rank, args=(world_size, init_file, run, out), nprocs=world_size, start_method="spawn")
        print(json.dumps(out.get()), flush=True)


if __name__ == "__main__":
    main()
