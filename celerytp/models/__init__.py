"""Model registry and the loading entry point ranks call: load_model(path, tp) -> CausalLM."""

from celerytp.models.architectures import ARCHITECTURES
from celerytp.models.base import BuildOptions, CausalLM
from celerytp.models.config import ModelConfig
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.loader import build_model, load_model

__all__ = [
    "ARCHITECTURES",
    "BuildOptions",
    "CausalLM",
    "DecoderForCausalLM",
    "ModelConfig",
    "build_model",
    "load_model",
]
