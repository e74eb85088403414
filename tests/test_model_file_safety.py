"""Hostile model files (issue 41, items 3 and 4): every GGUF reader is bounded by the file, and a
load opens regular files only. Pure unit tests: no cluster, no server.

- An 84-byte GGUF whose one array claims 2^40 items is refused in milliseconds, with flat
  memory, by every reader a rank runs (in a subprocess under RLIMIT_AS).
- hypothesis fuzzes GGUF headers: each reader parses cleanly or raises CeleryTPError(load_failed),
  never another exception, never hangs (a timer interrupts a runaway loop), within a memory cap.
- A FIFO, socket or device in a model directory is refused at once, typed, naming the file as the
  directory does; each call runs in a forked child that must answer within 5 s (killed if not).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.gguf_metadata import check_gguf_layout, read_gguf_metadata
from celerytp.core.model_files import is_gguf_file, open_regular, read_json_object
from celerytp.core.tokenizer import clear_tokenizer_cache, load_tokenizer
from celerytp.loading import open_checkpoint
from celerytp.loading.gguf_file import open_gguf_reader

REPO = Path(__file__).resolve().parent.parent
UINT8, INT32, UINT32, STRING, ARRAY, UINT64 = 0, 5, 4, 8, 9, 10


def _str(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def gguf_header(kvs: bytes = b"", n_kv: int = 0, n_tensors: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + kvs


def bomb_bytes() -> bytes:
    """The issue's file: a v3 header with one uint8 array whose count is 2^40, 84 bytes in all."""
    key = b"tokenizer.ggml.token_type.bomb.xxxxx"  # 36 bytes: the file comes to 84
    data = gguf_header(_str(key) + struct.pack("<IIQ", ARRAY, UINT8, 1 << 40), n_kv=1)
    return data + b"\0" * (84 - len(data))


# ---- the bomb -----------------------------------------------------------------------------------

_BOMB_SCRIPT = textwrap.dedent(
    """
    import json, pathlib, resource, sys, time
    from celerytp.core.errors import CeleryTPError
    from celerytp.core.gguf_metadata import read_gguf_metadata
    from celerytp.core.tokenizer import load_tokenizer
    from celerytp.loading import open_checkpoint
    from celerytp.loading.gguf_file import open_gguf_reader
    from celerytp.worker.model_ops import serving_tokenizer

    path = pathlib.Path(sys.argv[1])
    vm = int(next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmSize:"))) * 1024
    cap = vm + (256 << 20)  # what the imports mapped, plus 256 MB
    resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    readers = {
        "metadata (leader, rank 0's tokenizer)": read_gguf_metadata,
        "gguf reader": open_gguf_reader,
        "checkpoint (every rank's load)": open_checkpoint,
        "tokenizer": load_tokenizer,
        "rank 0's serving tokenizer": serving_tokenizer,
    }
    out = {}
    for name, read in readers.items():
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        started = time.perf_counter()
        try:
            read(path)
            result = "parsed"
        except CeleryTPError as exc:
            result = str(exc.kind)
        except BaseException as exc:
            result = type(exc).__name__
        out[name] = {"result": result, "s": time.perf_counter() - started,
                     "grew_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss}
    print(json.dumps(out))
    """
)


def test_the_84_byte_bomb_is_refused_in_milliseconds_with_flat_memory(tmp_path):
    bomb = tmp_path / "bomb.gguf"
    bomb.write_bytes(bomb_bytes())
    assert bomb.stat().st_size == 84
    proc = subprocess.run(
        [sys.executable, "-c", _BOMB_SCRIPT, str(bomb)],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in results.items():
        assert r["result"] == "load_failed", (name, r)
        assert r["s"] < 0.5, (name, r)
        assert r["grew_kb"] < 32 * 1024, (name, r)  # flat: no allocation sized by the count


def _nested_arrays(depth: int) -> bytes:
    value = struct.pack("<IQ", UINT8, 0)
    for _ in range(depth - 1):
        value = struct.pack("<IQ", ARRAY, 1) + value
    return struct.pack("<I", ARRAY) + value


def _tensor_info(name: bytes, dims: list[int], ggml_type: int, offset: int = 0) -> bytes:
    return _str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)


