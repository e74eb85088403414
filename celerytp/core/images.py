"""Image inputs: taken out of a chat's messages, checked, and carried to the ranks as bytes.

A chat message's content may hold OpenAI image parts, `{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`; a Leader caller may also give `{"type": "image", "image": b"..."}`
(the file's bytes) or a path in the model's directory. Each is checked here, on the leader, before
anything is queued: its format (PNG, JPEG or WebP, the file's own bytes, not only its label), its
size in bytes and pixels, and that it decodes. Every failure is a 400 naming the part and the limit.
A remote `http(s)` image URL is refused, unless its host is one of the media domains the operator
allows (vLLM's --allowed-media-domains): then it is fetched (`fetch_image`), within a deadline and
the byte limit, redirects not followed, and checked as a data URL's image is.
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
import http.client
import io
import ipaddress
import math
import os
import re
import socket
import ssl
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any
from urllib.parse import SplitResult, urlsplit

from celerytp.core.errors import CeleryTPError
from celerytp.core.secrets import clipped
from celerytp.core.validation import bad_request

FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
ENV = {"domains": "CELERYTP_ALLOWED_MEDIA_DOMAINS", "fetch_timeout": "CELERYTP_MEDIA_FETCH_TIMEOUT"}
_LABEL = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?")


@dataclass(frozen=True)
class ImageLimits:
    """What one request may carry, and where its images may come from.

    Args:
    images, bytes, pixels: images in all, bytes of each file, pixels of each image.
    domains: the hosts whose http(s) image URLs are fetched, each matched exactly (case-insensitive;
        a subdomain is not included: list it too); empty: a remote URL is refused.
    fetch_timeout: seconds one fetch may take in all (name lookup, connect, TLS, answer).
    """

    images: int = 8
    bytes: int = 8 << 20
    pixels: int = 4096 * 4096
    domains: frozenset[str] = frozenset()
    fetch_timeout: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.domains, str):
            raise TypeError("ImageLimits.domains takes a collection of host names, not one string")
        object.__setattr__(self, "domains", frozenset(checked_domain(d) for d in self.domains))
        if not (isinstance(self.fetch_timeout, (int, float)) and math.isfinite(self.fetch_timeout)
                and self.fetch_timeout > 0):
            raise ValueError(f"the media fetch timeout (${ENV['fetch_timeout']}) must be a number of seconds > 0, "
                             f"got {clipped(self.fetch_timeout)!r}")

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ImageLimits:
        """The limits with $CELERYTP_ALLOWED_MEDIA_DOMAINS (comma-separated) and $CELERYTP_MEDIA_FETCH_TIMEOUT
        (seconds) where set: how `celerytp serve` hands them to its HTTP API and its Celery front door."""
        values: dict[str, Any] = {}
        domains = env.get(ENV["domains"], "").strip()
        if domains:
            try:
                values["domains"] = media_domains(domains)
            except ValueError as exc:
                raise ValueError(f"${ENV['domains']}: {exc}") from None
        timeout = env.get(ENV["fetch_timeout"], "").strip()
        if timeout:
            try:
                values["fetch_timeout"] = float(timeout)
            except ValueError:
                raise ValueError(f"${ENV['fetch_timeout']} must be a number of seconds, got {clipped(timeout)!r}") from None
        return cls(**values)

    def as_env(self) -> dict[str, str]:
        return {ENV["domains"]: ",".join(sorted(self.domains)), ENV["fetch_timeout"]: repr(float(self.fetch_timeout))}


DEFAULT_LIMITS = ImageLimits()


def media_domains(text: str) -> frozenset[str]:
    """The host names of a comma-separated list (`a.com,b.org`), each checked (`checked_domain`)."""
    names = [name.strip() for name in text.split(",")]
    if not any(names):
        raise ValueError("no domain named (give host names, comma-separated, such as images.example.com)")
    if "" in names:
        raise ValueError(f"an empty name in {clipped(text)!r}")
    return frozenset(checked_domain(name) for name in names)


def checked_domain(name: str) -> str:
    """A host name (or IP address) as a URL's host is compared with it: lower case, no final dot."""
    host = _host_key(name) if isinstance(name, str) else ""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not 0 < len(host) <= 253 or not all(_LABEL.fullmatch(label) for label in host.split(".")):
        raise ValueError(f"{clipped(name)!r} is not a host name (such as images.example.com: no scheme, port or path)")
    return host


def _host_key(host: str) -> str:
    host = host.strip().lower().removesuffix(".")
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return host


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
        scheme = urlsplit(url[:64]).scheme.lower()
        if scheme in ("http", "https"):
            data = fetch_image(url, f"{field}.image_url.url", limits)
        else:
            data = _from_url(url, f"{field}.image_url.url", limits)
    if len(data) > limits.bytes:
        raise bad_request(field, f"the image is {len(data)} bytes, over the limit of {limits.bytes} bytes per image")
    return data


def _from_url(url: str, field: str, limits: ImageLimits) -> bytes:
    if urlsplit(url[:64]).scheme.lower() != "data":
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


