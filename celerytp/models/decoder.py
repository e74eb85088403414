"""The decoder skeleton every dense and MoE architecture shares: embedding, blocks of attention
(layers/attention.py) and MLP (dense or routed experts) with pre-norm residuals, final norm and
a vocabulary-parallel LM head. An architecture is a config translation (models/architectures.py)
plus, only where it differs, a subclass here: gemma3's extra norms, phi3's packed checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from celerytp.layers.attention import Attention, AttentionSpec
from celerytp.layers.host_transfer import to_device
from celerytp.layers.hybrid_norm import ZeroCenteredRMSNorm
from celerytp.layers.kv_cache import CacheSlots
from celerytp.layers.mlp import SwiGLUMLP
from celerytp.layers.moe import SparseMoeBlock
from celerytp.layers.norm import RMSNorm
from celerytp.layers.rotary import RotaryEmbedding
from celerytp.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from celerytp.models.base import BuildOptions, CausalLM, cache_rows
from celerytp.models.config import ModelConfig


def norm_class(config: ModelConfig) -> type[nn.Module]:
    return ZeroCenteredRMSNorm if config.zero_centered_norms else RMSNorm


def attention_spec(config: ModelConfig, layer: int) -> AttentionSpec:
    """Layer `layer`'s attention as the config describes it."""
    return AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        qkv_bias=config.attention_bias,
        o_bias=config.o_proj_bias,
        rotary_dim=config.rotary_dim,
        qk_norm=norm_class(config) if config.qk_norm else None,
        norm_eps=config.rms_norm_eps,
        scaling=config.attention_scale,
        sliding_window=config.sliding_window if config.is_sliding(layer) else None,
    )


def make_mlp(config: ModelConfig, options: BuildOptions, layer: int) -> nn.Module:
    """Layer `layer`'s MLP: a routed MoE block on the config's MoE layers, else the gated MLP."""
    common = {"dtype": options.dtype, "device": options.device, "quant": options.quant}
    if layer in config.moe_layers:
        return SparseMoeBlock(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, 0,
            config.norm_topk_prob, options.tp, **common,
        )  # fmt: skip
    return SwiGLUMLP(
        config.hidden_size, config.intermediate_size, options.tp, bias=config.mlp_bias, block=options.mlp_block,
        activation=config.hidden_act, **common,
    )  # fmt: skip


class DecoderLayer(nn.Module):
    """x + attn(norm(x)), then + mlp(norm(.)). `rope` picks the model's rotary table (1: local)."""

    def __init__(self, config: ModelConfig, options: BuildOptions, index: int) -> None:
        super().__init__()
        norm = {"dtype": options.dtype, "device": options.device}
        self.self_attn = Attention(
            attention_spec(config, index), options.tp, cache_rows=cache_rows(options), max_context=options.max_context,
            dtype=options.dtype, kv_dtype=options.kv_dtype, device=options.device, quant=options.quant,
        )  # fmt: skip
        self.mlp = make_mlp(config, options, index)
        self.input_layernorm = norm_class(config)(config.hidden_size, config.rms_norm_eps, **norm)
        self.post_attention_layernorm = norm_class(config)(config.hidden_size, config.rms_norm_eps, **norm)
        self.rope = int(config.local_rope is not None and config.is_sliding(index))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, slots)
        return h + self.mlp(self.post_attention_layernorm(h))


def run_layers(
    layers: Sequence[DecoderLayer], h: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]], slots: CacheSlots
) -> torch.Tensor:
    """`layers` in turn over `h`, each with its rotary table. Compiled decode compiles this over a
    run of layers (models/compiled.py), so the layers of a run are one graph."""
    for layer in layers:
        h = layer(h, *tables[layer.rope], slots)
    return h


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig, options: BuildOptions, layer_cls: type[DecoderLayer]) -> None:
        super().__init__()
        common = {"dtype": options.dtype, "device": options.device}
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, options.tp, quant=options.embedding_quant, **common
        )
        self.embedding_scale = config.embedding_scale
        self.layers = nn.ModuleList(layer_cls(config, options, i) for i in range(config.num_layers))
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps, **common)
        rotary = config.rotary_dim or config.head_dim
        ropes = [config.rope] if config.local_rope is None else [config.rope, config.local_rope]
        self.rotary_embs = nn.ModuleList(
            RotaryEmbedding(rotary, options.max_context, rope, device=options.device, sections=config.mrope_section,
                            interleaved=config.mrope_interleaved)
            for rope in ropes
        )
        # Compiled decode (models/compiled.py): `run_layers` over consecutive runs of the layers.
        self.decode_runs: list[Callable[..., torch.Tensor]] | None = None

    def forward(self, ids: torch.Tensor, slots: CacheSlots,
                embeds: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
        h = self.embed_tokens(ids)  # (B, T, D)
        if self.embedding_scale is not None:
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype)  # rounded to the weights' dtype, as gemma does
        deep: list[torch.Tensor] = []
        if embeds is not None:  # image features in their tokens' places (one row: CausalLM.forward_tokens)
            at, rows = embeds
            at = to_device(at, h.device)
            rows, *deep = rows.to(h.dtype).split(h.shape[-1], -1)  # wider: Qwen3-VL's deepstack features too
            h[0, at] = rows
        tables = []
        for rotary in self.rotary_embs:
            cos, sin = rotary(slots.positions if slots.rope is None else slots.rope, h.dtype)  # (B, T, rotary_dim) each
            tables.append((cos[:, None], sin[:, None]))  # (B, 1, T, rotary_dim): broadcast over heads
        if slots.writes is not None and self.decode_runs:
            for run in self.decode_runs:
                h = run(h, tables, slots)
        elif deep:  # each deepstack feature added to the image tokens' states after its layer
            for i, layer in enumerate(self.layers):
                h = layer(h, *tables[layer.rope], slots)
                if i < len(deep):
                    h[0].index_add_(0, at, deep[i])
        else:
            h = run_layers(self.layers, h, tables, slots)
        return self.norm(h)


class DecoderForCausalLM(CausalLM):
    """Every architecture of models/architectures.py but the hybrids."""

    decoder_layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.model = DecoderModel(config, options, self.decoder_layer_cls)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            config.hidden_size, config.vocab_size, options.tp, dtype=options.dtype, device=options.device, tied=tied,
            quant=options.quant,
        )
