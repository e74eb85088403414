"""The record of a loaded model: what leaders need to send it requests, and how to load it again.

Leaders keep one per model in Redis (keys.models_key) and every rank reports its own in `ping`,
so the record survives both a Redis restart (the ranks still hold it) and a rank restart (Redis
and the other ranks still hold it), and a group can be healed by loading it again.
"""

from __future__ import annotations

from typing import Any

LOAD_FIELDS = (
    "path", "dtype", "quant", "max_context", "max_batch", "kv_cache_bytes", "kv_memory_fraction", "kv_dtype", "prefill_budget", "idle_s", "max_queue",
    "read_deadline_s", "mmproj",
)


def model_record(
    load: dict[str, Any], *, dtype: str, model_type: str, vocab_size: int, max_context: int, max_batch: int,
    decode: str = "eager", batch_invariant: bool = False, attention: str = "sdpa",
) -> dict[str, Any]:
    """`load`: the load request's fields (LOAD_FIELDS); the rest: what the load produced."""
    return {
        "path": load["path"], "dtype": dtype, "model_type": model_type, "vocab_size": vocab_size,
        "max_context": max_context, "max_batch": max_batch, "max_queue": load["max_queue"], "decode": decode,
        "batch_invariant": batch_invariant, "attention": attention,
        "load": {k: load[k] for k in LOAD_FIELDS if k in load},
    }
