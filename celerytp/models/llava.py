"""LLaVA (transformers' LlavaForConditionalGeneration): a CLIP or SigLIP vision tower and a
projector (models/vision.py, replicated on every rank) in front of a llama, mistral or qwen2
language model, split across the ranks as that model alone would be.

An image's features take the places of its image tokens in the prompt's embeddings
(CausalLM.forward_tokens `embeds`; worker/image_features.py makes them); the rest is the text
model's.
"""

from __future__ import annotations

from celerytp.models.base import BuildOptions
from celerytp.models.config import ModelConfig
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.vision_language import VisionLanguageModel


class LlavaForCausalLM(VisionLanguageModel, DecoderForCausalLM):
    def __init__(self, config: ModelConfig, options: BuildOptions) -> None:
        super().__init__(config, options)
        self.build_vision()
