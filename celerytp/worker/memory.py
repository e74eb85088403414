"""A rank's memory as operators read it (the seed harness's QueryVram): its device's free and
total memory, what its models' weights and KV caches hold, and its peak."""

from __future__ import annotations

import resource
import sys
from typing import Any

import torch

from celerytp.models.kv_budget import free_memory


def memory_report(device: torch.device | None, models: dict[str, Any]) -> dict[str, int]:
    """Bytes: `free` and `total` of the rank's device (a CPU: the host's available and total
    RAM), `weights` and `kv_cache` of the loaded models (`LoadedModel.memory`), and `peak`
    (CUDA: the most the caching allocator held; a CPU: the process's peak RSS)."""
    held = list(models.values())
    report = {"weights": sum(m.memory.get("weights", 0) for m in held),
              "kv_cache": sum(m.memory.get("kv_cache", 0) for m in held)}
    device = torch.device("cpu") if device is None else device
    free, total = free_memory(device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"free": free, "total": total, **report, "peak": peak}
