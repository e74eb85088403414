"""Single-file GGUF checkpoints: metadata as an HF config, block-aligned slice reads.

llama and qwen3 are translated here, the hybrid architectures (qwen3next, qwen35, qwen35moe) by
gguf_hybrid.py on top of GGUFSource (gguf_source.py); MoE files (qwen3moe, and llama files with
experts: Mixtral) take their dense keys from here and their experts from gguf_moe.py.

GGUF stores a 2-D weight as rows of quant blocks; a rank's rows are a slice of the memory
map, its columns a block-aligned byte range of each row. Only that slice is dequantized.
"""

from __future__ import annotations

import inspect
import mmap
import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.gguf_metadata import check_gguf_layout
from celerytp.core.model_files import open_regular
from celerytp.core.read_deadline import within
from celerytp.loading.checkpoint import Checkpoint, TensorSource
from celerytp.loading.gguf_names import hf_name
from celerytp.loading.gguf_rope import ROPE_TENSORS, gguf_rope_parameters
from celerytp.loading.gguf_source import GGUFSource

SUPPORTED_ARCHS = (
    "llama", "qwen3", "qwen3next", "qwen35", "qwen35moe", "gemma3", "qwen3moe", "qwen2", "phi3", "qwen2vl",
)
# Architectures whose text model is another's: Qwen2.5-VL's language model (qwen2vl: qwen2's tensors,
# plus the M-RoPE sections `rope.dimension_sections`) is served as qwen2, exact for text (its three
# position streams are equal), and as qwen2_5_vl with its mmproj (loading/gguf_mmproj.py).
TEXT_MODEL_TYPES = {"qwen2vl": "qwen2"}
# Hybrid (Gated DeltaNet) architectures: their converter's rewrites are undone by gguf_hybrid.py.
HYBRID_GGUF_ARCHS = ("qwen3next", "qwen35", "qwen35moe")
# MoE model types whose tensors gguf_moe.py translates (experts stacked per layer).
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")

# llama.cpp's rope factors for llama3-style scaling; folded into the config, not a weight.
ROPE_FREQS = "rope_freqs.weight"


class _PlainViewReader(gguf.GGUFReader):
    """GGUFReader that slices a plain ndarray view of its memory map.

    np.memmap runs Python-level hooks on every slice; the reader takes ~250k slices for a
    tokenizer's metadata arrays, so a plain view of the same mapping opens ~4x faster.
    Tensor data stays memory-mapped (views into the same mapping).
    """

    def _get(self, offset, dtype, count=1, override_order=None):  # type: ignore[no-untyped-def]
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _reader_class() -> type[gguf.GGUFReader]:
    # Only override the private _get of the gguf versions whose signature we know.
    params = list(inspect.signature(gguf.GGUFReader._get).parameters)
    return _PlainViewReader if params == ["self", "offset", "dtype", "count", "override_order"] else gguf.GGUFReader


def open_gguf_reader(path: str | Path) -> gguf.GGUFReader:
    """A GGUFReader for `path` (the faster subclass where this gguf version allows).

    The reader loops over whatever counts a header states, so the file is first walked by our
    bounded scan (core/gguf_metadata.py): a count, string or tensor that the file cannot hold is
    refused before the reader sees it. The file is opened once, as a regular file without
    blocking (a FIFO or device is refused), and the reader maps that very file.
    Raises CeleryTPError(load_failed) naming the file for anything that is not a readable GGUF.
    """
    try:
        file = open_regular(path)
    except OSError as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{path}: cannot read: {exc}") from exc
    with file:
        try:
            if os.fstat(file.fileno()).st_size == 0:
                raise ValueError("the file is empty")
            with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
                within(f"{Path(path).name}'s header", lambda: check_gguf_layout(data, gguf.GGML_QUANT_SIZES, path))
            # np.memmap maps the open file (its own duplicate descriptor)
            return within(f"{Path(path).name}'s header", lambda: _reader_class()(file))
        except CeleryTPError:
            raise
        except Exception as exc:  # the reader raises ValueError/KeyError/struct errors on junk
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{path}: not a readable GGUF file: {exc}") from exc


