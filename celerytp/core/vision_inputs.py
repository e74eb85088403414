"""What a vision-language checkpoint's prompts look like: its image token and how many places
each image takes. The leader reads it from config.json to expand a chat's image tokens; the ranks
check a request's prompt against it. No torch: the leader imports it too."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from celerytp.core.tokenizer import Tokenizer
from celerytp.core.validation import bad_request

# transformers' defaults for what a llava config.json leaves out (LlavaConfig, CLIPVisionConfig)
LLAVA_DEFAULTS = {"image_token_index": 32000, "vision_feature_select_strategy": "default"}
CLIP_DEFAULTS = {"image_size": 224, "patch_size": 32, "model_type": "clip_vision_model"}
# Gemma3Config's (transformers 5.25)
GEMMA3_DEFAULTS = {"mm_tokens_per_image": 256, "boi_token_index": 255_999, "eoi_token_index": 256_000,
                   "image_token_index": 262_144}


@dataclass(frozen=True)
class VisionInputs:
    """How a checkpoint's prompts hold images.

    image_token_id: the token whose places take an image's features, `tokens_per_image` of them
    per image. begin_token_id / end_token_id: where the chat template renders one begin token per
    image (gemma3's `<start_of_image>`), which the processor expands to blank lines, begin, the
    image tokens, end, blank lines; None where the template renders the image token itself (llava).
    bidirectional: an image's tokens attend to each other both ways at prefill (gemma3).
    """

    image_token_id: int
    tokens_per_image: int
    begin_token_id: int | None = None
    end_token_id: int | None = None
    bidirectional: bool = False

    def expansion(self, token_text: Callable[[int], str]) -> tuple[str, str]:
        """(what the template renders per image, the text transformers' processor puts in its place)."""
        image = token_text(self.image_token_id)
        if self.begin_token_id is None:
            return image, image * self.tokens_per_image
        begin, end = token_text(self.begin_token_id), token_text(self.end_token_id)
        return begin, f"\n\n{begin}{image * self.tokens_per_image}{end}\n\n"


def vision_inputs(hf_config: dict[str, Any]) -> VisionInputs | None:
    """Of a config.json's contents; None for a text-only model."""
    model_type = hf_config.get("model_type")
    if model_type == "gemma3" and hf_config.get("vision_config"):
        d = {**GEMMA3_DEFAULTS, **hf_config}
        return VisionInputs(int(d.get("image_token_id", d["image_token_index"])), int(d["mm_tokens_per_image"]),
                            int(d["boi_token_index"]), int(d["eoi_token_index"]), bidirectional=True)
    if model_type != "llava":
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
    if not config_file.is_file() or not (Path(path) / "preprocessor_config.json").is_file():
        return None  # a GGUF file; a checkpoint without an image processor is served as text
    return _read(str(config_file), os.path.getmtime(config_file))


def image_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 vision: VisionInputs, images: int) -> list[int]:
    """A chat with `images` images tokenized as transformers' processor does it: the template's
    mark for each image replaced by the image's tokens (`VisionInputs.expansion`), then tokenized;
    a 400 when the template did not mark each image."""
    text = tokenizer.render_chat(messages, tools)
    mark, expanded = vision.expansion(tokenizer.backend.id_to_token)
    if text.count(mark) != images:
        raise bad_request("messages", f"the model's chat template placed {text.count(mark)} images of {images}")
    return tokenizer.encode_rendered(text.replace(mark, expanded))


def runs(positions: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of sorted `positions` as [start, end) pairs: each image's places."""
    out: list[tuple[int, int]] = []
    for p in positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def whole_images(n: int, images: list[tuple[int, int]], low: int = 0) -> int:
    """`n` moved out of any image run it would split: to the run's start, or where that is not
    past `low`, to its end (a prefill piece of a model whose image tokens see their whole image)."""
    for start, end in images:
        if start < n < end:
            return start if start > low else end
    return n


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