BOMBS = {
    "array count 2^40": bomb_bytes(),
    "string length 2^40": gguf_header(_str(b"k") + struct.pack("<IQ", STRING, 1 << 40), n_kv=1),
    "string array count 2^62": gguf_header(_str(b"k") + struct.pack("<IIQ", ARRAY, STRING, 1 << 62), n_kv=1),
    "key length 2^63": gguf_header(struct.pack("<Q", 1 << 63), n_kv=1),
    "kv count 2^40": gguf_header(_str(b"k") + struct.pack("<IB", UINT8, 1), n_kv=1 << 40),
    "tensor count 2^40": gguf_header(n_tensors=1 << 40),
    "arrays nested 5000 deep": gguf_header(_str(b"k") + _nested_arrays(5000), n_kv=1),
    "a tensor past the file's end": gguf_header(_tensor_info(b"t", [1 << 30, 1 << 30], 0), n_tensors=1),
    "2^31 dimensions": gguf_header(_str(b"t") + struct.pack("<I", 1 << 31) + b"\0" * 64, n_tensors=1),
}


TENSOR_BOMBS = ("a tensor past the file's end", "2^31 dimensions")


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_every_reader_refuses_counts_the_file_cannot_hold(tmp_path, name):
    path = tmp_path / "bomb.gguf"
    path.write_bytes(BOMBS[name])
    readers = [open_gguf_reader, open_checkpoint]
    if name not in TENSOR_BOMBS:  # the metadata reader stops before the tensor descriptions
        readers.append(read_gguf_metadata)
    for read in readers:
        started = time.perf_counter()
        with _interrupt_after(5.0), pytest.raises(CeleryTPError) as info:
            read(path)
        assert info.value.kind == ErrorKind.LOAD_FAILED, (read.__name__, info.value)
        assert "not a readable GGUF file" in info.value.message, (read.__name__, info.value)
        assert time.perf_counter() - started < 0.5, read.__name__


# ---- the fuzz -----------------------------------------------------------------------------------


class _TooSlow(BaseException):  # not an Exception: no reader's `except Exception` can swallow it
    pass


