"""What every dense and MoE GGUF architecture shares: llama.cpp's tensor names -> Hugging Face
names, and the head and layer counts of its metadata.

The global tensors are named alike everywhere; each architecture's block tensors map through a
table (BLOCK_NAMES for llama and its kin; gemma3 and phi3 pass their own, gguf_gemma3.py and
gguf_phi3.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

from celerytp.core.errors import CeleryTPError, ErrorKind

# GGUF tensor name stem -> Hugging Face module name.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, blocks: dict[str, str] = BLOCK_NAMES) -> str:
    """The Hugging Face name of a GGUF tensor (unknown names pass through unchanged)."""
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, stem, kind = m.groups()
        return f"model.layers.{layer}.{blocks[stem]}.{kind}" if stem in blocks else gguf_name
    stem, _, kind = gguf_name.rpartition(".")
    return f"{GLOBAL_NAMES[stem]}.{kind}" if stem in GLOBAL_NAMES else gguf_name


class Counts(NamedTuple):
    layers: int
    heads: int
    kv_heads: int
    hidden: int
    head_dim: int


def attention_counts(key: Callable[..., Any], arch: str, where: str) -> Counts:
    """Layers, heads, KV heads, hidden size and head size from `{arch}.*` metadata; LOAD_FAILED
    when a count is missing, UNSUPPORTED_ARCH for per-layer head counts."""
    layers, heads, hidden = key("block_count"), key("attention.head_count"), key("embedding_length")
    kv_heads = key("attention.head_count_kv", heads)
    if not (layers and heads and hidden):
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{where}: {arch} metadata lacks block, head or embedding counts")
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{where}: per-layer head counts are not supported")
    return Counts(layers, heads, kv_heads, hidden, key("attention.key_length") or hidden // heads)
