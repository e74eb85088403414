"""Hybrid GGUF files (qwen3next, qwen35, qwen35moe): llama.cpp's converter undone, tensor by tensor, per rank.

llama.cpp's convert_hf_to_gguf.py (Qwen3NextModel on top of Qwen2MoeModel and TextModel; for
Qwen3.5 Qwen3_5TextModel / Qwen3_5MoeTextModel, which add _LinearAttentionVReorderBase before
Qwen3NextModel) renames and rewrites the Hugging Face tensors. Each source below presents one HF
tensor and undoes those rewrites while reading only the rows (or columns) a rank asks for:

- `A_log` -> `ssm_a = -exp(A_log)`                      undone by ALogSource (log(-ssm_a))
- `dt_bias` -> renamed `dt_proj.bias` -> `ssm_dt.bias`   a rename
- `conv1d.weight` (C, 1, K) squeezed to (C, K)           undone by Conv1dSource (the 1 put back)
- every `*norm.weight` except `linear_attn.norm` + 1     undone by ShiftedNormSource (- 1): these
  RMSNorms scale by (1 + w), llama.cpp's by w
- qwen3next: `in_proj_qkvz` ([q, k, v, z] per key head) split into `attn_qkv` ([all q | all k |
  all v]) and `attn_gate` (all z)                        undone by QKVZSource (row map back)
- qwen35*: value heads reordered from grouped-by-key-head to tiled (`_reorder_v_heads`) in
  in_proj_qkv's V rows, in_proj_z, in_proj_b/a, A_log, dt_bias, conv1d's V channels (rows) and
  out_proj (columns)                                     undone by RowOrderSource / ColumnOrderSource
- experts stacked into `ffn_{gate,up,down}_exps` (E, out, in)   undone by one 2-D view per expert
- attention (q_proj keeps its [q | gate] heads), in_proj_ba, shared expert, router,
  `shared_expert_gate`: renamed only (post_attention_layernorm is `post_attention_norm` here).
- Qwen3.5's MTP layers, appended as blocks past `nextn_predict_layers`' start: skipped.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import gguf
import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import Range, ReadRecord, TensorSource
from celerytp.loading.gguf_rope import gguf_rope_parameters
from celerytp.loading.gguf_source import GGUFSource

# GGUF architecture -> the model_type of the HF config it was converted from.
HYBRID_MODEL_TYPES = {"qwen3next": "qwen3_next", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}
SourceFactory = Callable[[str, list[ReadRecord]], TensorSource]

# GGUF block tensor stem -> HF module under model.layers.N, for every architecture.
RENAMED = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",  # still [q | gate] per head, as in HF
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_dt": "linear_attn.dt_bias",  # `dt_bias` renamed `dt_proj.bias` by the converter
    "ssm_a": "linear_attn.A_log",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate": "mlp.gate_proj",  # Qwen3.5's dense MLP
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
QWEN3NEXT_RENAMED = {"ssm_ba": "linear_attn.in_proj_ba"}  # untouched by Qwen3NextModel.modify_tensors
QWEN35_RENAMED = {
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
}
GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
# Stems whose weights the converter stored as 1 + w ("norm.weight" but not "linear_attn.norm.weight").
SHIFTED_NORMS = ("output_norm", "attn_norm", "post_attention_norm", "attn_q_norm", "attn_k_norm")
# ssm_in is how older converters stored in_proj_qkvz; its layout is not documented by the current one.
UNTRANSLATED = ("ssm_in",)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.([\w.]+?)(?:\.(weight|bias))?")  # nextn.eh_proj: a dotted stem


class _TensorView(NamedTuple):
    """What GGUFSource needs of a reader tensor: GGUF-order shape, type and memory-mapped data."""

    shape: tuple[int, ...]
    tensor_type: Any
    data: Any


@dataclass(frozen=True)
class VHeadOrder:
    """_LinearAttentionVReorderBase._reorder_v_heads along one dim: past `offset`, value heads
    grouped by key head in HF ([g0 w0, g0 w1, .., g1 w0, ..]) are stored tiled ([g0 w0, g1 w0, ..,
    g0 w1, ..]), `head_dim` entries each."""

    offset: int
    key_heads: int
    per_key: int
    head_dim: int

    def runs(self, span: Range) -> list[Range]:
        """Runs of file indices holding HF indices span[0]:span[1], in HF order."""
        lo, hi = span
        runs: list[Range] = []
        if lo < self.offset:
            _append_run(runs, (lo, min(hi, self.offset)))
        hd = self.head_dim
        for h in range(max(lo - self.offset, 0) // hd, -(-(hi - self.offset) // hd)):
            start = self.offset + h * hd
            g, w = divmod(h, self.per_key)
            stored = self.offset + (w * self.key_heads + g) * hd
            a, b = max(lo, start), min(hi, start + hd)
            _append_run(runs, (stored + a - start, stored + b - start))
        return runs


def _append_run(runs: list[Range], run: Range) -> None:
    if runs and runs[-1][1] == run[0]:
        runs[-1] = (runs[-1][0], run[1])
    elif run[0] < run[1]:
        runs.append(run)


# ---- sources that undo one converter step --------------------------------------------------


class _Derived(TensorSource):
    """A source computed from another (which logs nothing itself: we log the HF-named read)."""

    def __init__(self, name: str, shape: tuple[int, ...], log: list[ReadRecord], inner: TensorSource) -> None:
        super().__init__(name, shape, log)
        self._inner = inner

    @property
    def ggml_type(self) -> Any:
        return self._inner.ggml_type

    def column_block(self) -> int:
        return self._inner.column_block()


class ShiftedNormSource(_Derived):
    """Undoes `data_torch + 1` on norm weights (Qwen3NextModel.modify_tensors)."""

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        return self._inner.read(rows, cols) - 1.0


class ALogSource(_Derived):
    """Undoes `-torch.exp(A_log)`: A_log = log(-ssm_a), in float64 so the round trip stays exact
    to float32 (a vector of num_value_heads: read whole)."""

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        ssm_a = self._inner.read().double()
        return torch.log(-ssm_a)[rows[0] : rows[1]].float()


class Conv1dSource(_Derived):
    """Undoes `data_torch.squeeze()` on the conv1d weight: (C, K) back to HF's (C, 1, K)."""

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        return self._inner.read(rows)[:, None, :]


