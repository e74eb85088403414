"""Vocab-parallel token embedding and LM head: each rank holds one contiguous slice of the vocabulary.

The embedding and the LM head are the largest matrices of a small model (SmolLM2: 49152 x 576,
108 MiB in float32) and every token reads the LM head whole. Splitting the vocabulary divides
both the memory and that read by the world size, for two small collectives per forward: the
embedding looks up the ids it owns, zeroes the others and all-reduces (exact: one term per
position is non-zero); the LM head computes its slice of the logits and all-gathers them, so
every rank returns the same full logits as before. Tied weights stay one tensor per rank:
the LM head shares the embedding's slice. A quantized load keeps the embedding quantized too
(quant/plan.py `embedding_plan`): a lookup dequantizes only its rows, and a tied LM head runs on the same
tensor through the quantized kernel. An untied LM head is kept like the linears.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.distributed.tp import TPContext
from celerytp.layers.packed_linear import float_linear
from celerytp.layers.partition import split_units
from celerytp.layers.quantized import QuantizedWeight
from celerytp.layers.weights import check_shape, copy_into, empty_param
from celerytp.loading.checkpoint import TensorSource
from celerytp.quant.formats import QuantPlan


def vocab_shards(tp: TPContext, vocab_size: int) -> list[tuple[int, int]]:
    """(start, count) of every rank's vocabulary slice (uneven: the first ranks get one more)."""
    shards = [split_units(r, tp.world_size, vocab_size) for r in range(tp.world_size)]
    if any(count == 0 for _, count in shards):
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"vocab size {vocab_size} cannot be split over {tp.world_size} ranks"
        )
    return shards