def fetch_image(url: str, field: str, limits: ImageLimits = DEFAULT_LIMITS) -> bytes:
    """The bytes of an http(s) image URL whose host is one of `limits.domains`, fetched within
    `limits.fetch_timeout` seconds in all and `limits.bytes`; a redirect is not followed. Any
    failure (a host not allowed, no answer, a status other than 200, too large) is a 400 naming it."""
    if not limits.domains:
        raise bad_request(field, "remote image URLs are not fetched by this server (it allows no media domains: "
                                 "`celerytp serve --allowed-media-domains`); send the image inline as a data URL "
                                 "(data:image/png;base64,...)")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # a port that is not a number raises here
    except ValueError:
        raise bad_request(field, "not a valid URL") from None
    if parts.scheme.lower() not in ("http", "https"):
        raise bad_request(field, "an http or https URL, or a data URL, is required")
    if parts.username is not None or parts.password is not None:
        raise bad_request(field, "an image URL may not carry credentials (user:password@)")
    if not host or _host_key(host) not in limits.domains:
        raise bad_request(field, f"the host {clipped(host or '')!r} is not one of the media domains this server "
                                 "fetches images from (`celerytp serve --allowed-media-domains`)")
    # In a thread, so that the deadline holds for the name lookup too (getaddrinfo takes no timeout);
    # one still running after it ends by its own socket timeouts and deadline.
    deadline = time.monotonic() + limits.fetch_timeout
    box: list[bytes | BaseException] = []
    thread = threading.Thread(target=lambda: box.append(_outcome(parts, field, limits, deadline)),
                              name="celerytp-image-fetch", daemon=True)
    thread.start()
    thread.join(limits.fetch_timeout)
    if not box:
        raise bad_request(field, f"cannot fetch the image from {host}: no answer within {limits.fetch_timeout:g} s")
    if isinstance(box[0], CeleryTPError):
        raise box[0]
    if isinstance(box[0], BaseException):
        raise bad_request(field, f"cannot fetch the image from {host}: {_failure(box[0])}")
    return box[0]


def _outcome(parts: SplitResult, field: str, limits: ImageLimits, deadline: float) -> bytes | BaseException:
    try:
        return _get(parts, field, limits, deadline)
    except Exception as exc:  # reported by fetch_image, in the caller's thread
        return exc


def _get(parts: SplitResult, field: str, limits: ImageLimits, deadline: float) -> bytes:
    host = parts.hostname
    kind = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    conn = kind(host, parts.port, timeout=limits.fetch_timeout)
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={"Accept": "image/png, image/jpeg, image/webp", "User-Agent": "celerytp"})
        response = conn.getresponse()
        if 300 <= response.status < 400:
            raise bad_request(field, f"cannot fetch the image from {host}: it answered {response.status} (a redirect); "
                                     "redirects are not followed: give the image's own URL")
        if response.status != 200:
            raise bad_request(field, f"cannot fetch the image from {host}: it answered {response.status} "
                                     f"{clipped(response.reason)}")
        length = response.getheader("Content-Length", "")
        if length.isdigit() and int(length) > limits.bytes:
            raise bad_request(field, f"the image at {host} is {int(length)} bytes, over the limit of {limits.bytes} "
                                     "bytes per image")
        data = bytearray()
        while chunk := response.read1(min(1 << 16, limits.bytes + 1 - len(data))):
            data += chunk
            if len(data) > limits.bytes:
                raise bad_request(field, f"the image at {host} is over the limit of {limits.bytes} bytes per image")
            if time.monotonic() > deadline:
                raise TimeoutError("the deadline passed")
        return bytes(data)
    finally:
        conn.close()


def _failure(exc: BaseException) -> str:
    """What failed, in words a client can act on (never the traceback)."""
    if isinstance(exc, socket.gaierror):
        return f"its name does not resolve ({exc.strerror})"
    if isinstance(exc, ConnectionRefusedError):
        return "the connection was refused"
    if isinstance(exc, TimeoutError):
        return "it timed out"
    if isinstance(exc, ssl.SSLError):  # a certificate that does not verify too
        return f"TLS failed ({exc.reason or type(exc).__name__})"
    if isinstance(exc, http.client.InvalidURL):
        return "the URL cannot be requested as it is (spaces or control characters in it?)"
    if isinstance(exc, http.client.HTTPException):
        return f"not a valid HTTP answer ({type(exc).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return type(exc).__name__


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


def image_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a checked image."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.size


def encode(images: list[bytes]) -> list[str]:
    """Images as the request carries them: base64 text."""
    return [base64.b64encode(data).decode("ascii") for data in images]


def decode(images: list[str]) -> list[bytes]:
    return [base64.b64decode(text) for text in images]


def content_keys(prompt: list[int], image_token_id: int, tokens: list[int], images: list[str]) -> list[int]:
    """`prompt` with each image's placeholder tokens (`tokens[i]` of them for image i, in order)
    replaced by a key of the image's content (its base64 text, as the request carries it): a
    negative number, never a token id, so that a cached prefix is reused only where the same
    images sit in the same places."""
    keys = list(prompt)
    at = iter([i for i, t in enumerate(prompt) if t == image_token_id])
    for count, text in zip(tokens, images):
        key = _content_key(text)
        for _, i in zip(range(count), at):
            keys[i] = key
    return keys


@lru_cache(maxsize=256)
def _content_key(text: str) -> int:
    return -1 - int.from_bytes(hashlib.sha256(text.encode("ascii")).digest()[:7], "big")
