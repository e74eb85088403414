"""Gemma 3 (text): transformers' Gemma3ForCausalLM (`gemma3_text`) and the language model of
Gemma3ForConditionalGeneration (`gemma3`, its config under `text_config`).

A config translation onto the shared decoder (models/decoder.py) plus one block subclass. From
the config: every RMSNorm scales by (1 + w) in float32 (ZeroCenteredRMSNorm, Gemma3RMSNorm's
exact arithmetic), per-head q/k norms, a GeGLU MLP (gelu_pytorch_tanh), softmax scale
`query_pre_attn_scalar ** -0.5`, the embedding scaled by sqrt(hidden_size) rounded to the
weights' dtype, sliding-window layers by `layer_types` (or every layer but each
`sliding_window_pattern`-th) with their own rotary base, tied embeddings. Really new: the block
(Gemma3DecoderLayer), whose attention and MLP outputs are each normed before their residual add.

Refused at load: `final_logit_softcapping` (Gemma 2's; Gemma 3 checkpoints set it null, and the
vocabulary-parallel sampling path would need it too) and `use_bidirectional_attention`.
`attn_logit_softcapping` is ignored, as transformers' Gemma3Attention ignores it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.layers.kv_cache import CacheSlots
from celerytp.models.base import BuildOptions
from celerytp.models.config import LAYER_TYPES, ModelConfig, common_fields, rope_config
from celerytp.models.decoder import DecoderForCausalLM, DecoderLayer, norm_class
from celerytp.models.vision_language import VisionLanguageModel

log = logging.getLogger(__name__)

# Gemma3TextConfig's defaults (transformers 5.25) for keys a config.json leaves out: the hub's
# multimodal checkpoints write only a few text_config keys (gemma-3-4b-it: sizes, layers, window).
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 10_000.0  # Gemma3TextConfig.default_theta
# model_type -> where its text model's weights live (transformers' module names; the saved layout
# `language_model.model.` is recognised at load: models/vision_language.py).
WEIGHT_PREFIX = {"gemma3_text": "model.", "gemma3": "model.language_model."}


def gemma3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields of a gemma3_text config.json, or of a gemma3 one's text_config."""
    model_type = d.get("model_type")
    if model_type == "gemma3":
        text = d.get("text_config")
        if not isinstance(text, dict):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, "model_type 'gemma3' config has no text_config")
        t = {**TEXT_DEFAULTS, **text}
        for key in ("tie_word_embeddings", "bos_token_id", "eos_token_id"):  # the top level's win
            if d.get(key) is not None:
                t[key] = d[key]
    else:
        t = {**TEXT_DEFAULTS, **d}
    _refuse_unimplemented(t)
    layers = t["num_hidden_layers"]
    layer_types = _layer_types(t, layers)
    full, local = _rope_parameters(t)
    sliding = "sliding_attention" in layer_types
    hidden_act = t.get("hidden_activation") or t.get("hidden_act") or "gelu_pytorch_tanh"
    fields = common_fields({**t, "model_type": model_type, "rope_parameters": full, "hidden_act": hidden_act})
    return fields | {
        "qk_norm": True,
        "zero_centered_norms": True,
        "layer_types": layer_types,
        "sliding_window": t.get("sliding_window") if sliding else None,
        "local_rope": rope_config({"rope_parameters": local}) if sliding else None,
        "attention_scale": float(t["query_pre_attn_scalar"]) ** -0.5,
        "embedding_scale": float(t["hidden_size"]) ** 0.5,
        "weight_prefix": WEIGHT_PREFIX[model_type],
        "vision_config": d if model_type == "gemma3" and d.get("vision_config") else None,
    }


def _refuse_unimplemented(t: dict[str, Any]) -> None:
    if t.get("final_logit_softcapping") is not None:
        raise CeleryTPError(
            ErrorKind.UNSUPPORTED_ARCH,
            f"gemma3 final_logit_softcapping={t['final_logit_softcapping']!r} is not supported"
            " (Gemma 3 checkpoints set it null)",
        )
    if t.get("use_bidirectional_attention"):
        raise CeleryTPError(
            ErrorKind.UNSUPPORTED_ARCH, "gemma3 use_bidirectional_attention is not supported (causal only)"
        )
    if t.get("attn_logit_softcapping") is not None:
        log.warning("gemma3 attn_logit_softcapping=%r ignored, as transformers' Gemma3Attention ignores it",
                    t["attn_logit_softcapping"])  # fmt: skip


def _layer_types(t: dict[str, Any], layers: int) -> tuple[str, ...]:
    """`layer_types`, else every `sliding_window_pattern`-th layer global (Gemma3TextConfig.__post_init__)."""
    if t.get("layer_types"):
        return tuple(t["layer_types"])
    pattern = t.get("sliding_window_pattern") or t.get("_sliding_window_pattern") or 6
    if not isinstance(pattern, int) or pattern < 1:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"gemma3 sliding_window_pattern must be a positive integer, got {pattern!r}"
        )
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers))


def _rope_parameters(t: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global, local) rotary parameters: transformers 5's per-layer-type `rope_parameters`, or
    4.x's rope_theta + rope_scaling (global layers only) and rope_local_base_freq."""
    params = t.get("rope_parameters")
    if isinstance(params, dict) and set(params) & set(LAYER_TYPES):
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
    else:
        full, local = dict(params or t.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", t.get("rope_theta", GLOBAL_THETA))
    local.setdefault("rope_theta", t.get("rope_local_base_freq", LOCAL_THETA))
    return full, local


class Gemma3DecoderLayer(DecoderLayer):
    """Gemma 3's block, four norms: x + post_attn(attn(input(x))), then h + post_ffw(mlp(pre_ffw(h))).

    post_attention_layernorm normalizes the attention output (not the residual stream, as in
    llama); pre_feedforward_layernorm is the MLP's input norm.
    """

    def __init__(self, config: ModelConfig, options: BuildOptions, index: int) -> None:
        super().__init__(config, options, index)
        norm = {"dtype": options.dtype, "device": options.device}
        self.pre_feedforward_layernorm = norm_class(config)(config.hidden_size, config.rms_norm_eps, **norm)
        self.post_feedforward_layernorm = norm_class(config)(config.hidden_size, config.rms_norm_eps, **norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: CacheSlots) -> torch.Tensor:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, slots))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class Gemma3ForCausalLM(VisionLanguageModel, DecoderForCausalLM):
    """Gemma 3's text model, and of a multimodal checkpoint with an image processor, its SigLIP
    tower and projector (models/vision_language.py); image tokens attend to their whole image
    at prefill (CausalLM.forward_tokens)."""

    decoder_layer_cls = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.build_vision()
