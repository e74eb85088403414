"""The vision tower (CLIP or SigLIP ViT) and multimodal projector of a llava or gemma3 checkpoint,
in plain torch, matching transformers 5.25's LlavaModel.get_image_features and
Gemma3Model.get_image_features.

Replicated on every rank, no collectives: the tower is small next to the language model (0.3B
for llava-1.5's CLIP ViT-L/336) and runs once per image at prefill, so sharding it would buy
little memory for a collective per layer.

What transformers does, and we match:
- hidden_states[0] is the embeddings output (after CLIP's `pre_layrnorm`), hidden_states[i] the
  output of encoder layer i-1; none has `post_layernorm` (both towers capture hidden states with
  tie_last_hidden_states=False). A negative `vision_feature_layer` counts from the end of those
  num_hidden_layers + 1 states (-2: the penultimate layer's output). A list of layers
  concatenates their states on the last dim, in the list's order.
- `vision_feature_select_strategy` "default" drops position 0 of each state (CLIP's CLS token;
  for SigLIP, which has none, transformers drops the first patch all the same), "full" keeps all.
Only the layers up to the deepest one selected run; the rest, `post_layernorm` and SigLIP's
pooling head are loaded (a checkpoint has them) but never used.

Gemma 3 (config.json model_type "gemma3") has a SigLIP tower only and takes its last_hidden_state:
every layer, then `post_layernorm`, all patches. Its projector (Gemma3MultiModalProjector)
average-pools the patch grid down to `mm_tokens_per_image` positions, RMS-normalizes them in
float32 with a (1 + weight) scale (Gemma3RMSNorm, eps: the tower's layer_norm_eps) and multiplies
by `mm_input_projection_weight` (vision hidden, text hidden). The pooling head is loaded where
`vision_use_head` keeps it in the checkpoint (the gemma-3 hub configs set it false) and never used.

The other towers (qwen_vision, qwen3_vision, pixtral_vision) build on this module's pieces:
replicated parameters, Linear, LayerNorm, RMSNorm, the gated MLP, rotate_half and attention
within each image (or window, or frame), and the config checks' errors.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.layers.weights import empty_param, replicated_loader

# Every prefix a checkpoint stores tower or projector tensors under: transformers' saved layout,
# then its module names (`model.`). Either may nest the tower under `vision_model.` (see checkpoint_layout).
VISION_TENSOR_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)

# CLIPVisionConfig's / SiglipVisionConfig's defaults (transformers 5.25) for keys config.json leaves out.
_COMMON_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
VISION_DEFAULTS: dict[str, dict[str, Any]] = {
    "clip_vision_model": {
        **_COMMON_DEFAULTS,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 32,
        "hidden_act": "quick_gelu",
        "layer_norm_eps": 1e-5,
    },
    "siglip_vision_model": {
        **_COMMON_DEFAULTS,
        "num_channels": 3,
        "image_size": 224,
        "patch_size": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": 1e-6,
        "vision_use_head": True,
    },
}
DEFAULT_VISION_ROPE_THETA = 10000.0  # the rotary towers' (Qwen2.5-VL, Qwen3-VL, Pixtral) default
# LlavaConfig's vision_config when config.json has none: CLIP ViT-L/14 at 336 pixels.
LLAVA_VISION_CONFIG = {
    "model_type": "clip_vision_model",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 336,
    "patch_size": 14,
}
# LlavaConfig's defaults for its own keys.
LLAVA_DEFAULTS: dict[str, Any] = {
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": True,
}
# Gemma3Config's vision_config when config.json has none: SiglipVisionConfig's defaults.
GEMMA3_VISION_CONFIG = {"model_type": "siglip_vision_model"}
GEMMA3_MM_TOKENS_PER_IMAGE = 256  # Gemma3Config's default
# llava's keys as gemma3 reads its tower, whatever its config.json says: every patch of the last
# layer's output (VisionTower.forward applies post_layernorm). The llava projector keys are unused.
GEMMA3_FEATURES: dict[str, Any] = {
    "vision_feature_layer": -1,
    "vision_feature_select_strategy": "full",
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": False,
}


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """transformers' QuickGELUActivation (CLIP's hidden_act)."""
    return x * torch.sigmoid(1.702 * x)


# transformers' ACT2FN names -> the same arithmetic.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
    "quick_gelu": quick_gelu,
    "silu": F.silu,
    "relu": F.relu,
}


def vision_checkpoint_prefixes() -> tuple[str, ...]:
    """VISION_TENSOR_PREFIXES: a checkpoint name under one of them is the tower's or the projector's."""
    return VISION_TENSOR_PREFIXES


def checkpoint_layout(names: Iterable[str]) -> tuple[str, bool]:
    """(prefix, nested) for VisionTower.checkpoint_table, from a checkpoint's tensor names.

    prefix is "model." for transformers' module names (`model.vision_tower.`), else "" (the saved
    layout). nested is True where the tower sits under `vision_tower.vision_model.`, as
    transformers 4 saved it (the llava-hf and gemma-3 hub checkpoints); 5.25 saves
    `vision_tower.<...>`. Both families use the same prefixes.
    """
    names = [n for n in names if n.startswith(VISION_TENSOR_PREFIXES)]
    prefix = "model." if any(n.startswith("model.") for n in names) else ""
    nested = any(n.startswith(f"{prefix}vision_tower.vision_model.") for n in names)
    return prefix, nested


def unsupported(message: str) -> CeleryTPError:
    return CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, message)


def bad_request(message: str) -> CeleryTPError:
    return CeleryTPError(ErrorKind.BAD_REQUEST, message)


def activation(key: str, name: str) -> Any:
    """ACTIVATIONS[name], refused (naming config key `key`) where it has none."""
    if name not in ACTIVATIONS:
        raise unsupported(f"{key}={name!r} is not supported (supported: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def head_width(hidden_size: int, heads: int, heads_key: str) -> int:
    """hidden_size // heads, refused (naming vision_config key `heads_key`) unless heads divides it."""
    if hidden_size % heads:
        raise unsupported(f"vision_config.hidden_size {hidden_size} is not divisible by {heads_key} {heads}")
    return hidden_size // heads


