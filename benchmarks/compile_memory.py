"""Where compiled decode's memory goes: one process at TP=1 loads the default model three ways and
reports its RSS (MiB) before the load and after it (freed heap returned, as a worker does).

Run: python benchmarks/compile_memory.py

- eager: CELERYTP_COMPILE=0;
- compiler imported: eager, with Dynamo and inductor imported first (what the compiler costs
  resident, before it compiles anything);
- compiled: CELERYTP_COMPILE=1.
Each in its own process, so imports do not carry over.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

CASE = """
import json, os, sys, tempfile
import psutil, torch, torch.distributed as dist
from celerytp.core.model_files import default_model_path
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.loaded_model import release_memory

def rss():
    return psutil.Process().memory_info().rss / 2**20

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
if sys.argv[1] == "compiler imported":
    import torch._dynamo, torch._inductor.compile_fx  # noqa: F401
before = rss()
model = load_model(default_model_path(), TPContext(0, 1), max_batch=16)
release_memory()
print(json.dumps({"before_mib": round(before), "after_mib": round(rss())}))
"""


def main() -> None:
    for case, switch in (("eager", "0"), ("compiler imported", "0"), ("compiled", "1")):
        done = subprocess.run([sys.executable, "-c", CASE, case], capture_output=True, text=True, check=True,
                              env={**os.environ, "CELERYTP_COMPILE": switch})
        print(f"{case:18} {json.loads(done.stdout.strip().splitlines()[-1])}")


if __name__ == "__main__":
    main()
