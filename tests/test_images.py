"""A request's images on the leader (core/images.py): data URLs checked by their own bytes, and
remote image URLs fetched only from the media domains the operator allows (a real HTTP server on
127.0.0.1 in a thread: a redirect, a 404, a slow or oversized answer are each a 400, never a hang);
the setting's way from `celerytp serve` and the front door's environment to the fetch."""

from __future__ import annotations

import base64
import io
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from celerytp.client import generation
from celerytp.client.generation import prepare
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.images import (
    ImageLimits,
    content_keys,
    encode,
    fetch_image,
    media_domains,
    take_images,
)
from celerytp.server.service import Service

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIELD = "messages[0].content[1].image_url.url"


def image_file(fmt: str, size: tuple[int, int] = (8, 6), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, 128).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def chat(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [{"type": "text", "text": "What is it?"}, *parts]}]


def refused(messages: list[dict], limits: ImageLimits = ImageLimits()) -> str:
    with pytest.raises(CeleryTPError) as caught:
        take_images(messages, True, limits)
    assert caught.value.kind is ErrorKind.BAD_REQUEST, caught.value
    return caught.value.message


PNG = image_file("PNG")


# -- data URLs ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("fmt", "mime"), [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("WEBP", "image/webp")])
def test_a_png_jpeg_or_webp_data_url_is_taken_as_its_bytes(fmt, mime):
    data = image_file(fmt)
    messages, images = take_images(chat(data_url(data, mime)), True)
    assert images == [data]
    assert messages[0]["content"] == [{"type": "text", "text": "What is it?"}, {"type": "image"}]


def test_messages_without_images_come_back_as_they_are():
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": [{"type": "text", "text": "x"}]}]
    assert take_images(messages, False) == (messages, [])


def test_a_gif_is_refused_by_its_own_bytes_whatever_its_label():
    message = refused(chat(data_url(image_file("GIF", mode="P"), "image/png")))
    assert "field 'messages[0].content[1]'" in message and "GIF images are not taken" in message


def test_a_label_that_is_no_image_format_is_refused():
    message = refused(chat(data_url(PNG, "image/gif")))
    assert f"field '{FIELD}'" in message and "'image/gif' is not an image format" in message