def rope_theta(vision: dict[str, Any]) -> float:
    """A vision_config's rotary theta: rope_parameters' (transformers 5), else its own key (4)."""
    rope = vision.get("rope_parameters") or {}
    return float(rope.get("rope_theta", vision.get("rope_theta", DEFAULT_VISION_ROPE_THETA)))


@dataclass
class VisionConfig:
    """The tower and projector settings of a llava or gemma3 config.json, transformers' defaults applied.

    Args:
        model_type: vision_config.model_type, clip_vision_model or siglip_vision_model.
        feature_layers: vision_feature_layer as a tuple of hidden-state indices (may be negative).
        text_hidden_size: the projector's output width (the language model's hidden_size).
        mm_tokens_per_image: None for llava; gemma3's pooled positions per image, which selects
            its projector (and post_layernorm on the last layer's output).
    """

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    image_size: int
    patch_size: int
    hidden_act: str
    layer_norm_eps: float
    use_head: bool
    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    mm_tokens_per_image: int | None = None
    # derived
    head_dim: int = field(init=False)
    num_patches: int = field(init=False)
    has_cls: bool = field(init=False)
    layers_used: int = field(init=False)  # encoder layers that run: up to the deepest feature layer

    def __post_init__(self) -> None:
        self.head_dim = head_width(self.hidden_size, self.num_attention_heads, "num_attention_heads")
        if self.select_strategy not in ("default", "full"):
            raise unsupported(
                f"vision_feature_select_strategy={self.select_strategy!r} is not supported (default or full)"
            )
        activation("vision_config.hidden_act", self.hidden_act)
        activation("projector_hidden_act", self.projector_act)
        self.num_patches = (self.image_size // self.patch_size) ** 2
        self.has_cls = self.model_type == "clip_vision_model"
        n_states = self.num_hidden_layers + 1  # the embeddings' output, then each layer's
        bad = [i for i in self.feature_layers if not -n_states <= i < n_states]
        if bad or not self.feature_layers:
            raise unsupported(
                f"vision_feature_layer={list(self.feature_layers)} selects no hidden state of a "
                f"{self.num_hidden_layers}-layer tower (indices in [{-n_states}, {n_states - 1}])"
            )
        self.layers_used = max(i % n_states for i in self.feature_layers)
        if self.mm_tokens_per_image is not None:
            side, grid = math.isqrt(self.mm_tokens_per_image), self.image_size // self.patch_size
            if self.has_cls or side * side != self.mm_tokens_per_image or not 0 < side <= grid or grid % side:
                raise unsupported(
                    f"gemma3 with vision_config.model_type={self.model_type!r} and mm_tokens_per_image="
                    f"{self.mm_tokens_per_image} is not supported (a SigLIP tower whose {grid}x{grid} patch "
                    "grid average-pools evenly to a square of mm_tokens_per_image positions)"
                )

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], text_hidden_size: int) -> VisionConfig:
        gemma3 = hf_config.get("model_type") == "gemma3"
        top = {**hf_config, **GEMMA3_FEATURES} if gemma3 else {**LLAVA_DEFAULTS, **hf_config}
        vision = hf_config.get("vision_config") or (GEMMA3_VISION_CONFIG if gemma3 else LLAVA_VISION_CONFIG)
        model_type = vision.get("model_type", "siglip_vision_model" if gemma3 else "clip_vision_model")
        if model_type not in VISION_DEFAULTS:
            raise unsupported(
                f"vision_config.model_type={model_type!r} is not supported (supported: {sorted(VISION_DEFAULTS)})"
            )
        v = {**VISION_DEFAULTS[model_type], **vision}
        layers = top["vision_feature_layer"]
        return cls(
            model_type=model_type,
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_hidden_layers=v["num_hidden_layers"],
            num_attention_heads=v["num_attention_heads"],
            num_channels=v["num_channels"],
            image_size=v["image_size"],
            patch_size=v["patch_size"],
            hidden_act=v["hidden_act"],
            layer_norm_eps=v["layer_norm_eps"],
            use_head=bool(v.get("vision_use_head", False)),
            feature_layers=(layers,) if isinstance(layers, int) else tuple(layers),
            select_strategy=top["vision_feature_select_strategy"],
            projector_act=top["projector_hidden_act"],
            projector_bias=top["multimodal_projector_bias"],
            text_hidden_size=text_hidden_size,
            mm_tokens_per_image=top.get("mm_tokens_per_image", GEMMA3_MM_TOKENS_PER_IMAGE) if gemma3 else None,
        )


