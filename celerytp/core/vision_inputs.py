"""What a vision-language checkpoint's prompts look like: its image token and how many places
each image takes. The leader reads it from config.json to expand a chat's image tokens; the ranks
check a request's prompt against it. No torch: the leader imports it too."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from celerytp.core.validation import bad_request

VISION_MODEL_TYPES = ("llava",)
# transformers' defaults for what a llava config.json leaves out (LlavaConfig, CLIPVisionConfig)
LLAVA_DEFAULTS = {"image_token_index": 32000, "vision_feature_select_strategy": "default"}
CLIP_DEFAULTS = {"image_size": 224, "patch_size": 32, "model_type": "clip_vision_model"}


@dataclass(frozen=True)
class VisionInputs:
    """image_token_id: the token a chat template renders for an image, and that the prompt
    repeats `tokens_per_image` times in its place (one position per image feature)."""

    image_token_id: int
    tokens_per_image: int


def vision_inputs(hf_config: dict[str, Any]) -> VisionInputs | None:
    """Of a config.json's contents; None for a text-only model."""
    if hf_config.get("model_type") not in VISION_MODEL_TYPES:
        return None
    d = {**LLAVA_DEFAULTS, **hf_config}
    vision = {**CLIP_DEFAULTS, **(d.get("vision_config") or {})}
    patches = (vision["image_size"] // vision["patch_size"]) ** 2
    has_cls = vision["model_type"] == "clip_vision_model"  # SigLIP has no class position
    # "default" drops the first position (CLIP's class position; transformers drops it from SigLIP too)
    dropped = d["vision_feature_select_strategy"] == "default"
    token = d.get("image_token_id", d["image_token_index"])
    return VisionInputs(int(token), patches + has_cls - dropped)


@lru_cache(maxsize=64)
def _read(config_file: str, mtime: float) -> VisionInputs | None:
    with open(config_file, encoding="utf-8") as f:
        return vision_inputs(json.load(f))


def checkpoint_vision(path: str) -> VisionInputs | None:
    """Of the checkpoint at `path` (a directory with config.json; a GGUF file: text only)."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return None
    return _read(str(config_file), os.path.getmtime(config_file))


def expand_images(ids: list[int], vision: VisionInputs | None, images: int) -> list[int]:
    """A rendered chat's ids with each image token repeated for its image's features; a 400 when
    the model takes no images or its template did not place each image."""
    if not images:
        return ids
    if vision is None:
        raise bad_request("messages", "this model takes no images (it is not a vision-language model)")
    placed = ids.count(vision.image_token_id)
    if placed != images:
        raise bad_request("messages", f"the model's chat template placed {placed} image tokens for {images} images")
    out: list[int] = []
    for t in ids:
        out.extend([t] * vision.tokens_per_image if t == vision.image_token_id else [t])
    return out


def check_placeholders(prompt: list[int], vision: VisionInputs | None, images: int) -> None:
    """A prompt must hold each image's run of image tokens and no other (a 400 naming `images`)."""
    if vision is None:
        if images:
            raise bad_request("images", "this model takes no images (it is not a vision-language model)")
        return
    placed = prompt.count(vision.image_token_id)
    if placed != images * vision.tokens_per_image:
        raise bad_request("images", f"the prompt holds {placed} image tokens; {images} images need "
                                    f"{images * vision.tokens_per_image} ({vision.tokens_per_image} each)")
