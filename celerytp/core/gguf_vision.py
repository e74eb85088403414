"""A Gemma 3 language-model GGUF with llama.cpp's mmproj GGUF beside it, read as the gemma3
config.json and preprocessor_config.json they were converted from. No torch: the leader reads it
to expand a chat's images (vision_inputs.py `checkpoint_vision`); the ranks build their vision
tower and image processor from it (loading/gguf_mmproj.py).

An mmproj is what convert_hf_to_gguf.py --mmproj writes for Gemma3ForConditionalGeneration
(Gemma3VisionModel, an MmprojModel), clip.cpp's format: general.architecture "clip", general.type
"mmproj", `clip.has_vision_encoder`, `clip.projector_type` "gemma3" (`clip.vision.projector_type`
in files with several encoders), and the SigLIP tower's `clip.vision.*`: image_size, patch_size,
embedding_length, feed_forward_length, block_count, attention.head_count,
attention.layer_norm_epsilon, projection_dim (the text model's hidden size), image_mean and
image_std (from preprocessor_config.json), `clip.use_gelu` true (SigLIP's gelu_pytorch_tanh; ggml's
gelu is the tanh one). The pooling is not written for Gemma 3 itself: clip.cpp takes 4 (patches per
side pooled to one), and the converter writes `clip.vision.projector.scale_factor` only where the
processor's image_seq_length makes it another (test models): mm_tokens_per_image is
((image_size / patch_size) / scale_factor) ** 2. clip.cpp resizes every image to image_size square,
bilinear, then scales by 1/255 and normalizes, as Gemma3ImageProcessor does (pan-and-scan off).

The image tokens are none of the mmproj's: Gemma3Processor's `<start_of_image>`,
`<end_of_image>` and `<image_soft_token>` are looked up in the language model's GGUF vocabulary
(clip.cpp wraps an image in the first two), else Gemma3Config's default ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.gguf_metadata import read_gguf_metadata
from celerytp.core.model_files import is_gguf_file

MMPROJ_ARCH = "clip"
PROJECTORS = ("gemma3",)  # clip.cpp projector types we serve
TEXT_ARCHS = {"gemma3": "gemma3"}  # projector -> the language model architecture it feeds
SCALE_FACTOR = 4  # clip.cpp's gemma3 n_merge when the file has no clip.vision.projector.scale_factor
# Gemma3Processor's tokens -> Gemma3Config's keys and default ids (transformers 5.25)
IMAGE_TOKENS = {
    "<start_of_image>": ("boi_token_index", 255_999),
    "<end_of_image>": ("eoi_token_index", 256_000),
    "<image_soft_token>": ("image_token_index", 262_144),
}
BILINEAR = 2  # PIL.Image.Resampling.BILINEAR, as preprocessor_config.json writes it


def _failed(message: str) -> CeleryTPError:
    return CeleryTPError(ErrorKind.LOAD_FAILED, message)


def mmproj_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mmproj's metadata, checked: a clip file with a vision encoder and a projector we serve
    (UNSUPPORTED_ARCH naming it otherwise)."""
    if not is_gguf_file(path):
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"mmproj {path}: not a GGUF file")
    meta = read_gguf_metadata(path)  # load_failed naming the file for a damaged one
    arch = meta.get("general.architecture")
    if arch != MMPROJ_ARCH:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"mmproj {path}: general.architecture {arch!r}, "
                                                        f"llama.cpp's mmproj files are {MMPROJ_ARCH!r}")
    if not meta.get("clip.has_vision_encoder"):
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"mmproj {path}: no vision encoder (clip.has_vision_encoder)")
    projector = meta.get("clip.vision.projector_type") or meta.get("clip.projector_type")
    if projector not in PROJECTORS:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"mmproj {path}: projector type {projector!r} is not "
                                                        f"supported (supported: {', '.join(PROJECTORS)})")
    return meta


def vision_config(text: dict[str, Any], mmproj: dict[str, Any], where: str) -> dict[str, Any]:
    """The gemma3 config.json keys beside text_config that the two files stand for: model_type,
    vision_config (SiglipVisionConfig's keys), mm_tokens_per_image and the image token ids.
    `text`, `mmproj`: the two files' metadata (mmproj checked by mmproj_metadata)."""
    projector = mmproj.get("clip.vision.projector_type") or mmproj.get("clip.projector_type")
    arch = text.get("general.architecture")
    if arch != TEXT_ARCHS[projector]:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{where}: a {projector} mmproj goes with a "
                                                        f"{TEXT_ARCHS[projector]} language model, not {arch!r}")

    def key(name: str) -> Any:
        value = mmproj.get(f"clip.vision.{name}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _failed(f"{where}: mmproj clip.vision.{name} is {value!r}, a positive integer is required")
        return value

    hidden, projection = text.get(f"{arch}.embedding_length"), key("projection_dim")
    if projection != hidden:
        raise _failed(f"{where}: mmproj projection_dim {projection} is not the language model's hidden size {hidden}")
    image_size, patch_size = key("image_size"), key("patch_size")
    grid, merge = image_size // patch_size, mmproj.get("clip.vision.projector.scale_factor", SCALE_FACTOR)
    if not isinstance(merge, int) or merge < 1 or grid % merge:
        raise _failed(f"{where}: mmproj projector scale_factor {merge!r} does not divide its {grid}x{grid} patch grid")
    tokens = text.get("tokenizer.ggml.tokens") or []
    ids = {name: tokens.index(t) if t in tokens else default for t, (name, default) in IMAGE_TOKENS.items()}
    return {
        "model_type": "gemma3",
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": key("embedding_length"),
            "intermediate_size": key("feed_forward_length"),
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": key("attention.head_count"),
            "num_channels": 3,
            "image_size": image_size,
            "patch_size": patch_size,
            "hidden_act": "silu" if mmproj.get("clip.use_silu") else "gelu_pytorch_tanh",
            "layer_norm_eps": float(mmproj.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            "vision_use_head": False,  # the converter drops SigLIP's pooling head
        },
        "mm_tokens_per_image": (grid // merge) ** 2,
        **ids,
    }


def image_processor(mmproj: dict[str, Any]) -> dict[str, Any]:
    """The preprocessor_config.json (Gemma3ImageProcessor's settings) the mmproj was written from."""
    size = mmproj.get("clip.vision.image_size")
    mean, std = mmproj.get("clip.vision.image_mean"), mmproj.get("clip.vision.image_std")
    if not all(isinstance(v, list) and len(v) == 3 for v in (mean, std)):
        raise _failed(f"mmproj clip.vision.image_mean {mean!r} / image_std {std!r}: 3 values each are required")
    return {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": size, "width": size},
        "resample": BILINEAR,
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [float(v) for v in mean],
        "image_std": [float(v) for v in std],
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
    }


def gguf_vision(path: str | os.PathLike[str], mmproj: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vision_config's keys, preprocessor_config.json) of the language model at `path` (a .gguf
    file) with the mmproj at `mmproj`."""
    if not Path(path).is_file() or not is_gguf_file(path):
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{path}: an mmproj goes with a GGUF language model file")
    meta = mmproj_metadata(mmproj)
    return vision_config(read_gguf_metadata(path), meta, str(path)), image_processor(meta)