def replicated_param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised parameter every rank holds whole, loaded by replicated_loader."""
    p = empty_param(*shape, dtype=dtype, device=device, sharded=False)
    p.weight_loader = replicated_loader
    return p


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = replicated_param(n_out, n_in, dtype=dtype, device=device)
        self.bias = replicated_param(n_out, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param(size, dtype=dtype, device=device)
        self.bias = replicated_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Qwen2_5_VLRMSNorm / PixtralRMSNorm / Mistral3RMSNorm: normalize in float32, back to x's
    dtype, then scale."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = replicated_param(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)): Qwen2.5-VL's vision MLP (biases) and Pixtral's (none)."""

    def __init__(self, c: Any, bias: bool, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.act = ACTIVATIONS[c.hidden_act]
        kw = {"dtype": dtype, "device": device}
        self.gate_proj = Linear(c.hidden_size, c.intermediate_size, bias, **kw)
        self.up_proj = Linear(c.hidden_size, c.intermediate_size, bias, **kw)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size, bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def block_diagonal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """(N, heads, hd) each -> (N, heads * hd): each run of `lengths` rows (an image, a window or a
    frame) attends only within itself."""
    n = q.shape[0]
    q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (heads, N, hd)
    out = torch.cat(
        [
            F.scaled_dot_product_attention(qs, ks, vs)
            for qs, ks, vs in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1))
        ],
        dim=1,
    )
    return out.transpose(0, 1).reshape(n, -1)


