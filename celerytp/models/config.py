"""ModelConfig: the architecture facts a model needs, built from a checkpoint's own config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.layers.eager_ops import ACTIVATIONS
from celerytp.layers.rotary import RopeConfig

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
DEFAULT_MAX_CONTEXT = 4096
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer: every dense and MoE architecture but the hybrids.

    Built from a checkpoint's config.json by models/architectures.py `config_from_hf`: common
    keys here (`common_fields`), each architecture's own in its translator.

    Args:
        model_type: the checkpoint's architecture (its translator decided the rest).
        num_heads, num_kv_heads: query and key/value heads (GQA when they differ).
        head_dim: per-head size; may differ from hidden_size / num_heads.
        rotary_dim: leading dims of each head that rotate (None: the whole head).
        tie_word_embeddings: lm_head shares the embedding matrix.
        attention_bias: q/k/v projections have biases; o_proj_bias: o_proj has one; mlp_bias:
            gate/up/down do.
        qk_norm: per-head RMSNorm on queries and keys (qwen3, gemma3).
        zero_centered_norms: every RMSNorm scales by (1 + w) (gemma3).
        hidden_act: the gated MLP's activation (silu, or gelu_pytorch_tanh).
        layer_types: per layer, "full_attention" or "sliding_attention" (empty: all full).
        sliding_window: keys the sliding layers attend to.
        local_rope: the rotary parameters of sliding layers (None: `rope`).
        attention_scale: softmax scale (None: head_dim ** -0.5).
        embedding_scale: the token embedding is multiplied by this (None: not scaled).
        moe_layers: layers whose MLP is a routed sparse MoE block (none: dense only), with
            num_experts, num_experts_per_tok, moe_intermediate_size and norm_topk_prob.
        weight_prefix: where the text model's weights live (`model.` or `model.language_model.`).
        vision_config: a vision-language checkpoint's config.json (None: a text model), and
            image_processor its preprocessor_config.json.
        mrope_section: multimodal rotary sections (Qwen2.5-VL), None: ordinary rotary.
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
    rotary_dim: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    zero_centered_norms: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    local_rope: RopeConfig | None = None
    attention_scale: float | None = None
    embedding_scale: float | None = None
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    weight_prefix: str = "model."
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # A vision-language checkpoint's whole config.json (its vision tower's settings: models/vision.py)
    vision_config: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # and its preprocessor_config.json (models/loader.py `with_image_processor`)
    image_processor: dict[str, Any] | None = field(default=None, hash=False, compare=False)
    # Multimodal rotary (Qwen2.5-VL): the rotary half's frequencies in sections taken from the
    # temporal, height and width positions in turn (layers/rotary.py); None: one position.
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False  # Qwen3-VL's layout of those sections

    def __post_init__(self) -> None:
        require_positive(
            self, "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "max_position_embeddings",
        )
        rotary = self.rotary_dim or self.head_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"rotary dim {rotary} must be even and within head_dim {self.head_dim}"
            )
        if self.num_heads % self.num_kv_heads:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"hidden_act {self.hidden_act!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - set(LAYER_TYPES)):
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED, f"layer_types must list {self.num_layers} of {LAYER_TYPES}, got {list(self.layer_types)}"
            )
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"sliding layers need a positive sliding_window, got {self.sliding_window!r}")
        if self.moe_layers and not (self.num_experts and self.num_experts_per_tok and self.moe_intermediate_size):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, "MoE layers need num_experts, num_experts_per_tok and moe_intermediate_size")
        if len(self.moe_layers) < self.num_layers:
            require_positive(self, "intermediate_size")

    @property
    def default_max_context(self) -> int:
        return min(self.max_position_embeddings, DEFAULT_MAX_CONTEXT)

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"


def common_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The ModelConfig fields every llama-like config.json spells the same way."""
    num_heads = d["num_attention_heads"]
    hidden = d["hidden_size"]
    return dict(
        model_type=d["model_type"],
        vocab_size=d["vocab_size"],
        hidden_size=hidden,
        intermediate_size=d.get("intermediate_size") or 0,
        num_layers=d["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=d.get("num_key_value_heads") or num_heads,
        head_dim=d.get("head_dim") or hidden // num_heads,
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope=rope_config(d),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        attention_bias=bool(d.get("attention_bias", False)),
        o_proj_bias=bool(d.get("attention_bias", False)),
        mlp_bias=bool(d.get("mlp_bias", False)),
        hidden_act=d.get("hidden_act", "silu"),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=id_tuple(d.get("eos_token_id")),
    )


def sliding_fields(d: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """layer_types and sliding_window as transformers derives them: `use_sliding_window: false`
    turns the window off; an explicit `layer_types` list wins; otherwise a window applies to the
    layers from `max_window_layers` on (qwen2/qwen3), or to every layer (mistral)."""
    window = d.get("sliding_window")
    if not window or d.get("use_sliding_window") is False:
        return {}
    if d.get("layer_types"):
        types = tuple(d["layer_types"])
    else:
        first = d.get("max_window_layers", 0) if "use_sliding_window" in d else 0
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))
    if "sliding_attention" not in types:
        return {}
    return {"layer_types": types, "sliding_window": int(window)}


