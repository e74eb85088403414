"""Tensor-parallel linear layers that allocate only their local shard (vLLM style).

Column-parallel layers split the output dim and need no collective; row-parallel layers
split the input dim and all-reduce their partial sums in `forward`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.distributed.tp import TPContext
from celerytp.layers.packed_linear import float_linear
from celerytp.layers.partition import HeadShard
from celerytp.layers.quantized import QuantizedWeight
from celerytp.layers.weights import check_shape, copy_into, empty_param, replicated_loader
from celerytp.loading.checkpoint import TensorSource
from celerytp.quant.formats import QuantPlan


@dataclass(frozen=True)
class OutputShard:
    """This rank's rows of one checkpoint matrix packed into a column-parallel layer.

    Args:
        total: rows of the full checkpoint matrix.
        start, size: the rows this rank holds.
    """

    total: int
    start: int
    size: int



class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (outputs) split over ranks; several checkpoint matrices may
    be packed into one weight, each addressed by a shard id.

    Args:
        input_size: full input features (every rank sees the whole input).
        shards: shard id -> this rank's rows of that checkpoint matrix, packed in this order.
        bias: whether the checkpoint has a bias for each packed matrix.
        quant: keep the weight quantized in this format (see layers/quantized.py).
    """

    def __init__(
        self,
        input_size: int,
        shards: dict[str, OutputShard],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.shards = shards
        self.offsets: dict[str, int] = {}
        offset = 0
        for shard_id, shard in shards.items():
            self.offsets[shard_id] = offset
            offset += shard.size
        self.output_size = offset  # local rows
        self.qweight = QuantizedWeight(quant, offset, input_size, dtype=dtype, device=device) if quant else None
        self.weight = empty_param(*((0,) if quant else (offset, input_size)), dtype=dtype, device=device, sharded=True)
        self.weight.weight_loader = self.weight_loader
        self.bias = empty_param(offset, dtype=dtype, device=device, sharded=True) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.register_buffer("onednn_weight", None, persistent=False)  # in oneDNN's layout: packed_linear.py

    def weight_loader(self, param: torch.Tensor, source: TensorSource, shard_id: str | None) -> None:
        if shard_id not in self.shards:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{source.name}: no shard {shard_id!r} in {list(self.shards)}")
        shard, offset = self.shards[shard_id], self.offsets[shard_id]
        check_shape(source, (shard.total, self.input_size) if param is not self.bias else (shard.total,))
        if self.qweight is not None and param is self.weight:
            return self.qweight.load(source, offset, rows=(shard.start, shard.start + shard.size))
        value = source.read(rows=(shard.start, shard.start + shard.size))
        copy_into(param.data[offset : offset + shard.size], value, source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight(x, self.bias)
        return float_linear(x, self.weight, self.onednn_weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """q_proj, k_proj and v_proj packed into one weight, split by whole KV groups."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        heads: HeadShard,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
    ) -> None:
        kv = OutputShard(num_kv_heads * head_dim, heads.kv_start * head_dim, heads.kv_count * head_dim)
        shards = {
            "q_proj": OutputShard(num_heads * head_dim, heads.q_start * head_dim, heads.q_count * head_dim),
            "k_proj": kv,
            "v_proj": kv,
        }
        super().__init__(hidden_size, shards, bias=bias, dtype=dtype, device=device, quant=quant)
        self.split_sizes = [s.size for s in shards.values()]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several matrices of the same output size packed together (gate_proj and up_proj)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        local: tuple[int, int],
        shard_ids: tuple[str, ...],
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
    ) -> None:
        start, size = local
        shards = {sid: OutputShard(output_size, start, size) for sid in shard_ids}
        super().__init__(input_size, shards, bias=bias, dtype=dtype, device=device, quant=quant)
        self.local_size = size


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b with W's columns (inputs) split over ranks.

    Args:
        input_size: full input features; this rank holds columns local[0]:local[0]+local[1].
        output_size: output features (whole on every rank after the all-reduce).
        tp: the rank's tensor-parallel context.
        reduce_results: all-reduce the partial sums in forward (False only for tests).
        quant: keep the weight quantized (a slice that is not whole blocks falls back, see QuantPlan).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        local: tuple[int, int],
        tp: TPContext,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        reduce_results: bool = True,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.start, self.local_size = local
        self.tp = tp
        self.reduce_results = reduce_results
        self.qweight = None
        if quant:
            self.qweight = QuantizedWeight(quant, output_size, self.local_size, dtype=dtype, device=device)
        shape = (0,) if quant else (output_size, self.local_size)
        self.weight = empty_param(*shape, dtype=dtype, device=device, sharded=True)
        self.weight.weight_loader = self.weight_loader
        # The bias is added once, after the reduction, so it is replicated, not split.
        self.bias = empty_param(output_size, dtype=dtype, device=device, sharded=False) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = replicated_loader
        self.register_buffer("onednn_weight", None, persistent=False)

    def weight_loader(self, param: torch.Tensor, source: TensorSource, shard_id: str | None = None) -> None:
        check_shape(source, (self.output_size, self.input_size))
        if self.qweight is not None:
            return self.qweight.load(source, 0, cols=(self.start, self.start + self.local_size))
        value = source.read(cols=(self.start, self.start + self.local_size))
        copy_into(param.data, value, source.name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # partial sum over this rank's input columns
        y = float_linear(x, self.weight, self.onednn_weight) if self.qweight is None else self.qweight(x)
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y


class ReplicatedLinear(nn.Module):
    """A whole linear layer on every rank (lm_head).

    Args:
        tied_weight: share this parameter (the embedding) instead of allocating one.
        quant: keep an untied weight quantized (a tied one stays the embedding).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tied_weight: nn.Parameter | None = None,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.qweight = None
        self.register_buffer("onednn_weight", None, persistent=False)
        if tied_weight is not None:
            self.weight = tied_weight
            return
        if quant:
            self.qweight = QuantizedWeight(quant, output_size, input_size, dtype=dtype, device=device, sharded=False)
        self.weight = empty_param(*((0,) if quant else (output_size, input_size)), dtype=dtype, device=device, sharded=False)
        self.weight.weight_loader = replicated_loader if quant is None else self._load_quantized

    def _load_quantized(self, param: torch.Tensor, source: TensorSource, shard_id: str | None = None) -> None:
        check_shape(source, (self.qweight.out_features, self.qweight.in_features))
        self.qweight.load(source, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float_linear(x, self.weight, self.onednn_weight) if self.qweight is None else self.qweight(x)