class VisionEmbeddings(nn.Module):
    """Patches through a strided conv (SigLIP's has a bias), CLIP's class token first, then learned positions."""

    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.patch_size = c.patch_size
        h, kw = c.hidden_size, {"dtype": dtype, "device": device}
        self.patch_embedding = nn.Module()
        self.patch_embedding.weight = replicated_param(h, c.num_channels, c.patch_size, c.patch_size, **kw)
        self.patch_embedding.bias = None if c.has_cls else replicated_param(h, **kw)
        self.class_embedding = replicated_param(h, **kw) if c.has_cls else None
        self.position_embedding = nn.Module()
        self.position_embedding.weight = replicated_param(c.num_patches + c.has_cls, h, **kw)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        conv = self.patch_embedding
        x = F.conv2d(pixel_values, conv.weight, conv.bias, stride=self.patch_size)  # (N, H, g, g)
        x = x.flatten(2).transpose(1, 2)  # (N, g*g, H)
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)
        return x + self.position_embedding.weight


class VisionAttention(nn.Module):
    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.head_dim = c.head_dim
        h = c.hidden_size
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (
            Linear(h, h, True, dtype=dtype, device=device) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, h = x.shape
        q, k, v = (p(x).view(n, t, -1, self.head_dim).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # (N, heads, T, hd); every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(n, t, h))


class VisionMLP(nn.Module):
    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.act = ACTIVATIONS[c.hidden_act]
        self.fc1 = Linear(c.hidden_size, c.intermediate_size, True, dtype=dtype, device=device)
        self.fc2 = Linear(c.intermediate_size, c.hidden_size, True, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.layer_norm1 = LayerNorm(c.hidden_size, c.layer_norm_eps, **kw)
        self.self_attn = VisionAttention(c, **kw)
        self.layer_norm2 = LayerNorm(c.hidden_size, c.layer_norm_eps, **kw)
        self.mlp = VisionMLP(c, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class SiglipPoolingHead(nn.Module):
    """SiglipMultiheadAttentionPoolingHead's weights, loaded only: llava never reads the pooled output."""

    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, kw = c.hidden_size, {"dtype": dtype, "device": device}
        self.probe = replicated_param(1, 1, h, **kw)
        self.attention = nn.Module()  # torch.nn.MultiheadAttention's parameter names
        self.attention.in_proj_weight = replicated_param(3 * h, h, **kw)
        self.attention.in_proj_bias = replicated_param(3 * h, **kw)
        self.attention.out_proj = Linear(h, h, True, **kw)
        self.layernorm = LayerNorm(h, c.layer_norm_eps, **kw)
        self.mlp = VisionMLP(c, **kw)


class VisionTransformer(nn.Module):
    """CLIPVisionModel / SiglipVisionModel, returning the hidden states llava selects."""

    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = c
        kw = {"dtype": dtype, "device": device}
        self.embeddings = VisionEmbeddings(c, **kw)
        self.pre_layrnorm = LayerNorm(c.hidden_size, c.layer_norm_eps, **kw) if c.has_cls else None
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(VisionEncoderLayer(c, **kw) for _ in range(c.num_hidden_layers))
        self.post_layernorm = LayerNorm(c.hidden_size, c.layer_norm_eps, **kw)
        self.head = SiglipPoolingHead(c, **kw) if c.use_head else None

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """hidden_states[i] for each i of config.feature_layers, in that order."""
        c = self.config
        x = self.embeddings(pixel_values)  # (N, T, H)
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        states = [x]
        for layer in self.encoder.layers[: c.layers_used]:
            states.append(layer(states[-1]))
        n_states = c.num_hidden_layers + 1
        return [states[i % n_states] for i in c.feature_layers]


class MultiModalProjector(nn.Module):
    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.linear_1 = Linear(c.hidden_size * len(c.feature_layers), c.text_hidden_size, c.projector_bias, **kw)
        self.act = ACTIVATIONS[c.projector_act]
        self.linear_2 = Linear(c.text_hidden_size, c.text_hidden_size, c.projector_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class Gemma3Projector(nn.Module):
    """Gemma3MultiModalProjector: (N, grid*grid, vision H) -> (N, mm_tokens_per_image, text H)."""

    def __init__(self, c: VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        assert c.mm_tokens_per_image is not None
        self.grid = c.image_size // c.patch_size
        self.kernel = self.grid // math.isqrt(c.mm_tokens_per_image)
        self.eps = c.layer_norm_eps
        kw = {"dtype": dtype, "device": device}
        self.mm_input_projection_weight = replicated_param(c.hidden_size, c.text_hidden_size, **kw)
        self.mm_soft_emb_norm = nn.Module()
        self.mm_soft_emb_norm.weight = replicated_param(c.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h = x.shape
        x = x.transpose(1, 2).reshape(n, h, self.grid, self.grid)  # patches in row-major grid order
        x = F.avg_pool2d(x, self.kernel).flatten(2).transpose(1, 2)  # (N, mm_tokens_per_image, H)
        xf = x.float()  # Gemma3RMSNorm: float32, (x * (1 + w)), back to x's dtype
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        normed = (xf * (1.0 + self.mm_soft_emb_norm.weight.float())).type_as(x)
        return torch.matmul(normed, self.mm_input_projection_weight).type_as(x)


class VisionTower(nn.Module):
    """The vision encoder and projector of a llava or gemma3 checkpoint, replicated on every rank.

    Args:
        hf_config: the checkpoint's whole config.json (`model_type`, `vision_config`,
            llava's `vision_feature_layer`, ..., gemma3's `mm_tokens_per_image`).
        text_hidden_size: the language model's hidden_size, the projector's output width.
    """

    def __init__(self, hf_config: dict, text_hidden_size: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = c = VisionConfig.from_hf(hf_config, text_hidden_size)
        self.dtype = dtype
        self.image_size = c.image_size
        self.gemma3 = c.mm_tokens_per_image is not None
        if self.gemma3:
            self.tokens_per_image = c.mm_tokens_per_image
        else:
            self.tokens_per_image = c.num_patches + c.has_cls - (c.select_strategy == "default")
        self.vision_tower = VisionTransformer(c, dtype=dtype, device=device)
        projector = Gemma3Projector if self.gemma3 else MultiModalProjector
        self.multi_modal_projector = projector(c, dtype=dtype, device=device)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(N, 3, H, W) float pixel values, as transformers' image processor makes them ->
        (N, tokens_per_image, text_hidden_size) in self's dtype."""
        c = self.config
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (c.num_channels, c.image_size, c.image_size):
            raise bad_request(
                f"pixel_values shape {tuple(pixel_values.shape)}, the vision tower expects "
                f"(N, {c.num_channels}, {c.image_size}, {c.image_size})"
            )
        weight = self.vision_tower.embeddings.patch_embedding.weight
        states = self.vision_tower(pixel_values.to(device=weight.device, dtype=self.dtype))
        if self.gemma3:  # last_hidden_state: the last layer's output after post_layernorm
            return self.multi_modal_projector(self.vision_tower.post_layernorm(states[0]))
        if c.select_strategy == "default":
            states = [s[:, 1:] for s in states]  # transformers drops position 0 (CLS), SigLIP's too
        return self.multi_modal_projector(torch.cat(states, dim=-1))  # (N, tokens_per_image, text H)

    def checkpoint_table(self, prefix: str = "", nested: bool = False) -> dict[str, nn.Parameter]:
        """Checkpoint tensor name -> parameter, for every tower and projector tensor.

        Names are `{prefix}vision_tower.<...>` and `{prefix}multi_modal_projector.<...>`, as
        transformers 5.25's save_pretrained writes them with prefix "" (its module names use
        "model."); nested puts the tower under `vision_tower.vision_model.` (transformers 4's
        saved layout). checkpoint_layout(names) gives both arguments for a checkpoint.
        """
        tower = f"{prefix}vision_tower." + ("vision_model." if nested else "")
        table = {tower + name: p for name, p in self.vision_tower.named_parameters()}
        table.update(
            {f"{prefix}multi_modal_projector.{n}": p for n, p in self.multi_modal_projector.named_parameters()}
        )
        return table
