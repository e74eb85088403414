"""Mistral 3 (transformers' Mistral3ForConditionalGeneration, Mistral Small 3.1): a Pixtral vision
encoder and patch-merging projector (models/pixtral_vision.py, replicated on every rank) before a
mistral text model split across the ranks as usual. An image's tokens follow its size, in rows
that each end in `[IMG_BREAK]` (core/vision_inputs.py `PixtralGrid`); only its `[IMG]` tokens
take features. The text model lies under `language_model.model.` as transformers saves it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.models.base import BuildOptions
from celerytp.models.config import ModelConfig
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.dense_archs import mistral_fields
from celerytp.models.pixtral_vision import PIXTRAL_VISION_PREFIXES, PixtralVisionTower, pixtral_vision_layout
from celerytp.models.vision_language import VisionLanguageModel

TEXT_TYPES = ("mistral",)


def mistral3_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A mistral3 config.json: its text_config's fields, the whole config for the tower."""
    text = dict(d.get("text_config") or {})
    text_type = text.setdefault("model_type", "mistral")
    if text_type not in TEXT_TYPES:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"mistral3 text_config model_type {text_type!r} is not one of "
                                                        f"{', '.join(TEXT_TYPES)}")
    text["tie_word_embeddings"] = d.get("tie_word_embeddings", True)  # Mistral3Config's: the top level decides
    return mistral_fields(text) | {
        "model_type": "mistral3", "weight_prefix": "model.language_model.", "vision_config": d,
    }


class Mistral3ForCausalLM(VisionLanguageModel, DecoderForCausalLM):
    tower_prefixes = PIXTRAL_VISION_PREFIXES

    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.build_vision()

    def make_tower(self) -> nn.Module:
        return PixtralVisionTower(self.config.vision_config, self.config.hidden_size, dtype=self.options.dtype,
                                  device=self.options.device)

    def tower_table(self) -> dict[str, nn.Parameter]:
        return self.vision_encoder.checkpoint_table(pixtral_vision_layout(self._names))

    @property
    def processor_options(self) -> dict[str, Any]:
        """PixtralProcessor calls its image processor with patch x spatial merge as the patch."""
        cell = self.vision.cells.cell
        return {"patch_size": {"height": cell, "width": cell}}

    @torch.inference_mode()
    def encode_images(self, processed: dict[str, torch.Tensor]) -> torch.Tensor:
        """pixel_values (N, 3, H, W) padded to the largest and image_sizes (N, 2), as
        PixtralImageProcessor makes them -> one row per `[IMG]` token, images in order."""
        return self.vision_encoder(processed["pixel_values"].to(self.device), processed["image_sizes"])