class RowOrderSource(_Derived):
    """Undoes a value-head reorder of rows: the HF rows asked for, gathered from their file runs."""

    def __init__(
        self, name: str, shape: tuple[int, ...], log: list[ReadRecord], inner: TensorSource, order: VHeadOrder
    ) -> None:
        super().__init__(name, shape, log, inner)
        self._order = order

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        return torch.cat([self._inner.read(run, cols) for run in self._order.runs(rows)])

    def read_blocks(self, qtype: Any, rows: Range | None = None, cols: Range | None = None) -> torch.Tensor:
        r, c = self._check_range(rows, 0), self._check_range(cols, 1)
        out = torch.cat([self._inner.read_blocks(qtype, run, c) for run in self._order.runs(r)])
        self._log.append(ReadRecord(self.name, (r[1] - r[0], c[1] - c[0]), self.shape))
        return out


class ColumnOrderSource(_Derived):
    """Undoes the value-head reorder of out_proj's columns (input features).

    Kept quantized only where every head is whole blocks of the file's type; else it presents
    itself as a float tensor (ggml_type None), which the quant plan loads in the compute dtype.
    """

    def __init__(
        self, name: str, shape: tuple[int, ...], log: list[ReadRecord], inner: TensorSource, order: VHeadOrder
    ) -> None:
        super().__init__(name, shape, log, inner)
        self._order = order

    @property
    def ggml_type(self) -> Any:
        file_type = self._inner.ggml_type
        return file_type if self._order.head_dim % self._inner.column_block() == 0 else None

    def column_block(self) -> int:
        return 1 if self.ggml_type is None else self._inner.column_block()

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        span = cols if cols is not None else (0, self.shape[1])
        return torch.cat([self._inner.read(rows, run) for run in self._order.runs(span)], dim=1)

    def read_blocks(self, qtype: Any, rows: Range | None = None, cols: Range | None = None) -> torch.Tensor:
        r, c = self._check_range(rows, 0), self._check_range(cols, 1)
        block = gguf.GGML_QUANT_SIZES[qtype][0]
        runs = self._order.runs(c)
        if qtype != self._inner.ggml_type or any(a % block or b % block for a, b in runs):
            return super().read_blocks(qtype, r, c)  # quantize the reordered floats
        out = torch.cat([self._inner.read_blocks(qtype, r, run) for run in runs], dim=1)
        self._log.append(ReadRecord(self.name, (r[1] - r[0], c[1] - c[0]), self.shape))
        return out


