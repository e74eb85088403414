"""Mistral 3's Pixtral vision encoder and multimodal projector in plain torch, replicated on every
rank, matching transformers 5.25's Mistral3Model.get_image_features (its pooler_output, one tensor
per image, concatenated).

What transformers does, and we match:
- Images arrive as PixtralImageProcessor makes them: (N, C, H, W) zero-padded at the bottom/right
  to the batch's largest, and image_sizes (N, 2), each image's (height, width) in pixels. Each image
  yields an (h // patch) x (w // patch) patch grid from a Conv2d (kernel = stride = patch, no bias)
  over its own pixels; the grids are flattened row-major and concatenated, then `ln_pre`.
- 2-D rotary (PixtralVisionRotaryEmbedding, "axial"): inv_freq = 1 / theta^(2i / head_dim) for
  i < head_dim / 2; a patch's angles are [row * inv_freq[0::2], column * inv_freq[1::2]] twice over
  the head dim, cos and sin computed in float32 then cast to the activations' dtype, applied with
  rotate_half. Positions restart at (0, 0) for every image (no limit at image_size // patch_size).
- Blocks: x + attention(attention_norm(x)), then + feed_forward(ffn_norm(x)); q, k, v, o without
  bias; MLP down(act(gate(x)) * up(x)) without bias; every vision RMSNorm has eps 1e-5 (hard-coded).
  Attention is block-diagonal: each image attends within itself.
- `vision_feature_layer` (default -1) indexes num_hidden_layers + 1 hidden states: 0 is ln_pre's
  output, i the output of layer i - 1. A list concatenates states, but the projector's norm is
  hidden_size wide, so transformers fails on a list of more than one; we refuse it.
- Projector (Mistral3MultiModalProjector): RMSNorm `norm` (eps: text_config.rms_norm_eps), then
  Mistral3PatchMerger: each image's (h // patch, w // patch) grid cut into merge x merge blocks
  (F.unfold: blocks row-major, a remainder row/column dropped, each block's vector channel-major:
  [c * merge**2 + ki * merge + kj]), `merging_layer` (no bias) back to the vision width; then
  linear_1 (bias: multimodal_projector_bias), projector_hidden_act, linear_2. An image gives
  (h // patch // merge) * (w // patch // merge) tokens, row-major.

The prompt side (core/vision_inputs.py `PixtralGrid`): PixtralProcessor resizes with patch =
patch_size * spatial_merge_size and expands each `[IMG]` of the text to rows x ([IMG] * cols +
[IMG_BREAK]), the last [IMG_BREAK] replaced by [IMG_END] (rows, cols = resized height, width //
that patch).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.models.vision import (
    ACTIVATIONS,
    GatedMLP,
    Linear,
    RMSNorm,
    activation,
    bad_request,
    block_diagonal_attention,
    head_width,
    replicated_param,
    rope_theta,
    rotate_half,
    unsupported,
)

# Every prefix a checkpoint stores tower or projector tensors under: transformers' saved layout
# (also the hub checkpoints'), then its module names.
PIXTRAL_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)

# PixtralVisionConfig's defaults (transformers 5.25) for keys a config.json vision_config leaves out.
PIXTRAL_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "num_channels": 3,
    "image_size": 1024,
    "patch_size": 16,
    "hidden_act": "gelu",
}
# Mistral3Config's vision_config when config.json has none (Mistral-Small-3.1's tower, gelu).
MISTRAL3_VISION_CONFIG: dict[str, Any] = {
    "model_type": "pixtral",
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 24,
    "num_attention_heads": 16,
    "image_size": 1540,
    "patch_size": 14,
    "head_dim": 64,
    "hidden_act": "gelu",
}
# Mistral3Config's defaults for its own keys.
MISTRAL3_DEFAULTS: dict[str, Any] = {
    "vision_feature_layer": -1,
    "spatial_merge_size": 2,
    "projector_hidden_act": "gelu",
    "multimodal_projector_bias": False,
}
# rms_norm_eps (the projector norm's eps) where text_config leaves it out: Mistral3Config's text
# default without a text_config, else the text config class's default by model_type.
MISTRAL3_TEXT_RMS_EPS = 1e-5
TEXT_RMS_EPS_DEFAULTS = {"mistral": 1e-6, "ministral": 1e-6, "ministral3": 1e-5}
VISION_RMS_EPS = 1e-5  # transformers hard-codes it for ln_pre, attention_norm and ffn_norm


def pixtral_vision_layout(names: Iterable[str]) -> str:
    """The prefix for PixtralVisionTower.checkpoint_table from a checkpoint's tensor names: "model."
    for transformers' module names, else "" (what save_pretrained and the hub checkpoints write)."""
    return "model." if any(n.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for n in names) else ""


