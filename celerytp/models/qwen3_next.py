"""Qwen3-Next and Qwen3.5 (dense and MoE): Gated DeltaNet and gated full attention by layer_types.

Full-attention layers are the shared attention core (layers/attention.py) with q_proj carrying
each head's query and output gate ([q | gate] per head), per-head zero-centred q/k norms, partial
rotary, and sigmoid(gate) applied before o_proj. Linear-attention layers: celerytp.layers.gated_deltanet. MLPs: dense SwiGLU or
the sparse MoE block of celerytp.layers.moe.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from celerytp.layers.attention import Attention, AttentionSpec
from celerytp.layers.gated_deltanet import FUSED_PROJECTIONS, SPLIT_PROJECTIONS, GatedDeltaNet, GatedDeltaNetDims
from celerytp.layers.hybrid_norm import ZeroCenteredRMSNorm
from celerytp.layers.kv_cache import CacheSlots
from celerytp.layers.mlp import SwiGLUMLP
from celerytp.layers.moe import SparseMoeBlock
from celerytp.layers.recurrent_state import RecurrentState
from celerytp.layers.rotary import RotaryEmbedding
from celerytp.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding
from celerytp.loading.checkpoint import Checkpoint
from celerytp.models.base import BuildOptions, CausalLM, Progress, cache_rows, common_prefix
from celerytp.models.hybrid_config import HybridConfig

log = logging.getLogger(__name__)

# Checkpoint tensors that are not the text model: multi-token-prediction head, vision tower.
MTP_PREFIX = "mtp."
VISION_PREFIXES = ("model.visual.", "visual.")


def attention_spec(config: HybridConfig) -> AttentionSpec:
    """The gated full-attention layers: [query | gate] rows per head, zero-centred q/k norms, partial rotary."""
    return AttentionSpec(
        hidden_size=config.hidden_size,
        num_heads=config.num_heads,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        qkv_bias=config.attention_bias,
        o_bias=config.attention_bias,
        rotary_dim=config.rotary_dim,
        qk_norm=ZeroCenteredRMSNorm,
        norm_eps=config.rms_norm_eps,
        output_gate=True,
    )


def linear_attention_dims(config: HybridConfig) -> GatedDeltaNetDims:
    return GatedDeltaNetDims(
        hidden_size=config.hidden_size,
        num_key_heads=config.linear_num_key_heads,
        num_value_heads=config.linear_num_value_heads,
        key_head_dim=config.linear_key_head_dim,
        value_head_dim=config.linear_value_head_dim,
        conv_kernel=config.linear_conv_kernel_dim,
        eps=config.rms_norm_eps,
        fused_proj=config.fused_linear_proj,
        chunk_size=config.chunk_size,
    )


class Qwen3NextDecoderLayer(nn.Module):
    """Token mixer (linear_attn or self_attn, by layer_types) then MLP (dense or MoE)."""

    def __init__(self, config: HybridConfig, options: BuildOptions, index: int) -> None:
        super().__init__()
        common = {"dtype": options.dtype, "device": options.device}
        quant = {"quant": options.quant}
        self.is_linear = config.layer_types[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                linear_attention_dims(config), options.tp, cache_rows(options), **common, **quant
            )
        else:
            self.self_attn = Attention(
                attention_spec(config), options.tp, cache_rows=cache_rows(options), max_context=options.max_context,
                kv_dtype=options.kv_dtype, **common, **quant,
            )  # fmt: skip
        self.mlp: nn.Module
        if index in config.moe_layers:
            self.mlp = SparseMoeBlock(
                config.hidden_size, config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size,
                config.shared_expert_intermediate_size, config.norm_topk_prob, options.tp, **common, **quant,
            )  # fmt: skip
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, options.tp, **common, **quant)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, **common)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, **common)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = x + (self.linear_attn(h, slots) if self.is_linear else self.self_attn(h, cos, sin, slots))
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3NextModel(nn.Module):
    """Embedding, hybrid decoder layers and final norm (the checkpoint's text-model prefix)."""

    def __init__(self, config: HybridConfig, options: BuildOptions) -> None:
        super().__init__()
        common = {"dtype": options.dtype, "device": options.device}
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, options.tp, quant=options.embedding_quant, **common
        )
        self.layers = nn.ModuleList(Qwen3NextDecoderLayer(config, options, i) for i in range(config.num_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps, **common)
        self.rotary_emb = RotaryEmbedding(config.rotary_dim, options.max_context, config.rope, device=options.device)

    def forward(self, ids: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        h = self.embed_tokens(ids)  # (B, T, D)
        cos, sin = self.rotary_emb(slots.positions, h.dtype)  # (B, T, rotary_dim) each
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, T, rotary_dim): broadcast over heads
        for layer in self.layers:
            h = layer(h, cos, sin, slots)
        return self.norm(h)

    def recurrent_states(self) -> list[RecurrentState]:
        return [m for m in self.modules() if isinstance(m, RecurrentState)]


class Qwen3NextForCausalLM(CausalLM):
    """Qwen3NextForCausalLM; also serves the Qwen3.5 family through the config's layout facts.

    State per rank: a KV cache per full-attention layer and a RecurrentState (conv window +
    delta-rule memory) per linear-attention layer; `clear_cache` resets both.
    """

    packed_modules_mapping = CausalLM.packed_modules_mapping | {"in_proj": FUSED_PROJECTIONS}
    batched_prefill = False

    def __init__(self, config: HybridConfig, options: BuildOptions) -> None:  # type: ignore[override]
        super().__init__(config, options)  # type: ignore[arg-type]
        self.model = Qwen3NextModel(config, options)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(
            config.hidden_size, config.vocab_size, options.tp, dtype=options.dtype, device=options.device, tied=tied,
            quant=options.quant,
        )

    def clear_cache(self, row: int | None = None) -> None:
        super().clear_cache(row)
        for state in self.model.recurrent_states():
            state.reset(row)

    def copy_row(self, src: int, dst: int, keep: int) -> None:
        """Recurrent state holds a whole history: copy all of it, never a prefix."""
        if keep != self.cache_lens[src]:
            raise ValueError(f"row {src}: recurrent state cannot be copied as {keep} of {self.cache_lens[src]} tokens")
        super().copy_row(src, dst, keep)
        for state in self.model.recurrent_states():
            state.copy_row(src, dst)

    def reusable_prefix(self, held: list[int], prompt: list[int]) -> int:
        """Only a prompt that extends the row's whole history can continue its recurrent state."""
        return len(held) if len(held) < len(prompt) and common_prefix(held, prompt) == len(held) else 0

    def truncate(self, row: int, keep: int) -> None:
        """Recurrent state holds a whole history: keep all of it or none, never a prefix."""
        if keep not in (0, self.cache_lens[row]):
            raise ValueError(f"row {row}: recurrent state cannot be cut back to {keep} of {self.cache_lens[row]} tokens")
        super().truncate(row, keep)

    def memory_report(self) -> dict[str, int]:
        """As CausalLM's; `kv_cache_bytes` includes the recurrent state (also reported alone)."""
        report = super().memory_report()
        state = sum(s.nbytes for s in self.model.recurrent_states())
        return report | {"kv_cache_bytes": report["kv_cache_bytes"] + state, "recurrent_state_bytes": state}

    # ---- loading ---------------------------------------------------------------------------

    def is_ignorable(self, name: str) -> bool:
        return super().is_ignorable(name) or name.startswith(MTP_PREFIX) or name.startswith(VISION_PREFIXES)

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        names = checkpoint.names()
        vision = sum(n.startswith(VISION_PREFIXES) for n in names)
        mtp = sum(n.startswith(MTP_PREFIX) for n in names)
        if vision or mtp:
            log.info("%s: text model only; skipping %d vision and %d mtp tensors", checkpoint.path, vision, mtp)
        return super().load_weights(checkpoint, progress)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 (dense MLP) and Qwen3.5-MoE: separate in_proj_qkv / z / b / a projections."""

    packed_modules_mapping = CausalLM.packed_modules_mapping | {"in_proj": SPLIT_PROJECTIONS}


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    pass
