"""Qwen3-VL's vision encoder, patch merger and deepstack mergers in plain torch, replicated on
every rank, matching transformers 5.25's Qwen3VLModel.get_image_features.

What transformers does, and we match:
- Patches arrive flattened as Qwen2VLImageProcessor makes them (the processor qwen3_vl uses): one
  row of C*T*P*P values per patch, each image's patches block-major (every merge x merge block of
  the (h, w) patch grid contiguous, blocks row-major, frames first). The Conv3d patch embedding
  (kernel = stride = (T, P, P), with a bias) is one matmul over such a row.
- Learned positions: pos_embed holds a square side x side grid (side**2 = num_position_embeddings),
  resampled to each image's (h, w) patch grid bilinearly with align_corners=True (in float32, cast
  to the tower's dtype), put in block-major order, the same for every frame, added after the
  patch embedding.
- 2-D rotary as Qwen2.5-VL's (see qwen_vision): each patch's (row, column), head_dim // 4
  frequencies of vision rope_theta, [rows, columns] twice over the head dim, float32.
- Blocks: x + attn(norm1(x)), then + mlp(norm2(x)); LayerNorm (eps 1e-6, with bias); qkv and proj
  with biases; MLP linear_fc2(act(linear_fc1(x))) with biases. Full attention within each frame
  (h*w patches), never across images or frames; no windows.
- Merger: LayerNorm over hidden_size, merge**2 consecutive patches concatenated, linear_fc1, exact
  GELU, linear_fc2 to out_hidden_size. Deepstack: after block deepstack_visual_indexes[i] the hidden
  states go through deepstack_merger_list[i], the same but with its LayerNorm over the concatenated
  merge**2 patches (use_postshuffle_norm). Features come out in block order, one per index.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from celerytp.models.qwen_vision import (
    PatchEmbed,
    QwenVisionBaseConfig,
    QwenVisionTowerBase,
    VisionBlock,
    vision_position_ids,
)
from celerytp.models.vision import ACTIVATIONS, LayerNorm, Linear, replicated_param, unsupported

# Every prefix a checkpoint stores vision tensors under: transformers 5.25's saved layout (its
# module names, as the Qwen3-VL hub checkpoints also write), then the bare `visual.`.
QWEN3_VISION_PREFIXES = ("model.visual.", "visual.")

# Qwen3VLVisionConfig's defaults (transformers 5.25) for keys config.json leaves out.
QWEN3_VISION_DEFAULTS: dict[str, Any] = {
    "depth": 27,
    "hidden_size": 1152,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 4304,
    "num_heads": 16,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 3584,
    "num_position_embeddings": 2304,
    "deepstack_visual_indexes": (8, 16, 24),
}
LAYER_NORM_EPS = 1e-6  # transformers hard-codes it for every vision norm


def qwen3_vision_layout(names: Iterable[str]) -> str:
    """The prefix for Qwen3VisionTower.checkpoint_table from a checkpoint's tensor names:
    "visual." where a checkpoint stores the tower bare, else "model.visual." (what save_pretrained
    and the hub checkpoints write)."""
    return "visual." if any(n.startswith("visual.") for n in names) else "model.visual."


@dataclass
class Qwen3VisionConfig(QwenVisionBaseConfig):
    """A qwen3_vl config.json's vision_config, Qwen3VLVisionConfig's defaults applied."""

    DEFAULTS: ClassVar[dict[str, Any]] = QWEN3_VISION_DEFAULTS
    POSITIVE_INTS: ClassVar[tuple[str, ...]] = (*QwenVisionBaseConfig.POSITIVE_INTS, "num_position_embeddings")

    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]
    # derived
    grid_side: int = field(init=False)  # the learned position grid's side

    def __post_init__(self) -> None:
        super().__post_init__()
        self.deepstack_visual_indexes = tuple(self.deepstack_visual_indexes)
        self.grid_side = math.isqrt(self.num_position_embeddings)
        if self.grid_side**2 != self.num_position_embeddings:
            raise unsupported(
                f"vision_config.num_position_embeddings {self.num_position_embeddings} is not a square "
                f"({self.grid_side}**2 = {self.grid_side**2})"
            )
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad or len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise unsupported(
                f"vision_config.deepstack_visual_indexes {list(self.deepstack_visual_indexes)}: "
                f"each must be a distinct block in [0, depth {self.depth})"
            )


class VisionMLP(nn.Module):
    def __init__(self, c: Qwen3VisionConfig, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.act = ACTIVATIONS[c.hidden_act]
        kw = {"dtype": dtype, "device": device}
        self.linear_fc1 = Linear(c.hidden_size, c.intermediate_size, True, **kw)
        self.linear_fc2 = Linear(c.intermediate_size, c.hidden_size, True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class PatchMerger(nn.Module):
    """Qwen3VLVisionPatchMerger: LayerNorm (per patch, or over the merge**2 patches side by side
    when postshuffle_norm), Linear, GELU, Linear."""

    def __init__(
        self, c: Qwen3VisionConfig, postshuffle_norm: bool, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.width = c.hidden_size * c.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNorm(self.width if postshuffle_norm else c.hidden_size, LAYER_NORM_EPS, **kw)
        self.linear_fc1 = Linear(self.width, self.width, True, **kw)
        self.linear_fc2 = Linear(self.width, c.out_hidden_size, True, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.postshuffle_norm:
            x = self.norm(x.view(-1, self.width))  # (patches / merge**2, H * merge**2)
        else:
            x = self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))  # (patches / merge**2, out)


class Qwen3VisionTower(QwenVisionTowerBase):
    """Qwen3-VL's vision encoder, merger and deepstack mergers, replicated on every rank.

    Args:
        hf_config: the checkpoint's whole config.json (its `vision_config`; Qwen3VLVisionConfig's
            defaults fill what it leaves out).
    """

    config: Qwen3VisionConfig

    def __init__(self, hf_config: dict, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(Qwen3VisionConfig.from_hf(hf_config), dtype=dtype, device=device)
        c, kw = self.config, {"dtype": dtype, "device": device}
        self.deepstack_layers = len(c.deepstack_visual_indexes)
        self.patch_embed = PatchEmbed(c, True, **kw)
        self.pos_embed = nn.Module()  # nn.Embedding's parameter name
        self.pos_embed.weight = replicated_param(c.num_position_embeddings, c.hidden_size, **kw)
        self.blocks = nn.ModuleList(
            VisionBlock(c, LayerNorm, LAYER_NORM_EPS, VisionMLP(c, **kw), **kw) for _ in range(c.depth)
        )
        self.merger = PatchMerger(c, False, **kw)
        self.deepstack_merger_list = nn.ModuleList(PatchMerger(c, True, **kw) for _ in range(self.deepstack_layers))

    def _positions(self, grid: list[tuple[int, int, int]]) -> torch.Tensor:
        """(patches, H): the learned grid resampled to each image's patch grid, block-major."""
        side, m, hidden = self.config.grid_side, self.merge, self.config.hidden_size
        table = self.pos_embed.weight.float().view(side, side, hidden).permute(2, 0, 1)[None]  # (1, H, side, side)
        out = []
        for t, h, w in grid:
            pe = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # (H, h, w)
            pe = pe.permute(1, 2, 0).reshape(h // m, m, w // m, m, hidden).transpose(1, 2).reshape(h * w, hidden)
            out.append(pe.repeat(t, 1))
        return torch.cat(out).to(self.dtype)

    @torch.no_grad()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """pixel_values as Qwen2VLImageProcessor makes them: (sum of patches, C*T*P*P) float;
        grid_thw (images, 3) long -> (features, deepstack features): (sum of tokens, out_hidden_size)
        and deepstack_layers more of that shape, in self's dtype, images in order."""
        grid = self._check(pixel_values, grid_thw)
        device = self.inv_freq.device
        frame_lengths = [h * w for t, h, w in grid for _ in range(t)]

        x = self.patch_embed(pixel_values.to(device=device, dtype=self.dtype))  # (N, H)
        x = x + self._positions(grid).to(device)
        cos, sin = self._rotary(vision_position_ids(grid, self.merge).to(device))
        deepstack = []
        for i, block in enumerate(self.blocks):
            x = block(x, frame_lengths, cos, sin)
            if i in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[self.config.deepstack_visual_indexes.index(i)]
                deepstack.append(merger(x))  # (N / merge**2, out)
        return self.merger(x), deepstack

    def checkpoint_table(self, prefix: str = "model.visual.") -> dict[str, nn.Parameter]:
        """Checkpoint tensor name -> parameter, for every vision tensor: `{prefix}patch_embed.proj.…`,
        `{prefix}pos_embed.weight`, `{prefix}blocks.<i>.…`, `{prefix}merger.…`,
        `{prefix}deepstack_merger_list.<i>.…`. qwen3_vision_layout(names) gives the prefix."""
        return {prefix + name: p for name, p in self.named_parameters()}
