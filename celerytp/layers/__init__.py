"""Tensor-parallel building blocks: sharding maths, parallel linears, norms, rotary, KV cache."""

from celerytp.layers.kv_cache import KVCache
from celerytp.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    OutputShard,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from celerytp.layers.norm import RMSNorm
from celerytp.layers.partition import HeadShard, split_heads, split_intermediate, split_units
from celerytp.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary, inv_frequencies

__all__ = [
    "ColumnParallelLinear",
    "HeadShard",
    "KVCache",
    "MergedColumnParallelLinear",
    "OutputShard",
    "QKVParallelLinear",
    "RMSNorm",
    "ReplicatedLinear",
    "RopeConfig",
    "RotaryEmbedding",
    "RowParallelLinear",
    "apply_rotary",
    "inv_frequencies",
    "split_heads",
    "split_intermediate",
    "split_units",
]
