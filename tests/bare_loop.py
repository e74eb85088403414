"""The serving loop without Celery or Redis: ranks as processes on a gloo group, requests from a
list (worker/serving.py ListSource), for tests that script what the loop meets."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

BARE_LOOP_RANK = """
import json, os, sys
import torch
import torch.distributed as dist
from celerytp.core.protocol import GenSpec
from celerytp.distributed.control import ControlGroup
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.image_features import image_features
from celerytp.worker.serving import ListSource, ServingLoop
from pathlib import Path


class Scripted(ListSource):
    # cancels the listed requests at the loop's second step, their prompts part-way in, and
    # queues a request marked "after": n at the loop's n-th step
    def __init__(self, specs, cancel):
        super().__init__([GenSpec(**s) for s in specs if "after" not in s])
        self.later = [(s.pop("after"), GenSpec(**s)) for s in specs if "after" in s]
        self.cancel, self.calls = set(cancel), 0

    def publish(self, events, running, stats):
        super().publish(events, running, stats)
        self.calls += 1
        self.queue += [spec for after, spec in self.later if after == self.calls]
        return self.cancel & set(running) if self.calls == 2 else set()

    def try_exit(self):
        return not self.queue and all(after <= self.calls for after, _ in self.later)


rank, world, init, path, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
model = load_model(path, TPContext(rank, world), max_batch=int(sys.argv[7]))
control = ControlGroup.on_default_group(rank, world)
images = image_features(Path(path), model)  # a vision-language model's (None for a text model)
runs, done = [], {}
for specs, cancel in json.loads(sys.argv[6]):  # each run: a fresh loop over cold rows
    model.clear_cache()
    for spec in specs:  # "resume": [request id, n]: resumed after the first n tokens an earlier run gave it
        if "resume" in spec:
            rid, n = spec.pop("resume")
            spec["resumed"] = done.get(rid, [])[:n]
    source = Scripted(specs, cancel) if rank == 0 else None
    loop = ServingLoop(model, control, {}, 8, 0.0, source, image_features=images)
    stats = {**loop.run(), "host_waits": dict(loop.host_waits)}
    if rank == 0:
        rows = {rid: {"error": [str(f.error.kind), f.error.message]} if f.error is not None else
                {"tokens": f.result.token_ids, "logprobs": f.result.logprobs, "finish": f.result.finish_reason,
                 "reused": f.result.reused_tokens, "prompt_logprobs": f.result.prompt_logprobs}
                for rid, f in source.results.items()}
        runs.append({"stats": stats, "rows": rows})
        done.update((rid, row["tokens"]) for rid, row in rows.items() if "tokens" in row)
if rank == 0:
    json.dump(runs, open(out, "w"))
dist.barrier()
dist.destroy_process_group()  # gloo left to the interpreter's exit can abort the process
# and so can the compiler's threads (a compiled model): the work is done and written, leave now
sys.stderr.flush()
os._exit(0)
"""


def serve_bare(tmp_path, path, world: int, runs: list, prelude: str = "", max_batch: int = 8) -> list[dict]:
    """Each run ([GenSpec fields, ...], [request ids to cancel]) through a bare serving loop on
    `world` ranks (prefill budget 8, cold rows, `max_batch` rows): its stats and each request's
    result (or error).
    `prelude`: code each rank runs first."""
    call = Path(tempfile.mkdtemp(dir=tmp_path))  # a rendezvous file of its own: a used one may still hold keys
    init, out = call / "init", call / "out.json"
    ranks = [subprocess.Popen([sys.executable, "-c", prelude + BARE_LOOP_RANK, str(r), str(world), str(init), str(path),
                               str(out), json.dumps(runs), str(max_batch)], stderr=subprocess.PIPE, text=True) for r in range(world)]
    errors = {r: rank.communicate(timeout=240)[1] for r, rank in enumerate(ranks)}
    failed = {r: errors[r][-3000:] for r, rank in enumerate(ranks) if rank.returncode != 0}
    assert not failed, failed
    return json.loads(out.read_text())
