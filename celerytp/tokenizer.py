"""Tokenizers for the leader: from a Hugging Face directory or a GGUF file's metadata, cached."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celerytp.loading import is_gguf_file
from celerytp.loading.errors import LoadError

# generation_config.json keys that map onto SamplingParams fields.
_SAMPLING_KEYS = ("temperature", "top_k", "top_p")
_END_OF_TURN_TOKENS = frozenset({"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>"})


@dataclass
class Tokenizer:
    """Text <-> token ids, the chat template, stop tokens and the checkpoint's sampling defaults.

    Args:
        backend: a transformers tokenizer.
        eos_token_ids: ids that end a generation.
        generation_defaults: SamplingParams fields suggested by generation_config.json
            (empty when it has none, and for GGUF files).
    """

    backend: Any
    eos_token_ids: set[int]
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer adds by default (e.g. BOS)."""
        return list(self.backend.encode(text, add_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a chat, ending with the assistant's generation prompt."""
        if not getattr(self.backend, "chat_template", None):
            raise ValueError("this model has no chat template")
        ids = self.backend.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)


_cache: dict[tuple[str, int], Tokenizer] = {}
_lock = threading.Lock()


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model directory or .gguf file, cached per path and modification time."""
    p = Path(path).resolve()
    try:
        key = (str(p), p.stat().st_mtime_ns)
    except OSError as exc:
        raise LoadError("unsupported_arch", f"{path}: no such file or directory") from exc
    with _lock:  # one load per path even when several requests arrive at once
        if key not in _cache:
            _cache[key] = _gguf_tokenizer(p) if p.is_file() else _hf_tokenizer(p)
        return _cache[key]


def clear_tokenizer_cache() -> None:
    """Forget the in-process cache (the on-disk GGUF conversions stay)."""
    with _lock:
        _cache.clear()


def _hf_tokenizer(directory: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    if not (directory / "config.json").is_file() and not (directory / "tokenizer.json").is_file():
        gguf_files = sorted(directory.glob("*.gguf"))
        if len(gguf_files) == 1:
            return _gguf_tokenizer(gguf_files[0])
    try:
        backend = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError subclasses
        raise LoadError("load_failed", f"{directory}: cannot load tokenizer: {exc}") from exc
    config = _read_json(directory / "config.json")
    generation = _read_json(directory / "generation_config.json")
    eos = _ids(generation.get("eos_token_id")) | _ids(config.get("eos_token_id")) | _ids(backend.eos_token_id)
    return Tokenizer(backend, eos, _generation_defaults(generation))


def _gguf_tokenizer(file: Path) -> Tokenizer:
    if not is_gguf_file(file):
        raise LoadError("unsupported_arch", f"{file}: not a GGUF file")
    backend = _converted_gguf_tokenizer(file)
    # GGUF records one EOS; chat models also end turns with their end-of-turn special token.
    eos = _ids(backend.eos_token_id)
    eos |= {i for i, t in backend.added_tokens_decoder.items() if t.special and str(t) in _END_OF_TURN_TOKENS}
    return Tokenizer(backend, eos, {})


def tokenizer_cache_dir() -> Path:
    """Where converted GGUF tokenizers are kept ($CELERYTP_CACHE_DIR or ~/.cache/celerytp)."""
    base = os.environ.get("CELERYTP_CACHE_DIR") or Path.home() / ".cache" / "celerytp"
    return Path(base) / "tokenizers"


def _converted_gguf_tokenizer(file: Path) -> Any:
    """transformers' tokenizer for a GGUF file, converted once and kept on disk.

    Converting from GGUF metadata takes seconds; every CLI process would pay it again, while
    loading the saved tokenizer.json takes a fraction of a second.
    """
    from transformers import AutoTokenizer  # heavy import; the leader pays it once

    stat = file.stat()
    key = hashlib.sha256(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:32]
    cached = tokenizer_cache_dir() / key
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
        except Exception:  # a damaged cache entry: convert again
            pass
    try:
        backend = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name, local_files_only=True)
    except Exception as exc:  # transformers raises OSError/ValueError subclasses
        raise LoadError("load_failed", f"{file}: cannot load tokenizer: {exc}") from exc
    _save_atomically(backend, cached)
    return backend


def _save_atomically(backend: Any, target: Path) -> None:
    """Save to a temporary sibling and rename, so readers never see half a tokenizer."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            backend.save_pretrained(tmp)
            os.rename(tmp, target)
            os.mkdir(tmp)  # TemporaryDirectory cleans up the (now empty) name it made
    except OSError:
        pass  # read-only or full disk, or another process won the race: the cache is optional


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _ids(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return set(value) if isinstance(value, list) else {int(value)}


def _generation_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields from generation_config.json.

    transformers ignores temperature/top_k/top_p unless do_sample is true, so do we.
    """
    defaults: dict[str, Any] = {}
    if generation.get("do_sample"):
        defaults.update({k: generation[k] for k in _SAMPLING_KEYS if generation.get(k) is not None})
    penalty = generation.get("repetition_penalty")
    if penalty is not None and penalty != 1.0:
        defaults["repetition_penalty"] = penalty
    return defaults
