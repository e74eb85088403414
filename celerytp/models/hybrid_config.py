"""HybridConfig: Qwen3-Next / Qwen3.5 (Gated DeltaNet + gated attention, dense or MoE MLP)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.layers.rotary import RopeConfig
from celerytp.models.config import DEFAULT_MAX_CONTEXT, id_tuple, require_positive, rope_config

# model_type in config.json -> what it is. `qwen3_5` and `qwen3_5_moe` are the multimodal
# checkpoints (text model under `text_config`, weights under `model.language_model.`); the
# `*_text` types are what transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM save.
HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
LAYER_TYPES = ("linear_attention", "full_attention")
DEFAULT_CHUNK_SIZE = 64  # the chunked delta rule's block length (transformers' default)


@dataclass(frozen=True)
class HybridConfig:
    """A hybrid linear/full attention model of the Qwen3-Next family.

    Args:
        model_type: as in config.json (`qwen3_next`, `qwen3_5`, `qwen3_5_text`, `qwen3_5_moe`, ...).
        layer_types: per layer, "linear_attention" (Gated DeltaNet) or "full_attention".
        num_heads, num_kv_heads, head_dim: the gated full-attention layers.
        rotary_dim: leading dims of each head that are rotated (partial_rotary_factor * head_dim).
        linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
            linear_conv_kernel_dim: the Gated DeltaNet layers.
        fused_linear_proj: the checkpoint packs in_proj_qkvz/in_proj_ba per key head (Qwen3-Next)
            rather than separate in_proj_qkv/z/b/a (Qwen3.5).
        moe_layers: indices of layers whose MLP is a sparse MoE block (the rest are dense).
        num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size,
            norm_topk_prob: the MoE blocks (0 experts: dense only).
        weight_prefix: where the text model's weights live (`model.` or `model.language_model.`).
        chunk_size: block length of the chunked delta rule used for prefill (config.json key
            `linear_chunk_size`, a celerytp extension; the result does not depend on it).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    fused_linear_proj: bool
    intermediate_size: int = 0
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    weight_prefix: str = "model."
    chunk_size: int = DEFAULT_CHUNK_SIZE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require_positive(
            self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "max_position_embeddings", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "chunk_size",
        )
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES):
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"layer_types must list {self.num_layers} of {LAYER_TYPES}, got {list(self.layer_types)}",
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"rotary dim {self.rotary_dim} must be even and within head_dim {self.head_dim}"
            )
        if self.moe_layers and not (self.num_experts and self.num_experts_per_tok and self.moe_intermediate_size):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, "MoE layers need num_experts, num_experts_per_tok and moe_intermediate_size")
        dense = [i for i in range(self.num_layers) if i not in self.moe_layers]
        if dense and self.intermediate_size < 1:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"layers {dense} are dense but intermediate_size is {self.intermediate_size}"
            )

    @property
    def default_max_context(self) -> int:
        return min(self.max_position_embeddings, DEFAULT_MAX_CONTEXT)

    @property
    def num_linear_layers(self) -> int:
        return self.layer_types.count("linear_attention")

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> HybridConfig:
        """Build from config.json; for the multimodal types, from its `text_config`."""
        model_type = d.get("model_type")
        if model_type not in HYBRID_MODEL_TYPES:
            raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"model_type {model_type!r} is not one of {HYBRID_MODEL_TYPES}")
        nested = model_type in ("qwen3_5", "qwen3_5_moe")
        text = dict(d.get("text_config") or {}) if nested else d
        if nested and not text:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"model_type {model_type!r} config has no text_config")
        if text.get("hidden_act", "silu") != "silu":
            raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"hidden_act {text['hidden_act']!r} is not silu")
        try:
            return cls._from_text_config(model_type, text, d, nested)
        except KeyError as exc:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"config is missing {exc.args[0]!r}") from exc

    @classmethod
    def _from_text_config(cls, model_type: str, t: dict[str, Any], top: dict[str, Any], nested: bool) -> HybridConfig:
        num_layers = t["num_hidden_layers"]
        num_heads = t["num_attention_heads"]
        head_dim = t.get("head_dim") or t["hidden_size"] // num_heads
        params = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
        partial = float(params.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)))
        layer_types = t.get("layer_types") or [
            "full_attention" if (i + 1) % t.get("full_attention_interval", 4) == 0 else "linear_attention"
            for i in range(num_layers)
        ]
        moe = model_type.startswith("qwen3_5_moe") or (model_type == "qwen3_next" and t.get("num_experts", 0) > 0)
        return cls(
            model_type=model_type,
            vocab_size=t["vocab_size"],
            hidden_size=t["hidden_size"],
            num_layers=num_layers,
            layer_types=tuple(layer_types),
            num_heads=num_heads,
            num_kv_heads=t.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rotary_dim=int(head_dim * partial),
            max_position_embeddings=t.get("max_position_embeddings", 2048),
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            rope=rope_config({k: v for k, v in t.items() if k != "rope_freq_factors"} | _plain_rope(params)),
            linear_num_key_heads=t["linear_num_key_heads"],
            linear_num_value_heads=t["linear_num_value_heads"],
            linear_key_head_dim=t["linear_key_head_dim"],
            linear_value_head_dim=t["linear_value_head_dim"],
            linear_conv_kernel_dim=t.get("linear_conv_kernel_dim", 4),
            fused_linear_proj=model_type == "qwen3_next",
            intermediate_size=t.get("intermediate_size") or 0,
            moe_layers=moe_layers(t, num_layers) if moe else (),
            num_experts=t.get("num_experts", 0) if moe else 0,
            num_experts_per_tok=t.get("num_experts_per_tok", 0) if moe else 0,
            moe_intermediate_size=t.get("moe_intermediate_size", 0) if moe else 0,
            shared_expert_intermediate_size=t.get("shared_expert_intermediate_size", 0) if moe else 0,
            # Qwen3.5-MoE's router always renormalizes its top-k weights.
            norm_topk_prob=bool(t.get("norm_topk_prob", True)) or model_type.startswith("qwen3_5_moe"),
            tie_word_embeddings=bool(top.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
            attention_bias=bool(t.get("attention_bias", False)),
            weight_prefix="model.language_model." if nested else "model.",
            chunk_size=int(top.get("linear_chunk_size", t.get("linear_chunk_size", DEFAULT_CHUNK_SIZE))),
            bos_token_id=t.get("bos_token_id", top.get("bos_token_id")),
            eos_token_ids=id_tuple(t.get("eos_token_id", top.get("eos_token_id"))),
        )


def _plain_rope(params: dict[str, Any]) -> dict[str, Any]:
    """Qwen3.5's mrope keys: with text-only positions (t = h = w) M-RoPE is ordinary RoPE."""
    rope = {k: v for k, v in params.items() if k not in ("mrope_section", "mrope_interleaved", "partial_rotary_factor")}
    return {"rope_parameters": rope} if rope else {}


def moe_layers(t: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    step = t.get("decoder_sparse_step", 1) or 1
    dense = set(t.get("mlp_only_layers") or [])
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)

