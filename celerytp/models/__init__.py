"""Model registry and the loading entry point ranks call: load_model(path, tp) -> CausalLM."""

from celerytp.models.base import BuildOptions, CausalLM
from celerytp.models.config import ModelConfig
from celerytp.models.llama import LlamaForCausalLM
from celerytp.models.loader import MODEL_REGISTRY, build_model, load_model
from celerytp.models.qwen3 import Qwen3ForCausalLM

__all__ = [
    "MODEL_REGISTRY",
    "BuildOptions",
    "CausalLM",
    "LlamaForCausalLM",
    "ModelConfig",
    "Qwen3ForCausalLM",
    "build_model",
    "load_model",
]
