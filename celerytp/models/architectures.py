"""Every architecture we run: its config.json translator and its model class.

Adding a dense or MoE architecture is a translator (config.json -> ModelConfig fields) and, only
for what is really new, a subclass of the shared decoder (models/decoder.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.models.base import CausalLM
from celerytp.models.config import ModelConfig
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.dense_archs import llama_fields, mistral_fields, qwen2_fields, qwen3_fields
from celerytp.models.gemma3 import Gemma3ForCausalLM, gemma3_fields
from celerytp.models.hybrid_config import HYBRID_MODEL_TYPES, HybridConfig
from celerytp.models.llava import LlavaForCausalLM
from celerytp.models.mistral3 import Mistral3ForCausalLM, mistral3_fields
from celerytp.models.moe_archs import MixtralForCausalLM, MoeDecoderForCausalLM, mixtral_fields, qwen3_moe_fields
from celerytp.models.phi3 import Phi3ForCausalLM, phi3_fields
from celerytp.models.qwen2_5_vl import Qwen2_5_VLForCausalLM, qwen2_5_vl_fields
from celerytp.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from celerytp.models.qwen3_vl import Qwen3VLForCausalLM, qwen3_vl_fields

Fields = Callable[[dict[str, Any]], dict[str, Any]]


LLAVA_TEXT_TYPES = ("llama", "mistral", "qwen2")


def llava_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A llava config.json: its text_config's fields (a llama, mistral or qwen2), the whole
    config for the vision tower (models/vision.py)."""
    text = dict(d.get("text_config") or {})
    text_type = text.setdefault("model_type", "llama")
    if text_type not in LLAVA_TEXT_TYPES:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"llava text_config model_type {text_type!r} is not one of "
                                                        f"{', '.join(LLAVA_TEXT_TYPES)}")
    if d.get("tie_word_embeddings") is not None:  # the top level's wins, as in transformers
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return ARCHITECTURES[text_type].fields(text) | {
        "model_type": "llava", "weight_prefix": "model.language_model.", "vision_config": d,
    }


@dataclass(frozen=True)
class Architecture:
    """model_cls builds it; fields translates its config.json (None: a hybrid, HybridConfig's own)."""

    model_cls: type[CausalLM]
    fields: Fields | None = None


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(DecoderForCausalLM, llama_fields),
    "qwen3": Architecture(DecoderForCausalLM, qwen3_fields),
    "qwen2": Architecture(DecoderForCausalLM, qwen2_fields),
    "mistral": Architecture(DecoderForCausalLM, mistral_fields),
    "phi3": Architecture(Phi3ForCausalLM, phi3_fields),
    "gemma3_text": Architecture(Gemma3ForCausalLM, gemma3_fields),
    "gemma3": Architecture(Gemma3ForCausalLM, gemma3_fields),
    "qwen3_moe": Architecture(MoeDecoderForCausalLM, qwen3_moe_fields),
    "mixtral": Architecture(MixtralForCausalLM, mixtral_fields),
    "llava": Architecture(LlavaForCausalLM, llava_fields),
    "qwen2_5_vl": Architecture(Qwen2_5_VLForCausalLM, qwen2_5_vl_fields),
    "mistral3": Architecture(Mistral3ForCausalLM, mistral3_fields),
    "qwen3_vl": Architecture(Qwen3VLForCausalLM, qwen3_vl_fields),
    "qwen3_next": Architecture(Qwen3NextForCausalLM),
    "qwen3_5": Architecture(Qwen3_5ForCausalLM),
    "qwen3_5_text": Architecture(Qwen3_5ForCausalLM),
    "qwen3_5_moe": Architecture(Qwen3_5MoeForCausalLM),
    "qwen3_5_moe_text": Architecture(Qwen3_5MoeForCausalLM),
}
assert set(HYBRID_MODEL_TYPES) == {name for name, arch in ARCHITECTURES.items() if arch.fields is None}


def architecture(model_type: object) -> Architecture:
    """The architecture of a config.json's model_type; UNSUPPORTED_ARCH naming the supported ones."""
    arch = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        raise CeleryTPError(
            ErrorKind.UNSUPPORTED_ARCH, f"model_type {model_type!r} is not one of {', '.join(ARCHITECTURES)}"
        )
    return arch


def config_from_hf(d: dict[str, Any]) -> ModelConfig | HybridConfig:
    """The config of a checkpoint's config.json, whatever its architecture."""
    fields = architecture(d.get("model_type")).fields
    if fields is None:
        return HybridConfig.from_hf_config(d)
    try:
        return ModelConfig(**fields(d))
    except KeyError as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"config is missing {exc.args[0]!r}") from exc
