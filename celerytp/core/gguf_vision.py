"""A language-model GGUF with llama.cpp's mmproj GGUF beside it (Gemma 3, Qwen2.5-VL), read as the
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

For Qwen2.5-VL (Qwen2VLVisionModel, projector "qwen2.5vl_merger", beside the `qwen2vl` language
model of Qwen2VLModel) the converter writes MmprojModel's keys from vision_config: image_size (560:
Qwen has none), patch_size, embedding_length (hidden_size), feed_forward_length
(intermediate_size), block_count (depth), attention.head_count (num_heads), projection_dim (the
text hidden size, = out_hidden_size), image_mean/std; then `clip.use_silu` true,
`clip.vision.n_wa_pattern` = fullatt_block_indexes[0] + 1 (it refuses indexes not spaced so), and
attention.layer_norm_epsilon = the text model's rms_norm_eps (transformers' vision RMSNorms use
1e-6 whatever it says; so does models/qwen_vision.py). What it does not write is taken as clip.cpp
(load_hparams, the qwen2vl graph) takes it: full attention in the layers i with (i + 1) %
n_wa_pattern == 0 (`clip.vision.wa_layer_indexes`, where a file has it, lists them), windows of 112
pixels (attn_window_size; `clip.vision.window_size` where present), spatial_merge_size 2
(`clip.vision.spatial_merge_size` where present), temporal_patch_size 2 (the converter asserts it),
vision rope theta 10000. The image processor is Qwen2VLImageProcessor's (bicubic, as clip.cpp
resizes Qwen-VL images) with clip.cpp's bounds on an image's merged tokens, 8 to 4096
(set_limit_image_tokens: pixels = tokens * (patch * merge) ** 2; `clip.vision.image_min_pixels` /
`image_max_pixels` where present), not transformers' defaults (3136 to 1003520 pixels). The text
model's M-RoPE sections are the language model's `qwen2vl.rope.dimension_sections`, [t, h, w, 0].
The image tokens, Qwen2_5_VLProcessor's `<|image_pad|>`, `<|vision_start|>` and `<|vision_end|>`,
are looked up in the language model's vocabulary, else Qwen2_5_VLConfig's default ids.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.gguf_metadata import read_gguf_metadata
from celerytp.core.model_files import is_gguf_file

MMPROJ_ARCH = "clip"
QWEN25VL = "qwen2.5vl_merger"  # gguf VisionProjectorType.QWEN25VL
PROJECTORS = ("gemma3", QWEN25VL)  # clip.cpp projector types we serve
TEXT_ARCHS = {"gemma3": "gemma3", QWEN25VL: "qwen2vl"}  # projector -> the language model architecture it feeds
SCALE_FACTOR = 4  # clip.cpp's gemma3 n_merge when the file has no clip.vision.projector.scale_factor
# Gemma3Processor's tokens -> Gemma3Config's keys and default ids (transformers 5.25)
IMAGE_TOKENS = {
    "<start_of_image>": ("boi_token_index", 255_999),
    "<end_of_image>": ("eoi_token_index", 256_000),
    "<image_soft_token>": ("image_token_index", 262_144),
}
BILINEAR, BICUBIC = 2, 3  # PIL.Image.Resampling's, as preprocessor_config.json writes them
# Qwen2_5_VLProcessor's tokens -> Qwen2_5_VLConfig's keys and default ids (transformers 5.25)
QWEN_TOKENS = {
    "<|image_pad|>": ("image_token_id", 151_655),
    "<|vision_start|>": ("vision_start_token_id", 151_652),
    "<|vision_end|>": ("vision_end_token_id", 151_653),
}
# clip.cpp's Qwen-VL settings for what the converter does not write
QWEN_MERGE, QWEN_TEMPORAL_PATCH, QWEN_WINDOW = 2, 2, 112
QWEN_MIN_TOKENS, QWEN_MAX_TOKENS = 8, 4096  # hparams.set_limit_image_tokens(8, 4096)


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
    projector = _projector(meta)
    if projector not in PROJECTORS:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"mmproj {path}: projector type {projector!r} is not "
                                                        f"supported (supported: {', '.join(PROJECTORS)})")
    return meta


def _projector(mmproj: dict[str, Any]) -> str:
    return mmproj.get("clip.vision.projector_type") or mmproj.get("clip.projector_type")


def _positive(mmproj: dict[str, Any], name: str, where: str, default: int | None = None) -> int:
    """`clip.vision.{name}`: a positive integer (`default` where absent and one is given), else LOAD_FAILED."""
    value = mmproj.get(f"clip.vision.{name}", default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _failed(f"{where}: mmproj clip.vision.{name} is {value!r}, a positive integer is required")
    return value


def _token_ids(text: dict[str, Any], tokens: dict[str, tuple[str, int]]) -> dict[str, int]:
    """The config keys of `tokens`: each one's id in the language model's vocabulary, else its default."""
    vocabulary = text.get("tokenizer.ggml.tokens") or []
    return {name: vocabulary.index(t) if t in vocabulary else default for t, (name, default) in tokens.items()}


def vision_config(text: dict[str, Any], mmproj: dict[str, Any], where: str) -> dict[str, Any]:
    """The config.json keys beside text_config that the two files stand for: model_type,
    vision_config, the image token ids and the projector's own (gemma3: mm_tokens_per_image;
    qwen2_5_vl: text_config.rope_parameters.mrope_section, to merge into the language model's).
    `text`, `mmproj`: the two files' metadata (mmproj checked by mmproj_metadata)."""
    projector = _projector(mmproj)
    arch = text.get("general.architecture")
    if arch != TEXT_ARCHS[projector]:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{where}: a {projector} mmproj goes with a "
                                                        f"{TEXT_ARCHS[projector]} language model, not {arch!r}")
    hidden, projection = text.get(f"{arch}.embedding_length"), _positive(mmproj, "projection_dim", where)
    if projection != hidden:
        raise _failed(f"{where}: mmproj projection_dim {projection} is not the language model's hidden size {hidden}")
    if projector == QWEN25VL:
        return qwen2_5_vl_config(text, mmproj, where)
    return gemma3_config(text, mmproj, where)


