"""ModelConfig: the architecture facts a model needs, built from a checkpoint's own config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.layers.rotary import RopeConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_MAX_CONTEXT = 4096


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only llama-family model.

    Args:
        model_type: "llama" or "qwen3" (qwen3 adds per-head q_norm/k_norm).
        num_heads, num_kv_heads: query and key/value heads (GQA when they differ).
        head_dim: per-head size; may differ from hidden_size / num_heads.
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: q/k/v/o projections have biases; mlp_bias: gate/up/down do.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require_positive(
            self, "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
            "head_dim", "max_position_embeddings",
        )
        if self.head_dim % 2:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.num_heads % self.num_kv_heads:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )

    @property
    def qk_norm(self) -> bool:
        return self.model_type == "qwen3"

    @property
    def default_max_context(self) -> int:
        return min(self.max_position_embeddings, DEFAULT_MAX_CONTEXT)

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict (transformers 4.x or 5.x keys)."""
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CeleryTPError(
                ErrorKind.UNSUPPORTED_ARCH,
                f"model_type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}",
            )
        if d.get("hidden_act", "silu") != "silu":
            raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"hidden_act {d['hidden_act']!r} is not silu")
        if d.get("use_sliding_window"):
            raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, "sliding-window attention is not supported")
        try:
            num_heads = d["num_attention_heads"]
            hidden = d["hidden_size"]
            return cls(
                model_type=model_type,
                vocab_size=d["vocab_size"],
                hidden_size=hidden,
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=d.get("num_key_value_heads") or num_heads,
                head_dim=d.get("head_dim") or hidden // num_heads,
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope=rope_config(d),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", False)),
                mlp_bias=bool(d.get("mlp_bias", False)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=id_tuple(d.get("eos_token_id")),
            )
        except KeyError as exc:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"config is missing {exc.args[0]!r}") from exc


def id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def rope_config(d: dict[str, Any]) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); 4.x wrote rope_theta + rope_scaling.
    params = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"rope type {rope_type!r} is not one of {', '.join(SUPPORTED_ROPE_TYPES)}")
    factors = d.get("rope_freq_factors")
    return RopeConfig(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
        freq_factors=tuple(factors) if factors else None,
    )


def require_positive(config: object, *names: str) -> None:
    """Raise CeleryTPError naming the first of `names` that is not a positive integer on `config`."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"config {name} must be a positive integer, got {value!r}")
