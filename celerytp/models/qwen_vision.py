"""Qwen2.5-VL's vision encoder and patch merger in plain torch, replicated on every rank, matching
transformers 5.25's Qwen2_5_VLModel.get_image_features.

What transformers does, and we match:
- Patches arrive flattened as Qwen2VLImageProcessor makes them: one row of C*T*P*P values per
  patch, the patches of each image in block-major order (every spatial_merge_size x
  spatial_merge_size block of the (h, w) patch grid contiguous, blocks row-major, frames first).
  The Conv3d patch embedding (kernel = stride = (T, P, P), no bias) is one matmul over such a row.
- 2-D rotary embedding: each patch's (row, column) in its image's patch grid; head_dim // 4
  frequencies 1 / theta^(2i / (head_dim/2)) (theta: vision rope_theta, 10000 by default), angles
  laid out [row freqs, column freqs] twice over the whole head dim, applied in float32 to q and k
  with rotate_half.
- Window attention: the merge units (blocks of merge**2 patches) are reordered window by window,
  a window being window_size // spatial_merge_size // patch_size units on a side (windows at the
  bottom/right edge are cut short); every layer runs in that order. Layers in
  fullatt_block_indexes attend over each whole frame (h*w patches), the others within a window;
  attention never crosses images or frames.
- Blocks: x + attn(norm1(x)), then + mlp(norm2(x)); RMSNorm (eps 1e-6, float32, weight applied
  after the cast back); MLP down(act(gate(x)) * up(x)) with biases; qkv and proj with biases.
- Merger: ln_q (RMSNorm), merge**2 consecutive patches concatenated, Linear, exact GELU,
  Linear to out_hidden_size; then the merged tokens are put back in image order (argsort of the
  window order), so each image yields t * (h/merge) * (w/merge) tokens in row-major order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.models.vision import (
    GatedMLP,
    LayerNorm,
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

# Every prefix a checkpoint stores vision tensors under: transformers' saved layout (also the hub
# checkpoints'), then its module names.
QWEN_VISION_PREFIXES = ("visual.", "model.visual.")

# Qwen2_5_VLVisionConfig's defaults (transformers 5.25) for keys config.json leaves out.
QWEN_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32,
    "hidden_size": 3584,
    "hidden_act": "silu",
    "intermediate_size": 3420,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "out_hidden_size": 3584,
    "fullatt_block_indexes": (7, 15, 23, 31),
}
# Other spellings config.json may use: transformers' attribute_map, and the hub files' `in_chans`.
CONFIG_ALIASES = {"num_attention_heads": "num_heads", "num_hidden_layers": "depth", "in_chans": "in_channels"}
RMS_EPS = 1e-6  # transformers hard-codes it for every vision norm


def qwen_vision_layout(names: Iterable[str]) -> str:
    """The prefix for QwenVisionTower.checkpoint_table from a checkpoint's tensor names:
    "model.visual." for transformers' module names, else "visual." (what save_pretrained and the
    hub checkpoints write)."""
    return "model.visual." if any(n.startswith("model.visual.") for n in names) else "visual."


@dataclass
class QwenVisionBaseConfig:
    """The vision_config keys the Qwen2.5-VL and Qwen3-VL towers both read, checked; a subclass
    adds its own keys, DEFAULTS and checks."""

    DEFAULTS: ClassVar[dict[str, Any]]
    POSITIVE_INTS: ClassVar[tuple[str, ...]] = ("patch_size", "temporal_patch_size", "spatial_merge_size")

    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int
    rope_theta: float
    # derived
    head_dim: int = field(init=False)
    patch_dim: int = field(init=False)  # C*T*P*P values per patch row

    def __post_init__(self) -> None:
        self.head_dim = head_width(self.hidden_size, self.num_heads, "num_heads")
        if self.head_dim % 4:
            raise unsupported(f"vision head_dim {self.head_dim} is not divisible by 4 (2-D rotary over h and w)")
        activation("vision_config.hidden_act", self.hidden_act)
        for key in self.POSITIVE_INTS:
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise unsupported(f"vision_config.{key}={getattr(self, key)!r} is not supported (a positive int)")
        self.patch_dim = self.in_channels * self.temporal_patch_size * self.patch_size**2

    @classmethod
    def from_hf(cls, hf_config: dict[str, Any]) -> Self:
        vision = dict(hf_config.get("vision_config") or {})
        for alias, key in CONFIG_ALIASES.items():
            if alias in vision and key not in vision:
                vision[key] = vision[alias]
        v = {**cls.DEFAULTS, **vision}
        rope = v.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type", "axial")) != "axial":
            raise unsupported(
                f"vision_config.rope_parameters.rope_type={rope.get('rope_type')!r} is not supported (axial)"
            )
        v["rope_theta"] = rope_theta(v)
        return cls(**{f.name: v[f.name] for f in fields(cls) if f.init})


@dataclass
class QwenVisionConfig(QwenVisionBaseConfig):
    """A qwen2_5_vl config.json's vision_config, Qwen2_5_VLVisionConfig's defaults applied."""

    DEFAULTS: ClassVar[dict[str, Any]] = QWEN_VISION_DEFAULTS

    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    # derived
    window_units: int = field(init=False)  # merge units on a window's side

    def __post_init__(self) -> None:
        super().__post_init__()
        self.fullatt_block_indexes = tuple(self.fullatt_block_indexes)
        self.window_units = self.window_size // self.spatial_merge_size // self.patch_size
        if self.window_units < 1:
            raise unsupported(
                f"vision_config.window_size {self.window_size} is smaller than spatial_merge_size "
                f"{self.spatial_merge_size} * patch_size {self.patch_size}"
            )


def vision_position_ids(grid: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(patches, 2) long: each patch's (row, column) in its image's patch grid, in the
    processor's block-major patch order, repeated for each frame."""
    out = []
    for t, h, w in grid:
        rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows, cols = (a.reshape(blocks).transpose(1, 2).flatten() for a in (rows, cols))
        out.append(torch.stack([rows, cols], dim=-1).repeat(t, 1))
    return torch.cat(out)


