"""How many positions a rank's KV cache holds: what fits the memory left once its weights are in.

A load names a budget in bytes (`kv_cache_bytes`) or leaves it to a fraction of the memory its
device has free after the weights (`kv_memory_fraction`, default DEFAULT_KV_MEMORY_FRACTION,
vLLM's `gpu_memory_utilization` in spirit): on CUDA the device's free memory; on a CPU the host's
available RAM shared by the group's ranks (a CPU cache's pages become resident only as rows
write them, so that is what it could grow to). The positions are then the model's own default
context, or fewer where that does not fit; a context asked for that does not fit is refused.
"""

from __future__ import annotations

import psutil
import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.layers.partition import split_heads, split_linear_heads
from celerytp.layers.rotary import scaled_context
from celerytp.models.config import ModelConfig
from celerytp.models.hybrid_config import HybridConfig

DEFAULT_KV_MEMORY_FRACTION = 0.8  # the rest: activations, the compiler's and CUDA graphs' pools, other models


def free_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of `device`: a GPU's own, or the host's available and total RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)
    ram = psutil.virtual_memory()
    return ram.available, ram.total


def memory_budget(device: torch.device, fraction: float, world_size: int) -> int:
    """The KV cache bytes a rank may take now: `fraction` of its device's free memory (a CPU's
    available RAM is shared by the group's ranks, which may all run on this host)."""
    free, _ = free_memory(device)
    return int(free * fraction) // (1 if device.type == "cuda" else world_size)


def kv_bytes_per_position(config: ModelConfig | HybridConfig, world_size: int, dtype: torch.dtype) -> int:
    """KV cache bytes one position of one row costs on the rank holding the most KV heads."""
    if isinstance(config, HybridConfig):  # its linear heads' split is checked first, as the model would
        for rank in range(world_size):
            split_linear_heads(rank, world_size, config.linear_num_value_heads, config.linear_num_key_heads)
    attention_layers = config.num_layers - getattr(config, "num_linear_layers", 0)
    kv_heads = max(split_heads(r, world_size, config.num_heads, config.num_kv_heads).kv_count for r in range(world_size))
    return attention_layers * 2 * kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def check_context(config: ModelConfig | HybridConfig, max_context: int | None) -> None:
    """Refuse a context the model's positions do not reach (before any weight is read)."""
    limit = scaled_context(config.rope, config.max_position_embeddings)
    if max_context is not None and not 1 <= max_context <= limit:
        extended = f", extended by its {config.rope.rope_type} rope scaling" if limit > config.max_position_embeddings else ""
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"max_context {max_context} must be within 1..{limit} (max_position_embeddings"
            f" {config.max_position_embeddings}{extended})",
        )


def fit_context(
    config: ModelConfig | HybridConfig,
    world_size: int,
    dtype: torch.dtype,
    max_batch: int,
    max_context: int | None,
    budget: int,
    budget_from: str = "kv_cache_bytes",
) -> int:
    """The KV cache's positions per row: as asked if it fits `budget` bytes, else the most that
    fits, up to the model's default. `budget_from` names where the budget came from, for a refusal."""
    check_context(config, max_context)
    rows = max_batch + 1
    per_position = max(1, kv_bytes_per_position(config, world_size, dtype)) * rows
    fits = budget // per_position
    if max_context is None:
        max_context = min(config.default_max_context, fits)
        if max_context < 1:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"the KV cache budget of {budget} bytes ({budget_from}) holds no position of {rows} rows"
                f" ({per_position} bytes each): lower max_batch, or free memory",
            )
    if max_context > fits:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"a KV cache of {rows} rows x {max_context} positions needs {max_context * per_position >> 20}"
            f" MiB per rank, over the budget of {budget >> 20} MiB ({budget_from}): lower max_batch or"
            f" max_context, or raise the budget (at most {fits} positions fit)",
        )
    return max_context