def gemma3_config(text: dict[str, Any], mmproj: dict[str, Any], where: str) -> dict[str, Any]:
    """A gemma3 config.json's model_type, vision_config (SiglipVisionConfig's keys),
    mm_tokens_per_image and image token ids."""
    image_size, patch_size = _positive(mmproj, "image_size", where), _positive(mmproj, "patch_size", where)
    grid, merge = image_size // patch_size, mmproj.get("clip.vision.projector.scale_factor", SCALE_FACTOR)
    if not isinstance(merge, int) or merge < 1 or grid % merge:
        raise _failed(f"{where}: mmproj projector scale_factor {merge!r} does not divide its {grid}x{grid} patch grid")
    return {
        "model_type": "gemma3",
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": _positive(mmproj, "embedding_length", where),
            "intermediate_size": _positive(mmproj, "feed_forward_length", where),
            "num_hidden_layers": _positive(mmproj, "block_count", where),
            "num_attention_heads": _positive(mmproj, "attention.head_count", where),
            "num_channels": 3,
            "image_size": image_size,
            "patch_size": patch_size,
            "hidden_act": "silu" if mmproj.get("clip.use_silu") else "gelu_pytorch_tanh",
            "layer_norm_eps": float(mmproj.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
            "vision_use_head": False,  # the converter drops SigLIP's pooling head
        },
        "mm_tokens_per_image": (grid // merge) ** 2,
        **_token_ids(text, IMAGE_TOKENS),
    }


def qwen2_5_vl_config(text: dict[str, Any], mmproj: dict[str, Any], where: str) -> dict[str, Any]:
    """A qwen2_5_vl config.json's model_type, vision_config (Qwen2_5_VLVisionConfig's keys), image
    token ids and the text model's mrope_section (under text_config.rope_parameters)."""
    depth = _positive(mmproj, "block_count", where)
    return {
        "model_type": "qwen2_5_vl",
        "vision_config": {
            "model_type": "qwen2_5_vl_vision",
            "depth": depth,
            "hidden_size": _positive(mmproj, "embedding_length", where),
            "intermediate_size": _positive(mmproj, "feed_forward_length", where),
            "num_heads": _positive(mmproj, "attention.head_count", where),
            "in_channels": 3,
            "patch_size": _positive(mmproj, "patch_size", where),
            "spatial_merge_size": _positive(mmproj, "spatial_merge_size", where, QWEN_MERGE),
            "temporal_patch_size": QWEN_TEMPORAL_PATCH,
            "window_size": _positive(mmproj, "window_size", where, QWEN_WINDOW),
            "fullatt_block_indexes": _full_attention_layers(mmproj, depth, where),
            "out_hidden_size": _positive(mmproj, "projection_dim", where),
            "hidden_act": "silu" if mmproj.get("clip.use_silu") else "gelu_pytorch_tanh",
        },
        "text_config": {"rope_parameters": {"mrope_section": _mrope_section(text, where)}},
        **_token_ids(text, QWEN_TOKENS),
    }


def _full_attention_layers(mmproj: dict[str, Any], depth: int, where: str) -> list[int]:
    """The vision layers attending over whole frames: `clip.vision.wa_layer_indexes` as listed, else
    those with (i + 1) % n_wa_pattern == 0 (clip.cpp's qwen2vl graph; 0: no windows, every layer)."""
    listed = mmproj.get("clip.vision.wa_layer_indexes")
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(i, int) and 0 <= i < depth for i in listed):
            raise _failed(f"{where}: mmproj clip.vision.wa_layer_indexes {listed!r}: layer indexes below "
                          f"block_count {depth} are required")
        return sorted(listed)
    pattern = mmproj.get("clip.vision.n_wa_pattern")
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 0:
        raise _failed(f"{where}: mmproj clip.vision.n_wa_pattern is {pattern!r}, a qwen2.5vl_merger mmproj "
                      "needs a non-negative integer (or clip.vision.wa_layer_indexes)")
    return [i for i in range(depth) if pattern == 0 or (i + 1) % pattern == 0]


