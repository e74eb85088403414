"""Every rank: a request's images as its vision-language model's features.

Each rank decodes the images' bytes and preprocesses them with the checkpoint's own transformers
image processor (preprocessor_config.json, the PIL backend: no torchvision), then runs its replica
of the vision tower (models/vision.py). Every rank computes the same features, so no image tensor
crosses the group: docs/design.md, "Images".
"""

from __future__ import annotations

import io
import logging
from pathlib import Path

import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.models import CausalLM

log = logging.getLogger(__name__)


class ImageFeatures:
    """Images' bytes -> (images x tokens_per_image, hidden) rows, in the model's dtype and device."""

    def __init__(self, path: Path, model: CausalLM):
        from transformers import AutoImageProcessor  # only vision-language models pay its import

        directory = path if path.is_dir() else path.parent
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"image processor (preprocessor_config.json): {exc}") from None
        self.model = model

    @torch.inference_mode()
    def __call__(self, images: list[bytes]) -> torch.Tensor:
        from PIL import Image

        pixels = self.processor(images=[Image.open(io.BytesIO(data)) for data in images],
                                return_tensors="pt")["pixel_values"]
        features = self.model.encode_images(pixels.to(self.model.device))  # (images, places, hidden)
        return features.flatten(0, 1)


def image_features(path: Path, model: CausalLM) -> ImageFeatures | None:
    """A vision-language model's ImageFeatures; None for a text model."""
    return ImageFeatures(path, model) if model.vision is not None else None
