"""Pure tensor-parallel sharding maths: which heads and MLP columns each rank owns.

Every function takes (rank, world_size, ...) explicitly so it can be tested without a
process group, and raises CeleryTPError(ErrorKind.LOAD_FAILED, ...) naming the numbers when a model
cannot be split that way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from celerytp.core.errors import CeleryTPError, ErrorKind

# Uneven MLP splits move whole blocks of this many columns, so the row-parallel down_proj
# slices stay aligned with GGUF quant blocks (32 for Q4/Q5/Q8) and SIMD widths.
UNEVEN_SPLIT_BLOCK = 32


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"rank {rank} is outside world size {world_size}")


def split_units(rank: int, world_size: int, units: int) -> tuple[int, int]:
    """(start, count) of `units` items for `rank`, contiguous, as even as possible.

    The first `units % world_size` ranks get one extra item.
    """
    _check_rank(rank, world_size)
    base, extra = divmod(units, world_size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank owns.

    Args:
        q_start, q_count: the rank's contiguous run of query heads.
        kv_start, kv_count: the rank's contiguous run of key/value heads.
        kv_replicas: how many ranks hold each of this rank's KV heads (1 = not replicated).
    """

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int
    kv_replicas: int = 1


def split_heads(rank: int, world_size: int, num_heads: int, num_kv_heads: int) -> HeadShard:
    """Split attention heads by whole KV groups.

    With world_size <= num_kv_heads each rank gets a contiguous run of KV groups (uneven is
    fine: 3 groups over 2 ranks gives 2 and 1) and the query heads of those groups. With
    world_size > num_kv_heads each KV head is replicated on world_size / num_kv_heads ranks,
    which split the query heads of that group evenly.
    """
    _check_rank(rank, world_size)
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}",
        )
    group = num_heads // num_kv_heads  # query heads per KV head
    if world_size <= num_kv_heads:
        kv_start, kv_count = split_units(rank, world_size, num_kv_heads)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if world_size % num_kv_heads:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"world size {world_size} exceeds num_kv_heads {num_kv_heads} "
            f"and is not a multiple of it, so KV heads cannot be replicated evenly",
        )
    replicas = world_size // num_kv_heads
    if group % replicas:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"each KV head is shared by {replicas} ranks (world size {world_size}, "
            f"num_kv_heads {num_kv_heads}) but its {group} query heads do not divide by {replicas}",
        )
    kv_head = rank // replicas
    q_per_rank = group // replicas
    q_start = kv_head * group + (rank % replicas) * q_per_rank
    return HeadShard(q_start, q_per_rank, kv_head, 1, replicas)


def split_intermediate(rank: int, world_size: int, intermediate_size: int, block: int = 1) -> tuple[int, int]:
    """(start, size) of the MLP intermediate columns for `rank`.

    Even when intermediate_size / world_size is a whole number of `block`s (the checkpoint's
    quant block, 1 when unquantized). Otherwise whole blocks of lcm(block, 32) where that
    divides intermediate_size into at least world_size blocks, else of `block`; the first
    ranks take one extra block.
    """
    _check_rank(rank, world_size)
    if intermediate_size % world_size == 0 and (intermediate_size // world_size) % block == 0:
        size = intermediate_size // world_size
        return rank * size, size
    unit = math.lcm(block, UNEVEN_SPLIT_BLOCK)
    if intermediate_size % unit or intermediate_size // unit < world_size:
        unit = block
    if intermediate_size % unit or intermediate_size // unit < world_size:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"intermediate_size {intermediate_size} cannot be split over world size {world_size} in blocks of {unit}",
        )
    start, count = split_units(rank, world_size, intermediate_size // unit)
    return start * unit, count * unit


def split_linear_heads(rank: int, world_size: int, num_value_heads: int, num_key_heads: int) -> HeadShard:
    """Split Gated DeltaNet heads: value heads play the query heads' part, key heads the KV heads'.

    Each key head serves num_value_heads / num_key_heads consecutive value heads; a rank owns
    whole key heads with their value heads, or (world size above the key heads) one key head,
    replicated, and an even share of its value heads. No communication inside the delta rule.
    """
    try:
        return split_heads(rank, world_size, num_value_heads, num_key_heads)
    except CeleryTPError as exc:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"linear attention (linear_num_value_heads {num_value_heads}, linear_num_key_heads {num_key_heads}) "
            f"cannot be split over world size {world_size}: {exc.message}",
        ) from None
