"""GGUF rope metadata -> transformers' `rope_parameters`: the inverse of what llama.cpp's
convert_hf_to_gguf.py writes (keys as gguf's `Keys.Rope`).

- `{arch}.rope.freq_base` -> rope_theta.
- `{arch}.rope.scaling.type`: "none" (or absent) -> default; "linear" -> linear with
  `.scaling.factor`; "yarn" -> yarn with `.scaling.factor`, `.scaling.original_context_length`
  and, when written, `.scaling.yarn_beta_fast` / `.yarn_beta_slow` and an attention factor;
  "longrope" -> longrope. Anything else is refused naming it.
- The attention factor is `.scaling.yarn_attn_factor` (the generic converter writes HF's
  `attention_factor` there) or `.scaling.attn_factor` (Phi-3 and OLMo-2 write it there); without
  either, transformers' own default applies.
- `.scaling.yarn_log_multiplier`: on the llama architecture only the Mistral-format converter
  writes it, as HF's `mscale_all_dim` (1.0: YaRN without the attention scaling); read so, with
  HF's `mscale` 1.0. (DeepSeek-2's converter writes 0.1 * mscale_all_dim, for MLA only.)
- `.scaling.yarn_ext_factor` other than 1 (or llama.cpp's "auto", negative) has no transformers
  equivalent and is refused.
- longrope: Phi-3's converter writes no scaling type, only the tensors `rope_factors_long.weight`
  / `rope_factors_short.weight` (HF long_factor / short_factor), `.scaling.attn_factor` and
  `.scaling.original_context_length`; their presence means longrope. HF's factor is derived
  from the context length as transformers does (config.rope_config).

llama.cpp picks longrope's long factors when the context it was started with exceeds the original
length; we follow transformers instead (layers/rotary.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gguf
import numpy as np

from celerytp.core.errors import CeleryTPError, ErrorKind

ROPE_FACTORS_LONG = "rope_factors_long.weight"
ROPE_FACTORS_SHORT = "rope_factors_short.weight"
# Tensors that are rope parameters, folded into the config, never model weights.
ROPE_TENSORS = ("rope_freqs.weight", ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT)

Key = Callable[..., Any]  # key(suffix, default=None): the metadata value of "{arch}.{suffix}"


def gguf_rope_parameters(key: Key, tensors: dict[str, Any], head_dim: int) -> dict[str, Any]:
    """transformers' `rope_parameters` (HF keys) of a GGUF file's rope metadata.

    Args:
        key: metadata getter for the architecture's keys, `key("rope.freq_base", 10000.0)`.
        tensors: the file's tensors by GGUF name (gguf ReaderTensor).
        head_dim: the rotated size of a head (longrope's factor tables hold head_dim / 2).
    """
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": key("rope.freq_base", 10000.0)}
    scaling = key("rope.scaling.type")
    has_factors = ROPE_FACTORS_LONG in tensors or ROPE_FACTORS_SHORT in tensors
    if scaling in (None, "none") and not has_factors:
        return rope
    if scaling == "linear":
        return rope | {"rope_type": "linear", "factor": _required(key, "rope.scaling.factor", "linear")}
    if scaling == "yarn":
        return rope | _yarn(key)
    if scaling == "longrope" or (scaling in (None, "none") and has_factors):
        return rope | _longrope(key, tensors, head_dim)
    raise CeleryTPError(
        ErrorKind.UNSUPPORTED_ARCH,
        f"GGUF rope.scaling.type {scaling!r} is not one of none, linear, yarn, longrope",
    )


def _required(key: Key, suffix: str, kind: str) -> Any:
    value = key(suffix)
    if value is None:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"GGUF {kind} rope scaling needs {suffix}, which is missing")
    return value


def _attention_factor(key: Key) -> dict[str, Any]:
    value = key("rope.scaling.yarn_attn_factor")
    value = key("rope.scaling.attn_factor") if value is None else value
    return {} if value is None else {"attention_factor": value}


def _original(key: Key) -> dict[str, Any]:
    # Absent: transformers' default (max_position_embeddings, here the file's context_length).
    value = key("rope.scaling.original_context_length")
    return {} if value is None else {"original_max_position_embeddings": value}


def _yarn(key: Key) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "yarn", "factor": _required(key, "rope.scaling.factor", "yarn")}
    params |= _original(key) | _attention_factor(key)
    for suffix, name in (("rope.scaling.yarn_beta_fast", "beta_fast"), ("rope.scaling.yarn_beta_slow", "beta_slow")):
        if (value := key(suffix)) is not None:
            params[name] = value
    log_mul = key("rope.scaling.yarn_log_multiplier")
    if log_mul:
        params |= {"mscale": 1.0, "mscale_all_dim": log_mul}
    ext = key("rope.scaling.yarn_ext_factor")
    if ext is not None and not (ext < 0 or ext == 1.0):
        raise CeleryTPError(
            ErrorKind.UNSUPPORTED_ARCH, f"GGUF rope.scaling.yarn_ext_factor {ext} (other than 1) is not supported"
        )
    return params


def _longrope(key: Key, tensors: dict[str, Any], head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "longrope"}
    for name, field in ((ROPE_FACTORS_SHORT, "short_factor"), (ROPE_FACTORS_LONG, "long_factor")):
        tensor = tensors.get(name)
        if tensor is None:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"GGUF longrope needs the tensor {name}, which is missing")
        values = np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(-1)
        if values.size != head_dim // 2:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"GGUF {name} has {values.size} entries, head_dim / 2 is {head_dim // 2}"
            )
        params[field] = [float(x) for x in values]
    return params | _original(key) | _attention_factor(key)