def id_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)


def rope_config(d: dict[str, Any]) -> RopeConfig:
    """The rotary parameters of a config.json dict, resolved as transformers resolves them.

    transformers 5 writes `rope_parameters` (theta inside); 4.x wrote `rope_theta` + `rope_scaling`
    (`type` or `rope_type`). The pretraining length of llama3/yarn/longrope is the top-level
    `original_max_position_embeddings` when set (transformers gives it priority), else the
    parameters', else `max_position_embeddings`; dynamic's is `max_position_embeddings`; longrope's
    factor defaults to max_position_embeddings / that length. An unknown type is UNSUPPORTED_ARCH,
    a malformed parameter LOAD_FAILED.
    """
    import math  # (module imports are shared with other edits; kept local)

    raw = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(raw, dict):
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"rope parameters must be a mapping, got {raw!r}")
    params = dict(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"rope type {rope_type!r} is not one of {', '.join(SUPPORTED_ROPE_TYPES)}")

    def bad(name: str, value: Any, want: str) -> CeleryTPError:
        return CeleryTPError(ErrorKind.LOAD_FAILED, f"rope type {rope_type!r}: {name} must be {want}, got {value!r}")

    def number(name: str, value: Any, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(name, value, "a positive number" if positive else "a number")
        if positive and value <= 0:
            raise bad(name, value, "a positive number")
        return float(value)

    def optional(name: str, positive: bool = True) -> float | None:
        value = params.get(name)
        return None if value is None else number(name, value, positive)

    def length(name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad(name, value, "a positive integer")
        if value != int(value) or value <= 0:
            raise bad(name, value, "a positive integer")
        return int(value)

    def factor_list(name: str) -> tuple[float, ...]:
        value = params.get(name)
        if not isinstance(value, (list, tuple)) or not value:
            raise bad(name, value, "a non-empty list of numbers")
        return tuple(number(f"{name}[{i}]", x) for i, x in enumerate(value))

    max_positions = d.get("max_position_embeddings", 2048)
    fields: dict[str, Any] = {"theta": number("rope_theta", params.get("rope_theta", d.get("rope_theta", 10000.0)))}
    if rope_type in ("llama3", "yarn", "longrope"):
        top = d.get("original_max_position_embeddings")
        original = top if top is not None else params.get("original_max_position_embeddings")
        fields["original_max_position_embeddings"] = length(
            "original_max_position_embeddings", original if original is not None else max_positions
        )
    if rope_type in ("linear", "llama3"):
        fields["factor"] = number("factor", params.get("factor", 1.0))
    if rope_type == "llama3":
        fields["low_freq_factor"] = number("low_freq_factor", params.get("low_freq_factor", 1.0))
        fields["high_freq_factor"] = number("high_freq_factor", params.get("high_freq_factor", 4.0))
    if rope_type in ("yarn", "dynamic") and "factor" not in params:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"rope type {rope_type!r} needs a 'factor'")
    if rope_type == "dynamic":
        fields["factor"] = number("factor", params["factor"])
        fields["original_max_position_embeddings"] = length("max_position_embeddings", max_positions)
    if rope_type in ("yarn", "longrope"):
        factor = params.get("factor")
        original = fields["original_max_position_embeddings"]
        if factor is None:  # transformers: the ratio of the context lengths
            factor = length("max_position_embeddings", max_positions) / original
        fields["factor"] = number("factor", factor)
        fields["attention_factor"] = optional("attention_factor")
    if rope_type == "yarn":
        fields["beta_fast"] = number("beta_fast", params.get("beta_fast") or 32, positive=False)
        fields["beta_slow"] = number("beta_slow", params.get("beta_slow") or 1, positive=False)
        fields["mscale"] = optional("mscale", positive=False)
        fields["mscale_all_dim"] = optional("mscale_all_dim", positive=False)
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise bad("truncate", truncate, "true or false")
        fields["truncate"] = truncate
    if rope_type == "longrope":
        short, long = factor_list("short_factor"), factor_list("long_factor")
        head_dim = d.get("head_dim")
        if not head_dim and d.get("hidden_size") and d.get("num_attention_heads"):
            head_dim = d["hidden_size"] // d["num_attention_heads"]
        partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0))
        half = int(head_dim * partial) // 2 if isinstance(head_dim, int) and isinstance(partial, (int, float)) else None
        for name, values in (("short_factor", short), ("long_factor", long)):
            if len(values) != (half or len(short)):
                want = f"rotary dim / 2 = {half}" if half else f"short_factor's {len(short)}"
                raise CeleryTPError(
                    ErrorKind.LOAD_FAILED, f"rope type 'longrope': {name} has {len(values)} entries, not {want}"
                )
        fields["short_factor"], fields["long_factor"] = short, long
    factors = d.get("rope_freq_factors")
    return RopeConfig(rope_type=rope_type, freq_factors=tuple(factors) if factors else None, **fields)


def require_positive(config: object, *names: str) -> None:
    """Raise CeleryTPError naming the first of `names` that is not a positive integer on `config`."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"config {name} must be a positive integer, got {value!r}")
