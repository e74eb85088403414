"""QwenVisionTower against transformers' Qwen2_5_VLModel.get_image_features on a tiny random model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import randomize
from safetensors.torch import load_file, save_file

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading import open_checkpoint
from celerytp.models.qwen_vision import QWEN_VISION_PREFIXES, QwenVisionTower, qwen_vision_layout

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
PATCH, TEMPORAL, MERGE, OUT_HIDDEN = 4, 2, 2, 64
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH
# window_size 16 pixels: 16 // MERGE // PATCH = 2 merge units (4x4 patches) on a window's side.
VISION = {
    "depth": 4,
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 64,
    "out_hidden_size": OUT_HIDDEN,
    "patch_size": PATCH,
    "temporal_patch_size": TEMPORAL,
    "spatial_merge_size": MERGE,
    "window_size": 16,
    "fullatt_block_indexes": [1, 3],
}
TEXT = {
    "hidden_size": OUT_HIDDEN,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
    "rope_parameters": {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
}
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random tiny Qwen2_5_VLForConditionalGeneration saved to a directory; (path, model)."""
    path = tmp_path_factory.mktemp("qwen2_5_vl")
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    torch.manual_seed(0)
    model = randomize(transformers.Qwen2_5_VLForConditionalGeneration(config)).eval()
    model.save_pretrained(path)
    return path, model


def load_tower(path: Path, dtype: torch.dtype = torch.float32) -> QwenVisionTower:
    with open_checkpoint(path) as checkpoint:
        tower = QwenVisionTower(checkpoint.hf_config, dtype=dtype, device=CPU)
        names = checkpoint.names()
        table = tower.checkpoint_table(qwen_vision_layout(names))
        assert set(table) == {n for n in names if n.startswith(QWEN_VISION_PREFIXES)}
        for name, param in table.items():
            param.weight_loader(param, checkpoint.source(name), None)
    return tower


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
    grid_thw = torch.tensor(GRIDS[case])
    patches = int(grid_thw.prod(-1).sum())
    pixel_values = torch.randn(patches, PATCH_DIM, generator=torch.Generator().manual_seed(1))
    expected = expected_features(model, pixel_values, grid_thw)
    ours = tower(pixel_values, grid_thw)
    assert ours.shape == expected.shape == (sum(tower.num_tokens(grid_thw)), OUT_HIDDEN)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-5)


def test_image_processor_output(saved: tuple[Path, Any]) -> None:
    """Two PIL images of different shapes through Qwen2VLImageProcessorPil, as a request brings them."""
    from PIL import Image

    path, model = saved
    processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=PATCH, temporal_patch_size=TEMPORAL, merge_size=MERGE, min_pixels=16 * 16, max_pixels=48 * 48
    )
    rng = torch.Generator().manual_seed(2)
    images = [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
        for h, w in ((40, 56), (70, 30))
    ]
    batch = processor(images=images, return_tensors="pt")
    pixel_values, grid_thw = batch["pixel_values"], batch["image_grid_thw"]
    assert grid_thw.shape == (2, 3) and grid_thw[0].tolist() != grid_thw[1].tolist()
    torch.testing.assert_close(
        load_tower(path)(pixel_values, grid_thw), expected_features(model, pixel_values, grid_thw), atol=ATOL, rtol=1e-5
    )


def test_table_is_exactly_the_saved_visual_tensors(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    tensors = load_file(path / "model.safetensors")
    visual = {n for n in tensors if n.startswith("visual.")}
    assert qwen_vision_layout(tensors) == "visual."
    assert not any(n.startswith("model.visual.") for n in tensors)
    tower = load_tower(path)
    table = tower.checkpoint_table()
    assert set(table) == visual
    for name, param in table.items():
        torch.testing.assert_close(param, tensors[name], rtol=0, atol=0)


def test_module_name_layout(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """`model.visual.<...>` (transformers' module names) loads to the same tower."""
    path, _ = saved
    shutil.copy(path / "config.json", tmp_path / "config.json")
    tensors = load_file(path / "model.safetensors")
    tensors = {("model." + n if n.startswith("visual.") else n): t for n, t in tensors.items()}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert qwen_vision_layout(tensors) == "model.visual."
    grid_thw = torch.tensor([(1, 8, 12)])
    pixel_values = torch.randn(96, PATCH_DIM)
    torch.testing.assert_close(load_tower(tmp_path)(pixel_values, grid_thw), load_tower(path)(pixel_values, grid_thw))


def test_parameters_are_replicated_and_frozen(saved: tuple[Path, Any]) -> None:
    config = json.loads((saved[0] / "config.json").read_text())
    tower = QwenVisionTower(config, dtype=torch.bfloat16, device=CPU)
    for p in tower.checkpoint_table().values():
        assert p.dtype == torch.bfloat16 and not p.requires_grad and p.tp_sharded is False
    assert tower.merge == MERGE
    out = tower(torch.zeros(16, PATCH_DIM), torch.tensor([(1, 4, 4)]))
    assert out.dtype == torch.bfloat16 and out.shape == (4, OUT_HIDDEN)


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
    tower = QwenVisionTower(config, dtype=torch.bfloat16, device=torch.device("meta"))
    c = tower.config
    assert (c.head_dim, c.window_units, c.patch_dim, c.rope_theta) == (80, 4, 1176, 10000.0)
    table = tower.checkpoint_table(qwen_vision_layout(["visual.blocks.0.norm1.weight"]))
    assert table["visual.patch_embed.proj.weight"].shape == (1280, 3, 2, 14, 14)
    assert table["visual.merger.mlp.0.weight"].shape == (5120, 5120)
    assert table["visual.merger.mlp.2.weight"].shape == (3584, 5120)
    assert "visual.blocks.31.mlp.gate_proj.bias" in table
    assert QwenVisionTower({}, dtype=torch.float32, device=torch.device("meta")).config.hidden_size == 3584


@pytest.mark.parametrize(
    "vision, key",
    [
        ({"hidden_size": 30, "num_heads": 4}, "hidden_size"),
        ({"hidden_size": 24, "num_heads": 4}, "head_dim"),
        ({"hidden_act": "swiglu"}, "hidden_act"),
        ({"window_size": 7, "patch_size": 4}, "window_size"),  # 7 // 2 // 4 = 0 units
        ({"rope_parameters": {"rope_type": "default"}}, "rope_type"),
    ],
)
def test_unsupported_config_is_refused(vision: dict[str, Any], key: str) -> None:
    with pytest.raises(CeleryTPError) as err:
        QwenVisionTower({"vision_config": {**VISION, **vision}}, dtype=torch.float32, device=torch.device("meta"))
    assert err.value.kind == ErrorKind.UNSUPPORTED_ARCH
    assert key in str(err.value)


@pytest.mark.parametrize(
    "rows, grid",
    [
        (96, [(1, 8, 13)]),  # w not a multiple of spatial_merge_size
        (95, [(1, 8, 12)]),  # rows != t*h*w
        (96, [(1, 8, 12, 1)]),
    ],
)
def test_bad_inputs_are_refused(rows: int, grid: list[tuple[int, ...]]) -> None:
    tower = QwenVisionTower({"vision_config": VISION}, dtype=torch.float32, device=CPU)
    with pytest.raises(CeleryTPError) as err:
        tower(torch.zeros(rows, PATCH_DIM), torch.tensor(grid))
    assert err.value.kind == ErrorKind.BAD_REQUEST
