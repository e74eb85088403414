"""Preallocated per-layer key/value cache for this rank's KV heads, one row per sequence."""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import torch
from torch import nn

from celerytp.layers.host_transfer import to_device


@dataclass(frozen=True)
class CacheSlots:
    """Where a forward's tokens sit in the cache, and which cached keys each query sees.

    Args:
        rows: (B,) cache row of each batch row.
        positions: (B, T) absolute position of each token (what rotary sees).
        length: keys 0..length-1 of each row take part in attention.
        mask: bool, broadcastable to (B, heads, T, length); None = every key 0..length-1.
        first_row: set when rows are first_row..first_row+B-1 (views instead of gathers).
        writes: (B,) cache position each decode token is stored at (a scratch position for
            inactive rows); None for prefill.
        active: (B,) bool, decode rows that carry a real token; None = all.
        start: the first position of a prefill's tokens, the same for every row (None for decode),
            known on the host so that no layer reads it back from the device.
        rope: (3, B, T) temporal, height and width positions for multimodal rotary (Qwen2.5-VL);
            None: rotary sees `positions`.
    """

    rows: torch.Tensor
    positions: torch.Tensor
    length: int
    mask: torch.Tensor | None
    first_row: int | None
    writes: torch.Tensor | None = None
    active: torch.Tensor | None = None
    start: int | None = None
    rope: torch.Tensor | None = None

    @classmethod
    def prefill(cls, row: int, offset: int, count: int, device: torch.device, keys: int | None = None,
                both_ways: list[tuple[int, int]] = ()) -> CacheSlots:
        """`count` tokens of one row at offset..offset+count-1 (causal within the chunk). `keys`:
        how many cached keys attention reads (default offset + count; more, on the device path,
        for a length from a few buckets: the ones past a query's own position are masked).
        `both_ways`: [start, end) runs of the chunk's tokens that see each other whole (an
        image's tokens, gemma3)."""
        keys = offset + count if keys is None else keys
        positions = torch.arange(offset, offset + count, device=device)[None]  # (1, T)
        mask = None
        if count > 1 or keys > offset + count:  # query i sees cached keys and its own prefix: key j <= offset + i
            mask = torch.ones(count, keys, dtype=torch.bool, device=device).tril(diagonal=offset)
            for start, end in both_ways:
                mask[start:end, offset + start : offset + end] = True
        rows = torch.arange(row, row + 1, device=device)
        return cls(rows, positions, keys, mask, row, start=offset)

    @classmethod
    def prefill_rows(cls, rows: list[int], lengths: list[int], device: torch.device, width: int | None = None) -> CacheSlots:
        """Several rows' prompts from position 0, padded to the longest (or to `width`): keys past
        a row's length are hidden."""
        T = max(lengths) if width is None else width
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # (T, T)
        on_device = to_device([lengths, rows], device)  # (2, B): one copy
        real = torch.arange(T, device=device)[None] < on_device[0][:, None]  # (B, T)
        mask = (causal[None] & real[:, None, :])[:, None]  # (B, 1, T, T)
        positions = torch.arange(T, device=device)[None].expand(len(rows), T)
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        return cls(on_device[1], positions, T, mask, rows[0] if contiguous else None, start=0)

    @classmethod
    def decode(
        cls, positions: list[int], active: list[bool], scratch: int, device: torch.device, bucketed: bool = False,
        masked: bool = False,
    ) -> CacheSlots:
        """One token for each of rows 0..R-1 at its own position; inactive rows are passengers.

        The batch has a fixed shape (a view of the first R cache rows, never a gather). An
        inactive row's token goes to the `scratch` position, past every real one, and it
        attends to key 0 only, so it disturbs no row and produces no NaN. `bucketed`: the keys
        read run to the next power of two (at least 16), the ones past a row's position masked,
        and the mask and `active` are always given, so a step's shapes change only at bucket
        boundaries (CUDA graphs record one graph per shape: models/compiled.py). `masked`: the
        mask is given even when every row attends to all the keys read (one compiled graph for both).
        """
        live = [p for p, a in zip(positions, active) if a]
        length = max(live) + 1 if live else 1
        ragged = masked or len(live) < len(positions) or min(live) != length - 1
        if bucketed:
            length, ragged = keys_bucket(length, scratch + 1), True
        pos, on = to_device([positions, active], device)  # (R,) each: one copy
        on = on.bool()
        mask = None
        if ragged:
            keys = torch.arange(length, device=device)[None]  # (1, L)
            mask = torch.where(on[:, None], keys <= pos[:, None], keys == 0)[:, None, None]  # (R, 1, 1, L)
        return cls(
            rows=torch.arange(len(positions), device=device),
            positions=torch.where(on, pos, 0)[:, None],  # (R, 1)
            length=length,
            mask=mask,
            first_row=0,
            writes=torch.where(on, pos, scratch),
            active=None if len(live) == len(positions) and not bucketed else on,
        )

    def window_mask(self, window: int) -> torch.Tensor:
        """This forward's mask with keys `window` or more positions behind their query hidden too
        (transformers' sliding window: key j is seen from position p when p - window < j <= p)."""
        keys = torch.arange(self.length, device=self.positions.device)  # (L,)
        recent = (keys[None, None] > self.positions[:, :, None] - window)[:, None]  # (B, 1, T, L)
        return recent if self.mask is None else recent & self.mask


