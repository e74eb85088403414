"""CausalLM: the interface a rank drives (forward with KV cache) and table-driven loading."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.distributed.tp import TPContext
from celerytp.layers.kv_cache import CacheSlots, KVCache
from celerytp.loading.checkpoint import Checkpoint
from celerytp.models.config import ModelConfig
from celerytp.quant.formats import QuantFormat

Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class BuildOptions:
    """Where and how a rank builds its shard of a model.

    Args:
        tp: this rank's tensor-parallel context.
        dtype: compute and storage dtype of weights and KV cache.
        device: where tensors live.
        max_context: positions preallocated in the KV cache.
        max_batch: batch slots in the KV cache.
        mlp_block: the checkpoint's quant block along down_proj's columns (1 if unquantized),
            so MLP shards start on block boundaries.
        quant: keep sharded linears (and an untied lm_head) quantized in this format.
    """

    tp: TPContext
    dtype: torch.dtype
    device: torch.device
    max_context: int
    max_batch: int = 1
    mlp_block: int = 1
    quant: QuantFormat | None = None


class CausalLM(nn.Module):
    """A decoder-only language model shard with its KV cache.

    Subclasses build `self.model` (embed_tokens, layers, norm, rotary_emb) and
    `self.lm_head`, named as in the Hugging Face checkpoint.
    """

    # Checkpoint matrices packed into one of our parameters, in packing order (vLLM style).
    packed_modules_mapping: dict[str, tuple[str, ...]] = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    model: nn.Module
    lm_head: nn.Module

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__()
        self.config = config
        self.options = options
        self.tp = options.tp
        self.max_context = options.max_context
        self.max_batch = options.max_batch
        self.cache_lens = [0] * options.max_batch  # tokens cached per row

    @property
    def device(self) -> torch.device:
        return self.options.device

    @property
    def cache_len(self) -> int:
        """Tokens in row 0's cache (the row step mode uses)."""
        return self.cache_lens[0]

    # ---- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_tokens(
        self, tokens: torch.Tensor, offset: int, *, last_only: bool = False, row: int = 0
    ) -> torch.Tensor:
        """Run tokens (T,) of cache row `row` at positions offset..offset+T-1, appending to its cache.

        Returns float32 logits (T, vocab), or (1, vocab) for the last position when
        `last_only` (saves a (T, vocab) matrix on long prompts).
        """
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
        if not 0 <= row < self.max_batch:
            raise ValueError(f"row {row} is outside the {self.max_batch} cache rows")
        n = tokens.numel()
        if offset != self.cache_lens[row]:
            raise ValueError(f"offset {offset} != cache_len {self.cache_lens[row]}")
        if offset + n > self.max_context:
            raise ValueError(f"offset {offset} + {n} tokens exceeds max_context {self.max_context}")
        ids = tokens.to(device=self.device, dtype=torch.long)[None]  # (1, T)
        h = self.model(ids, CacheSlots.prefill(row, offset, n, self.device))  # (1, T, D)
        if last_only:
            h = h[:, -1:]
        logits = self.lm_head(h)[0].float()  # (T, V)
        self.cache_lens[row] = offset + n
        return logits

    @torch.inference_mode()
    def prefill_rows(self, prompts: list[list[int]], rows: list[int]) -> torch.Tensor:
        """Several rows' prompts in one padded forward from position 0: logits (B, vocab) at each last token."""
        lengths = [len(p) for p in prompts]
        if max(lengths) > self.max_context:
            raise ValueError(f"a prompt of {max(lengths)} tokens exceeds max_context {self.max_context}")
        ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        for b, prompt in enumerate(prompts):
            ids[b, : len(prompt)] = torch.tensor(prompt)
        h = self.model(ids.to(self.device), CacheSlots.prefill_rows(rows, lengths, self.device))  # (B, T, D)
        last = h[torch.arange(len(prompts)), torch.tensor(lengths) - 1]  # (B, D): each row's last real token
        logits = self.lm_head(last).float()  # (B, V)
        for r, n in zip(rows, lengths):
            self.cache_lens[r] = n
        return logits

    @torch.inference_mode()
    def forward_decode(self, tokens: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """One token per cache row, each at that row's next position: (B,) -> float32 logits (B, vocab)."""
        positions = [self.cache_lens[r] for r in rows]
        if max(positions) >= self.max_context:
            raise ValueError(f"a row is at max_context {self.max_context}")
        ids = tokens.to(device=self.device, dtype=torch.long)[:, None]  # (B, 1)
        h = self.model(ids, CacheSlots.decode(rows, positions, self.device))  # (B, 1, D)
        logits = self.lm_head(h[:, 0]).float()  # (B, V)
        for r in rows:
            self.cache_lens[r] += 1
        return logits

    def clear_cache(self, row: int | None = None) -> None:
        """Forget the cached positions of one row, or of all (buffers stay allocated)."""
        for r in range(self.max_batch) if row is None else [row]:
            self.cache_lens[r] = 0

    def kv_caches(self) -> list[KVCache]:
        return [m for m in self.modules() if isinstance(m, KVCache)]

    def memory_report(self) -> dict[str, int]:
        """Bytes of this rank's split weights, replicated weights and KV cache."""
        sharded = replicated = 0
        quantized = [b for b in self.buffers() if hasattr(b, "tp_sharded")]  # QuantizedWeight storage
        for p in [*self.parameters(), *quantized]:  # parameters() yields a tied weight once
            if getattr(p, "tp_sharded", False):
                sharded += p.nbytes
            else:
                replicated += p.nbytes
        kv = sum(c.nbytes for c in self.kv_caches())
        return {"sharded_bytes": sharded, "replicated_bytes": replicated, "kv_cache_bytes": kv}

    # ---- loading -------------------------------------------------------------------------

    def checkpoint_table(self) -> dict[str, tuple[nn.Parameter, str | None]]:
        """Checkpoint tensor name -> (our parameter, shard id within a packed parameter)."""
        table: dict[str, tuple[nn.Parameter, str | None]] = {}
        for name, param in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            prefix, _, module = module_path.rpartition(".")
            for sub in self.packed_modules_mapping.get(module, ()):
                table[f"{prefix}.{sub}.{leaf}"] = (param, sub)
            if module not in self.packed_modules_mapping:
                table[name] = (param, None)
        return table

    def is_ignorable(self, name: str) -> bool:
        """Checkpoint tensors we may skip: a saved copy of a tied lm_head, rotary buffers."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return True
        return name.endswith("rotary_emb.inv_freq")

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        """Copy each checkpoint tensor we know into its parameter; return the names loaded.

        Checks names first, so a wrong checkpoint fails before any data is read.
        """
        table = self.checkpoint_table()
        names = checkpoint.names()
        check_names(set(table), names, self.is_ignorable)
        loaded: set[str] = set()
        for i, name in enumerate(names, 1):
            if name in table:
                param, shard_id = table[name]
                param.weight_loader(param, checkpoint.source(name), shard_id)
                loaded.add(name)
            if progress is not None:
                progress(i, len(names), name)
        return loaded


def check_names(expected: set[str], names: list[str], ignorable: Callable[[str], bool]) -> None:
    """Raise CeleryTPError listing checkpoint names we lack and parameters it lacks."""
    present = set(names)
    missing = sorted(expected - present)
    unexpected = sorted(n for n in present - expected if not ignorable(n))
    if missing or unexpected:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"missing: {_short(missing)}; unexpected: {_short(unexpected)}")


def _short(names: list[str], limit: int = 8) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return "[" + ", ".join(names[:limit]) + "]" + more
