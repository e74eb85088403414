"""Tokenizers for the leader (and rank 0's stop strings), built with `tokenizers` and `jinja2`.

A Hugging Face directory brings its `tokenizer.json`; a GGUF file describes a byte-level BPE in
its metadata (llama.cpp's `gpt2` tokenizer model), rebuilt here as transformers' GGUF converter
builds it. Chat templates render as transformers renders them. transformers itself is needed
only for what this module does not build (a directory with no tokenizer.json, a sentencepiece
GGUF), and is imported only then: it brings torch along, which a leader should not pay for.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.gguf_metadata import check_gguf_file, read_gguf_metadata
from celerytp.core.model_files import check_model_directory, is_gguf_file, read_json_object, read_text_file
from celerytp.core.read_deadline import within

# generation_config.json keys that map onto SamplingParams fields.
_SAMPLING_KEYS = ("temperature", "top_k", "top_p")
_END_OF_TURN_TOKENS = frozenset({"<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|endoftext|>", "<|end|>", "<end_of_turn>"})
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Pre-tokenizer splits by `tokenizer.ggml.pre` (transformers' GGUF_PRE_TOKENIZER_SPLITS); others
# use byte-level BPE's own GPT-2 split.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
}


@dataclass
class Tokenizer:
    """Text <-> token ids, the chat template, stop tokens and the checkpoint's sampling defaults.

    Args:
        backend: the `tokenizers` tokenizer (its post-processor adds BOS where the model wants it).
        eos_token_ids: ids that end a generation.
        chat_template: the Jinja chat template, or None.
        special_tokens: bos/eos/unk/pad token strings, as the template sees them.
        generation_defaults: SamplingParams fields suggested by generation_config.json
            (empty when it has none, and for GGUF files).
    """

    backend: Backend
    eos_token_ids: set[int]
    chat_template: str | None = None
    special_tokens: dict[str, str] = field(default_factory=dict)
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with the special tokens the tokenizer adds by default (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=True).ids

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of a chat, ending with the assistant's generation prompt (`tools`: OpenAI's
        tool list, for a template that renders them)."""
        return self.encode_rendered(self.render_chat(messages, tools))

    def encode_rendered(self, text: str) -> list[int]:
        """Token ids of a rendered chat (the template writes its own BOS)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The chat as the model's template writes it, before tokenizing."""
        if not self.chat_template:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'messages': this model has no chat template; send a prompt")
        try:
            extra = {"tools": tools} if tools else {}
            text = _compile(self.chat_template).render(messages=messages, add_generation_prompt=True,
                                                       **self.special_tokens, **extra)
        except jinja2.TemplateError as exc:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'messages': the chat template refused them: {exc}") from None
        return text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write tokenizer.json and tokenizer_config.json, as a Hugging Face directory has them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / "tokenizer.json"))
        config = {**self.special_tokens, "chat_template": self.chat_template}
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))


_cache: dict[tuple[str, int], Tokenizer] = {}
_lock = threading.Lock()


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """The tokenizer of a model directory or .gguf file, cached per path and modification time."""
    p = Path(path).resolve()
    try:
        key = (str(p), p.stat().st_mtime_ns)
    except OSError as exc:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{path}: no such file or directory") from exc
    with _lock:  # one load per path even when several requests arrive at once
        if key not in _cache:
            _cache[key] = _gguf_tokenizer(p) if p.is_file() else _directory_tokenizer(p)
        return _cache[key]


def clear_tokenizer_cache() -> None:
    with _lock:
        _cache.clear()


# ---- Hugging Face directories ------------------------------------------------------------