class QKVZSource(TensorSource):
    """HF's in_proj_qkvz ([q, k, v, z] per key head) over the converter's attn_qkv and attn_gate.

    The converter viewed the weight as (hidden, key_heads, q+k+v+z), split the last dim and
    concatenated [q | k | v] into attn_qkv and z into attn_gate (Qwen3NextModel.modify_tensors);
    a requested row range maps back to a few contiguous row runs of those two tensors.
    """

    def __init__(
        self, name: str, log: list[ReadRecord], qkv: GGUFSource, gate: GGUFSource, key_heads: int, key_dim: int
    ) -> None:
        self._parts = (qkv, gate)
        self._key_heads, self._key_dim = key_heads, key_dim
        self._value_rows = gate.shape[0] // key_heads  # v (and z) rows per key head
        super().__init__(name, (qkv.shape[0] + gate.shape[0], qkv.shape[1]), log)
        expected = 2 * key_heads * key_dim + key_heads * self._value_rows
        if qkv.shape[0] != expected or gate.shape[1] != qkv.shape[1]:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"{name}: attn_qkv {qkv.shape} and attn_gate {gate.shape} do not fit {key_heads} key heads",
            )

    @property
    def ggml_type(self) -> Any:
        # attn_qkv's type; an attn_gate of another type is requantized by its read_blocks.
        return self._parts[0].ggml_type

    def column_block(self) -> int:
        return math.lcm(*(p.column_block() for p in self._parts))

    def _read(self, rows: Range, cols: Range | None) -> torch.Tensor:
        return torch.cat([self._parts[part].read((lo, hi), cols) for part, lo, hi in self.runs(rows)])

    def read_blocks(self, qtype: Any, rows: Range | None = None, cols: Range | None = None) -> torch.Tensor:
        r, c = self._check_range(rows, 0), self._check_range(cols, 1)
        out = torch.cat([self._parts[part].read_blocks(qtype, (lo, hi), c) for part, lo, hi in self.runs(r)])
        self._log.append(ReadRecord(self.name, (r[1] - r[0], c[1] - c[0]), self.shape))
        return out

    def runs(self, rows: Range) -> list[tuple[int, int, int]]:
        """(part, start, stop) row runs of attn_qkv (0) / attn_gate (1) holding HF rows `rows`, in order."""
        K, hk, vr = self._key_heads, self._key_dim, self._value_rows
        group = 2 * hk + 2 * vr
        runs: list[tuple[int, int, int]] = []
        for g in range(rows[0] // group, -(-rows[1] // group)):
            # (offset in the HF group, length, part, first row in that part)
            segments = (
                (0, hk, 0, g * hk),
                (hk, hk, 0, K * hk + g * hk),
                (2 * hk, vr, 0, 2 * K * hk + g * vr),
                (2 * hk + vr, vr, 1, g * vr),
            )
            for offset, size, part, first in segments:
                start = g * group + offset
                lo, hi = max(rows[0], start), min(rows[1], start + size)
                if lo >= hi:
                    continue
                src = (part, first + lo - start, first + hi - start)
                if runs and runs[-1][0] == part and runs[-1][2] == src[1]:
                    runs[-1] = (part, runs[-1][1], src[2])
                else:
                    runs.append(src)
        return runs


def _quiet(tensor: Any, name: str) -> GGUFSource:
    """A GGUFSource whose reads are not logged (its wrapper logs the HF-named read)."""
    return GGUFSource(tensor, name, [])


def _expert_view(tensor: Any, expert: int) -> _TensorView:
    """Expert `expert` of a stacked ffn_*_exps tensor (GGUF shape (in, out, E); data (E, out, in-or-bytes))."""
    return _TensorView(tuple(int(d) for d in tensor.shape[:2]), tensor.tensor_type, tensor.data[expert])


# ---- the name table ------------------------------------------------------------------------


def hybrid_sources(arch: str, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, SourceFactory]:
    """HF tensor name -> how to build its source, for every text-model tensor of a hybrid GGUF file."""
    renamed = RENAMED | (QWEN3NEXT_RENAMED if arch == "qwen3next" else QWEN35_RENAMED)
    table: dict[str, SourceFactory] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name in GLOBAL:
            table[GLOBAL[gguf_name]] = _factory_for(gguf_name.rpartition(".")[0], tensor, None)
            continue
        m = _BLOCK_RE.fullmatch(gguf_name)
        if m is None:
            table[gguf_name] = _factory_for("", tensor, None)  # unknown: the loader reports it
            continue
        layer, stem, kind = m.groups()
        if int(layer) >= config["num_hidden_layers"]:
            continue  # an MTP block (_Qwen35MtpMixin appends them); the text model does not use it
        prefix = f"model.layers.{layer}."
        if stem in UNTRANSLATED:
            raise CeleryTPError(
                ErrorKind.UNSUPPORTED_ARCH,
                f"{gguf_name}: this {arch} GGUF stores in_proj_qkvz as {stem} (an older converter layout); "
                f"only the current attn_qkv + attn_gate split is translated",
            )
        if arch == "qwen3next" and stem in ("attn_qkv", "attn_gate"):
            if stem == "attn_qkv":
                table[prefix + "linear_attn.in_proj_qkvz.weight"] = _qkvz_factory(tensors, layer, config)
        elif stem in EXPERTS:
            for e in range(int(tensor.shape[2])):
                view = _expert_view(tensor, e)
                table[f"{prefix}mlp.experts.{e}.{EXPERTS[stem]}.weight"] = _factory_for("", view, None)
        elif stem in renamed:
            hf = prefix + renamed[stem] + ("" if stem in ("ssm_a", "ssm_dt") else f".{kind}")
            order = _v_head_order(stem, config) if arch != "qwen3next" else None
            table[hf] = _factory_for(stem, tensor, order)
        else:
            table[gguf_name] = _factory_for("", tensor, None)
    return table


def _v_head_order(stem: str, config: dict[str, Any]) -> VHeadOrder | None:
    """Where _LinearAttentionVReorderBase.modify_tensors reordered value heads in this tensor (qwen35*)."""
    nk, nv = config["linear_num_key_heads"], config["linear_num_value_heads"]
    qk_rows, hv = 2 * nk * config["linear_key_head_dim"], config["linear_value_head_dim"]
    # stem -> (first reordered index, entries per value head); ssm_out's are columns.
    spans = {
        "attn_qkv": (qk_rows, hv),  # only the V rows
        "ssm_conv1d": (qk_rows, hv),  # only the V channels
        "attn_gate": (0, hv),
        "ssm_out": (0, hv),
        "ssm_beta": (0, 1),
        "ssm_alpha": (0, 1),
        "ssm_a": (0, 1),
        "ssm_dt": (0, 1),
    }
    if stem not in spans or nk == nv:  # the converter reorders only when nk != nv (else it is the identity)
        return None
    offset, head_dim = spans[stem]
    return VHeadOrder(offset, nk, nv // nk, head_dim)


def _factory_for(stem: str, tensor: Any, order: VHeadOrder | None) -> SourceFactory:
    shape = _hf_shape(tensor)

    def make(name: str, log: list[ReadRecord]) -> TensorSource:
        file = _quiet(tensor, name)
        if order is not None and stem == "ssm_out":
            return ColumnOrderSource(name, shape, log, file, order)
        rows = file if order is None else RowOrderSource(name, shape, [], file, order)
        if stem in SHIFTED_NORMS:
            return ShiftedNormSource(name, shape, log, rows)
        if stem == "ssm_a":
            return ALogSource(name, shape, log, rows)
        if stem == "ssm_conv1d":
            return Conv1dSource(name, (shape[0], 1, shape[1]), log, rows)
        return GGUFSource(tensor, name, log) if order is None else RowOrderSource(name, shape, log, file, order)

    return make


def _qkvz_factory(tensors: dict[str, Any], layer: str, config: dict[str, Any]) -> SourceFactory:
    qkv, gate = tensors[f"blk.{layer}.attn_qkv.weight"], tensors.get(f"blk.{layer}.attn_gate.weight")
    if gate is None:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"blk.{layer}.attn_qkv.weight has no blk.{layer}.attn_gate.weight beside it"
        )
    heads, dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
    return lambda name, log: QKVZSource(name, log, _quiet(qkv, name), _quiet(gate, name), heads, dim)


def _hf_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))


