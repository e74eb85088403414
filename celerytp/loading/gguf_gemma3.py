"""Gemma 3 GGUF files (llama.cpp's `gemma3` architecture) as the gemma3_text checkpoint they
were converted from.

llama.cpp's convert_hf_to_gguf.py (Gemma3Model, for Gemma3ForCausalLM and the text model of
Gemma3ForConditionalGeneration) rewrites, undone here:

- every `*norm.weight` + 1 (`norm_shift`): llama.cpp's RMSNorm scales by w, Gemma3RMSNorm by
  1 + w. Undone by gguf_hybrid's ShiftedNormSource (- 1) on input, post-attention, pre- and
  post-feedforward, q/k and final norms.
- names: `attn_norm` input_layernorm, `post_attention_norm` post_attention_layernorm,
  `ffn_norm` pre_feedforward_layernorm (llama's post_attention_layernorm elsewhere),
  `post_ffw_norm` post_feedforward_layernorm; q/k/v/o, q/k norms and the MLP as for llama,
  but Q/K rows are not permuted (Gemma3Model is no LlamaModel).
- `token_embd` cut to the tokenizer's real vocabulary: the vocabulary size is its row count.

Metadata the converter does not write, taken as llama.cpp's loader (llama_load_hparams_gemma3,
llm_build_gemma3) takes it:

- which layers slide: a non-zero `attention.sliding_window` turns on the pattern, every 6th
  layer global (`set_swa_pattern(6)`: layer i is global when i % 6 == 5, as transformers'
  `sliding_window_pattern` 6). A `gemma3.attention.sliding_window_pattern` key, when a file
  has one, overrides it (a period, or per-layer booleans, true = sliding).
- the sliding layers' rotary base: 10000 (`rope_freq_base_train_swa`, no scaling), or
  `rope.freq_base_swa` when present; global layers: `rope.freq_base` and `rope.scaling.*`.
- the softmax scale: 1/sqrt(key_length), but 1/sqrt(hidden / heads) for the 62-layer 27B
  model (query_pre_attn_scalar 168 in its config.json, not its head_dim 128).
- `final_logit_softcapping` when written (the converter writes it only if non-null): passed
  on, so ModelConfig refuses it as for a config.json.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import ReadRecord, TensorSource
from celerytp.loading.gguf_hybrid import ShiftedNormSource
from celerytp.loading.gguf_names import attention_counts, hf_name
from celerytp.loading.gguf_rope import gguf_rope_parameters
from celerytp.loading.gguf_source import GGUFSource

SourceFactory = Callable[[str, list[ReadRecord]], TensorSource]

BLOCK = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
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
SWA_PATTERN = 6  # llama.cpp's set_swa_pattern(6) for gemma3
LOCAL_THETA = 10_000.0  # llama.cpp's rope_freq_base_train_swa for gemma3
LAYERS_27B = 62  # llama.cpp scales the 27B model's queries by its hidden / heads


def gemma3_sources(tensors: dict[str, Any]) -> dict[str, SourceFactory]:
    """HF tensor name -> how to build its source, for every tensor of a gemma3 GGUF file
    (names we do not know keep their GGUF name, for the loader to report)."""
    table: dict[str, SourceFactory] = {}
    for gguf_name, tensor in tensors.items():
        hf = hf_name(gguf_name, BLOCK)
        known_norm = hf != gguf_name and gguf_name.rpartition(".")[0].endswith("norm")
        table[hf] = _factory(tensor, shifted=known_norm)
    return table


def _factory(tensor: Any, shifted: bool) -> SourceFactory:
    if not shifted:
        return lambda name, log: GGUFSource(tensor, name, log)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return lambda name, log: ShiftedNormSource(name, shape, log, GGUFSource(tensor, name, []))


def gemma3_config(metadata: Callable[[str, Any], Any], tensors: dict[str, Any], where: str) -> dict[str, Any]:
    """The gemma3_text config.json that Gemma3Model.set_gguf_parameters wrote these keys from."""

    def key(suffix: str, default: Any = None) -> Any:
        return metadata(f"gemma3.{suffix}", default)

    layers, heads, kv_heads, hidden, head_dim = attention_counts(key, "gemma3", where)
    window = key("attention.sliding_window") or None
    layer_types = _layer_types(key("attention.sliding_window_pattern"), layers, window, where)
    full = gguf_rope_parameters(key, tensors, head_dim)
    local = {"rope_type": "default", "rope_theta": key("rope.freq_base_swa", LOCAL_THETA)}
    embd = tensors.get("token_embd.weight")
    return {
        "model_type": "gemma3_text",
        "vocab_size": int(embd.shape[1]) if embd is not None else key("vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": hidden // heads if layers == LAYERS_27B else head_dim,
        "max_position_embeddings": key("context_length", 131_072),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "layer_types": list(layer_types),
        "sliding_window": window,
        "final_logit_softcapping": key("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": metadata("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": metadata("tokenizer.ggml.eos_token_id", None),
    }


def _layer_types(pattern: Any, layers: int, window: int | None, where: str) -> tuple[str, ...]:
    if window is None:  # llama.cpp: no sliding window key, no sliding layers
        return ("full_attention",) * layers
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"{where}: sliding_window_pattern lists {len(pattern)} layers, block_count is {layers}",
            )
        return tuple("sliding_attention" if sliding else "full_attention" for sliding in pattern)
    period = SWA_PATTERN if pattern is None else int(pattern)
    if period < 1:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"{where}: sliding_window_pattern {pattern!r} is not a positive period"
        )
    return tuple("sliding_attention" if i % period < period - 1 else "full_attention" for i in range(layers))