def window_order(grid: list[tuple[int, int, int]], merge: int, window_units: int) -> tuple[torch.Tensor, list[int]]:
    """(order, lengths): the merge units (global index) window by window, frame by frame, image by
    image; and each window's length in patches. Edge windows are cut short, never padded."""
    order, lengths, start = [], [], 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        units = torch.arange(t * gh * gw).reshape(t, gh, gw) + start
        for frame in units:
            for r in range(0, gh, window_units):
                for c in range(0, gw, window_units):
                    window = frame[r : r + window_units, c : c + window_units].flatten()
                    order.append(window)
                    lengths.append(window.numel() * merge * merge)
        start += t * gh * gw
    return torch.cat(order), lengths


class PatchEmbed(nn.Module):
    """Conv3d with kernel = stride = (T, P, P) over one patch per row: a matmul (Qwen3-VL's has a bias)."""

    def __init__(self, c: QwenVisionBaseConfig, bias: bool, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        p, t, kw = c.patch_size, c.temporal_patch_size, {"dtype": dtype, "device": device}
        self.proj = nn.Module()
        self.proj.weight = replicated_param(c.hidden_size, c.in_channels, t, p, p, **kw)
        self.proj.bias = replicated_param(c.hidden_size, **kw) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x, w.reshape(w.shape[0], -1), self.proj.bias)  # (patches, C*T*P*P) -> (patches, H)


class VisionAttention(nn.Module):
    def __init__(self, c: QwenVisionBaseConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads = c.num_heads
        kw = {"dtype": dtype, "device": device}
        self.qkv = Linear(c.hidden_size, 3 * c.hidden_size, True, **kw)
        self.proj = Linear(c.hidden_size, c.hidden_size, True, **kw)

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, -1).unbind(1)  # each (N, heads, hd)
        q, k = ((t.float() * cos + rotate_half(t.float()) * sin).to(x.dtype) for t in (q, k))
        return self.proj(block_diagonal_attention(q, k, v, lengths))  # a window or frame sees only itself


