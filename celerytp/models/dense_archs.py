"""qwen2 and mistral: config translations onto the shared decoder (models/decoder.py); nothing
in their forward is new.

- qwen2 (Qwen2/Qwen2.5, transformers Qwen2ForCausalLM): q/k/v always carry biases, o_proj never
  (whatever `attention_bias` says). A sliding window applies only with `use_sliding_window`
  (transformers' default: off), to layers max_window_layers.. (default 28), unless an explicit
  `layer_types` says otherwise (models/config.py `sliding_fields`).
- mistral (MistralForCausalLM): llama without biases, plus `sliding_window` on every layer when
  set (null: none). transformers' Mistral ignores `layer_types` and `use_sliding_window`.
"""

from __future__ import annotations

from typing import Any

from celerytp.models.config import common_fields, sliding_fields


def llama_fields(d: dict[str, Any]) -> dict[str, Any]:
    return common_fields(d) | sliding_fields(d, d["num_hidden_layers"])


def qwen3_fields(d: dict[str, Any]) -> dict[str, Any]:
    return llama_fields(d) | {"qk_norm": True}


QWEN2_DEFAULTS = {"use_sliding_window": False, "max_window_layers": 28}  # Qwen2Config's own


def qwen2_fields(d: dict[str, Any]) -> dict[str, Any]:
    d = QWEN2_DEFAULTS | d
    return (
        common_fields(d)
        | sliding_fields(d, d["num_hidden_layers"])
        | {"attention_bias": True, "o_proj_bias": False}
    )


def every_layer_window(d: dict[str, Any]) -> dict[str, Any]:
    """`sliding_window` on every layer when set (mistral, phi3): their attention reads the config's
    window directly, whatever `layer_types` / `use_sliding_window` say."""
    return sliding_fields({"sliding_window": d.get("sliding_window")}, d["num_hidden_layers"])


def mistral_fields(d: dict[str, Any]) -> dict[str, Any]:
    no_bias = {"attention_bias": False, "o_proj_bias": False, "mlp_bias": False}
    return common_fields(d) | every_layer_window(d) | no_bias