@contextlib.contextmanager
def _interrupt_after(seconds: float):
    """Raise _TooSlow in this (main) thread if the block runs longer: a runaway loop fails, not hangs."""

    def alarm(signum, frame):
        raise _TooSlow(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def _memory_cap(extra: int):
    """Cap this process's address space at what it maps now plus `extra` bytes, for the block."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    status = Path("/proc/self/status").read_text().splitlines()
    vm = int(next(line.split()[1] for line in status if line.startswith("VmSize:"))) * 1024
    cap = vm + extra if hard == resource.RLIM_INFINITY else min(vm + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


COUNTS = st.one_of(st.integers(0, 4), st.sampled_from([1 << 24, 1 << 31, 1 << 32, 1 << 40, 1 << 62, (1 << 64) - 1]))
KEYS = st.one_of(
    st.sampled_from([b"general.architecture", b"general.alignment", b"tokenizer.ggml.tokens", b"k"]),
    st.binary(max_size=12),
)


@st.composite
def gguf_values(draw, depth: int = 0):
    """(type, encoded value): honest or lying counts, unknown types, nested arrays."""
    kind = draw(st.sampled_from([UINT8, UINT32, INT32, UINT64, 6, 7, 12, STRING, ARRAY, 13, 1 << 31]))
    if kind == STRING:
        raw = draw(st.binary(max_size=16))
        length = draw(st.one_of(st.just(len(raw)), COUNTS))
        return kind, struct.pack("<Q", length) + raw
    if kind == ARRAY:
        if depth >= 2:
            return UINT32, struct.pack("<I", draw(st.integers(0, 2**32 - 1)))
        items = draw(st.lists(gguf_values(depth + 1), max_size=3))
        item_kind = items[0][0] if items else draw(st.sampled_from([UINT8, STRING, ARRAY, 77]))
        count = draw(st.one_of(st.just(len(items)), COUNTS))
        return kind, struct.pack("<IQ", item_kind, count) + b"".join(v for _, v in items)
    sizes = {UINT8: 1, UINT32: 4, INT32: 4, UINT64: 8, 6: 4, 7: 1, 12: 8}
    return kind, draw(st.binary(min_size=sizes.get(kind, 0), max_size=sizes.get(kind, 0) or 8))


@st.composite
def gguf_files(draw):
    kvs = draw(st.lists(st.tuples(KEYS, gguf_values()), max_size=4))
    types = [int(t) for t in gguf.GGML_QUANT_SIZES]
    tensors = draw(
        st.lists(
            st.tuples(
                st.binary(max_size=6),
                st.lists(st.one_of(st.integers(0, 64), st.sampled_from([256, 1 << 32, (1 << 64) - 1])), max_size=5),
                st.one_of(st.sampled_from([0, 1, 8]), st.sampled_from(types), st.integers(0, 2**32 - 1)),
                st.one_of(st.integers(0, 128), st.sampled_from([1 << 40, (1 << 64) - 1])),
            ),
            max_size=3,
        )
    )
    n_kv = draw(st.one_of(st.just(len(kvs)), COUNTS))
    n_tensors = draw(st.one_of(st.just(len(tensors)), COUNTS))
    version = draw(st.sampled_from([3, 3, 3, 2, 1, 4]))
    body = b"".join(_str(k) + struct.pack("<I", kind) + v for k, (kind, v) in kvs)
    body += b"".join(_tensor_info(name, dims, t, off) for name, dims, t, off in tensors)
    data = gguf_header(body, n_kv, n_tensors, version) + draw(st.binary(max_size=256))
    # Then damage: cut it short, or overwrite a few bytes anywhere.
    cut = draw(st.one_of(st.none(), st.integers(0, len(data))))
    if cut is not None:
        data = data[:cut]
    for at, byte in draw(st.lists(st.tuples(st.integers(0, max(len(data) - 1, 0)), st.integers(0, 255)), max_size=3)):
        if at < len(data):
            data = data[:at] + bytes([byte]) + data[at + 1 :]
    return data


def test_fuzzed_gguf_headers_parse_cleanly_or_fail_typed():
    directory = Path(tempfile.mkdtemp(prefix="gguf-fuzz-"))
    path = directory / "fuzz.gguf"
    seen = {"parsed": 0, "refused": 0, "layout passed": 0}

    # No shrinking: a failing example may take the full timer each time, and CI must stay bounded.
    @settings(
        max_examples=300,
        deadline=2000,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(data=gguf_files())
    def one(data: bytes) -> None:
        path.write_bytes(data)
        with _interrupt_after(2.0):
            for read in (read_gguf_metadata, open_gguf_reader):
                try:
                    read(path)
                    seen["parsed"] += 1
                except CeleryTPError as exc:
                    assert exc.kind == ErrorKind.LOAD_FAILED, exc
                    seen["refused"] += 1
            # What our bounded scan passes, the `gguf` package's own reader must read cleanly.
            try:
                check_gguf_layout(data, gguf.GGML_QUANT_SIZES, path)
            except CeleryTPError:
                return
            gguf.GGUFReader(path)
            seen["layout passed"] += 1

    try:
        with _memory_cap(512 << 20):
            one()
    finally:
        path.unlink(missing_ok=True)
        directory.rmdir()
    assert all(seen.values()), seen


# ---- FIFOs, sockets and devices -----------------------------------------------------------------


class Refusal:
    """What a call raised in the child: its type name, kind and message."""

    def __init__(self, exc: BaseException) -> None:
        self.type = type(exc).__name__
        self.kind = getattr(exc, "kind", None)
        self.message = getattr(exc, "message", str(exc))

    def __repr__(self) -> str:
        return f"{self.type}({self.kind}: {self.message})"


def _returns_within(call, seconds: float = 5.0) -> Refusal | None:
    """call() in a forked child: what it raised (None if nothing) if it comes back within
    `seconds`, else the child is killed and the test fails. A thread would not do: safetensors
    opens files holding the GIL, so a FIFO blocking it there would block the test too."""
    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child() -> None:
        try:
            call()
            send.send(None)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            send.send(Refusal(exc))

    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    try:
        if not receive.poll(seconds):
            pytest.fail(f"still blocked after {seconds} s")
        return receive.recv()
    finally:
        proc.kill()
        proc.join()


def _is_load_failed(exc: object) -> bool:
    return exc is not None and exc.type == "CeleryTPError" and exc.kind == ErrorKind.LOAD_FAILED


def _assert_refused(exc: Refusal | None, name: str, root: Path) -> None:
    assert _is_load_failed(exc), repr(exc)
    assert name in exc.message and "not a regular file" in exc.message, exc.message
    assert str(root) not in exc.message, exc.message  # named as the directory does, no server path


@pytest.fixture
def tiny_hf_dir(tmp_path):
    """A config.json + tokenizer.json + model.safetensors directory (no weights worth running)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 4}))
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(d / "tokenizer.json"))
    save_file({"model.embed_tokens.weight": torch.zeros(4, 2)}, str(d / "model.safetensors"))
    return d