@dataclass
class PixtralVisionConfig:
    """A mistral3 config.json's vision and projector settings, transformers' defaults applied.

    Args:
        feature_layers: vision_feature_layer as a one-element tuple of a hidden-state index.
        norm_eps: the projector norm's eps, the text model's rms_norm_eps.
        text_hidden_size: the projector's output width.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_channels: int
    patch_size: int
    hidden_act: str
    rope_theta: float
    spatial_merge_size: int
    feature_layers: tuple[int, ...]
    projector_act: str
    projector_bias: bool
    norm_eps: float
    text_hidden_size: int
    head_dim: int | None = None
    # derived
    layers_used: int = field(init=False)  # encoder layers that run: up to the selected state

    def __post_init__(self) -> None:
        heads = self.num_attention_heads
        width = head_width(self.hidden_size, heads, "num_attention_heads")
        if self.head_dim is not None and self.head_dim != width:
            raise unsupported(
                f"vision_config.head_dim {self.head_dim} != hidden_size {self.hidden_size} // num_attention_heads "
                f"{heads} (transformers' attention uses the latter, its rotary the former)"
            )
        self.head_dim = width
        if self.head_dim % 4:
            raise unsupported(f"vision head_dim {self.head_dim} is not divisible by 4 (2-D rotary over h and w)")
        activation("vision_config.hidden_act", self.hidden_act)
        activation("projector_hidden_act", self.projector_act)
        for key in ("patch_size", "spatial_merge_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise unsupported(f"{key}={value!r} is not supported (a positive int)")
        n_states = self.num_hidden_layers + 1  # ln_pre's output, then each layer's
        if len(self.feature_layers) != 1:
            raise unsupported(
                f"vision_feature_layer={list(self.feature_layers)} is not supported (one layer: transformers' "
                "projector norm is vision hidden_size wide and fails on concatenated layers)"
            )
        layer = self.feature_layers[0]
        if not isinstance(layer, int) or not -n_states <= layer < n_states:
            raise unsupported(
                f"vision_feature_layer={layer!r} selects no hidden state of a {self.num_hidden_layers}-layer "
                f"tower (indices in [{-n_states}, {n_states - 1}])"
            )
        self.layers_used = layer % n_states

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any], text_hidden_size: int) -> PixtralVisionConfig:
        top = {**MISTRAL3_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
        vision = hf_config.get("vision_config")
        vision = MISTRAL3_VISION_CONFIG if vision is None else vision  # {}: PixtralVisionConfig's defaults
        if vision.get("model_type", "pixtral") != "pixtral":
            raise unsupported(f"vision_config.model_type={vision.get('model_type')!r} is not supported (pixtral)")
        v = {**PIXTRAL_VISION_DEFAULTS, **vision}
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", "axial") not in ("axial", "default"):  # transformers reads "default" as axial
            raise unsupported(
                f"vision_config.rope_parameters.rope_type={rope.get('rope_type')!r} is not supported (axial)"
            )
        layers = top["vision_feature_layer"]
        return cls(
            hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"],
            num_hidden_layers=v["num_hidden_layers"],
            num_attention_heads=v["num_attention_heads"],
            num_channels=v["num_channels"],
            patch_size=v["patch_size"],
            hidden_act=v["hidden_act"],
            rope_theta=rope_theta(v),
            head_dim=v.get("head_dim"),
            spatial_merge_size=top["spatial_merge_size"],
            feature_layers=(layers,) if isinstance(layers, int) else tuple(layers),
            projector_act=top["projector_hidden_act"],
            projector_bias=bool(top["multimodal_projector_bias"]),
            norm_eps=_text_rms_eps(hf_config.get("text_config")),
            text_hidden_size=text_hidden_size,
        )


def _text_rms_eps(text: dict[str, Any] | None) -> float:
    if text is None:
        return MISTRAL3_TEXT_RMS_EPS
    if text.get("rms_norm_eps") is not None:
        return float(text["rms_norm_eps"])
    model_type = text.get("model_type", "mistral")
    if model_type not in TEXT_RMS_EPS_DEFAULTS:
        raise unsupported(
            f"text_config.rms_norm_eps is missing and text model_type {model_type!r} has no known default "
            f"(known: {sorted(TEXT_RMS_EPS_DEFAULTS)})"
        )
    return TEXT_RMS_EPS_DEFAULTS[model_type]


class PixtralAttention(nn.Module):
    def __init__(self, c: PixtralVisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = c.num_attention_heads
        h, kw = c.hidden_size, {"dtype": dtype, "device": device}
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (Linear(h, h, False, **kw) for _ in range(4))

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (p(x).view(n, self.num_heads, -1) for p in (self.q_proj, self.k_proj, self.v_proj))  # (N, heads, hd)
        q, k = (t * cos + rotate_half(t) * sin for t in (q, k))
        return self.o_proj(block_diagonal_attention(q, k, v, lengths))  # one image sees only itself


class PixtralAttentionLayer(nn.Module):
    def __init__(self, c: PixtralVisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.attention_norm = RMSNorm(c.hidden_size, VISION_RMS_EPS, **kw)
        self.attention = PixtralAttention(c, **kw)
        self.ffn_norm = RMSNorm(c.hidden_size, VISION_RMS_EPS, **kw)
        self.feed_forward = GatedMLP(c, False, **kw)  # PixtralMLP: no biases

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), lengths, cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class PixtralVisionModel(nn.Module):
    """Patch conv, ln_pre and the transformer layers, returning the selected hidden state."""

    def __init__(self, c: PixtralVisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = c
        kw = {"dtype": dtype, "device": device}
        self.patch_conv = nn.Module()
        self.patch_conv.weight = replicated_param(c.hidden_size, c.num_channels, c.patch_size, c.patch_size, **kw)
        self.ln_pre = RMSNorm(c.hidden_size, VISION_RMS_EPS, **kw)
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(PixtralAttentionLayer(c, **kw) for _ in range(c.num_hidden_layers))
        inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float) / c.head_dim)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # (head_dim // 2,)

    def _rotary(self, grids: list[tuple[int, int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        positions = []
        for h, w in grids:  # every image's grid from (0, 0), row-major
            rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            positions.append(torch.stack([rows.flatten(), cols.flatten()], dim=-1))
        pos = torch.cat(positions).to(self.inv_freq.device).float()  # (N, 2)
        angles = torch.cat([pos[:, :1] * self.inv_freq[0::2], pos[:, 1:] * self.inv_freq[1::2]], dim=-1)
        angles = angles.repeat(1, 2)  # (N, head_dim): [rows, columns, rows, columns]
        return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]  # (N, 1, head_dim)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        """(N, C, H, W) in the tower's dtype and each image's patch grid -> (sum of h*w, hidden)."""
        p, weight = self.config.patch_size, self.patch_conv.weight
        patches = [
            F.conv2d(image[None, :, : h * p, : w * p], weight, stride=p)[0].flatten(1).T  # (h*w, hidden)
            for image, (h, w) in zip(pixel_values, grids)
        ]
        x = self.ln_pre(torch.cat(patches))
        cos, sin = self._rotary(grids, x.dtype)
        lengths = [h * w for h, w in grids]
        for layer in self.transformer.layers[: self.config.layers_used]:
            x = layer(x, lengths, cos, sin)
        return x


class Mistral3PatchMerger(nn.Module):
    def __init__(self, c: PixtralVisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.merge = c.spatial_merge_size
        self.merging_layer = Linear(c.hidden_size * self.merge**2, c.hidden_size, False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        m, d, blocks = self.merge, x.shape[-1], []
        for image, (h, w) in zip(x.split([h * w for h, w in grids]), grids):
            hb, wb = h // m, w // m  # F.unfold drops a remainder row / column of patches
            grid = image.view(h, w, d)[: hb * m, : wb * m].reshape(hb, m, wb, m, d)
            blocks.append(grid.permute(0, 2, 4, 1, 3).reshape(hb * wb, d * m * m))  # channel-major, as unfold
        return self.merging_layer(torch.cat(blocks))


class Mistral3MultiModalProjector(nn.Module):
    def __init__(self, c: PixtralVisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.norm = RMSNorm(c.hidden_size, c.norm_eps, **kw)
        self.patch_merger = Mistral3PatchMerger(c, **kw)
        self.linear_1 = Linear(c.hidden_size, c.text_hidden_size, c.projector_bias, **kw)
        self.act = ACTIVATIONS[c.projector_act]
        self.linear_2 = Linear(c.text_hidden_size, c.text_hidden_size, c.projector_bias, **kw)

    def forward(self, x: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:
        x = self.patch_merger(self.norm(x), grids)  # (sum of tokens, hidden)
        return self.linear_2(self.act(self.linear_1(x)))


class PixtralVisionTower(nn.Module):
    """Mistral 3's Pixtral vision encoder and projector, replicated on every rank.

    Args:
        hf_config: the checkpoint's whole config.json (`vision_config`, `spatial_merge_size`,
            `vision_feature_layer`, `projector_hidden_act`, `multimodal_projector_bias`,
            `text_config.rms_norm_eps`); transformers' defaults fill what it leaves out.
        text_hidden_size: the language model's hidden_size, the projector's output width.
    """

    def __init__(self, hf_config: dict, text_hidden_size: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = c = PixtralVisionConfig.from_hf(hf_config, text_hidden_size)
        self.dtype = dtype
        self.patch, self.merge = c.patch_size, c.spatial_merge_size
        self.vision_tower = PixtralVisionModel(c, dtype=dtype, device=device)
        self.multi_modal_projector = Mistral3MultiModalProjector(c, dtype=dtype, device=device)

    def num_tokens(self, image_sizes: torch.Tensor) -> list[int]:
        """Tokens each image gives the language model: (h // patch // merge) * (w // patch // merge)."""
        unit = self.patch * self.merge
        return [(int(h) // unit) * (int(w) // unit) for h, w in torch.as_tensor(image_sizes).tolist()]

    def _check(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> list[tuple[int, int]]:
        c = self.config
        if pixel_values.dim() != 4 or pixel_values.shape[1] != c.num_channels or pixel_values.shape[0] == 0:
            raise bad_request(f"pixel_values shape {tuple(pixel_values.shape)}, expected (N, {c.num_channels}, H, W)")
        n, _, height, width = pixel_values.shape
        if image_sizes.dim() != 2 or tuple(image_sizes.shape) != (n, 2):
            raise bad_request(f"image_sizes shape {tuple(image_sizes.shape)}, expected ({n}, 2) for {n} images")
        grids = []
        for h, w in ((int(h), int(w)) for h, w in image_sizes.tolist()):
            if not (0 < h <= height and 0 < w <= width) or h // self.patch < self.merge or w // self.patch < self.merge:
                raise bad_request(
                    f"image size (height, width) {(h, w)} must fit pixel_values' {(height, width)} and span at "
                    f"least spatial_merge_size {self.merge} patches of {self.patch} pixels each way"
                )
            grids.append((h // self.patch, w // self.patch))
        return grids

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, image_sizes: torch.Tensor) -> torch.Tensor:
        """As PixtralImageProcessor makes them (pixel_values (N, 3, H, W) padded to the batch's
        largest, image_sizes (N, 2) = each image's (height, width) in pixels) -> (sum of tokens,
        text_hidden_size) in self's dtype, images in order; tokens per image =
        (h // patch // merge) * (w // patch // merge), row-major."""
        grids = self._check(pixel_values, torch.as_tensor(image_sizes))
        device = self.vision_tower.inv_freq.device
        x = self.vision_tower(pixel_values.to(device=device, dtype=self.dtype), grids)  # (patches, hidden)
        return self.multi_modal_projector(x, grids)

    def checkpoint_table(self, prefix: str = "") -> dict[str, nn.Parameter]:
        """Checkpoint tensor name -> parameter, for every tower and projector tensor:
        `{prefix}vision_tower.<...>` and `{prefix}multi_modal_projector.<...>` (prefix "" as
        save_pretrained and the hub write them, "model." for transformers' module names;
        pixtral_vision_layout(names) gives it)."""
        return {prefix + name: p for name, p in self.named_parameters()}
