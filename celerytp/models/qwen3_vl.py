"""Qwen3-VL (transformers' Qwen3VLForConditionalGeneration): its vision encoder, merger and
deepstack mergers (models/qwen3_vision.py, replicated on every rank) before a qwen3 text model
split across the ranks as usual. As Qwen2.5-VL (models/qwen2_5_vl.py): an image's tokens follow
its size and the rotary is multimodal, here with the sections' frequencies interleaved. New: the
deepstack features, one per deepstack merger, each added to the image tokens' hidden states after
the text layer of its index (models/decoder.py): the tower's rows carry them beside the features.

Checkpoints: transformers saves the text model as `model.language_model.*` and the tower as
`model.visual.*`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.models.base import BuildOptions
from celerytp.models.config import ModelConfig
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.dense_archs import qwen3_fields
from celerytp.models.qwen3_vision import QWEN3_VISION_PREFIXES, Qwen3VisionTower, qwen3_vision_layout
from celerytp.models.vision_language import VisionLanguageModel


def qwen3_vl_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A qwen3_vl config.json: its text_config's fields (a qwen3 with q/k norms), the multimodal
    rotary sections (always interleaved, as transformers runs them), the whole config for the tower."""
    text = {**(d.get("text_config") or {})}
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    sections = rope.pop("mrope_section", None) or (24, 20, 20)  # Qwen3VLTextConfig's default
    rope.pop("mrope_interleaved", None)
    if "rope_theta" not in rope and "rope_theta" not in text:
        rope["rope_theta"] = 500_000.0  # Qwen3VLTextConfig's default
    if not text:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, "qwen3_vl config has no text_config")
    text = {**text, "rope_parameters": rope, "rope_scaling": None, "model_type": "qwen3"}
    if d.get("tie_word_embeddings") is not None:
        text["tie_word_embeddings"] = d["tie_word_embeddings"]
    return qwen3_fields(text) | {
        "model_type": "qwen3_vl", "weight_prefix": "model.language_model.", "vision_config": d,
        "mrope_section": tuple(sections), "mrope_interleaved": True,
    }


class Qwen3VLForCausalLM(VisionLanguageModel, DecoderForCausalLM):
    tower_prefixes = QWEN3_VISION_PREFIXES

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.build_vision()

    def make_tower(self) -> nn.Module:
        return Qwen3VisionTower(self.config.vision_config, dtype=self.options.dtype, device=self.options.device)

    def tower_table(self) -> dict[str, nn.Parameter]:
        return self.vision_encoder.checkpoint_table(qwen3_vision_layout(self._names))

    @torch.inference_mode()
    def encode_images(self, processed: dict[str, torch.Tensor]) -> torch.Tensor:
        """pixel_values and image_grid_thw as Qwen2VLImageProcessor makes them -> one row per image
        token, images in order: its feature, then its deepstack features, side by side."""
        features, deep = self.vision_encoder(processed["pixel_values"].to(self.device), processed["image_grid_thw"])
        return torch.cat([features, *deep], dim=-1)