class VisionBlock(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(x)); the norm (Qwen2.5-VL: RMSNorm, Qwen3-VL:
    LayerNorm) and the MLP are the family's."""

    def __init__(
        self,
        c: QwenVisionBaseConfig,
        norm: type[RMSNorm] | type[LayerNorm],
        eps: float,
        mlp: nn.Module,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.norm1 = norm(c.hidden_size, eps, **kw)
        self.norm2 = norm(c.hidden_size, eps, **kw)
        self.attn = VisionAttention(c, **kw)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, lengths: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), lengths, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Qwen2_5_VLPatchMerger: RMSNorm, merge**2 patches side by side, Linear, GELU, Linear."""

    def __init__(self, c: QwenVisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.width = c.hidden_size * c.spatial_merge_size**2
        self.ln_q = RMSNorm(c.hidden_size, RMS_EPS, **kw)
        self.mlp = nn.Sequential(
            Linear(self.width, self.width, True, **kw), nn.GELU(), Linear(self.width, c.out_hidden_size, True, **kw)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # (patches, H) -> (patches / merge**2, out)


class QwenVisionTowerBase(nn.Module):
    """What the Qwen2.5-VL and Qwen3-VL towers share: their inputs (as Qwen2VLImageProcessor makes
    them) and checks, tokens per image, and the 2-D rotary."""

    def __init__(self, config: Any, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.merge = config.spatial_merge_size
        spatial = config.head_dim // 2
        inv_freq = 1.0 / config.rope_theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial)
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)  # (head_dim // 4,)

    def num_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Tokens each image gives the language model: t * h * w / merge**2."""
        return [t * h * w // self.merge**2 for t, h, w in grid_thw.tolist()]

    def _check(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
        c = self.config
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3 or grid_thw.shape[0] == 0:
            raise bad_request(f"image_grid_thw shape {tuple(grid_thw.shape)}, expected (images, 3)")
        grid = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        for t, h, w in grid:
            if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
                raise bad_request(
                    f"image_grid_thw {[t, h, w]}: h and w must be positive multiples of spatial_merge_size {self.merge}"
                )
        patches = sum(t * h * w for t, h, w in grid)
        if tuple(pixel_values.shape) != (patches, c.patch_dim):
            raise bad_request(
                f"pixel_values shape {tuple(pixel_values.shape)}, image_grid_thw {[list(g) for g in grid]} "
                f"expects ({patches}, {c.patch_dim})"
            )
        return grid

    def _rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # (N, 2, head_dim // 4)
        angles = freqs.flatten(1).repeat(1, 2)  # (N, head_dim): [rows, columns, rows, columns]
        return angles.cos()[:, None], angles.sin()[:, None]  # (N, 1, head_dim), float32


class QwenVisionTower(QwenVisionTowerBase):
    """Qwen2.5-VL's vision encoder and merger, replicated on every rank.

    Args:
        hf_config: the checkpoint's whole config.json (its `vision_config`; Qwen2_5_VLVisionConfig's
            defaults fill what it leaves out).
    """

    config: QwenVisionConfig

    def __init__(self, hf_config: dict, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(QwenVisionConfig.from_hf(hf_config), dtype=dtype, device=device)
        c, kw = self.config, {"dtype": dtype, "device": device}
        self.patch_embed = PatchEmbed(c, False, **kw)
        self.blocks = nn.ModuleList(
            VisionBlock(c, RMSNorm, RMS_EPS, GatedMLP(c, True, **kw), **kw) for _ in range(c.depth)
        )
        self.merger = PatchMerger(c, **kw)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values as Qwen2VLImageProcessor makes them: (sum of patches, C*T*P*P) float;
        grid_thw (images, 3) long -> (sum of tokens, out_hidden_size) in self's dtype, images in order."""
        c, unit = self.config, self.merge**2
        grid = self._check(pixel_values, grid_thw)
        device = self.inv_freq.device
        units, window_lengths = window_order(grid, self.merge, c.window_units)
        order = (units[:, None] * unit + torch.arange(unit)).flatten()  # patches, window by window
        frame_lengths = [h * w for t, h, w in grid for _ in range(t)]

        x = self.patch_embed(pixel_values.to(device=device, dtype=self.dtype))  # (N, H)
        order = order.to(device)
        x = x[order]
        cos, sin = self._rotary(vision_position_ids(grid, self.merge).to(device)[order])
        for i, block in enumerate(self.blocks):
            lengths = frame_lengths if i in c.fullatt_block_indexes else window_lengths
            x = block(x, lengths, cos, sin)
        merged = self.merger(x)  # (N / merge**2, out), merge units in window order
        return merged[torch.argsort(units.to(device))]

    def checkpoint_table(self, prefix: str = "visual.") -> dict[str, nn.Parameter]:
        """Checkpoint tensor name -> parameter, for every vision tensor: `{prefix}patch_embed.proj.weight`,
        `{prefix}blocks.<i>.…`, `{prefix}merger.…`. qwen_vision_layout(names) gives the prefix."""
        return {prefix + name: p for name, p in self.named_parameters()}