class GGUFCheckpoint(Checkpoint):
    """A .gguf file, with its metadata translated to Hugging Face config keys."""

    def __init__(self, path: Path) -> None:
        reader = open_gguf_reader(path)  # CeleryTPError(load_failed) for a damaged file
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        self.path = path  # _hf_config's messages name it
        super().__init__(path, self._hf_config())
        self._hf_to_gguf = {hf_name(n): n for n in self._tensors if n not in ROPE_TENSORS}
        self._hybrid: dict[str, Any] | None = None  # HF name -> source factory, for hybrid archs
        arch = self.metadata("general.architecture")
        if arch in HYBRID_GGUF_ARCHS:
            from celerytp.loading.gguf_hybrid import hybrid_sources  # it builds on GGUFSource

            self._hybrid = hybrid_sources(arch, self._tensors, self.hf_config)
        elif arch == "gemma3":  # its norms are stored + 1: gguf_gemma3.py's own sources
            from celerytp.loading.gguf_gemma3 import gemma3_sources

            self._hybrid = gemma3_sources(self._tensors)
        elif arch == "phi3":  # fused attn_qkv, and ffn_up holding [gate; up]: gguf_phi3.py's names
            from celerytp.loading.gguf_phi3 import phi3_sources

            self._hybrid = phi3_sources(self._tensors)
        elif self.hf_config["model_type"] in MOE_MODEL_TYPES:  # qwen3moe, Mixtral (llama with experts)
            from celerytp.loading.gguf_moe import moe_sources

            self._hybrid = moe_sources(arch, self._tensors, self.hf_config)

    def metadata(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def names(self) -> list[str]:
        return list(self._hybrid if self._hybrid is not None else self._hf_to_gguf)

    def source(self, name: str) -> TensorSource:
        if self._hybrid is not None:
            return self._hybrid[name](name, self.reads)
        gguf_name = self._hf_to_gguf[name]
        head_dim = None
        if self.hf_config["model_type"] == "llama" and re.search(r"\.attn_[qk]\.", gguf_name):
            head_dim = self.hf_config["head_dim"]
        return GGUFSource(self._tensors[gguf_name], name, self.reads, head_dim)

    def close(self) -> None:
        self._tensors.clear()
        self._reader = None  # drop the memory map

    def _hf_config(self) -> dict[str, Any]:
        arch = self.metadata("general.architecture")
        if arch not in SUPPORTED_ARCHS:
            raise CeleryTPError(
                ErrorKind.UNSUPPORTED_ARCH,
                f"{self.path}: GGUF architecture {arch!r} is not one of {', '.join(SUPPORTED_ARCHS)}",
            )

        if arch in HYBRID_GGUF_ARCHS:
            from celerytp.loading.gguf_hybrid import hybrid_config

            return hybrid_config(arch, self.metadata, self._tensors, str(self.path))
        if arch == "gemma3":
            from celerytp.loading.gguf_gemma3 import gemma3_config

            return gemma3_config(self.metadata, self._tensors, str(self.path))
        if arch == "phi3":
            from celerytp.loading.gguf_phi3 import phi3_config

            return phi3_config(self.metadata, self._tensors, str(self.path))

        def key(suffix: str, default: Any = None) -> Any:
            return self.metadata(f"{arch}.{suffix}", default)

        num_heads = key("attention.head_count")
        num_kv_heads = key("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list) or isinstance(num_heads, list):
            raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"{self.path}: per-layer head counts are not supported")
        hidden = key("embedding_length")
        head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads
        embd = self._tensors.get("token_embd.weight")
        vocab = key("vocab_size") or (int(embd.shape[1]) if embd is not None else None)
        rope = gguf_rope_parameters(key, self._tensors, head_dim)
        config: dict[str, Any] = {
            "model_type": TEXT_MODEL_TYPES.get(arch, arch),
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": key("feed_forward_length"),
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": num_heads,
            "num_key_value_heads": num_kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": key("context_length", 2048),
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
            "rope_parameters": rope,
            "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": "blk.0.attn_q.bias" in self._tensors,
            "mlp_bias": "blk.0.ffn_gate.bias" in self._tensors,
            "bos_token_id": self.metadata("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata("tokenizer.ggml.eos_token_id"),
        }
        if arch == "llama" and (window := key("attention.sliding_window")):
            # Not written by llama.cpp's converter (a Mistral GGUF has no window): honoured when present.
            config["sliding_window"] = window
        if ROPE_FREQS in self._tensors:
            factors = gguf.quants.dequantize(self._tensors[ROPE_FREQS].data, self._tensors[ROPE_FREQS].tensor_type)
            config["rope_freq_factors"] = [float(x) for x in np.asarray(factors).reshape(-1)]
        from celerytp.loading.gguf_moe import is_moe_file, moe_config  # it imports hf_name from here

        if is_moe_file(arch, self._tensors):
            return moe_config(arch, config, self.metadata, self._tensors, str(self.path))
        return config