# ---- metadata ------------------------------------------------------------------------------


def hybrid_config(
    arch: str, metadata: Callable[[str, Any], Any], tensors: dict[str, Any], where: str
) -> dict[str, Any]:
    """The HF config.json that the converter's set_gguf_parameters (TextModel, Qwen2MoeModel,
    Qwen3NextModel; for Qwen3.5 also the MTP and M-RoPE mixins) wrote these keys from."""

    def key(suffix: str, default: Any = None) -> Any:
        return metadata(f"{arch}.{suffix}", default)

    names = set(tensors)
    # _Qwen35MtpMixin counts the MTP layers in block_count and writes their number as nextn_predict_layers.
    layers = (key("block_count") or 0) - (key("nextn_predict_layers") or 0)
    heads = key("attention.head_count")
    hidden = key("embedding_length")
    value_heads = key("ssm.time_step_rank")  # add_ssm_time_step_rank(linear_num_value_heads)
    if not (layers and heads and hidden and value_heads):
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{where}: {arch} metadata lacks block, head or ssm counts")
    head_dim = key("attention.key_length") or hidden // heads
    return {
        "model_type": HYBRID_MODEL_TYPES[arch],
        "vocab_size": _vocab_size(arch, metadata, tensors),
        "hidden_size": hidden,
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": layers,
        # Which tensors a block has says its kind (llama.cpp derives the same from full_attention_interval).
        "layer_types": ["linear_attention" if f"blk.{i}.ssm_a" in names else "full_attention" for i in range(layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": head_dim,
        # The converter writes rope.dimension_count = head_dim * partial_rotary_factor. Qwen3.5's
        # M-RoPE sections (rope.dimension_sections) are plain RoPE for text-only positions.
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "rope_parameters": gguf_rope_parameters(key, tensors, key("rope.dimension_count", head_dim)),
        "max_position_embeddings": key("context_length", 2048),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", 1e-6),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": value_heads,
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_value_head_dim": key("ssm.inner_size") // value_heads,  # inner_size = value dim * value heads
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "num_experts": key("expert_count", 0),
        "num_experts_per_tok": key("expert_used_count", 0),
        "moe_intermediate_size": key("expert_feed_forward_length", 0),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
        # Not written by the converter; Qwen3-Next's config (transformers' default) renormalizes,
        # and Qwen3.5-MoE always does.
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        "bos_token_id": metadata("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": metadata("tokenizer.ggml.eos_token_id", None),
    }


def _vocab_size(arch: str, metadata: Callable[[str, Any], Any], tensors: dict[str, Any]) -> int | None:
    # TextModel writes no vocab_size: the embedding's rows say it.
    embd = tensors.get("token_embd.weight")
    return int(embd.shape[1]) if embd is not None else metadata(f"{arch}.vocab_size", None)

