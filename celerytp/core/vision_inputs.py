"""What a vision-language checkpoint's prompts look like: its image token and how many places
each image takes. The leader reads it from config.json to expand a chat's image tokens; the ranks
check a request's prompt against it. No torch: the leader imports it too."""

from __future__ import annotations

import json
import math
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
# Qwen2_5_VLConfig's and Qwen2VLImageProcessor's
QWEN_VL_DEFAULTS = {"image_token_id": 151_655}
QWEN_VISION_DEFAULTS = {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
# Mistral3Config's and PixtralImageProcessor's
MISTRAL3_DEFAULTS = {"image_token_index": 10, "spatial_merge_size": 2}
PIXTRAL_PROCESSOR_DEFAULTS = {"size": {"longest_edge": 1024}, "patch_size": 16}


@dataclass(frozen=True)
class ImageGrid:
    """Qwen2-VL's image processor's resizing (transformers' `smart_resize`): each side rounded to
    whole merged patches, the area kept within [min_pixels, max_pixels], the aspect ratio as close
    as it can be. An image's tokens follow its size: one per merge x merge patches."""

    patch: int = 14
    merge: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280

    @classmethod
    def of(cls, vision: dict[str, Any], processor: dict[str, Any]) -> ImageGrid:
        size = processor.get("size") or {}
        v = {**QWEN_VISION_DEFAULTS, **vision}
        return cls(int(processor.get("patch_size", v["patch_size"])), int(processor.get("merge_size", v["spatial_merge_size"])),
                   int(processor.get("min_pixels") or size.get("shortest_edge") or cls.min_pixels),
                   int(processor.get("max_pixels") or size.get("longest_edge") or cls.max_pixels))

    def patches(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of patches of an image of this size once resized."""
        factor = self.patch * self.merge
        if max(height, width) / min(height, width) > 200:
            raise bad_request("messages", f"an image of {width}x{height} is too narrow (aspect ratio over 200)")
        h, w = round(height / factor) * factor, round(width / factor) * factor
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
        return h // self.patch, w // self.patch


@dataclass(frozen=True)
class PixtralGrid:
    """Mistral 3's image processor's resizing (PixtralImageProcessor, as PixtralProcessor calls it):
    an image larger than `longest_edge` scaled down into it, each side then rounded up to whole
    `cell`s (patch x spatial merge), one image token per cell. Its tokens follow its size."""

    longest_edge: int = 1024
    cell: int = 32

    @classmethod
    def of(cls, config: dict[str, Any], processor: dict[str, Any]) -> PixtralGrid:
        p = {**PIXTRAL_PROCESSOR_DEFAULTS, **processor}
        patch = p["patch_size"]["height"] if isinstance(p["patch_size"], dict) else p["patch_size"]
        size = p["size"]
        edge = size.get("longest_edge") or max(size.get("height", 0), size.get("width", 0))
        return cls(int(edge), int(patch) * int(config["spatial_merge_size"]))

    def cells(self, width: int, height: int) -> tuple[int, int]:
        """(rows, columns) of tokens of an image of this size."""
        ratio = max(height / self.longest_edge, width / self.longest_edge)
        if ratio > 1:
            height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
        return (height - 1) // self.cell + 1, (width - 1) // self.cell + 1


@dataclass(frozen=True)
class VisionInputs:
    """How a checkpoint's prompts hold images.

    image_token_id: the token whose places take an image's features: `tokens_per_image` of them
    per image, or where the image's size decides as many as its merged patches (`grid`,
    Qwen2.5-VL) or its cells (`cells`, Mistral 3, whose rows each end in `[IMG_BREAK]`, the last
    in `[IMG_END]`, tokens that take no feature). begin_token_id / end_token_id: where the chat
    template renders one begin token per image (gemma3's `<start_of_image>`), which the processor
    expands to blank lines, begin, the image tokens, end, blank lines; None where the template
    renders the image token itself. bidirectional: an image's tokens attend to each other both
    ways at prefill (gemma3).
    """

    image_token_id: int
    tokens_per_image: int = 0
    begin_token_id: int | None = None
    end_token_id: int | None = None
    bidirectional: bool = False
    grid: ImageGrid | None = None
    cells: PixtralGrid | None = None

    @property
    def sized(self) -> bool:
        """Whether an image's size decides its places."""
        return self.grid is not None or self.cells is not None

    def tokens(self, size: tuple[int, int]) -> int:
        """Places an image of `size` (width, height) takes."""
        if self.grid is not None:
            rows, columns = self.grid.patches(*size)
            return rows * columns // self.grid.merge**2
        if self.cells is not None:
            rows, columns = self.cells.cells(*size)
            return rows * columns
        return self.tokens_per_image

    def mark(self, token_text: Callable[[int], str]) -> str:
        """What the chat template renders for each image."""
        return token_text(self.image_token_id if self.begin_token_id is None else self.begin_token_id)

    def expansion(self, token_text: Callable[[int], str], size: tuple[int, int]) -> str:
        """The text transformers' processor puts in the mark's place for an image of `size`."""
        image = token_text(self.image_token_id)
        if self.cells is not None:
            rows, columns = self.cells.cells(*size)
            return f"{image * columns}[IMG_BREAK]" * (rows - 1) + f"{image * columns}[IMG_END]"
        if self.begin_token_id is None:
            return image * self.tokens(size)
        begin, end = token_text(self.begin_token_id), token_text(self.end_token_id)
        return f"\n\n{begin}{image * self.tokens(size)}{end}\n\n"


def vision_inputs(hf_config: dict[str, Any], processor: dict[str, Any] | None = None) -> VisionInputs | None:
    """Of a config.json's contents (and its preprocessor_config.json's); None for a text-only model."""
    model_type = hf_config.get("model_type")
    if model_type == "gemma3" and hf_config.get("vision_config"):
        d = {**GEMMA3_DEFAULTS, **hf_config}
        return VisionInputs(int(d.get("image_token_id", d["image_token_index"])), int(d["mm_tokens_per_image"]),
                            int(d["boi_token_index"]), int(d["eoi_token_index"]), bidirectional=True)
    if model_type == "mistral3":
        d = {**MISTRAL3_DEFAULTS, **hf_config}
        return VisionInputs(int(d.get("image_token_id", d["image_token_index"])), cells=PixtralGrid.of(d, processor or {}))
    if model_type in ("qwen2_5_vl", "qwen3_vl"):
        d = {**QWEN_VL_DEFAULTS, **hf_config}
        return VisionInputs(int(d["image_token_id"]), grid=ImageGrid.of(d.get("vision_config") or {}, processor or {}))
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
def _read(config_file: str, processor_file: str, mtimes: tuple[float, float]) -> VisionInputs | None:
    with open(config_file, encoding="utf-8") as f, open(processor_file, encoding="utf-8") as g:
        return vision_inputs(json.load(f), json.load(g))


@lru_cache(maxsize=16)
def _read_gguf(path: str, mmproj: str, mtimes: tuple[float, float]) -> VisionInputs | None:
    from celerytp.core.gguf_vision import gguf_vision  # the two GGUF headers

    return vision_inputs(*gguf_vision(path, mmproj))  # Qwen2.5-VL's image grid is the processor's


def checkpoint_vision(path: str, mmproj: str | None = None) -> VisionInputs | None:
    """Of the checkpoint at `path` (a directory with config.json; a GGUF file: text only, or with
    llama.cpp's `mmproj` file beside it: core/gguf_vision.py)."""
    if mmproj is not None:
        return _read_gguf(path, mmproj, (Path(path).stat().st_mtime, Path(mmproj).stat().st_mtime))
    config_file, processor_file = Path(path) / "config.json", Path(path) / "preprocessor_config.json"
    if not config_file.is_file() or not processor_file.is_file():
        return None  # a GGUF file; a checkpoint without an image processor is served as text
    return _read(str(config_file), str(processor_file), (config_file.stat().st_mtime, processor_file.stat().st_mtime))


def image_prompt(tokenizer: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 vision: VisionInputs, sizes: list[tuple[int, int]]) -> list[int]:
    """A chat with images of `sizes` tokenized as transformers' processor does it: the template's
    mark for each image replaced by the image's tokens (`VisionInputs.expansion`), then tokenized;
    a 400 when the template did not mark each image."""
    text = tokenizer.render_chat(messages, tools)
    pieces = text.split(vision.mark(tokenizer.backend.id_to_token))
    if len(pieces) != len(sizes) + 1:
        raise bad_request("messages", f"the model's chat template placed {len(pieces) - 1} images of {len(sizes)}")
    out = pieces[0]
    for size, piece in zip(sizes, pieces[1:]):
        out += vision.expansion(tokenizer.backend.id_to_token, size) + piece
    return tokenizer.encode_rendered(out)


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


def mrope_positions(ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]],
                    merge: int) -> tuple[list[list[int]], int]:
    """Multimodal rotary positions (temporal, height, width) of `ids`, as transformers'
    Qwen2.5-VL `get_rope_index` makes them, and the delta decoding adds to a position after them.

    Text counts on from where the last token left off, the same in all three; an image (a run of
    image tokens, grid (t, h, w) patches in turn) sits at that start plus its merged patch's
    (t, row, column), and the text after it starts past its largest row or column."""
    streams: list[list[int]] = [[], [], []]
    at, images, i = 0, iter(grids), 0
    while i < len(ids):
        if ids[i] != image_token_id:
            for stream in streams:
                stream.append(at)
            at, i = at + 1, i + 1
            continue
        t, h, w = next(images)
        h, w = h // merge, w // merge
        for frame in range(t):
            for row in range(h):
                for column in range(w):
                    streams[0].append(at + frame)
                    streams[1].append(at + row)
                    streams[2].append(at + column)
        i += t * h * w
        at += max(h, w)
    return streams, at - len(ids)


def check_placeholders(prompt: list[int], vision: VisionInputs | None, tokens: int, images: int) -> None:
    """A prompt with `images` images must hold their `tokens` image tokens and no other (a 400 naming `images`)."""
    if vision is None:
        if images:
            raise bad_request("images", "this model takes no images (it is not a vision-language model)")
        return
    placed = prompt.count(vision.image_token_id)
    if placed != tokens:
        raise bad_request("images", f"the prompt holds {placed} image tokens; its {images} images need {tokens}")
