"""QwenVisionTower against transformers' Qwen2_5_VLModel.get_image_features on a tiny random model."""

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
from celerytp.models.qwen_vision import QWEN_VISION_PREFIXES, QwenVisionTower, qwen_vision_layout

transformers = pytest.importorskip("transformers")

# window_size 16 pixels: 16 // MERGE // PATCH = 2 merge units (4x4 patches) on a window's side.
VISION = {**QWEN_VISION, "depth": 4, "window_size": 16, "fullatt_block_indexes": [1, 3]}
TEXT = {
    **TINY_TEXT,
    "hidden_size": QWEN_OUT_HIDDEN,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random tiny Qwen2_5_VLForConditionalGeneration saved to a directory; (path, model)."""
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    return path, save_random(transformers.Qwen2_5_VLForConditionalGeneration, config, path)


def load_tower(path: Path, dtype: torch.dtype = torch.float32) -> QwenVisionTower:
    return load_checkpoint_tower(
        path,
        lambda config: QwenVisionTower(config, dtype=dtype, device=CPU),
        lambda tower, names: tower.checkpoint_table(qwen_vision_layout(names)),
        QWEN_VISION_PREFIXES,
    )


def expected_features(model: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        per_image = model.model.get_image_features(pixel_values, grid_thw).pooler_output
    assert isinstance(per_image, tuple)  # 5.25: one tensor per image
    return torch.cat(per_image)


GRIDS = {
    "one_image": [(1, 8, 12)],
    "two_images": [(1, 8, 12), (1, 12, 8)],
    # 5x3 merge units: windows cut short at the bottom and right edges
    "edge_windows": [(1, 10, 6), (1, 4, 4)],
    # two frames: full attention per frame, windows per frame
    "two_frames": [(2, 8, 4), (1, 8, 8)],
}


@pytest.mark.parametrize("case", list(GRIDS))
def test_matches_transformers(saved: tuple[Path, Any], case: str) -> None:
    path, model = saved
    tower = load_tower(path)
    pixel_values, grid_thw = qwen_patches(GRIDS[case])
    expected = expected_features(model, pixel_values, grid_thw)
    ours = tower(pixel_values, grid_thw)
    assert ours.shape == expected.shape == (sum(tower.num_tokens(grid_thw)), QWEN_OUT_HIDDEN)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-5)


def test_image_processor_output(saved: tuple[Path, Any]) -> None:
    """Two PIL images of different shapes through Qwen2VLImageProcessorPil, as a request brings them."""
    path, model = saved
    processor = transformers.Qwen2VLImageProcessorPil(**QWEN_PROCESSOR, min_pixels=16 * 16, max_pixels=48 * 48)
    batch = processor(images=random_images([(40, 56), (70, 30)]), return_tensors="pt")
    pixel_values, grid_thw = batch["pixel_values"], batch["image_grid_thw"]
    assert grid_thw.shape == (2, 3) and grid_thw[0].tolist() != grid_thw[1].tolist()
    torch.testing.assert_close(
        load_tower(path)(pixel_values, grid_thw), expected_features(model, pixel_values, grid_thw), atol=ATOL, rtol=1e-5
    )


def test_table_is_exactly_the_saved_visual_tensors(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    tensors = load_file(path / "model.safetensors")
    assert qwen_vision_layout(tensors) == "visual."
    assert not any(n.startswith("model.visual.") for n in tensors)
    visual = {n for n in tensors if n.startswith("visual.")}
    assert_table_is_saved(load_tower(path).checkpoint_table(), tensors, visual)


def test_module_name_layout(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """`model.visual.<...>` (transformers' module names) loads to the same tower."""
    path, _ = saved
    tensors = save_renamed(path, tmp_path, lambda n: "model." + n if n.startswith("visual.") else n)
    assert qwen_vision_layout(tensors) == "model.visual."
    grid_thw = torch.tensor([(1, 8, 12)])
    pixel_values = torch.randn(96, QWEN_PATCH_DIM)
    torch.testing.assert_close(load_tower(tmp_path)(pixel_values, grid_thw), load_tower(path)(pixel_values, grid_thw))


def test_parameters_are_replicated_and_frozen(saved: tuple[Path, Any]) -> None:
    config = json.loads((saved[0] / "config.json").read_text())
    tower = QwenVisionTower(config, dtype=torch.bfloat16, device=CPU)
    assert_replicated_and_frozen(tower.checkpoint_table(), torch.bfloat16)
    assert tower.merge == QWEN_MERGE
    out = tower(torch.zeros(16, QWEN_PATCH_DIM), torch.tensor([(1, 4, 4)]))
    assert out.dtype == torch.bfloat16 and out.shape == (4, QWEN_OUT_HIDDEN)


def test_hub_config_defaults() -> None:
    """Qwen2.5-VL-7B's vision_config (hub keys: `in_chans`, no rope_theta); missing keys take
    Qwen2_5_VLVisionConfig's defaults."""
    config = {
        "model_type": "qwen2_5_vl",
        "vision_config": {
            "depth": 32,
            "hidden_act": "silu",
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "num_heads": 16,
            "in_chans": 3,
            "out_hidden_size": 3584,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "spatial_patch_size": 14,
            "window_size": 112,
            "fullatt_block_indexes": [7, 15, 23, 31],
            "tokens_per_second": 2,
            "temporal_patch_size": 2,
        },
    }
    tower = QwenVisionTower(config, dtype=torch.bfloat16, device=META)
    c = tower.config
    assert (c.head_dim, c.window_units, c.patch_dim, c.rope_theta) == (80, 4, 1176, 10000.0)
    table = tower.checkpoint_table(qwen_vision_layout(["visual.blocks.0.norm1.weight"]))
    assert table["visual.patch_embed.proj.weight"].shape == (1280, 3, 2, 14, 14)
    assert table["visual.merger.mlp.0.weight"].shape == (5120, 5120)
    assert table["visual.merger.mlp.2.weight"].shape == (3584, 5120)
    assert "visual.blocks.31.mlp.gate_proj.bias" in table
    assert QwenVisionTower({}, dtype=torch.float32, device=META).config.hidden_size == 3584


@pytest.mark.parametrize(
    "vision, key",
    [*QWEN_UNSUPPORTED, ({"window_size": 7, "patch_size": 4}, "window_size")],  # 7 // 2 // 4 = 0 units
)
def test_unsupported_config_is_refused(vision: dict[str, Any], key: str) -> None:
    with refused(ErrorKind.UNSUPPORTED_ARCH, key):
        QwenVisionTower({"vision_config": {**VISION, **vision}}, dtype=torch.float32, device=META)


@pytest.mark.parametrize("rows, grid", QWEN_BAD_INPUTS)
def test_bad_inputs_are_refused(rows: int, grid: list[tuple[int, ...]]) -> None:
    tower = QwenVisionTower({"vision_config": VISION}, dtype=torch.float32, device=CPU)
    with refused(ErrorKind.BAD_REQUEST):
        tower(torch.zeros(rows, QWEN_PATCH_DIM), torch.tensor(grid))