@pytest.mark.parametrize("name", ["model.gguf", "config.json"])
def test_a_fifo_in_a_model_directory_is_refused_at_once(tmp_path, name):
    d = tmp_path / "model"
    d.mkdir()
    os.mkfifo(d / name)
    clear_tokenizer_cache()
    for call in (lambda: open_checkpoint(d), lambda: load_tokenizer(d)):
        _assert_refused(_returns_within(call), name, tmp_path)


@pytest.mark.parametrize("name", ["tokenizer.json", "model.safetensors", "model-00001-of-00002.safetensors"])
def test_a_fifo_beside_real_files_is_refused(tiny_hf_dir, name):
    if name.startswith("model-"):  # a shard the index names
        (tiny_hf_dir / "model.safetensors").rename(tiny_hf_dir / "model-00002-of-00002.safetensors")
        weight_map = {"model.embed_tokens.weight": name, "lm_head.weight": "model-00002-of-00002.safetensors"}
        (tiny_hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        (tiny_hf_dir / name).unlink()
    os.mkfifo(tiny_hf_dir / name)
    clear_tokenizer_cache()

    def load_everything() -> None:
        with open_checkpoint(tiny_hf_dir) as ckpt:
            for tensor in ckpt.names():
                ckpt.source(tensor)

    for call in (load_everything, lambda: load_tokenizer(tiny_hf_dir)):
        _assert_refused(_returns_within(call), name, tiny_hf_dir.parent)


def test_sockets_and_devices_in_a_model_directory_are_refused(tiny_hf_dir):
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tiny_hf_dir / "control.sock"))
        clear_tokenizer_cache()
        _assert_refused(_returns_within(lambda: open_checkpoint(tiny_hf_dir)), "control.sock", tiny_hf_dir.parent)
    (tiny_hf_dir / "control.sock").unlink()
    (tiny_hf_dir / "generation_config.json").symlink_to("/dev/zero")  # a link to a device
    clear_tokenizer_cache()
    for call in (lambda: open_checkpoint(tiny_hf_dir), lambda: load_tokenizer(tiny_hf_dir)):
        _assert_refused(_returns_within(call), "generation_config.json", tiny_hf_dir.parent)
    (tiny_hf_dir / "generation_config.json").unlink()
    with open_checkpoint(tiny_hf_dir) as ckpt:  # the same directory, clean again, opens
        assert ckpt.names() == ["model.embed_tokens.weight"]


def test_every_opener_refuses_a_fifo_given_to_it_directly(tmp_path):
    """The open itself checks (O_NONBLOCK, then fstat), not only the directory scan before it:
    a FIFO swapped in after the scan is refused too."""
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    calls = {
        "open_regular": lambda: open_regular(fifo),
        "is_gguf_file": lambda: is_gguf_file(fifo),
        "read_json_object": lambda: read_json_object(fifo),
        "read_gguf_metadata": lambda: read_gguf_metadata(fifo),
        "open_gguf_reader": lambda: open_gguf_reader(fifo),
    }
    for name, call in calls.items():
        exc = _returns_within(call)
        assert _is_load_failed(exc), (name, repr(exc))
        assert "model.gguf is a FIFO (named pipe), not a regular file" in exc.message, (name, exc.message)
    assert _is_load_failed(_returns_within(lambda: open_regular("/dev/null")))
    assert is_gguf_file(tmp_path) is False  # a directory is simply not a GGUF file
