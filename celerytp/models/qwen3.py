"""Qwen3 (Qwen3ForCausalLM): Llama plus a per-head RMSNorm on queries and keys."""

from __future__ import annotations

import torch

from celerytp.layers.norm import RMSNorm
from celerytp.models.base import BuildOptions
from celerytp.models.config import ModelConfig
from celerytp.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        # Norms act on one head_dim vector, so they are identical on every rank.
        norm = {"dtype": options.dtype, "device": options.device}
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **norm)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, **norm)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # (B, T, nh, hd), (B, T, nkv, hd)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen3DecoderLayer
