"""Qwen3VisionTower against transformers' Qwen3VLModel.get_image_features on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from vision_tower_fixtures import (
    ATOL,
    CPU,
    META,
    QWEN_BAD_INPUTS,
    QWEN_MERGE,
    QWEN_OUT_HIDDEN,
    QWEN_PATCH_DIM,
    QWEN_PROCESSOR,
    QWEN_UNSUPPORTED,
    QWEN_VISION,
    TINY_TEXT,
    assert_replicated_and_frozen,
    assert_table_is_saved,
    load_checkpoint_tower,
    qwen_patches,
    random_images,
    refused,
    save_random,
    save_renamed,
)

from celerytp.core.errors import ErrorKind
from celerytp.models.qwen3_vision import QWEN3_VISION_PREFIXES, Qwen3VisionTower, qwen3_vision_layout

transformers = pytest.importorskip("transformers")

DEEPSTACK = [0, 2]
# num_position_embeddings 16: a 4x4 learned grid, resampled to every other grid.
VISION = {**QWEN_VISION, "depth": 3, "num_position_embeddings": 16, "deepstack_visual_indexes": DEEPSTACK}
TEXT = {
    **TINY_TEXT,
    "hidden_size": QWEN_OUT_HIDDEN,
    "num_hidden_layers": 2,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "mrope_section": [4, 2, 2], "rope_theta": 10000.0},
}
Features = tuple[torch.Tensor, list[torch.Tensor]]  # (features, one per deepstack index)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random tiny Qwen3VLForConditionalGeneration saved to a directory; (path, model)."""
    path = tmp_path_factory.mktemp("qwen3_vl")
    config = transformers.Qwen3VLConfig(vision_config=VISION, text_config=TEXT)
    return path, save_random(transformers.Qwen3VLForConditionalGeneration, config, path)


def load_tower(path: Path, dtype: torch.dtype = torch.float32) -> Qwen3VisionTower:
    return load_checkpoint_tower(
        path,
        lambda config: Qwen3VisionTower(config, dtype=dtype, device=CPU),
        lambda tower, names: tower.checkpoint_table(qwen3_vision_layout(names)),
        QWEN3_VISION_PREFIXES,
    )


def expected_features(model: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> Features:
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, grid_thw)
    # 5.25: one tensor per image, and per deepstack index one tensor per image
    assert isinstance(out.pooler_output, tuple) and len(out.pooler_output) == len(grid_thw)
    assert len(out.deepstack_features) == len(DEEPSTACK)
    return torch.cat(out.pooler_output), [torch.cat(per_image) for per_image in out.deepstack_features]


def assert_matches(ours: Features, expected: Features) -> None:
    (features, deepstack), (ref, ref_deepstack) = ours, expected
    torch.testing.assert_close(features, ref, atol=ATOL, rtol=1e-5)
    assert len(deepstack) == len(ref_deepstack)
    for got, want in zip(deepstack, ref_deepstack):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)


