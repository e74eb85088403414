"""Every rank: a request's images as its vision-language model's features.

Each rank decodes the images' bytes and preprocesses them with the checkpoint's own transformers
image processor (preprocessor_config.json, the PIL backend: no torchvision; for a GGUF with
llama.cpp's mmproj, the family's processor with the mmproj's settings: core/gguf_vision.py), then
runs its replica of the vision tower (models/vision.py and its siblings). Every rank computes the same features, so no image tensor
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


Grids = list[tuple[int, int, int]]


class ImageFeatures:
    """Images' bytes -> their features, one row per image token in order, in the model's dtype and
    device; and where an image's size decides its tokens (Qwen2.5-VL), each one's (t, h, w) patch grid."""

    def __init__(self, path: Path, model: CausalLM, mmproj: Path | None = None):
        from transformers import AutoImageProcessor  # only vision-language models pay its import

        self.model = model
        if mmproj is not None:  # no preprocessor_config.json: the settings the loader read from the mmproj
            from celerytp.loading.gguf_mmproj import mmproj_image_processor

            self.processor = mmproj_image_processor(model.config.image_processor)
            return
        directory = path if path.is_dir() else path.parent
        try:
            self.processor = AutoImageProcessor.from_pretrained(str(directory), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"image processor (preprocessor_config.json): {exc}") from None

    @torch.inference_mode()
    def __call__(self, images: list[bytes]) -> tuple[torch.Tensor, Grids | None]:
        from PIL import Image

        processed = self.processor(images=[Image.open(io.BytesIO(data)) for data in images], return_tensors="pt",
                                   **self.model.processor_options)
        grids = processed.get("image_grid_thw")
        return self.model.encode_images(processed), None if grids is None else [tuple(g) for g in grids.tolist()]


def image_features(path: Path, model: CausalLM, mmproj: Path | None = None) -> ImageFeatures | None:
    """A vision-language model's ImageFeatures (`mmproj`: the one it was loaded with); None for a text model."""
    return ImageFeatures(path, model, mmproj) if model.vision is not None else None