def _directory_tokenizer(directory: Path) -> Tokenizer:
    check_model_directory(directory)  # no FIFO, socket or device: nothing below blocks in open()
    if not (directory / "config.json").is_file() and not (directory / "tokenizer.json").is_file():
        ggufs = sorted(directory.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_tokenizer(ggufs[0])
    config = read_json_object(directory / "tokenizer_config.json")
    if (directory / "tokenizer.json").is_file():
        try:
            backend = Backend.from_str(read_text_file(directory / "tokenizer.json"))
        except CeleryTPError:
            raise
        except Exception as exc:  # tokenizers raises a plain Exception for a bad file
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{directory}: cannot read tokenizer.json: {exc}") from exc
    else:
        backend, config = _transformers_tokenizer(directory, {})
    special = {name: _token_text(config.get(name)) for name in _SPECIAL_NAMES if _token_text(config.get(name))}
    model_config = read_json_object(directory / "config.json")
    generation = read_json_object(directory / "generation_config.json")
    eos = _ids(generation.get("eos_token_id")) | _ids(model_config.get("eos_token_id"))
    if "eos_token" in special and backend.token_to_id(special["eos_token"]) is not None:
        eos.add(backend.token_to_id(special["eos_token"]))
    return Tokenizer(backend, eos, _chat_template(directory, config), special, _generation_defaults(generation))


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    """The template from chat_template.jinja (newer saves) or tokenizer_config.json."""
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return read_text_file(jinja_file)
    template = config.get("chat_template") or read_json_object(directory / "chat_template.json").get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


# ---- GGUF files ---------------------------------------------------------------------------


def _gguf_tokenizer(file: Path) -> Tokenizer:
    if not is_gguf_file(file):
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{file}: not a GGUF file")
    meta = read_gguf_metadata(file)
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{file}: the GGUF has no tokenizer (tokenizer.ggml.tokens)")
    special = {}
    for name, key in zip(_SPECIAL_NAMES, ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(token_id, int) and 0 <= token_id < len(tokens):
            special[name] = tokens[token_id]
    if meta.get("tokenizer.ggml.model") == "gpt2":
        backend = _byte_level_bpe(meta, special)
    else:
        check_gguf_file(file)  # transformers reads it with `gguf`, which trusts the header's counts
        backend, _ = _transformers_tokenizer(file.parent, {"gguf_file": file.name})
    # GGUF records one EOS; chat models also end turns with their end-of-turn special token.
    eos = {backend.token_to_id(special["eos_token"])} if "eos_token" in special else set()
    eos |= {i for i, t in enumerate(tokens) if t in _END_OF_TURN_TOKENS and _is_control(meta, i)}
    return Tokenizer(backend, eos, meta.get("tokenizer.chat_template"), special, {})


def _is_control(meta: dict[str, Any], index: int) -> bool:
    types = meta.get("tokenizer.ggml.token_type") or []
    return index < len(types) and types[index] == _CONTROL


def _byte_level_bpe(meta: dict[str, Any], special: dict[str, str]) -> Backend:
    """llama.cpp's `gpt2` tokenizer model: byte-level BPE with the file's vocabulary and merges."""
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    alphabet = set(_byte_alphabet().values())
    # A token spelled outside the byte alphabet (a mislabel) is respelled byte by byte, as transformers does.
    vocab = {
        t if set(t) <= alphabet else "".join(_byte_alphabet()[b] for b in t.encode("utf-8")): i for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    backend = Backend(
        models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    )
    split = _PRE_SPLITS.get(meta.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    backend.decoder = decoders.ByteLevel()
    # Control tokens stay whole and are special; user-defined ones stay whole and are plain text.
    backend.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types) if k == _CONTROL and set(t) <= alphabet]
    )
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types) if k == _USER_DEFINED])
    bos = special.get("bos_token")
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, vocab[bos])]
        )
    return backend


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the spelling of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _transformers_tokenizer(directory: Path, kwargs: dict[str, Any]) -> tuple[Backend, dict[str, Any]]:
    """What this module does not build itself, through transformers (a heavy, optional import)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"{directory}: no tokenizer.json nor byte-level GGUF tokenizer; reading this one needs transformers",
        ) from None
    try:
        # transformers opens the files by name, past open_regular's check: under the load's read
        # deadline, a FIFO swapped in meanwhile fails the load instead of blocking the rank
        loaded = within("the tokenizer files", lambda: AutoTokenizer.from_pretrained(
            str(directory), local_files_only=True, **kwargs))
    except CeleryTPError:
        raise
    except Exception as exc:  # transformers raises OSError/ValueError subclasses
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{directory}: cannot load tokenizer: {exc}") from exc
    config = {name: str(getattr(loaded, name)) for name in _SPECIAL_NAMES if getattr(loaded, name, None)}
    return loaded.backend_tokenizer, {**config, "chat_template": getattr(loaded, "chat_template", None)}


# ---- chat templates -----------------------------------------------------------------------


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    """A chat template compiled in the sandbox transformers uses, with the helpers templates call."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
        # Jinja's own tojson escapes HTML characters, which chat templates do not expect.
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _ids(value: int | list[int] | None) -> set[int]:
    if isinstance(value, bool) or value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {v for v in value if isinstance(v, int)} if isinstance(value, list) else set()


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