GRIDS = {
    "one_image": [(1, 8, 12)],
    "two_images": [(1, 8, 12), (1, 12, 8)],
    # smaller than the 4x4 learned grid on one side, larger on the other; and a 2x2 one
    "mixed_sizes": [(1, 2, 10), (1, 6, 6), (1, 2, 2)],
    # two frames: full attention per frame, the same positions for each
    "two_frames": [(2, 8, 4), (1, 4, 8)],
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_matches_transformers(saved: tuple[Path, Any], case: str) -> None:
    path, model = saved
    tower = load_tower(path)
    pixel_values, grid_thw = qwen_patches(GRIDS[case])
    expected = expected_features(model, pixel_values, grid_thw)
    features, deepstack = ours = tower(pixel_values, grid_thw)
    tokens = sum(tower.num_tokens(grid_thw))
    assert features.shape == expected[0].shape == (tokens, QWEN_OUT_HIDDEN)
    assert tower.deepstack_layers == len(deepstack) == len(DEEPSTACK)
    assert all(d.shape == (tokens, QWEN_OUT_HIDDEN) for d in deepstack)
    assert_matches(ours, expected)


def test_image_processor_output(saved: tuple[Path, Any]) -> None:
    """Two PIL images of different shapes through Qwen2VLImageProcessorPil (what qwen3_vl uses
    without torchvision), as a request brings them."""
    path, model = saved
    processor = transformers.Qwen2VLImageProcessorPil(
        **QWEN_PROCESSOR,
        size={"shortest_edge": 16 * 16, "longest_edge": 48 * 48},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    batch = processor(images=random_images([(40, 56), (70, 30)]), return_tensors="pt")
    pixel_values, grid_thw = batch["pixel_values"], batch["image_grid_thw"]
    assert grid_thw.tolist() == [[1, 10, 14], [1, 18, 8]]
    assert_matches(load_tower(path)(pixel_values, grid_thw), expected_features(model, pixel_values, grid_thw))


def test_each_part_is_checked(saved: tuple[Path, Any]) -> None:
    """The comparison sees the learned positions and each deepstack merger: perturb one, it fails."""
    path, model = saved
    pixel_values, grid_thw = qwen_patches([(1, 8, 12)], seed=3)
    expected = expected_features(model, pixel_values, grid_thw)
    for name in ("pos_embed.weight", "deepstack_merger_list.1.norm.bias", "blocks.2.attn.qkv.bias"):
        tower = load_tower(path)
        param = dict(tower.named_parameters())[name]
        with torch.no_grad():  # not a constant: LayerNorm would cancel a uniform shift of pos_embed
            param.add_(0.01 * torch.randn(param.shape, generator=torch.Generator().manual_seed(4)))
        with pytest.raises(AssertionError):
            assert_matches(tower(pixel_values, grid_thw), expected)


def test_table_is_exactly_the_saved_visual_tensors(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    tensors = load_file(path / "model.safetensors")
    assert qwen3_vision_layout(tensors) == "model.visual."
    assert not any(n.startswith("visual.") for n in tensors)
    visual = {n for n in tensors if n.startswith("model.visual.")}
    assert_table_is_saved(load_tower(path).checkpoint_table(qwen3_vision_layout(tensors)), tensors, visual)


def test_bare_visual_layout(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """`visual.<...>` (the tower stored bare) loads to the same tower."""
    path, _ = saved
    tensors = save_renamed(path, tmp_path, lambda n: n.removeprefix("model.") if n.startswith("model.visual.") else n)
    assert qwen3_vision_layout(tensors) == "visual."
    grid_thw = torch.tensor([(1, 8, 12)])
    pixel_values = torch.randn(96, QWEN_PATCH_DIM)
    ours, reference = load_tower(tmp_path)(pixel_values, grid_thw), load_tower(path)(pixel_values, grid_thw)
    torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_parameters_are_replicated_and_frozen(saved: tuple[Path, Any]) -> None:
    config = json.loads((saved[0] / "config.json").read_text())
    tower = Qwen3VisionTower(config, dtype=torch.bfloat16, device=CPU)
    assert_replicated_and_frozen(tower.checkpoint_table(), torch.bfloat16)
    assert tower.merge == QWEN_MERGE and tower.deepstack_layers == 2
    features, deepstack = tower(torch.zeros(16, QWEN_PATCH_DIM), torch.tensor([(1, 4, 4)]))
    assert features.dtype == torch.bfloat16 and features.shape == (4, QWEN_OUT_HIDDEN)
    assert [d.shape for d in deepstack] == [(4, QWEN_OUT_HIDDEN)] * 2


def test_hub_config_defaults() -> None:
    """A Qwen3-VL-style vision_config (no rope_parameters, old model_type); missing keys take
    Qwen3VLVisionConfig's defaults."""
    config = {
        "model_type": "qwen3_vl",
        "vision_config": {
            "deepstack_visual_indexes": [5, 11, 17],
            "depth": 24,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 1024,
            "in_channels": 3,
            "intermediate_size": 4096,
            "model_type": "qwen3_vl",
            "num_heads": 16,
            "num_position_embeddings": 2304,
            "out_hidden_size": 2560,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    }
    tower = Qwen3VisionTower(config, dtype=torch.bfloat16, device=META)
    c = tower.config
    assert (c.head_dim, c.patch_dim, c.grid_side, c.rope_theta) == (64, 1536, 48, 10000.0)
    table = tower.checkpoint_table(qwen3_vision_layout(["model.visual.blocks.0.norm1.weight"]))
    assert table["model.visual.patch_embed.proj.weight"].shape == (1024, 3, 2, 16, 16)
    assert table["model.visual.pos_embed.weight"].shape == (2304, 1024)
    assert table["model.visual.merger.norm.weight"].shape == (1024,)
    assert table["model.visual.deepstack_merger_list.2.norm.weight"].shape == (4096,)
    assert table["model.visual.merger.linear_fc2.weight"].shape == (2560, 4096)
    assert "model.visual.blocks.23.mlp.linear_fc2.bias" in table
    defaults = Qwen3VisionTower({}, dtype=torch.float32, device=META)
    assert (defaults.config.hidden_size, defaults.deepstack_layers) == (1152, 3)


@pytest.mark.parametrize(
    "vision, key",
    [
        *QWEN_UNSUPPORTED,
        ({"num_position_embeddings": 15}, "num_position_embeddings"),
        ({"deepstack_visual_indexes": [0, 3]}, "deepstack_visual_indexes"),
        ({"deepstack_visual_indexes": [1, 1]}, "deepstack_visual_indexes"),
    ],
)
def test_unsupported_config_is_refused(vision: dict[str, Any], key: str) -> None:
    with refused(ErrorKind.UNSUPPORTED_ARCH, key):
        Qwen3VisionTower({"vision_config": {**VISION, **vision}}, dtype=torch.float32, device=META)


@pytest.mark.parametrize("rows, grid", QWEN_BAD_INPUTS)
def test_bad_inputs_are_refused(rows: int, grid: list[tuple[int, ...]]) -> None:
    tower = Qwen3VisionTower({"vision_config": VISION}, dtype=torch.float32, device=CPU)
    with refused(ErrorKind.BAD_REQUEST):
        tower(torch.zeros(rows, QWEN_PATCH_DIM), torch.tensor(grid))