def _mrope_section(text: dict[str, Any], where: str) -> list[int]:
    """The language model's `qwen2vl.rope.dimension_sections` [t, h, w, 0] as mrope_section [t, h, w],
    checked against its rotary pairs (head_dim / 2)."""
    sections = text.get("qwen2vl.rope.dimension_sections")
    if (not isinstance(sections, list) or len(sections) < 3 or any(sections[3:])
            or not all(isinstance(s, int) and s >= 0 for s in sections)):
        raise _failed(f"{where}: qwen2vl.rope.dimension_sections is {sections!r}, [t, h, w] (then zeros) is required")
    heads = text.get("qwen2vl.attention.head_count") or 1
    head_dim = text.get("qwen2vl.attention.key_length") or (text.get("qwen2vl.embedding_length") or 0) // heads
    if sum(sections[:3]) * 2 != head_dim:
        raise _failed(f"{where}: qwen2vl.rope.dimension_sections {sections[:3]} cover {sum(sections[:3])} rotary "
                      f"pairs, the head has {head_dim // 2}")
    return list(sections[:3])


def image_processor(mmproj: dict[str, Any]) -> dict[str, Any]:
    """The preprocessor_config.json (Gemma3ImageProcessor's or Qwen2VLImageProcessor's settings) the
    mmproj was written from."""
    mean, std = mmproj.get("clip.vision.image_mean"), mmproj.get("clip.vision.image_std")
    if not all(isinstance(v, list) and len(v) == 3 for v in (mean, std)):
        raise _failed(f"mmproj clip.vision.image_mean {mean!r} / image_std {std!r}: 3 values each are required")
    common = {
        "do_resize": True,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [float(v) for v in mean],
        "image_std": [float(v) for v in std],
        "do_convert_rgb": True,
    }
    if _projector(mmproj) == QWEN25VL:
        return {"image_processor_type": "Qwen2VLImageProcessor", **common, **_qwen_resizing(mmproj)}
    size = mmproj.get("clip.vision.image_size")
    return {
        "image_processor_type": "Gemma3ImageProcessor",
        "size": {"height": size, "width": size},
        "resample": BILINEAR,
        **common,
        "do_pan_and_scan": False,
    }


def _qwen_resizing(mmproj: dict[str, Any]) -> dict[str, Any]:
    """Qwen2VLImageProcessor's patching and its bounds on an image's area (clip.cpp's: 8 to 4096
    merged tokens, where the file states no pixel bounds)."""
    patch = _positive(mmproj, "patch_size", "mmproj")
    merge = _positive(mmproj, "spatial_merge_size", "mmproj", QWEN_MERGE)
    tokens_area = (patch * merge) ** 2
    low = _positive(mmproj, "image_min_pixels", "mmproj", QWEN_MIN_TOKENS * tokens_area)
    high = _positive(mmproj, "image_max_pixels", "mmproj", QWEN_MAX_TOKENS * tokens_area)
    return {
        "size": {"shortest_edge": low, "longest_edge": high},
        "resample": BICUBIC,
        "patch_size": patch,
        "temporal_patch_size": QWEN_TEMPORAL_PATCH,
        "merge_size": merge,
    }


def gguf_vision(path: str | os.PathLike[str], mmproj: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(vision_config's keys, preprocessor_config.json) of the language model at `path` (a .gguf
    file) with the mmproj at `mmproj`."""
    if not Path(path).is_file() or not is_gguf_file(path):
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{path}: an mmproj goes with a GGUF language model file")
    meta = mmproj_metadata(mmproj)
    return vision_config(read_gguf_metadata(path), meta, str(path)), image_processor(meta)
