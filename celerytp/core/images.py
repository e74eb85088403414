"""Image inputs: taken out of a chat's messages, checked, and carried to the ranks as bytes.

A chat message's content may hold OpenAI image parts, `{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`; a Leader caller may also give `{"type": "image", "image": b"..."}`
(the file's bytes) or a path in the model's directory. Each is checked here, on the leader, before
anything is queued: its format (PNG, JPEG or WebP, the file's own bytes, not only its label), its
size in bytes and pixels, and that it decodes. Every failure is a 400 naming the part and the limit.
The message keeps a `{"type": "image"}` part in its place, which the model's chat template renders
as its image token.

The request carries each image's file bytes (base64 in JSON: tensors never travel through Redis);
every rank decodes them with the model's own transformers image processor (worker/image_features.py),
so the pixels are exactly transformers'. An image's SHA-256 keys prefix reuse (`content_keys`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import urlsplit

from celerytp.core.validation import bad_request

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry: images in all, bytes of each file, pixels of each image."""

    images: int = 8
    bytes: int = 8 << 20
    pixels: int = 4096 * 4096


DEFAULT_LIMITS = ImageLimits()


def take_images(messages: list[dict[str, Any]], vision: bool, limits: ImageLimits = DEFAULT_LIMITS,
                roots: Sequence[str] = ()) -> tuple[list[dict[str, Any]], list[bytes]]:
    """`messages` with each image part as `{"type": "image"}`, and the images' bytes in order.

    Messages without image parts come back as they are. `vision`: whether the model takes images
    (else an image part is a 400). `roots`: where a Leader caller's image paths may point (the
    loaded model's directory); empty, no path is taken."""
    images: list[bytes] = []
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(part) for part in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if not _is_image(part):
                parts.append(part)
                continue
            field = f"messages[{i}].content[{j}]"
            if not vision:
                raise bad_request(field, "this model takes no images (it is not a vision-language model)")
            if len(images) == limits.images:
                raise bad_request(field, f"more than {limits.images} images in one request (the limit per request)")
            data = _image_bytes(part, field, limits, roots)
            check_image(data, field, limits)
            images.append(data)
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "image")


def _image_bytes(part: dict[str, Any], field: str, limits: ImageLimits, roots: Sequence[str]) -> bytes:
    if part["type"] == "image":  # a Leader caller's bytes or path
        given = part.get("image")
        if isinstance(given, (bytes, bytearray)):
            data = bytes(given)
        elif isinstance(given, (str, os.PathLike)):
            data = _read_under_roots(os.fspath(given), field, limits, roots)
        else:
            raise bad_request(f"{field}.image", "the image's bytes or a path under the model roots is required")
    else:
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise bad_request(f"{field}.image_url.url", "a data URL (data:image/png;base64,...) is required")
        data = _from_url(url, f"{field}.image_url.url", limits)
    if len(data) > limits.bytes:
        raise bad_request(field, f"the image is {len(data)} bytes, over the limit of {limits.bytes} bytes per image")
    return data


def _from_url(url: str, field: str, limits: ImageLimits) -> bytes:
    scheme = urlsplit(url[:64]).scheme.lower()
    if scheme in ("http", "https"):
        raise bad_request(field, "remote image URLs are not fetched by this server; send the image inline "
                                 "as a data URL (data:image/png;base64,...)")
    if scheme != "data":
        raise bad_request(field, "a data URL (data:image/png;base64,...) is required")
    header, comma, payload = url.partition(",")
    mime, _, encoding = header[len("data:"):].partition(";")
    if not comma or encoding.lower() != "base64":
        raise bad_request(field, "a base64 data URL (data:image/png;base64,...) is required")
    if mime.lower() not in FORMATS:
        raise bad_request(field, f"{mime[:40]!r} is not an image format this server takes (PNG, JPEG, WebP)")
    if len(payload) > (limits.bytes + 2) // 3 * 4 + 4:
        raise bad_request(field, f"the image is over the limit of {limits.bytes} bytes per image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(field, "the data URL is not valid base64") from None


def _read_under_roots(path: str, field: str, limits: ImageLimits, roots: Sequence[str]) -> bytes:
    real = os.path.realpath(path)
    if "\x00" in path or not any(os.path.commonpath([real, os.path.realpath(r)]) == os.path.realpath(r) for r in roots):
        raise bad_request(f"{field}.image", "an image path must lie under the model's directory; send its bytes instead")
    try:
        with open(real, "rb") as f:
            return f.read(limits.bytes + 1)
    except OSError as exc:
        raise bad_request(f"{field}.image", f"cannot read the image file: {exc.strerror}") from None


def check_image(data: bytes, field: str, limits: ImageLimits = DEFAULT_LIMITS) -> None:
    """A 400 unless `data` is a PNG, JPEG or WebP file within `limits.pixels` that decodes."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            kind = image.format
            width, height = image.size
            if kind not in FORMATS.values():
                raise bad_request(field, f"{kind} images are not taken (PNG, JPEG, WebP)")
            if width * height > limits.pixels:
                raise bad_request(field, f"the image is {width}x{height}, over the limit of {limits.pixels} "
                                         "pixels per image")
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                image.load()  # the whole file decodes (a truncated or corrupt one fails here)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombWarning,
            Image.DecompressionBombError) as exc:
        raise bad_request(field, f"the image cannot be decoded ({type(exc).__name__})") from None


def encode(images: list[bytes]) -> list[str]:
    """Images as the request carries them: base64 text."""
    return [base64.b64encode(data).decode("ascii") for data in images]


def decode(images: list[str]) -> list[bytes]:
    return [base64.b64decode(text) for text in images]


def content_keys(prompt: list[int], image_token_id: int, tokens_per_image: int, images: list[str]) -> list[int]:
    """`prompt` with each image's placeholder tokens replaced by a key of the image's content (its
    base64 text, as the request carries it): a negative number, never a token id, so that a cached
    prefix is reused only where the same images sit in the same places."""
    keys = list(prompt)
    at = [i for i, t in enumerate(prompt) if t == image_token_id]
    for n, text in enumerate(images):
        key = _content_key(text)
        for i in at[n * tokens_per_image : (n + 1) * tokens_per_image]:
            keys[i] = key
    return keys


@lru_cache(maxsize=256)
def _content_key(text: str) -> int:
    return -1 - int.from_bytes(hashlib.sha256(text.encode("ascii")).digest()[:7], "big")