def test_a_corrupt_file_is_refused():
    message = refused(chat(data_url(PNG[: len(PNG) // 2])))
    assert "field 'messages[0].content[1]'" in message and "cannot be decoded" in message


def test_bad_base64_is_refused():
    message = refused(chat("data:image/png;base64,iVBOR*w0KGgo="))
    assert f"field '{FIELD}'" in message and "not valid base64" in message


def test_an_image_over_the_pixel_limit_is_refused_before_it_is_decoded():
    big = image_file("PNG", (4097, 4097), mode="L")  # a few KB of file, 16.8 M pixels
    assert len(big) < ImageLimits().bytes // 100
    started = time.monotonic()
    message = refused(chat(data_url(big)))
    assert "4097x4097, over the limit of 16777216 pixels per image" in message
    assert time.monotonic() - started < 2


def test_an_image_over_the_byte_limit_is_refused():
    message = refused(chat(data_url(PNG)), ImageLimits(bytes=len(PNG) - 1))
    assert f"over the limit of {len(PNG) - 1} bytes per image" in message


def test_more_images_than_allowed_are_refused():
    message = refused(chat(data_url(PNG), data_url(PNG)), ImageLimits(images=1))
    assert "field 'messages[0].content[2]'" in message and "more than 1 images in one request" in message


def test_a_text_model_takes_no_images():
    with pytest.raises(CeleryTPError, match="this model takes no images"):
        take_images(chat(data_url(PNG)), False)


def test_content_keys_follow_the_images_bytes_and_places():
    other = image_file("PNG", (8, 7))
    prompt = [5, 9, 9, 6, 9, 9, 7]
    first = content_keys(prompt, 9, [2, 2], encode([PNG, other]))
    assert first == content_keys(prompt, 9, [2, 2], encode([PNG, other]))
    assert [first[i] for i in (0, 3, 6)] == [5, 6, 7]
    assert first[1] == first[2] < 0 and first[4] == first[5] < 0 and first[1] != first[4]
    swapped = content_keys(prompt, 9, [2, 2], encode([other, PNG]))
    assert swapped[1] == first[4] and swapped[4] == first[1]
    assert content_keys(prompt, 9, [2, 2], encode([PNG, PNG]))[4] == first[1]


# -- remote URLs -------------------------------------------------------------------------------

GIF = image_file("GIF", mode="P")
SLOW_S = 3.0


class Images(BaseHTTPRequestHandler):
    """/cat.png, /cat.gif, /missing (404), /moved (302 to /cat.png), /slow (answers after SLOW_S),
    /drip (headers at once, then a byte each 0.1 s), /huge (1 MB with its length), /stream (1 MB,
    no length: to the connection's end)."""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        path = self.path
        if path == "/slow":
            time.sleep(SLOW_S)
            path = "/cat.png"
        if path in ("/cat.png", "/cat.gif"):
            self.answer(200, PNG if path == "/cat.png" else GIF)
        elif path == "/moved":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        elif path == "/huge":
            self.answer(200, b"\0" * (1 << 20))
        elif path == "/stream":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"\0" * (1 << 20))
        elif path == "/drip":
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"\0")
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self.answer(404, b"no such image")

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    """The base URL of the image server."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Images)
    httpd.daemon_threads, httpd.block_on_close = True, False
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


ALLOWED = ImageLimits(domains=frozenset({"127.0.0.1"}), fetch_timeout=1.0)


def test_a_remote_url_is_refused_when_no_domain_is_allowed(server):
    message = refused(chat(f"{server}/cat.png"))
    assert f"field '{FIELD}'" in message and "remote image URLs are not fetched by this server" in message


def test_an_image_from_an_allowed_domain_is_fetched_and_checked(server):
    messages, images = take_images(chat(f"{server}/cat.png"), True, ALLOWED)
    assert images == [PNG] and messages[0]["content"][1] == {"type": "image"}
    assert "GIF images are not taken" in refused(chat(f"{server}/cat.gif"), ALLOWED)


def test_the_allowed_domain_is_matched_exactly_and_without_case(server):
    port = server.rsplit(":", 1)[1]
    assert fetch_image(f"http://LocalHost:{port}/cat.png", FIELD, ImageLimits(domains={"localhost."})) == PNG
    for url, limits in [(f"{server}/cat.png", ImageLimits(domains={"localhost"})),
                        ("http://images.example.com/cat.png", ImageLimits(domains={"example.com"})),
                        ("http://example.com.evil.org/cat.png", ImageLimits(domains={"example.com"}))]:
        message = refused(chat(url), limits)
        assert f"field '{FIELD}'" in message and "is not one of the media domains" in message


@pytest.mark.parametrize(("url", "problem"), [
    ("http://user:secret@127.0.0.1/cat.png", "may not carry credentials"),
    ("http://127.0.0.1:port/cat.png", "not a valid URL"),
    ("ftp://127.0.0.1/cat.png", "a data URL (data:image/png;base64,...) is required"),
])
def test_only_plain_http_urls_are_fetched(url, problem):
    assert problem in refused(chat(url), ALLOWED)


@pytest.mark.parametrize(("path", "problem"), [
    ("/missing", "cannot fetch the image from 127.0.0.1: it answered 404 Not Found"),
    ("/moved", "it answered 302 (a redirect); redirects are not followed"),
    ("/huge", "the image at 127.0.0.1 is 1048576 bytes, over the limit of 65536 bytes per image"),
    ("/stream", "the image at 127.0.0.1 is over the limit of 65536 bytes per image"),
])
def test_a_failed_fetch_is_a_400_naming_the_host_and_what_failed(server, path, problem):
    limits = ImageLimits(bytes=1 << 16, domains={"127.0.0.1"}, fetch_timeout=5.0)
    message = refused(chat(f"{server}{path}"), limits)
    assert f"field '{FIELD}'" in message and problem in message


def test_a_refused_connection_is_a_400():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    message = refused(chat(f"http://127.0.0.1:{port}/cat.png"), ALLOWED)
    assert "cannot fetch the image from 127.0.0.1: the connection was refused" in message


def test_a_name_that_does_not_resolve_is_a_400():
    started = time.monotonic()
    message = refused(chat("http://images.invalid/cat.png"), ImageLimits(domains={"images.invalid"}, fetch_timeout=2.0))
    assert "cannot fetch the image from images.invalid: " in message and time.monotonic() - started < 2.5


@pytest.mark.parametrize("path", ["/slow", "/drip"])
def test_a_slow_server_is_a_400_within_the_timeout(server, path):
    started = time.monotonic()
    message = refused(chat(f"{server}{path}"), ALLOWED)
    assert time.monotonic() - started < ALLOWED.fetch_timeout + 0.5
    assert "cannot fetch the image from 127.0.0.1:" in message
    assert "no answer within 1 s" in message or "it timed out" in message


# -- the setting's way from the operator to the fetch -------------------------------------------

def test_domains_are_checked_when_given():
    assert media_domains(" A.com, b.org.,::1 ") == {"a.com", "b.org", "::1"}
    for text, problem in [("", "no domain named"), ("a.com,,b.org", "an empty name"),
                          ("https://a.com", "not a host name"), ("a.com:443", "not a host name"),
                          ("a.com/images", "not a host name")]:
        with pytest.raises(ValueError, match=problem):
            media_domains(text)
    with pytest.raises(ValueError, match="must be a number of seconds > 0"):
        ImageLimits(fetch_timeout=0)


def test_the_environment_carries_the_setting_both_ways():
    limits = ImageLimits(domains={"a.com", "B.org"}, fetch_timeout=2.5)
    assert ImageLimits.from_env(limits.as_env()) == limits
    assert ImageLimits.from_env({}) == ImageLimits() and ImageLimits().domains == frozenset()
    with pytest.raises(ValueError, match=r"\$CELERYTP_ALLOWED_MEDIA_DOMAINS: 'a.com/x' is not a host name"):
        ImageLimits.from_env({"CELERYTP_ALLOWED_MEDIA_DOMAINS": "a.com/x"})


class Vision:
    """Stands for a vision-language checkpoint (`checkpoint_vision`): images are taken out and checked
    before the tokenizer is loaded, so a refused image never reaches it."""


class _Leader:
    """A leader whose generation runs only the leader's own checks (prepare), as a real one does first."""

    group, world_size = "g", 1

    def generate(self, model_id: str, prompt=None, messages=None, **options):
        prepare({"path": "/nonexistent/model", "max_context": 100, "vocab_size": 1000}, prompt, messages, **options)
        raise AssertionError("not reached: the image is refused")

    stream = generate


class _Service(Service):
    """The real service over _Leader, with no Redis to look for live ranks in or count errors in."""

    def require_ranks(self, model_id: str) -> None:
        pass

    def count_error(self, model_id: str, exc: CeleryTPError) -> None:
        pass


def test_the_setting_reaches_the_fetch_through_prepare_and_the_service(server, monkeypatch):
    monkeypatch.setattr(generation, "checkpoint_vision", lambda path, mmproj=None: Vision())
    record = {"path": "/nonexistent/model", "max_context": 100, "vocab_size": 1000}
    missing = chat(f"{server}/missing")
    for run in (lambda: prepare(record, messages=missing),
                lambda: _Service(_Leader(), images=ImageLimits()).generate("m", {"messages": missing})):
        with pytest.raises(CeleryTPError, match="remote image URLs are not fetched"):
            run()
    for run in (lambda: prepare(record, messages=missing, image_limits=ALLOWED),
                lambda: _Service(_Leader(), images=ALLOWED).generate("m", {"messages": missing}),
                lambda: _Service(_Leader(), images=ALLOWED).stream("m", {"messages": missing})):
        with pytest.raises(CeleryTPError, match="it answered 404"):
            run()
    # the front door (and `celerytp serve`'s HTTP API) read the environment `serve` sets
    monkeypatch.setenv("CELERYTP_ALLOWED_MEDIA_DOMAINS", "127.0.0.1")
    with pytest.raises(CeleryTPError, match="it answered 404"):
        _Service(_Leader()).generate("m", {"messages": missing})


@pytest.mark.parametrize(("args", "expected"), [
    (["--allowed-media-domains", ""], "argument --allowed-media-domains: no domain named"),
    (["--allowed-media-domains", "a.com", "--allowed-media-domains", "http://b.org"],
     "argument --allowed-media-domains: 'http://b.org' is not a host name"),
    (["--media-fetch-timeout", "0"], "argument --media-fetch-timeout: must be > 0"),
])
def test_serve_refuses_a_bad_setting_in_one_line(args, expected):
    done = subprocess.run([sys.executable, "-m", "celerytp", "serve", *args], check=False, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and expected in done.stderr, done.stderr
    assert done.stderr.startswith("error: bad_request: celerytp serve: ")
