"""The gated MLP of every architecture here (SwiGLU; GeGLU for gemma3), and the hybrids' shared experts."""

from __future__ import annotations

import torch
from torch import nn

from celerytp.distributed.tp import TPContext
from celerytp.layers.eager_ops import activation
from celerytp.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from celerytp.layers.partition import split_intermediate
from celerytp.quant.formats import QuantPlan
from celerytp.quant.plan import mlp_block


class SwiGLUMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate/up column-parallel and down row-parallel.

    Args:
        bias: gate/up/down carry biases (llama's `mlp_bias`).
        activation: a key of layers/eager_ops.py ACTIVATIONS (silu: SwiGLU).
        reduce_results: all-reduce in forward; False when the caller sums it with other
            partial outputs first (the MoE block's shared expert).
        quant: keep the weights quantized as this plan says.
        block: where shards of the intermediate size start (the loader's, from the checkpoint's
            and the plan's blocks); None: from the plan alone.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        tp: TPContext,
        *,
        dtype: torch.dtype,
        device: torch.device,
        bias: bool = False,
        reduce_results: bool = True,
        quant: QuantPlan | None = None,
        block: int | None = None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.activation = activation
        block = block if block is not None else mlp_block(1, quant, intermediate_size, tp.world_size)
        local = split_intermediate(tp.rank, tp.world_size, intermediate_size, block)
        common = {"dtype": dtype, "device": device, "bias": bias, "quant": quant}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, intermediate_size, local, ("gate_proj", "up_proj"), **common
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, local, tp, reduce_results=reduce_results, **common
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # (..., I_local) each
        return self.down_proj(activation(self.activation, gate) * up)
