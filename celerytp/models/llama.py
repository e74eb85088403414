"""Llama (LlamaForCausalLM) with tensor-parallel attention and MLP; the base of Qwen3."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.layers.kv_cache import CacheSlots, KVCache
from celerytp.layers.linear import (
    QKVParallelLinear,
    RowParallelLinear,
)
from celerytp.layers.mlp import SwiGLUMLP
from celerytp.layers.norm import RMSNorm
from celerytp.layers.partition import split_heads
from celerytp.layers.rotary import RotaryEmbedding, apply_rotary
from celerytp.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from celerytp.models.base import BuildOptions, CausalLM, cache_rows
from celerytp.models.config import ModelConfig


class LlamaAttention(nn.Module):
    """GQA self-attention over this rank's whole KV groups, with a preallocated KV cache."""

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__()
        tp, hd = options.tp, config.head_dim
        heads = split_heads(tp.rank, tp.world_size, config.num_heads, config.num_kv_heads)
        self.heads = heads
        self.num_heads = heads.q_count  # local
        self.num_kv_heads = heads.kv_count  # local
        self.head_dim = hd
        self.scaling = hd**-0.5
        common = {"dtype": options.dtype, "device": options.device}
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, hd, config.num_heads, config.num_kv_heads, heads,
            bias=config.attention_bias, quant=options.quant, **common,
        )
        self.o_proj = RowParallelLinear(
            config.num_heads * hd,
            config.hidden_size,
            (heads.q_start * hd, heads.q_count * hd),
            tp,
            bias=config.attention_bias,
            quant=options.quant,
            **common,
        )
        self.kv_cache = KVCache(
            cache_rows(options), self.num_kv_heads, options.max_context, hd, dtype=options.kv_dtype, device=options.device
        )

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # Qwen3 normalizes each head here

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.split_sizes, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim)  # (B, T, nh, hd)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)  # (B, T, nkv, hd)
        q, k = self.norm_qk(q, k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)  # (B, nh, T, hd)
        k = apply_rotary(k.transpose(1, 2), cos, sin)  # (B, nkv, T, hd)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        k, v = self.kv_cache.update(slots, k, v)  # (B, nkv, L, hd)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=slots.mask, scale=self.scaling, enable_gqa=self.num_heads != self.num_kv_heads
        )  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(y)  # all-reduced over ranks


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__()
        norm = {"dtype": options.dtype, "device": options.device}
        self.self_attn = self.attention_cls(config, options)
        self.mlp = SwiGLUMLP(
            config.hidden_size, config.intermediate_size, options.tp, dtype=options.dtype, device=options.device,
            bias=config.mlp_bias, quant=options.quant, block=options.mlp_block,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, options: BuildOptions, layer_cls: type[LlamaDecoderLayer]) -> None:
        super().__init__()
        common = {"dtype": options.dtype, "device": options.device}
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, options.tp, quant=options.embedding_quant, **common
        )
        self.layers = nn.ModuleList(layer_cls(config, options) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **common)
        self.rotary_emb = RotaryEmbedding(config.head_dim, options.max_context, config.rope, device=options.device)
        self.decode_layers: list[Callable[..., torch.Tensor]] | None = None  # compiled (models/compiled.py)

    def forward(self, ids: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        h = self.embed_tokens(ids)  # (B, T, D)
        cos, sin = self.rotary_emb(slots.positions, h.dtype)  # (B, T, hd) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, hd): broadcast over heads
        decoding = slots.writes is not None
        for layer in self.decode_layers if decoding and self.decode_layers else self.layers:
            h = layer(h, cos, sin, slots)
        return self.norm(h)


class LlamaForCausalLM(CausalLM):
    decoder_layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.model = LlamaModel(config, options, self.decoder_layer_cls)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            config.hidden_size,
            config.vocab_size,
            options.tp,
            dtype=options.dtype,
            device=options.device,
            tied=tied,
            quant=options.quant,
        )
