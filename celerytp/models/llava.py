"""LLaVA (transformers' LlavaForConditionalGeneration): a CLIP or SigLIP vision tower and a
projector (models/vision.py, replicated on every rank) in front of a llama, mistral or qwen2
language model, split across the ranks as that model alone would be.

An image's features take the places of its image tokens in the prompt's embeddings
(CausalLM.forward_tokens `embeds`; worker/image_features.py makes them); the rest is the text
model's.
"""

from __future__ import annotations

from typing import Any

import torch

from celerytp.core.vision_inputs import vision_inputs
from celerytp.loading.checkpoint import Checkpoint
from celerytp.models.base import BuildOptions, Progress
from celerytp.models.config import ModelConfig
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.multimodal_layout import LanguageModelLayout
from celerytp.models.vision import VisionTower, checkpoint_layout


class LlavaForCausalLM(LanguageModelLayout, DecoderForCausalLM):
    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.vision = vision_inputs(config.vision_config)
        self.vision_encoder = VisionTower(config.vision_config, config.hidden_size, dtype=options.dtype,
                                          device=options.device)
        if self.vision_encoder.tokens_per_image != self.vision.tokens_per_image:  # two readings of one config
            raise AssertionError(f"{self.vision_encoder.tokens_per_image} != {self.vision.tokens_per_image}")
        self._vision_layout = ("", False)

    def checkpoint_table(self) -> dict[str, Any]:
        tower = {id(p) for p in self.vision_encoder.parameters()}
        table = {name: entry for name, entry in super().checkpoint_table().items() if id(entry[0]) not in tower}
        table.update({name: (p, None) for name, p in self.vision_encoder.checkpoint_table(*self._vision_layout).items()})
        return table

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        self._vision_layout = checkpoint_layout(checkpoint.names())
        return super().load_weights(checkpoint, progress)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) pixel values -> (N, tokens_per_image, hidden): every rank the same."""
        return self.vision_encoder(pixel_values)
