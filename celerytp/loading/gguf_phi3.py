"""Phi-3 GGUF files (llama.cpp's `phi3` architecture) as the phi3 checkpoint they were converted from.

llama.cpp's convert_hf_to_gguf.py (Phi3MiniModel, for Phi3ForCausalLM: Phi-3/3.5-mini, Phi-4-mini)
renames the tensors and rewrites none of them:

- `self_attn.qkv_proj` -> `attn_qkv` ([q; k; v] rows, no Q/K permutation: llama.cpp rotates
  phi3 NeoX-style, as transformers does); `mlp.gate_up_proj` -> `ffn_up` (still [gate; up] rows);
  the rest as for llama (attn_norm, ffn_norm, attn_output, ffn_down, token_embd, output_norm,
  output). The fused tensors load through models/phi3.py like the safetensors ones.
- longrope's `long_factor` / `short_factor` -> the tensors `rope_factors_long` /
  `rope_factors_short`, its attention factor `rope.scaling.attn_factor` (gguf_rope.py reads them).

Metadata (Phi3MiniModel.set_gguf_parameters), read back:

- `rope.dimension_count` = int(partial_rotary_factor * hidden) // heads: the rotated dims; the
  head is hidden / heads (no `attention.key_length` is written), so partial_rotary_factor =
  dimension_count / head_dim.
- `attention.sliding_window`: the config's window, 0 when it had none.
- `rope.scaling.original_context_length`: original_max_position_embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import ReadRecord, TensorSource
from celerytp.loading.gguf_names import attention_counts, hf_name
from celerytp.loading.gguf_rope import ROPE_TENSORS, gguf_rope_parameters
from celerytp.loading.gguf_source import GGUFSource

SourceFactory = Callable[[str, list[ReadRecord]], TensorSource]

BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q": "self_attn.q_proj",  # llama.cpp's phi3 also reads split q/k/v
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_up": "mlp.gate_up_proj",  # [gate; up]
    "ffn_down": "mlp.down_proj",
}


def phi3_sources(tensors: dict[str, Any]) -> dict[str, SourceFactory]:
    """HF tensor name -> how to build its source (names we do not know keep their GGUF name,
    for the loader to report; the longrope factor tensors are rope parameters, not weights)."""
    table: dict[str, SourceFactory] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name in ROPE_TENSORS:
            continue
        table[hf_name(gguf_name, BLOCK)] = _factory(tensor)
    return table


def _factory(tensor: Any) -> SourceFactory:
    return lambda name, log: GGUFSource(tensor, name, log)


def phi3_config(metadata: Callable[[str, Any], Any], tensors: dict[str, Any], where: str) -> dict[str, Any]:
    """The phi3 config.json that Phi3MiniModel.set_gguf_parameters wrote these keys from."""

    def key(suffix: str, default: Any = None) -> Any:
        return metadata(f"phi3.{suffix}", default)

    layers, heads, kv_heads, hidden, head_dim = attention_counts(key, "phi3", where)
    rotary = key("rope.dimension_count") or head_dim
    if not 0 < rotary <= head_dim:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"{where}: phi3 rope.dimension_count {rotary} is not within head_dim {head_dim}"
        )
    rope = gguf_rope_parameters(key, tensors, rotary) | {"partial_rotary_factor": rotary / head_dim}
    embd = tensors.get("token_embd.weight")
    config: dict[str, Any] = {
        "model_type": "phi3",
        "vocab_size": int(embd.shape[1]) if embd is not None else key("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": key("context_length", 4096),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-5),
        "rope_parameters": rope,
        "sliding_window": key("attention.sliding_window") or None,  # 0: none (Phi-4-mini)
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": metadata("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": metadata("tokenizer.ggml.eos_token_id", None),
    }
    if (original := key("rope.scaling.original_context_length")) is not None:
        config["original_max_position_embeddings"] = original
    return config