class VocabSlice(nn.Module):
    """This rank's contiguous vocabulary slice of a (vocab_size, hidden_size) matrix, float or
    kept quantized (`quant`), read from the checkpoint rows it owns.

    Args:
        vocab_size, hidden_size: the full matrix's shape.
        tp: the rank's tensor-parallel context.
        quant: keep the slice quantized as this plan says.
        allocate: False when the slice is another module's (a tied LM head sets it itself).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TPContext,
        *,
        dtype: torch.dtype,
        device: torch.device,
        quant: QuantPlan | None = None,
        allocate: bool = True,
    ):
        super().__init__()
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp
        self.shards = vocab_shards(tp, vocab_size)
        self.start, self.count = self.shards[tp.rank]
        self.qweight = None
        if not allocate:
            return
        sharded = tp.world_size > 1
        if quant is not None:
            self.qweight = QuantizedWeight(quant, self.count, hidden_size, dtype=dtype, device=device, sharded=sharded)
        self.weight = empty_param(0 if quant else self.count, hidden_size, dtype=dtype, device=device, sharded=sharded)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, source: TensorSource, shard_id: str | None = None) -> None:
        check_shape(source, (self.vocab_size, self.hidden_size))
        rows = (self.start, self.start + self.count)
        if self.qweight is not None:
            return self.qweight.load(source, 0, rows=rows)
        copy_into(param.data, source.read(rows=rows), source.name)


class VocabParallelEmbedding(VocabSlice):
    """The token embedding, rows split by vocabulary over the ranks (a VocabSlice; a quantized
    one, see quant/plan.py `embedding_plan`, dequantizes only the rows it looks up)."""

    def lookup(self, local_ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight.lookup(local_ids)
        return F.embedding(local_ids, self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self.lookup(ids)
        local = ids - self.start
        outside = (local < 0) | (local >= self.count)  # ids another rank owns
        h = self.lookup(local.masked_fill(outside, 0))  # (B, T, D)
        return self.tp.all_reduce(h.masked_fill(outside[..., None], 0.0))


class ParallelLMHead(VocabSlice):
    """logits = x W^T with W's rows (the vocabulary) split over ranks, gathered whole on every rank.

    Args:
        hidden_size, vocab_size: the full matrix's shape (vocab_size, hidden_size).
        tp: the rank's tensor-parallel context.
        tied: share this embedding's slice (float or quantized) instead of holding a weight.
        quant: keep an untied weight's slice quantized (a tied one is the embedding's).
    """

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        tp: TPContext,
        *,
        dtype: torch.dtype,
        device: torch.device,
        tied: VocabParallelEmbedding | None = None,
        quant: QuantPlan | None = None,
    ) -> None:
        super().__init__(vocab_size, hidden_size, tp, dtype=dtype, device=device, quant=quant, allocate=tied is None)
        self.register_buffer("onednn_weight", None, persistent=False)  # in oneDNN's layout: packed_linear.py
        if tied is not None:  # the embedding's slice, in whatever form it is kept
            self.weight, self.qweight = tied.weight, tied.qweight

    def forward(self, x: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """The logits (..., V) on every rank; only this rank's slice (..., V_local) when not `gather`."""
        if self.qweight is not None:
            local = self.qweight(x)  # (..., V_local)
        else:
            local = float_linear(x, self.weight, self.onednn_weight)
        if not gather:
            return local
        return self.tp.gather_last_dim(local, [count for _, count in self.shards])  # (..., V)

    def top_candidates(
        self, local: torch.Tensor, k: int, extra: torch.Tensor | None = None, lse: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Each row's k largest logits over the whole vocabulary, from every rank's slice, on every rank.

        local: (S, V_local) float32, this rank's slice (`forward(..., gather=False)`). Returns
        (values, ids) (S, k), largest first (for k = 1 the lowest id of equal maxima, as argmax picks;
        which of several equal logits make the k-th place is unspecified, as in torch.topk), each
        row's log-sum-exp over the whole vocabulary (S,), for log-probabilities, and every rank's
        `extra` (S, E) floats as (S, N, E), sent in the same collective. Every rank sends
        (S, 2k + 1 + E) floats instead of its (S, V_local) slice: the global top k is among the
        ranks' own top k. Ids travel as float32, exact below 2**24. `lse=False` (no row asks for
        log-probabilities; every rank must pass the same): None instead of the log-sum-exp, whose
        exp over the slice is the costliest part on CPU.
        """
        k = min(k, min(count for _, count in self.shards))
        if k == 1:  # greedy: the first maximum, as a full argmax would pick
            top, at = first_max(local)
        else:
            top, at = local.topk(k, dim=-1)
        extra = local.new_zeros(len(local), 0) if extra is None else extra.to(local)
        sums = torch.logsumexp(local, -1, keepdim=True) if lse else local.new_zeros(len(local), 1)
        packed = torch.cat([top, (at + self.start).float(), sums, extra], -1)
        width = packed.shape[1]
        parts = self.tp.gather_last_dim(packed, [width] * self.tp.world_size).view(len(local), -1, width)  # (S, N, w)
        values, ids = parts[..., :k].flatten(1), parts[..., k : 2 * k].flatten(1)  # (S, N * k)
        by_id = ids.argsort(-1)  # then a stable sort by value: equal values keep the lower id first
        order = by_id.gather(1, values.gather(1, by_id).argsort(dim=-1, descending=True, stable=True))[:, :k]
        total = torch.logsumexp(parts[..., 2 * k], -1) if lse else None
        return values.gather(1, order), ids.gather(1, order).long(), total, parts[..., 2 * k + 1 :] if extra.shape[1] else None


ARGMAX_BLOCK = 128


def first_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and the lowest index holding it, (S, 1) each, as `x.max(-1, keepdim=True)`
    gives them. Blocked: a max that also tracks its index does not vectorize on CPU (16 x 49,152
    logits: 690 µs against 90 µs here); the plain block maxima do, and only the first block that
    holds the row's maximum is searched for its index."""
    rows, width = x.shape
    pad = -width % ARGMAX_BLOCK
    blocks = (F.pad(x, (0, pad), value=float("-inf")) if pad else x).view(rows, -1, ARGMAX_BLOCK)
    block_max = blocks.amax(-1)  # (S, blocks)
    block = block_max.argmax(-1, keepdim=True)  # the first block holding the maximum
    inside = blocks.gather(1, block[:, :, None].expand(rows, 1, ARGMAX_BLOCK))[:, 0].argmax(-1, keepdim=True)
    return block_max.gather(1, block), block * ARGMAX_BLOCK + inside
