"""CausalLM: the interface a rank drives (forward with KV cache) and table-driven loading."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.switches import INVARIANT_ENV, switch
from celerytp.core.vision_inputs import VisionInputs, runs
from celerytp.distributed.tp import TPContext
from celerytp.layers import packed_linear
from celerytp.layers.host_transfer import takes_device_path, to_device
from celerytp.layers.kv_cache import CacheSlots, KVCache, bucket, keys_bucket
from celerytp.layers.moe import RoutedExperts
from celerytp.layers.rotary import RotaryEmbedding
from celerytp.loading.checkpoint import Checkpoint
from celerytp.models.config import ModelConfig
from celerytp.quant.formats import QuantPlan

Progress = Callable[[int, int, str], None]
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildOptions:
    """Where and how a rank builds its shard of a model.

    Args:
        tp: this rank's tensor-parallel context.
        dtype: compute and storage dtype of float weights.
        kv_dtype: storage dtype of the KV cache (attention reads it back in `dtype`).
        device: where tensors live.
        max_context: positions preallocated in the KV cache.
        max_batch: sequences served at once (KV cache rows; one more row is step mode's).
        mlp_block: the checkpoint's quant block along down_proj's columns (1 if unquantized),
            so MLP shards start on block boundaries.
        quant: keep sharded linears (and an untied lm_head) quantized as this plan says.
        embedding_quant: keep the embedding (and a tied lm_head) quantized as this plan says.
    """

    tp: TPContext
    dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_context: int
    max_batch: int = 1
    mlp_block: int = 1
    quant: QuantPlan | None = None
    embedding_quant: QuantPlan | None = None


class CausalLM(nn.Module):
    """A decoder-only language model shard with its KV cache.

    Subclasses build `self.model` (embed_tokens, layers, norm, rotary tables) and
    `self.lm_head`, named as in the Hugging Face checkpoint.
    """

    # Several rows' prompts can share one padded prefill (recurrent state cannot: padding would enter it).
    batched_prefill = True
    # A vision-language model's image token and places per image (core/vision_inputs.py); None: text only.
    vision: VisionInputs | None = None
    # Checkpoint matrices packed into one of our parameters, in packing order (vLLM style).
    quant: str | None = None  # the format load_model kept the linears in ("gguf": each tensor's own type)
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
        self.step_row = options.max_batch  # step mode's own row, beside the served rows
        self.cache_lens = [0] * cache_rows(options)  # tokens cached per row
        # Multimodal rotary (Qwen2.5-VL): what each row's rotary position runs ahead of (or behind)
        # its cache position once its images are in (`set_rope_delta`); 0 for text.
        self.mrope = getattr(config, "mrope_section", None) is not None
        self.rope_deltas = [0] * cache_rows(options)
        # Decode pads the batch width and the keys read to powers of two (CacheSlots.decode), so
        # its shapes come from a small set: on the device path, where each new shape costs (a
        # CUDA graph to record, a cuDNN attention plan to build), eager or compiled.
        self.decode_buckets = takes_device_path(options.device)
        # and prefill pads its chunk and the keys it reads so too (not where padding would enter
        # a recurrent state: hybrid models prefill one row as it comes)
        self.prefill_buckets = takes_device_path(options.device) and self.batched_prefill
        # (batch width, keys read) of every bucketed decode step so far: on CUDA a shape first met
        # records a CUDA graph (logged, and counted in the serving loop's stats)
        self.decode_shapes: set[tuple[int, int]] = set()
        # Decode always gives attention a mask (CacheSlots.decode), even when no row is ragged:
        # set by compiled decode, whose graph would otherwise differ with and without one.
        self.decode_masked = False

    @property
    def device(self) -> torch.device:
        return self.options.device

    @property
    def attention(self) -> str:
        """What its attention layers run (layers/invariant_attention.py `attention_kind`), for the load reply."""
        return ",".join(sorted({m.attention_kind for m in self.modules() if hasattr(m, "attention_kind")}))

    @property
    def batch_invariant(self) -> bool:
        """Whether a row's logits are the same bits whatever is batched beside it and whether its
        tokens were prefilled or decoded (docs/models.md, "Batch invariance"): every attention
        runs the invariant kernel, float linears run oneDNN (so none is in a compiled decode
        graph, whose matmuls are the compiler's), and no recurrent state is prefilled by another
        algorithm than it is decoded with."""
        compiled_floats = getattr(self.model, "decode_runs", None) and (
            self.quant in (None, "f32", "f16", "bf16")
            or any(getattr(m, "kernel", None) in ("float", "dequant") for m in self.modules()))
        stepwise = all(m.stepwise for m in self.modules() if hasattr(m, "stepwise"))  # recurrent layers
        return (stepwise and self.attention == "invariant" and switch(INVARIANT_ENV) == "1"
                and packed_linear.kernel_works(self.options.dtype, str(self.device)) and not compiled_floats)

    @property
    def cache_len(self) -> int:
        """Tokens in step mode's row."""
        return self.cache_lens[self.step_row]

    # ---- forward -------------------------------------------------------------------------

    @torch.inference_mode()
    def forward_tokens(
        self, tokens: torch.Tensor, offset: int, *, last_only: bool = False, row: int | None = None, gather: bool = True,
        embeds: tuple[list[int], torch.Tensor] | None = None, rope: list[list[int]] | None = None,
    ) -> torch.Tensor:
        """Run tokens (T,) of cache row `row` (default: step mode's) at positions offset..offset+T-1.

        Offset 0 starts the row over. Returns float32 logits (T, vocab), or (1, vocab) for the
        last position when `last_only` (saves a (T, vocab) matrix on long prompts). With
        `gather=False` every method here returns this rank's vocabulary slice of the logits
        (the serving loop reduces the slices itself, layers/vocab_parallel.py `top_candidates`).
        `embeds`: (indices into `tokens`, rows (K, hidden)) that take those tokens' embeddings'
        places (a vision-language model's image features; each image whole in the piece where
        its tokens see each other both ways, `VisionInputs.bidirectional`). `rope`: the tokens'
        (temporal, height, width) rotary positions, 3 lists of T (multimodal rotary); else the
        row's position plus its `rope_deltas`.
        """
        row = self.step_row if row is None else row
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
        if not 0 <= row < len(self.cache_lens):
            raise ValueError(f"row {row} is outside the {len(self.cache_lens)} cache rows")
        n = tokens.numel()
        if offset != self.cache_lens[row]:
            raise ValueError(f"offset {offset} != cache_len {self.cache_lens[row]}")
        if offset + n > self.max_context:
            raise ValueError(f"offset {offset} + {n} tokens exceeds max_context {self.max_context}")
        if offset == 0:
            self.clear_cache(row)
        padded, keys = n, offset + n
        if self.prefill_buckets:  # pad positions hold junk keys past the row's own, masked until overwritten
            padded = min(bucket(n), self.max_context - offset)
            keys = keys_bucket(offset + padded, self.max_context)
            tokens = torch.cat([tokens.long(), tokens.new_zeros(padded - n, dtype=torch.long)])
        ids = to_device(tokens.long(), self.device)[None]  # (1, T)
        both_ways = runs(embeds[0]) if embeds is not None and self.vision.bidirectional else []
        slots = CacheSlots.prefill(row, offset, padded, self.device, keys, both_ways)
        if rope is not None or self.rope_deltas[row]:
            streams = rope or [list(range(offset + self.rope_deltas[row], offset + n + self.rope_deltas[row]))] * 3
            tail = streams[0][-1] + 1
            streams = [[*s, *range(tail, tail + padded - n)] for s in streams]  # padding's junk positions
            slots = replace(slots, rope=to_device(streams, self.device)[:, None])  # (3, 1, T)
        h = self.model(ids, slots) if embeds is None else self.model(ids, slots, embeds)  # (1, T, D)
        h = h[:, n - 1 : n] if last_only else h[:, :n]
        logits = self.lm_head(h, gather=gather)[0].float()  # (T, V)
        self.cache_lens[row] = offset + n
        return logits

    @torch.inference_mode()
    def prefill_rows(self, prompts: list[list[int]], rows: list[int], gather: bool = True) -> torch.Tensor:
        """Several rows' prompts in one padded forward from position 0: logits (B, vocab) at each last token."""
        if not self.batched_prefill:
            raise ValueError(f"{type(self).__name__} prefills one row at a time")
        lengths = [len(p) for p in prompts]
        if max(lengths) > self.max_context:
            raise ValueError(f"a prompt of {max(lengths)} tokens exceeds max_context {self.max_context}")
        width = min(bucket(max(lengths)), self.max_context) if self.prefill_buckets else max(lengths)
        ids = [[*prompt, *[0] * (width - len(prompt))] for prompt in prompts]
        slots = CacheSlots.prefill_rows(rows, lengths, self.device, width)
        h = self.model(to_device(ids, self.device), slots)  # (B, T, D)
        last = h[torch.arange(len(prompts), device=self.device), to_device([n - 1 for n in lengths], self.device)]
        # (B, D): each row's last real token
        logits = self.lm_head(last, gather=gather).float()  # (B, V)
        for r, n in zip(rows, lengths):
            self.cache_lens[r] = n
            self.rope_deltas[r] = 0
        return logits

    @torch.inference_mode()
    def decode(self, tokens: list[int], active: list[bool], gather: bool = True) -> torch.Tensor:
        """One token for each of cache rows 0..R-1 at its next position; only `active` rows count.

        The batch keeps the shape of the first R rows (no copy of any row's cache); inactive
        rows ride along without touching their cache. Returns float32 logits (active rows, vocab).
        """
        if self.decode_buckets:  # free or prefilling rows past R ride along as passengers
            padding = min(bucket(len(tokens)), self.max_batch) - len(tokens)
            tokens, active = [*tokens, *[0] * padding], [*active, *[False] * padding]
        positions = self.cache_lens[: len(tokens)]
        if any(a and p >= self.max_context for p, a in zip(positions, active)):
            raise ValueError(f"a row is at max_context {self.max_context}")
        ids = to_device(tokens, self.device)[:, None]  # (R, 1)
        slots = CacheSlots.decode(positions, active, self.max_context, self.device, bucketed=self.decode_buckets,
                                  masked=self.decode_masked)
        if any(self.rope_deltas[: len(tokens)]):  # multimodal rotary: rows past their images
            moved = [p + d if a else 0 for p, d, a in zip(positions, self.rope_deltas, active)]
            slots = replace(slots, rope=to_device(moved, self.device)[None, :, None].expand(3, -1, -1))  # (3, R, 1)
        if self.decode_buckets and (len(tokens), slots.length) not in self.decode_shapes:
            self.decode_shapes.add((len(tokens), slots.length))
            log.info("decode met a new shape, %d rows x %d keys (with CUDA graphs, one is recorded now)",
                     len(tokens), slots.length)
        h = self.model(ids, slots)[:, 0]  # (R, D)
        if not all(active):
            h = h.index_select(0, to_device([r for r, a in enumerate(active) if a], self.device))  # (A, D)
        logits = self.lm_head(h, gather=gather).float()  # (A, V)
        for r, a in enumerate(active):
            self.cache_lens[r] += a
        return logits

    def gather_logits(
        self, local: torch.Tensor, extra: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every rank's vocabulary slices (`gather=False` logits) joined into whole rows, on every
        rank, and every rank's `extra` (S, E) as (S, N, E), in the same collective."""
        sizes = [count for _, count in self.lm_head.shards]
        if extra is None:
            return self.lm_head.tp.gather_last_dim(local, sizes), None
        width = extra.shape[1]
        joined = self.lm_head.tp.gather_last_dim(torch.cat([local, extra.to(local)], -1), [n + width for n in sizes])
        parts = joined.split([n + width for n in sizes], -1)
        return torch.cat([part[..., :-width] for part in parts], -1), torch.stack([part[..., -width:] for part in parts], 1)

    def top_candidates(
        self, local: torch.Tensor, k: int, extra: torch.Tensor | None = None, lse: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Each row's k most likely tokens from the ranks' slices, and every rank's `extra` (layers/vocab_parallel.py)."""
        return self.lm_head.top_candidates(local, k, extra, lse)

    @property
    def vocab_start(self) -> int:
        """The first token id of this rank's vocabulary slice."""
        return self.lm_head.start

    def clear_cache(self, row: int | None = None) -> None:
        """Forget the cached positions of one row, or of all (buffers stay allocated)."""
        for r in range(len(self.cache_lens)) if row is None else [row]:
            self.cache_lens[r] = 0
            self.rope_deltas[r] = 0

    def set_rope_delta(self, row: int, delta: int) -> None:
        """Multimodal rotary: `row`'s tokens from now on sit `delta` rotary positions from their
        cache positions (its prompt's images took other than one position a token)."""
        self.rope_deltas[row] = delta

    def reusable_prefix(self, held: list[int], prompt: list[int]) -> int:
        """How many leading tokens of `prompt` a row holding `held` can keep (at least one runs)."""
        return min(common_prefix(held, prompt), len(prompt) - 1)

    def truncate(self, row: int, keep: int) -> None:
        """Keep the first `keep` cached positions of `row` (a prefix reused by the next sequence)."""
        if not 0 <= keep <= self.cache_lens[row]:
            raise ValueError(f"row {row} holds {self.cache_lens[row]} positions, cannot keep {keep}")
        if keep == 0:
            self.clear_cache(row)
        self.cache_lens[row] = keep

    def copy_row(self, src: int, dst: int, keep: int) -> None:
        """Make row `dst` hold the first `keep` positions of row `src`, bit for bit (a prompt
        prefilled once for several rows)."""
        if not 0 < keep <= self.cache_lens[src]:
            raise ValueError(f"row {src} holds {self.cache_lens[src]} positions, cannot copy {keep}")
        for cache in self.kv_caches():
            cache.copy_row(src, dst, keep)
        self.cache_lens[dst] = keep
        self.rope_deltas[dst] = self.rope_deltas[src]

    def resize_context(self, max_context: int) -> None:
        """Give every row `max_context` positions: the KV cache and the rotary tables, empty (a
        load sizes them once its weights are in, from the memory left: models/kv_budget.py)."""
        for module in self.modules():
            if isinstance(module, (KVCache, RotaryEmbedding)):
                module.resize(max_context)
        self.max_context = max_context
        self.options = replace(self.options, max_context=max_context)
        self.clear_cache()

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
        """Checkpoint tensor name -> (our parameter, shard id within a packed parameter).

        Packed parameters list each checkpoint matrix they hold; routed experts list each expert's
        projections; names under `model.` move to the config's `weight_prefix`.
        """
        table: dict[str, tuple[nn.Parameter, str | None]] = {}
        for name, param in self.named_parameters():
            module_path, _, leaf = name.rpartition(".")
            prefix, _, module = module_path.rpartition(".")
            for sub in self.packed_modules_mapping.get(module, ()):
                table[f"{prefix}.{sub}.{leaf}"] = (param, sub)
            if module not in self.packed_modules_mapping:
                table[name] = (param, None)
        for name, module in self.named_modules():
            if isinstance(module, RoutedExperts):
                del table[f"{name}.w13"], table[f"{name}.w2"]
                table.update(module.checkpoint_entries(name))
        prefix = getattr(self.config, "weight_prefix", "model.")
        if prefix == "model.":
            return table
        return {(prefix + n[len("model.") :] if n.startswith("model.") else n): v for n, v in table.items()}

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


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def cache_rows(options: BuildOptions) -> int:
    """KV cache / recurrent state rows: the served sequences and step mode's row."""
    return options.max_batch + 1


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
