"""The sharding maths on its own: no process group, just (rank, world_size, sizes)."""

from __future__ import annotations

import pytest

from celerytp.core.errors import CeleryTPError
from celerytp.layers.partition import HeadShard, split_heads, split_intermediate, split_units


def all_ranks(fn, world_size: int, *args):  # type: ignore[no-untyped-def]
    return [fn(r, world_size, *args) for r in range(world_size)]


def test_split_units_is_contiguous_and_front_loaded() -> None:
    assert all_ranks(split_units, 2, 3) == [(0, 2), (2, 1)]
    assert all_ranks(split_units, 3, 4) == [(0, 2), (2, 1), (3, 1)]
    assert all_ranks(split_units, 4, 8) == [(0, 2), (2, 2), (4, 2), (6, 2)]


@pytest.mark.parametrize(
    ("heads", "kv", "world", "expected"),
    [
        # even: 32 q / 8 kv over 4 ranks
        (32, 8, 4, [HeadShard(i * 8, 8, i * 2, 2) for i in range(4)]),
        # uneven KV groups: 9 q / 3 kv over 2 ranks (SmolLM2) -> 2 groups + 1 group
        (9, 3, 2, [HeadShard(0, 6, 0, 2), HeadShard(6, 3, 2, 1)]),
        # 4 kv over 3 ranks -> 2 + 1 + 1 groups
        (4, 4, 3, [HeadShard(0, 2, 0, 2), HeadShard(2, 1, 2, 1), HeadShard(3, 1, 3, 1)]),
        # replication: 2 kv heads on 4 ranks; each KV head's 4 q heads split 2 + 2
        (
            8,
            2,
            4,
            [HeadShard(0, 2, 0, 1, 2), HeadShard(2, 2, 0, 1, 2), HeadShard(4, 2, 1, 1, 2), HeadShard(6, 2, 1, 1, 2)],
        ),
        # MQA on 4 ranks
        (4, 1, 4, [HeadShard(r, 1, 0, 1, 4) for r in range(4)]),
        (6, 3, 1, [HeadShard(0, 6, 0, 3)]),
    ],
)
def test_split_heads(heads: int, kv: int, world: int, expected: list[HeadShard]) -> None:
    shards = all_ranks(split_heads, world, heads, kv)
    assert shards == expected
    # every query head is owned exactly once
    owned = sorted(q for s in shards for q in range(s.q_start, s.q_start + s.q_count))
    assert owned == list(range(heads))
    # each rank's q heads belong to its own KV heads
    group = heads // kv
    for s in shards:
        assert s.kv_start <= s.q_start // group and (s.q_start + s.q_count - 1) // group < s.kv_start + s.kv_count


@pytest.mark.parametrize(
    ("heads", "kv", "world", "numbers"),
    [
        (6, 3, 4, ["world size 4", "num_kv_heads 3"]),  # 4 ranks cannot share 3 KV heads evenly
        (4, 1, 3, ["world size 3", "num_kv_heads 1"]),
        (4, 2, 8, ["4 ranks", "2 query heads", "by 4"]),  # 2 q heads per group over 4 replicas
        (6, 4, 2, ["num_heads 6", "num_kv_heads 4"]),
    ],
)
def test_impossible_head_splits_name_the_numbers(heads: int, kv: int, world: int, numbers: list[str]) -> None:
    with pytest.raises(CeleryTPError) as err:
        split_heads(0, world, heads, kv)
    assert err.value.kind == "load_failed"
    for n in numbers:
        assert n in err.value.message


def test_split_intermediate() -> None:
    assert all_ranks(split_intermediate, 2, 1536) == [(0, 768), (768, 768)]
    # divisible but not block-aligned -> whole 32-blocks: 96 = 3 blocks -> 64 + 32
    assert all_ranks(split_intermediate, 2, 96, 32) == [(0, 64), (64, 32)]
    # unquantized and divisible: even even if not a multiple of 32
    assert all_ranks(split_intermediate, 2, 96) == [(0, 48), (48, 48)]
    # not divisible: 32-blocks when there are enough of them ...
    assert all_ranks(split_intermediate, 3, 160) == [(0, 64), (64, 64), (128, 32)]
    # ... else single columns when unquantized
    assert all_ranks(split_intermediate, 3, 80) == [(0, 27), (27, 27), (54, 26)]
    assert all_ranks(split_intermediate, 3, 64) == [(0, 22), (22, 21), (43, 21)]
    # K-quant blocks of 256
    assert all_ranks(split_intermediate, 3, 1536, 256) == [(0, 512), (512, 512), (1024, 512)]
    assert all_ranks(split_intermediate, 4, 1536, 256) == [(0, 512), (512, 512), (1024, 256), (1280, 256)]


def test_impossible_intermediate_split_names_the_numbers() -> None:
    with pytest.raises(CeleryTPError, match="intermediate_size 96 cannot be split over world size 4 in blocks of 32"):
        split_intermediate(0, 4, 96, 32)
    with pytest.raises(CeleryTPError, match="intermediate_size 2 cannot be split over world size 3"):
        split_intermediate(0, 3, 2)


def test_bad_rank() -> None:
    with pytest.raises(CeleryTPError, match="rank 2 is outside world size 2"):
        split_heads(2, 2, 4, 2)
