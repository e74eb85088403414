"""Gated DeltaNet (Qwen3-Next / Qwen3.5 linear attention), split over ranks by heads.

A rank owns whole key heads with the value heads they serve (or, with more ranks than key
heads, one replicated key head and a share of its value heads), so the delta rule runs with
no communication; `out_proj` is row-parallel and its all-reduce is the block's only one.
Decode uses the recurrent form of the delta rule. Prefill, with batch invariance on (the
default), runs the same recurrent step token by token, conv included, so that a token prefilled
and the same token decoded are the same bits (docs/models.md, "Batch invariance"); with
CELERYTP_RECURRENT_PREFILL=chunks (or CELERYTP_BATCH_INVARIANT=0) it uses the chunked
(UT-transform) form, about twice as fast (docs/benchmarks.md), and the model is not invariant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.switches import INVARIANT_ENV, RECURRENT_PREFILL_ENV, switch
from celerytp.distributed.tp import TPContext
from celerytp.layers.hybrid_norm import GatedRMSNorm
from celerytp.layers.kv_cache import CacheSlots
from celerytp.layers.lanewise import lanewise
from celerytp.layers.linear import RowParallelLinear
from celerytp.layers.packed_linear import float_linear
from celerytp.layers.partition import HeadShard, split_linear_heads
from celerytp.layers.quantized import QuantizedWeight
from celerytp.layers.recurrent_state import RecurrentState
from celerytp.layers.weights import check_shape, copy_into, empty_param
from celerytp.loading.checkpoint import TensorSource
from celerytp.quant.formats import QuantPlan

Piece = tuple[int, int, int]  # (checkpoint row start, rows, local row start)

# Checkpoint projections packed into our one `in_proj`, by checkpoint layout (vLLM style).
FUSED_PROJECTIONS = ("in_proj_qkvz", "in_proj_ba")  # Qwen3-Next: interleaved per key head
SPLIT_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # Qwen3.5


@dataclass(frozen=True)
class GatedDeltaNetDims:
    """Full (unsplit) sizes of one Gated DeltaNet layer.

    Args:
        fused_proj: the checkpoint has in_proj_qkvz / in_proj_ba (else in_proj_qkv/z/b/a).
        chunk_size: block length of the chunked delta rule (prefill).
    """

    hidden_size: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float
    fused_proj: bool
    chunk_size: int = 64


class LocalLayout:
    """Where this rank's rows of every checkpoint tensor go in its packed parameters.

    Local `in_proj` rows: [Q | K | V | Z | B | A]; local conv channels: [Q | K | V], each
    region holding this rank's heads only (regions have different widths).
    """

    def __init__(self, dims: GatedDeltaNetDims, heads: HeadShard) -> None:
        hk, hv = dims.key_head_dim, dims.value_head_dim
        self.heads = heads
        self.key_dim = heads.kv_count * hk  # local
        self.value_dim = heads.q_count * hv  # local
        self.num_v = heads.q_count
        self.conv_dim = 2 * self.key_dim + self.value_dim
        kd, vd, nv = self.key_dim, self.value_dim, self.num_v
        self.offsets = {"q": 0, "k": kd, "v": 2 * kd, "z": 2 * kd + vd, "b": 2 * kd + 2 * vd, "a": 2 * kd + 2 * vd + nv}
        self.proj_size = 2 * kd + 2 * vd + 2 * nv
        full_k, full_v = dims.num_key_heads * hk, dims.num_value_heads * hv
        ks, vs = heads.kv_start * hk, heads.q_start * hv
        self.conv_pieces = [(ks, kd, 0), (full_k + ks, kd, kd), (2 * full_k + vs, vd, 2 * kd)]
        self.conv_total = 2 * full_k + full_v
        self.proj_pieces, self.proj_totals = (self._fused if dims.fused_proj else self._split)(dims)

    def _split(self, dims: GatedDeltaNetDims) -> tuple[dict[str, list[Piece]], dict[str, int]]:
        """Qwen3.5: in_proj_qkv is [Q | K | V] like the conv; z, b, a are per value head."""
        h, o = self.heads, self.offsets
        hv = dims.value_head_dim
        pieces = {
            "in_proj_qkv": self.conv_pieces,
            "in_proj_z": [(h.q_start * hv, self.value_dim, o["z"])],
            "in_proj_b": [(h.q_start, self.num_v, o["b"])],
            "in_proj_a": [(h.q_start, self.num_v, o["a"])],
        }
        nv = dims.num_value_heads
        totals = {"in_proj_qkv": self.conv_total, "in_proj_z": nv * hv, "in_proj_b": nv, "in_proj_a": nv}
        return pieces, totals

    def _fused(self, dims: GatedDeltaNetDims) -> tuple[dict[str, list[Piece]], dict[str, int]]:
        """Qwen3-Next: per key head g, qkvz rows are [q | k | v (r heads) | z (r heads)] and ba
        rows [b (r) | a (r)], r = value heads per key head."""
        h, o = self.heads, self.offsets
        hk, hv = dims.key_head_dim, dims.value_head_dim
        r = dims.num_value_heads // dims.num_key_heads
        group = 2 * hk + 2 * r * hv
        qkvz: list[Piece] = []
        ba: list[Piece] = []
        for i, g in enumerate(range(h.kv_start, h.kv_start + h.kv_count)):
            qkvz += [(g * group, hk, o["q"] + i * hk), (g * group + hk, hk, o["k"] + i * hk)]
        for j, head in enumerate(range(h.q_start, h.q_start + h.q_count)):
            g, w = divmod(head, r)
            qkvz += [
                (g * group + 2 * hk + w * hv, hv, o["v"] + j * hv),
                (g * group + 2 * hk + (r + w) * hv, hv, o["z"] + j * hv),
            ]
            ba += [(g * 2 * r + w, 1, o["b"] + j), (g * 2 * r + r + w, 1, o["a"] + j)]
        totals = {"in_proj_qkvz": dims.num_key_heads * group, "in_proj_ba": dims.num_key_heads * 2 * r}
        return {"in_proj_qkvz": merge_pieces(qkvz), "in_proj_ba": merge_pieces(ba)}, totals


def merge_pieces(pieces: list[Piece]) -> list[Piece]:
    """Join pieces contiguous in both the checkpoint and the local rows (fewer, larger reads)."""
    merged: list[Piece] = []
    for src, n, dst in sorted(pieces, key=lambda p: p[2]):
        if merged and merged[-1][0] + merged[-1][1] == src and merged[-1][2] + merged[-1][1] == dst:
            merged[-1] = (merged[-1][0], merged[-1][1] + n, merged[-1][2])
        else:
            merged.append((src, n, dst))
    return merged


def load_pieces(param: torch.Tensor, source: TensorSource, pieces: list[Piece], full_shape: tuple[int, ...]) -> None:
    """Copy the listed row ranges of `source` into rows of `param` (rows are dim 0)."""
    check_shape(source, full_shape)
    for src, n, dst in pieces:
        copy_into(param.data[dst : dst + n], source.read(rows=(src, src + n)), source.name)



class WeightHolder(nn.Module):
    """A parameter with its own loader, under a module name the checkpoint uses."""

    def __init__(self, weight: nn.Parameter, loader: Callable[..., None]) -> None:
        super().__init__()
        self.weight = weight
        self.weight.weight_loader = loader


class GatedDeltaNet(nn.Module):
    """One linear-attention token mixer: packed input projection, causal depthwise conv over
    [Q | K | V], gated delta rule, gated RMSNorm, row-parallel out_proj.

    Args:
        dims: full sizes; tp: this rank; the split comes from split_linear_heads.
        rows: sequences whose state is kept (cache rows).
    """

    def __init__(
        self,
        dims: GatedDeltaNetDims,
        tp: TPContext,
        rows: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        heads = split_linear_heads(tp.rank, tp.world_size, dims.num_value_heads, dims.num_key_heads)
        self.dims = dims
        self.layout = layout = LocalLayout(dims, heads)
        self.num_k, self.num_v = heads.kv_count, heads.q_count  # local
        self.hk, self.hv = dims.key_head_dim, dims.value_head_dim
        self.chunk_size = dims.chunk_size
        # prefill as decode computes it (module docstring)
        self.stepwise = switch(INVARIANT_ENV) == "1" and switch(RECURRENT_PREFILL_ENV) == "steps"
        common = {"dtype": dtype, "device": device}
        # Submodules named as the checkpoint's, so parameters read `in_proj.weight`, `conv1d.weight`.
        # quant: the projections (in_proj, out_proj) are kept quantized; conv1d, A_log, dt_bias and
        # the norm are a few thousand numbers that stay float.
        shape = (0,) if quant else (layout.proj_size, dims.hidden_size)
        self.in_proj = WeightHolder(empty_param(*shape, **common), self._load_in_proj)
        self.in_proj.qweight = QuantizedWeight(quant, layout.proj_size, dims.hidden_size, **common) if quant else None
        self.conv1d = WeightHolder(empty_param(layout.conv_dim, 1, dims.conv_kernel, **common), self._load_conv)
        self.A_log = empty_param(self.num_v, **common)
        self.A_log.weight_loader = self._load_per_head
        self.dt_bias = empty_param(self.num_v, **common)
        self.dt_bias.weight_loader = self._load_per_head
        self.norm = GatedRMSNorm(dims.value_head_dim, dims.eps, **common)
        self.out_proj = RowParallelLinear(
            dims.num_value_heads * self.hv, dims.hidden_size, (heads.q_start * self.hv, layout.value_dim), tp,
            bias=False, quant=quant, **common,
        )  # fmt: skip
        self.state = RecurrentState(rows, layout.conv_dim, dims.conv_kernel - 1, self.num_v, self.hk, self.hv, **common)
        self.split_sizes = [layout.conv_dim, layout.value_dim, self.num_v, self.num_v]

    # ---- loading (checkpoint names: see FUSED_PROJECTIONS / SPLIT_PROJECTIONS) -------------

    def _load_in_proj(self, param: torch.Tensor, source: TensorSource, shard_id: str | None) -> None:
        pieces = self.layout.proj_pieces.get(shard_id or "")
        if pieces is None:
            known = list(self.layout.proj_pieces)
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{source.name}: no projection {shard_id!r} in {known}")
        full = (self.layout.proj_totals[shard_id], self.dims.hidden_size)
        if self.in_proj.qweight is None:
            return load_pieces(param, source, pieces, full)
        check_shape(source, full)
        for src, n, dst in pieces:
            self.in_proj.qweight.load(source, dst, rows=(src, src + n))

    def _load_conv(self, param: torch.Tensor, source: TensorSource, shard_id: str | None = None) -> None:
        load_pieces(param, source, self.layout.conv_pieces, (self.layout.conv_total, 1, self.dims.conv_kernel))

    def _load_per_head(self, param: torch.Tensor, source: TensorSource, shard_id: str | None = None) -> None:
        load_pieces(param, source, [(self.layout.heads.q_start, self.num_v, 0)], (self.dims.num_value_heads,))

    # ---- forward ---------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        B, T, _ = x.shape
        if slots.first_row is None:
            raise ValueError("Gated DeltaNet runs consecutive cache rows (its state is updated in place)")
        rows = slice(slots.first_row, slots.first_row + B)
        conv_state, ssm_state = self.state.conv[rows], self.state.ssm[rows]  # views of these rows' state
        qw = self.in_proj.qweight
        qkv, z, b, a = (float_linear(x, self.in_proj.weight, None) if qw is None else qw(x)).split(self.split_sizes, dim=-1)
        if self.stepwise and T > 1:  # each token as its decode step convolves it
            qkv = torch.cat([causal_conv(qkv[:, t : t + 1], self.conv1d.weight, conv_state) for t in range(T)], 1)
        else:
            qkv = causal_conv(qkv, self.conv1d.weight, conv_state, slots.active)  # (B, T, conv_dim)
        q, k, v = qkv.split([self.layout.key_dim, self.layout.key_dim, self.layout.value_dim], dim=-1)
        beta = lanewise(torch.sigmoid, b.float())  # (B, T, nv)
        g = -self.A_log.float().exp() * lanewise(F.softplus, a.float() + self.dt_bias.float())  # (B, T, nv), log decay
        if slots.active is not None:  # passenger rows: no decay (g = 0) and no write (beta = 0) leave S as it was
            keep = slots.active[:, None, None]
            beta, g = beta * keep, g * keep
        core = gated_delta_rule(
            q.view(B, T, self.num_k, self.hk),
            k.view(B, T, self.num_k, self.hk),
            v.view(B, T, self.num_v, self.hv),
            g,
            beta,
            ssm_state,
            None if self.stepwise else self.chunk_size,
        )  # (B, T, nv, hv) float32
        y = self.norm(core.to(x.dtype), z.view(B, T, self.num_v, self.hv))
        return self.out_proj(y.reshape(B, T, self.layout.value_dim))  # all-reduced over ranks


def causal_conv(
    x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, active: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal conv + SiLU of x (B, T, C) continuing from `state` (B, C, K-1), which
    is updated in place to the last K-1 inputs (of `active` rows only, when given)."""
    T, window = x.shape[1], state.shape[-1]
    full = torch.cat([state, x.transpose(1, 2).to(state.dtype)], dim=-1)  # (B, C, K-1+T)
    latest = full[..., full.shape[-1] - window :]
    state.copy_(latest if active is None else torch.where(active[:, None, None], latest, state))
    if T == 1:
        out = (full * weight[:, 0]).sum(-1, keepdim=True)  # (B, C, 1)
    else:
        out = F.conv1d(full, weight, groups=weight.shape[0])  # (B, C, T)
    return lanewise(F.silu, out).transpose(1, 2)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * lanewise(torch.rsqrt, (x * x).sum(-1, keepdim=True) + eps)


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int | None,
) -> torch.Tensor:
    """The gated delta rule over T steps from `state` (B, H, dk, dv), updated in place: in
    chunks of `chunk_size`, or (None) one recurrent step per token, as decode runs it.

    q, k (B, T, Hk, dk); v (B, T, H, dv); g (log decay) and beta (B, T, H). Each key head
    serves H / Hk consecutive value heads. Returns (B, T, H, dv) in float32.
    """
    rep = v.shape[2] // q.shape[2]
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2).float() for t in (q, k, v))  # (B, H, T, d)
    g, beta = g.transpose(1, 2).float(), beta.transpose(1, 2).float()  # (B, H, T)
    if q.shape[2] == 1 or chunk_size is None:
        out = torch.stack([_recurrent_step(q[:, :, t], k[:, :, t], v[:, :, t], g[:, :, t], beta[:, :, t], state)
                           for t in range(q.shape[2])], 2)
    else:
        out = _chunked(q, k, v, g, beta, state, chunk_size)
    return out.transpose(1, 2)  # (B, T, H, dv)


def _recurrent_step(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> torch.Tensor:
    """One token: S <- S exp(g); S <- S + k (beta (v - k^T S))^T; out = q^T S. q, k (B, H, dk)."""
    state.mul_(lanewise(torch.exp, g)[..., None, None])
    kv_mem = (k.unsqueeze(-2) @ state).squeeze(-2)  # (B, H, dv)
    delta = (v - kv_mem) * beta.unsqueeze(-1)
    state.add_(k.unsqueeze(-1) * delta.unsqueeze(-2))
    return (q.unsqueeze(-2) @ state).squeeze(-2)  # (B, H, dv)


def _chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """Chunks of `chunk` tokens: within a chunk the delta-rule updates are condensed into
    triangular solves (UT transform); chunks are then scanned in order. q, k, v (B, H, T, d)."""
    B, H, T, dv = v.shape
    pad = (-T) % chunk  # padded steps have g = 0 and beta = 0: they leave the state alone
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (t.reshape(B, H, n, chunk, -1) for t in (q, k, v))  # (B, H, n, C, d)
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    cum = g.cumsum(-1)  # (B, H, n, C): log decay from chunk start to each step
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # (B, H, n, C, C)
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)  # (B, H, n, C, dv)
    w = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (B, H, n, 1, 1)
    s = state
    out = torch.empty_like(u)
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ s  # (B, H, C, dv)
        out[:, :, i] = q[:, :, i] @ s + intra[:, :, i] @ v_new
        s = s * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(B, H, n * chunk, dv)[:, :, :T]
