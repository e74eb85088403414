"""Qwen2.5-VL (transformers' Qwen2_5_VLForConditionalGeneration): its vision encoder and merger
(models/qwen_vision.py, replicated on every rank) before a qwen2 text model split across the
ranks as usual, whose rotary is multimodal: each token has a temporal, a height and a width
position (core/vision_inputs.py `mrope_positions`), and the rotary half's frequencies take them in
sections (`mrope_section`, layers/rotary.py). An image's tokens follow its size (`ImageGrid`).

Checkpoints: transformers (5.25 too) saves the text model as `model.*` and the tower as `visual.*`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.models.base import BuildOptions
from celerytp.models.config import ModelConfig
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.dense_archs import qwen2_fields
from celerytp.models.qwen_vision import QWEN_VISION_PREFIXES, QwenVisionTower, qwen_vision_layout
from celerytp.models.vision_language import VisionLanguageModel


def qwen2_5_vl_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A qwen2_5_vl config.json: its text model's fields (under `text_config`, or at the top level
    as transformers 4 wrote it), the multimodal rotary sections, the whole config for the tower."""
    text = {**d, **(d.get("text_config") or {})}
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    sections = rope.get("mrope_section")
    if not sections:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, "qwen2_5_vl: no mrope_section in the rope parameters")
    plain = {k: v for k, v in rope.items() if k != "mrope_section"}
    if plain.get("rope_type", plain.get("type")) == "mrope":  # transformers 4's name for it
        plain["rope_type"] = "default"
        plain.pop("type", None)
    text = {**text, "rope_parameters": plain, "rope_scaling": None, "model_type": "qwen2"}
    return qwen2_fields(text) | {
        "model_type": "qwen2_5_vl", "vision_config": d, "mrope_section": tuple(sections),
    }


class Qwen2_5_VLForCausalLM(VisionLanguageModel, DecoderForCausalLM):
    tower_prefixes = QWEN_VISION_PREFIXES

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.build_vision()

    def make_tower(self) -> nn.Module:
        return QwenVisionTower(self.config.vision_config, dtype=self.options.dtype, device=self.options.device)

    def tower_table(self) -> dict[str, nn.Parameter]:
        return self.vision_encoder.checkpoint_table(qwen_vision_layout(self._names))

    @torch.inference_mode()
    def encode_images(self, processed: dict[str, torch.Tensor]) -> torch.Tensor:
        """pixel_values (patches, C x T x P x P) and image_grid_thw (images, 3), as Qwen2VLImageProcessor
        makes them -> one row per image token, images in order."""
        return self.vision_encoder(processed["pixel_values"].to(self.device), processed["image_grid_thw"])