def bucket(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << (n - 1).bit_length()


def keys_bucket(n: int, limit: int) -> int:
    """How many keys a step reads on the device path to attend to `n`: the next power of two
    from 16, at most `limit` (what the cache holds)."""
    return min(bucket(max(n, 16)), limit)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros whose CPU pages are only touched when written (an anonymous mapping), so a cache
    sized for many rows and long contexts costs resident memory only for what is used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVCache(nn.Module):
    """Keys and values of positions 0..max_context-1 for `rows` sequences, plus one scratch
    position per row where decode steps of inactive rows write.

    Args:
        rows: cache rows (sequences decoded together, and step mode's own row).
        num_kv_heads: this rank's KV heads.
        max_context: positions preallocated.
        head_dim: per-head size.
        dtype: what the cache stores (bfloat16/float16 halve a float32 model's cache).
    """

    def __init__(
        self,
        rows: int,
        num_kv_heads: int,
        max_context: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.register_buffer("k", torch.empty(rows, num_kv_heads, 0, head_dim, dtype=dtype, device=device),
                             persistent=False)
        self.register_buffer("v", torch.empty_like(self.k), persistent=False)
        self.resize(max_context)

    def resize(self, max_context: int) -> None:
        """Positions 0..max_context-1 and the scratch one, empty (what held before is freed first)."""
        rows, heads, _, head_dim = self.k.shape
        dtype, device = self.k.dtype, self.k.device
        self.k = self.v = torch.empty(0, dtype=dtype, device=device)
        self.scratch = max_context
        self.k = lazy_zeros((rows, heads, max_context + 1, head_dim), dtype, device)
        self.v = lazy_zeros((rows, heads, max_context + 1, head_dim), dtype, device)

    def update(self, slots: CacheSlots, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, nkv, T, hd) at `slots`; return each row's keys/values 0..length-1 in
        k's dtype (a cache kept in another dtype is converted on the way in and out)."""
        T, compute = k.shape[2], k.dtype
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)
        if T == 1:
            pos = slots.writes if slots.writes is not None else slots.positions[:, 0]  # (B,)
            self.k[slots.rows, :, pos] = k[:, :, 0]  # (B, nkv, hd)
            self.v[slots.rows, :, pos] = v[:, :, 0]
        else:  # prefill: every row at the same consecutive positions
            start = slots.start
            rows = slots.rows if slots.first_row is None else slice(slots.first_row, slots.first_row + k.shape[0])
            self.k[rows, :, start : start + T] = k
            self.v[rows, :, start : start + T] = v
        if slots.first_row is not None:
            rows = slice(slots.first_row, slots.first_row + k.shape[0])
            keys, values = self.k[rows, :, : slots.length], self.v[rows, :, : slots.length]  # (B, nkv, L, hd) views
        else:
            keys, values = self.k[slots.rows, :, : slots.length], self.v[slots.rows, :, : slots.length]  # gathered
        return keys.to(compute), values.to(compute)

    @torch.inference_mode()
    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Give row `dst` the first `length` positions of row `src`, bit for bit."""
        self.k[dst, :, :length] = self.k[src, :, :length]
        self.v[dst, :, :length] = self.v[src, :, :length]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes
