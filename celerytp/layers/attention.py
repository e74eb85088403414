"""The attention core every architecture shares: GQA over this rank's whole KV groups, rotary,
optional per-head q/k norms, output gate and sliding window, and a preallocated KV cache.

What differs between architectures is data (AttentionSpec), not code: llama is the plain case;
qwen3 adds per-head norms; Qwen3-Next norms them zero-centred, rotates part of each head and
gates the output; qwen2 has q/k/v biases without an o_proj bias; mistral and gemma3 limit some
layers to a sliding window (masked; the cache keeps every position, so prefix reuse is unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from celerytp.distributed.tp import TPContext
from celerytp.layers.invariant_attention import attention, attention_kind
from celerytp.layers.kv_cache import CacheSlots, KVCache
from celerytp.layers.linear import ColumnParallelLinear, OutputShard, RowParallelLinear
from celerytp.layers.partition import split_heads
from celerytp.layers.rotary import apply_rotary
from celerytp.quant.formats import QuantPlan


@dataclass(frozen=True)
class AttentionSpec:
    """One architecture's attention block.

    Args:
        num_heads, num_kv_heads, head_dim: the whole model's heads (each rank takes whole KV groups).
        qkv_bias, o_bias: q/k/v and o_proj carry biases.
        rotary_dim: leading dims of each head that rotate (None: all of them).
        qk_norm: class of the per-head norm on queries and keys (None: no norm).
        norm_eps: that norm's epsilon.
        output_gate: q_proj rows are [query | gate] per head and sigmoid(gate) scales the output.
        scaling: the softmax scale (None: head_dim ** -0.5).
        sliding_window: keys more than this many positions back are not attended (None: all).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    rotary_dim: int | None = None
    qk_norm: type[nn.Module] | None = None
    norm_eps: float = 1e-6
    output_gate: bool = False
    scaling: float | None = None
    sliding_window: int | None = None


class Attention(nn.Module):
    """Self-attention over this rank's heads; o_proj all-reduces, so the output is whole.

    Args:
        spec: the architecture's attention.
        tp: this rank's tensor-parallel context.
        cache_rows, max_context: the KV cache's rows and positions.
        kv_dtype: the cache's storage dtype.
    """

    def __init__(
        self,
        spec: AttentionSpec,
        tp: TPContext,
        *,
        cache_rows: int,
        max_context: int,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        hd = spec.head_dim
        heads = split_heads(tp.rank, tp.world_size, spec.num_heads, spec.num_kv_heads)
        self.heads = heads
        self.num_heads, self.num_kv_heads, self.head_dim = heads.q_count, heads.kv_count, hd  # local
        self.rotary_dim = spec.rotary_dim or hd
        self.scaling = spec.scaling if spec.scaling is not None else hd**-0.5
        self.sliding_window = spec.sliding_window
        self.output_gate = spec.output_gate
        common = {"dtype": dtype, "device": device}
        q_width = 2 * hd if spec.output_gate else hd  # a gated query row carries its gate beside it
        kv = OutputShard(spec.num_kv_heads * hd, heads.kv_start * hd, heads.kv_count * hd)
        shards = {
            "q_proj": OutputShard(spec.num_heads * q_width, heads.q_start * q_width, heads.q_count * q_width),
            "k_proj": kv,
            "v_proj": kv,
        }
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, shards, bias=spec.qkv_bias, quant=quant, **common)
        self.split_sizes = [s.size for s in shards.values()]
        self.o_proj = RowParallelLinear(
            spec.num_heads * hd, spec.hidden_size, (heads.q_start * hd, heads.q_count * hd), tp,
            bias=spec.o_bias, quant=quant, **common,
        )  # fmt: skip
        if spec.qk_norm is not None:
            # Norms act on one head_dim vector, so they are identical on every rank.
            self.q_norm = spec.qk_norm(hd, spec.norm_eps, **common)
            self.k_norm = spec.qk_norm(hd, spec.norm_eps, **common)
        self.attention_kind = attention_kind(device)  # batch-invariant kernel or SDPA
        self.kv_cache = KVCache(cache_rows, self.num_kv_heads, max_context, hd, dtype=kv_dtype, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)  # (B, T, nh, hd) each
        q = q.reshape(B, T, self.num_heads, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, nkv, hd)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q = self._rotate(q.transpose(1, 2), cos, sin)  # (B, nh, T, hd)
        k = self._rotate(k.transpose(1, 2), cos, sin)  # (B, nkv, T, hd)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        k, v = self.kv_cache.update(slots, k, v)  # (B, nkv, L, hd)
        mask = slots.mask if self.sliding_window is None else slots.window_mask(self.sliding_window)
        y = attention(q, k, v, mask, self.scaling, self.attention_kind)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        if gate is not None:
            y = y * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(y)  # all-reduced over ranks

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Partial rotary: only the first rotary_dim dims of each head turn."""
        if self.rotary_dim == self.head_dim:
            return apply_rotary(x, cos, sin)
        return torch.cat((apply_rotary(x[..., : self.rotary_dim], cos, sin), x[..., self.rotary_dim :]), dim=-1)
