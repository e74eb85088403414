"""Tensor-parallel SwiGLU MLP and sparse MoE block (routed experts + gated shared expert).

The router and the shared-expert gate are replicated, so every rank routes identically with
no communication. Every expert's gate/up are split by columns and its down_proj by rows along
moe_intermediate_size (the shared expert likewise), so each rank holds a slice of every expert
and the block ends with exactly one all-reduce of the summed partial outputs.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.distributed.tp import TPContext
from celerytp.layers.host_transfer import expected_wait, takes_device_path
from celerytp.layers.lanewise import lanewise
from celerytp.layers.linear import ReplicatedLinear
from celerytp.layers.mlp import SwiGLUMLP
from celerytp.layers.packed_linear import float_linear
from celerytp.layers.partition import split_intermediate
from celerytp.layers.quantized import QuantizedWeight
from celerytp.layers.weights import check_shape, copy_into
from celerytp.loading.checkpoint import TensorSource
from celerytp.quant.formats import QuantPlan
from celerytp.quant.plan import mlp_block

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
log = logging.getLogger(__name__)


class RoutedExperts(nn.Module):
    """All experts' local slices stacked: w13 (E, 2 I_local, H) = [gate; up], w2 (E, H, I_local).

    Checkpoint names `experts.{e}.{gate,up,down}_proj.weight` are mapped onto the stacks by
    `checkpoint_entries`. With `quant` the stacks are empty and each expert keeps its two
    weights as QuantizedWeights (q13[e]: [gate; up], q2[e]: down).
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPContext,
        *,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        block = mlp_block(1, quant, intermediate_size, tp.world_size)
        self.start, self.local = split_intermediate(tp.rank, tp.world_size, intermediate_size, block)
        shape13, shape2 = (num_experts, 2 * self.local, hidden_size), (num_experts, hidden_size, self.local)
        self.q13 = self.q2 = None
        if quant:
            shape13 = shape2 = (0,)
            common = {"dtype": dtype, "device": device}
            experts = range(num_experts)
            self.q13 = nn.ModuleList(QuantizedWeight(quant, 2 * self.local, hidden_size, **common) for _ in experts)
            self.q2 = nn.ModuleList(QuantizedWeight(quant, hidden_size, self.local, **common) for _ in experts)
        self.w13 = nn.Parameter(torch.empty(shape13, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(shape2, dtype=dtype, device=device), requires_grad=False)
        for p in (self.w13, self.w2):
            p.tp_sharded = True
            p.weight_loader = self.weight_loader
        self.device_path = takes_device_path(device)  # no host reads: the float experts as one op

    def checkpoint_entries(self, prefix: str) -> dict[str, tuple[nn.Parameter, str]]:
        """Checkpoint name -> (stacked parameter, "expert.projection")."""
        return {
            f"{prefix}.{e}.{proj}.weight": (self.w2 if proj == "down_proj" else self.w13, f"{e}.{proj}")
            for e in range(self.num_experts)
            for proj in EXPERT_PROJECTIONS
        }

    def weight_loader(self, param: torch.Tensor, source: TensorSource, shard_id: str | None) -> None:
        expert, _, proj = (shard_id or "").partition(".")
        if proj not in EXPERT_PROJECTIONS or not expert.isdigit() or int(expert) >= self.num_experts:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{source.name}: no expert projection {shard_id!r}")
        e, cols = int(expert), (self.start, self.start + self.local)
        if proj == "down_proj":
            check_shape(source, (self.hidden_size, self.intermediate_size))
            if self.q2 is not None:
                return self.q2[e].load(source, 0, cols=cols)
            copy_into(param.data[e], source.read(cols=cols), source.name)
            return
        check_shape(source, (self.intermediate_size, self.hidden_size))
        half = 0 if proj == "gate_proj" else self.local
        if self.q13 is not None:
            return self.q13[e].load(source, half, rows=cols)
        copy_into(param.data[e, half : half + self.local], source.read(rows=cols), source.name)

    def forward(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Partial sum over this rank's columns of sum_k weights[n, k] * expert_k(x[n]).

        x (N, H); experts, weights (N, top_k). Tokens are grouped by expert, so each expert
        that any token chose runs one matmul over all of its tokens.
        """
        N, top_k = experts.shape
        if N == 1 and not self.device_path:  # decode on a CPU: its top_k experts as a list, the fewest ops
            chosen = zip(experts[0].tolist(), weights[0], strict=True)
            return _combine([w.to(x.dtype) * self._expert(e, x) for e, w in chosen])
        flat = experts.reshape(-1)  # (N * top_k,)
        order = flat.argsort(stable=True)
        bounds = torch.searchsorted(flat[order], torch.arange(self.num_experts + 1, device=flat.device))
        xs = x.index_select(0, order // top_k)  # (N * top_k, H), grouped by expert
        if self.q13 is None:  # float experts: the groups' ends stay a tensor (`grouped_linear`)
            grouped = torch.ops.celerytp.grouped_linear if self.device_path else _grouped_linear  # (a dispatch costs ~10 µs)
            ends = bounds[1:].to(torch.int32)
            gate, up = grouped(xs, self.w13, ends).chunk(2, dim=-1)
            ys = grouped(F.silu(gate) * up, self.w2, ends)
        else:  # quantized experts, a kernel call each: which run, and on how many tokens, is read on
            with expected_wait("moe_routing"):  # the host (a wait per layer on a GPU)
                counts = bounds.diff().tolist()
            ys, start = [], 0
            for e, count in enumerate(counts):
                if count:
                    ys.append(self._expert(e, xs[start : start + count]))
                    start += count
            ys = torch.cat(ys)
        ys = ys * weights.reshape(-1)[order].unsqueeze(-1).to(ys.dtype)
        by_token = torch.empty_like(ys).index_copy_(0, order, ys)
        return _combine(list(by_token.view(N, top_k, -1).unbind(1)))

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.q13 is not None:
            gate, up = self.q13[e](x).chunk(2, dim=-1)
            return self.q2[e](F.silu(gate) * up)
        gate, up = float_linear(x, self.w13[e], None).chunk(2, dim=-1)  # (n, I_local) each
        return float_linear(F.silu(gate) * up, self.w2[e], None)  # (n, H) partial


# The float experts' grouped matmul as one op, so that its groups' ends stay a tensor wherever it
# runs: on a GPU, torch's grouped GEMM takes them on the device (its CUTLASS kernel: bfloat16 on
# sm90 and later; torch's fallback elsewhere reads them back itself); on a CPU, one oneDNN product
# per group (`float_linear`, batch-invariant) reads them from host memory, which makes nothing
# wait. Being one op, its inside is out of worker/host_syncs.py's sight, as any kernel's is: on a
# GPU where torch has no grouped kernel for the dtype or shape, the loop below reads the ends back,
# a wait per layer (as every MoE layer made before).
_LIB = torch.library.Library("celerytp", "FRAGMENT")
_LIB.define("grouped_linear(Tensor x, Tensor weight, Tensor ends) -> Tensor")


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """x (M, in) W_e^T for each run x[ends[e-1]:ends[e]] of rows, W = weight (E, out, in); int32 ends (E,)."""
    if _grouped_kernel(x, weight):
        return F.grouped_mm(x, weight.transpose(1, 2), offs=ends)
    parts, start = [], 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            parts.append(float_linear(x[start:end], weight[e], None))
        start = end
    return torch.cat(parts)


_LIB.impl("grouped_linear", _grouped_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("celerytp::grouped_linear", lib=_LIB)
def _(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[1])


def _grouped_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matmul kernel takes these operands (off a CPU, rows of whole 16 bytes)."""
    aligned = x.shape[1] % 8 == 0 and weight.shape[1] % 8 == 0
    return x.device.type != "cpu" and aligned and grouped_mm_works(x.dtype, str(x.device))


@functools.cache
def grouped_mm_works(dtype: torch.dtype, device: str) -> bool:
    """Whether torch's grouped matmul runs here in `dtype` and agrees with one matmul per group."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 32, generator=g), torch.randn(3, 16, 32, generator=g)
    ends = torch.tensor([2, 2, 5], dtype=torch.int32)
    try:
        y = F.grouped_mm(x.to(device, dtype), w.to(device, dtype).transpose(1, 2), offs=ends.to(device)).float().cpu()
    except (RuntimeError, NotImplementedError) as exc:
        log.info("grouped matmul in %s on %s unavailable (%s); experts run one by one", dtype, device, exc)
        return False
    ref = torch.cat([x[:2] @ w[0].T, x[2:5] @ w[2].T])
    return bool((y - ref).abs().max() <= 2e-2 * ref.abs().max())


def _combine(parts: list[torch.Tensor]) -> torch.Tensor:
    """A token's weighted expert outputs summed in its top-k order, one way for one token or many
    (batch invariance: docs/models.md)."""
    out = parts[0]
    for part in parts[1:]:
        out = out + part
    return out


class SparseMoeBlock(nn.Module):
    """Top-k routed experts plus a sigmoid-gated shared expert; one all-reduce per block.

    Args:
        shared_intermediate_size: 0 when there is no shared expert.
        norm_topk_prob: renormalize the top-k routing weights to sum to 1.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        shared_intermediate_size: int,
        norm_topk_prob: bool,
        tp: TPContext,
        *,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        common = {"dtype": dtype, "device": device}
        self.tp, self.top_k, self.norm_topk_prob = tp, top_k, norm_topk_prob
        # The router and the shared expert's gate stay float (E and 1 outputs: tiny, and routing is sensitive).
        self.gate = ReplicatedLinear(hidden_size, num_experts, **common)  # the router
        self.experts = RoutedExperts(num_experts, hidden_size, intermediate_size, tp, quant=quant, **common)
        self.shared_expert: SwiGLUMLP | None = None
        if shared_intermediate_size:
            self.shared_expert = SwiGLUMLP(
                hidden_size, shared_intermediate_size, tp, reduce_results=False, quant=quant, **common
            )
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, H)
        logits = self.gate(flat)  # (N, E)
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        y = self.experts(flat, experts, weights.to(logits.dtype))
        if self.shared_expert is not None:
            # The gate scales this rank's partial sum, so gating before the reduction is exact.
            y = y + lanewise(torch.sigmoid, self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return self.tp.all_reduce(y).view(shape)  # the block's one all-reduce
