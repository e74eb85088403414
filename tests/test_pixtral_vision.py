"""PixtralVisionTower against transformers' Mistral3Model.get_image_features on a tiny random
Mistral3ForConditionalGeneration, and the prompt side's PixtralGrid against PixtralImageProcessor's resize."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from vision_tower_fixtures import (
    ATOL,
    CPU,
    META,
    TINY_TEXT,
    assert_replicated_and_frozen,
    assert_table_is_saved,
    load_checkpoint_tower,
    random_images,
    refused,
    save_random,
    save_renamed,
)

from celerytp.core.errors import ErrorKind
from celerytp.core.vision_inputs import PixtralGrid
from celerytp.models.pixtral_vision import (
    PIXTRAL_VISION_PREFIXES,
    PixtralVisionTower,
    pixtral_vision_layout,
)

transformers = pytest.importorskip("transformers")

PATCH, MERGE, TEXT_HIDDEN = 4, 2, 64
VISION = {
    "model_type": "pixtral",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 8,
    "image_size": 64,
    "patch_size": PATCH,
    "hidden_act": "silu",  # the hub towers' (PixtralVisionConfig's default is gelu)
    "rope_parameters": {"rope_type": "axial", "rope_theta": 1000.0},
}
TEXT = {
    **TINY_TEXT,
    "model_type": "mistral",
    "hidden_size": TEXT_HIDDEN,
    "head_dim": 16,
    "rms_norm_eps": 0.1,  # the projector norm's eps: large enough that another eps fails the test
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random tiny Mistral3ForConditionalGeneration saved to a directory; (path, model)."""
    path = tmp_path_factory.mktemp("mistral3")
    config = transformers.Mistral3Config(
        vision_config=VISION, text_config=TEXT, spatial_merge_size=MERGE, multimodal_projector_bias=True
    )
    return path, save_random(transformers.Mistral3ForConditionalGeneration, config, path)


def load_tower(
    path: Path, overrides: dict[str, Any] | None = None, dtype: torch.dtype = torch.float32
) -> PixtralVisionTower:
    def build(config: dict[str, Any]) -> PixtralVisionTower:
        hf_config = {**config, **(overrides or {})}
        return PixtralVisionTower(hf_config, hf_config["text_config"]["hidden_size"], dtype=dtype, device=CPU)

    return load_checkpoint_tower(
        path,
        build,
        lambda tower, names: tower.checkpoint_table(pixtral_vision_layout(names)),
        PIXTRAL_VISION_PREFIXES,
    )


def expected_features(model: Any, pixel_values: torch.Tensor, image_sizes: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=pixel_values, image_sizes=image_sizes, **kwargs)
    per_image = out.pooler_output
    assert isinstance(per_image, tuple) and len(per_image) == len(image_sizes)  # 5.25: one tensor per image
    return torch.cat(per_image)


# (padded height, width) and each image's (height, width) in pixels
BATCHES = {
    "one_image": ((32, 24), [(32, 24)]),
    "two_images": ((32, 40), [(32, 24), (16, 40)]),
    # sizes off the patch and merge grids: remainder pixels, patch rows and columns dropped
    "ragged": ((32, 48), [(30, 45), (20, 13)]),
}


@pytest.mark.parametrize("case", list(BATCHES))
def test_matches_transformers(saved: tuple[Path, Any], case: str) -> None:
    path, model = saved
    tower = load_tower(path)
    (height, width), sizes = BATCHES[case]
    # padding is random too: whatever lies outside an image's size must not reach its tokens
    pixel_values = torch.randn(len(sizes), 3, height, width, generator=torch.Generator().manual_seed(1))
    image_sizes = torch.tensor(sizes)
    expected = expected_features(model, pixel_values, image_sizes)
    ours = tower(pixel_values, image_sizes)
    assert ours.shape == expected.shape == (sum(tower.num_tokens(image_sizes)), TEXT_HIDDEN)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-5)


# (ours, transformers'): 5.25 fails on vision_feature_layer=0 (a falsy output_hidden_states
# captures nothing), so ln_pre's output is checked as -3, the same state of a 2-layer tower.
@pytest.mark.parametrize("layer, reference", [(-2, -2), (0, -3), (1, 1), ([1], [1])])
def test_vision_feature_layer(saved: tuple[Path, Any], layer: int | list[int], reference: int | list[int]) -> None:
    path, model = saved
    (height, width), sizes = BATCHES["two_images"]
    pixel_values = torch.randn(len(sizes), 3, height, width, generator=torch.Generator().manual_seed(3))
    image_sizes = torch.tensor(sizes)
    expected = expected_features(model, pixel_values, image_sizes, vision_feature_layer=reference)
    ours = load_tower(path, {"vision_feature_layer": layer})(pixel_values, image_sizes)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-5)


def test_image_processor_output(saved: tuple[Path, Any]) -> None:
    """Two PIL images of different shapes through PixtralImageProcessorPil (what AutoImageProcessor
    gives without torchvision), aligned to patch * merge as PixtralProcessor asks it to."""
    path, model = saved
    size, align = {"longest_edge": 48}, {"height": PATCH * MERGE, "width": PATCH * MERGE}
    processor = transformers.PixtralImageProcessorPil(size=size, patch_size=align)
    images = random_images([(40, 56), (70, 30)])
    batch = processor(images=images, return_tensors="pt")
    pixel_values, image_sizes = batch["pixel_values"], batch["image_sizes"]
    cell = PATCH * MERGE
    grid = PixtralGrid(size["longest_edge"], cell)
    assert image_sizes.tolist() == [[n * cell for n in grid.cells(im.width, im.height)] for im in images]
    assert image_sizes.tolist() == [[40, 48], [48, 24]]  # 56 wide: scaled by 48/56, 34 rows -> 40
    torch.testing.assert_close(
        load_tower(path)(pixel_values, image_sizes),
        expected_features(model, pixel_values, image_sizes),
        atol=ATOL,
        rtol=1e-5,
    )


def test_resized_size_matches_transformers() -> None:
    from transformers.image_utils import ChannelDimension
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    rng = np.random.default_rng(0)
    sizes = [(1, 1), (28, 28), (1540, 1540), (1541, 1), (3000, 2000), (4032, 3024), (333, 7777)]
    sizes += [tuple(int(v) for v in rng.integers(1, 5000, 2)) for _ in range(300)]
    for longest, patch in ((1540, 28), (1024, 16), (48, 8), (1024, 14)):
        for width, height in sizes:
            image = np.broadcast_to(np.zeros(1, dtype=np.uint8), (height, width, 3))  # no memory
            expected = get_resize_output_image_size(
                image, size=(longest, longest), patch_size=(patch, patch), input_data_format=ChannelDimension.LAST
            )
            rows, columns = PixtralGrid(longest, patch).cells(width, height)
            assert (rows * patch, columns * patch) == tuple(expected)
    # a 12 MP photo for Mistral Small 3.1 (longest_edge 1540, patch 14 * merge 2): 42 x 55 merged patches
    assert PixtralGrid(1540, 28).cells(4032, 3024) == (42, 55)


def test_table_is_exactly_the_saved_tensors(saved: tuple[Path, Any]) -> None:
    path, _ = saved
    tensors = load_file(path / "model.safetensors")
    assert pixtral_vision_layout(tensors) == ""
    assert not any(n.startswith("model.") for n in tensors)
    assert any(n.startswith("language_model.model.layers.") for n in tensors)  # 5.25's saved text layout
    vision = {n for n in tensors if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert "multi_modal_projector.linear_1.bias" in vision and "vision_tower.patch_conv.weight" in vision
    assert_table_is_saved(load_tower(path).checkpoint_table(), tensors, vision)


def test_module_name_layout(saved: tuple[Path, Any], tmp_path: Path) -> None:
    """`model.vision_tower.<...>` (transformers' module names) loads to the same tower."""
    path, _ = saved
    tensors = save_renamed(path, tmp_path, lambda n: "model." + n if n.startswith(PIXTRAL_VISION_PREFIXES) else n)
    assert pixtral_vision_layout(tensors) == "model."
    pixel_values, image_sizes = torch.randn(1, 3, 16, 24), torch.tensor([(16, 24)])
    torch.testing.assert_close(
        load_tower(tmp_path)(pixel_values, image_sizes), load_tower(path)(pixel_values, image_sizes)
    )


def test_parameters_are_replicated_and_frozen(saved: tuple[Path, Any]) -> None:
    config = json.loads((saved[0] / "config.json").read_text())
    tower = PixtralVisionTower(config, TEXT_HIDDEN, dtype=torch.bfloat16, device=CPU)
    assert_replicated_and_frozen(tower.checkpoint_table(), torch.bfloat16)
    assert (tower.patch, tower.merge) == (PATCH, MERGE)
    out = tower(torch.zeros(1, 3, 16, 24), torch.tensor([(16, 24)]))
    assert out.dtype == torch.bfloat16 and out.shape == (2 * 3, TEXT_HIDDEN)


MISTRAL_SMALL_3_1 = {  # mistralai/Mistral-Small-3.1-24B-Instruct-2503's config.json, trimmed
    "model_type": "mistral3",
    "image_token_index": 10,
    "multimodal_projector_bias": False,
    "projector_hidden_act": "gelu",
    "spatial_merge_size": 2,
    "vision_feature_layer": -1,
    "text_config": {"model_type": "mistral", "hidden_size": 5120, "rms_norm_eps": 1e-05},
    "vision_config": {
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 1024,
        "image_size": 1540,
        "intermediate_size": 4096,
        "model_type": "pixtral",
        "num_attention_heads": 16,
        "num_channels": 3,
        "num_hidden_layers": 24,
        "patch_size": 14,
        "rope_theta": 10000.0,  # transformers 4's spelling
    },
}


def test_hub_config_and_defaults() -> None:
    tower = PixtralVisionTower(MISTRAL_SMALL_3_1, 5120, dtype=torch.bfloat16, device=META)
    c = tower.config
    assert (c.head_dim, c.rope_theta, c.norm_eps, c.layers_used, tower.patch, tower.merge) == (64, 1e4, 1e-5, 24, 14, 2)
    table = tower.checkpoint_table(pixtral_vision_layout(["vision_tower.ln_pre.weight"]))
    assert table["vision_tower.patch_conv.weight"].shape == (1024, 3, 14, 14)
    assert table["vision_tower.transformer.layers.23.feed_forward.gate_proj.weight"].shape == (4096, 1024)
    assert table["multi_modal_projector.patch_merger.merging_layer.weight"].shape == (1024, 4096)
    assert table["multi_modal_projector.linear_1.weight"].shape == (5120, 1024)
    assert "multi_modal_projector.linear_1.bias" not in table
    assert tower.num_tokens(torch.tensor([(1176, 1540)])) == [42 * 55]
    # Mistral3Config() without sub-configs: its vision and text defaults (patch 14, text eps 1e-5)
    bare = PixtralVisionTower({}, 5120, dtype=torch.float32, device=META).config
    assert (bare.patch_size, bare.hidden_act, bare.norm_eps, bare.rope_theta) == (14, "gelu", 1e-5, 1e4)
    # a vision_config without those keys takes PixtralVisionConfig's; a text_config MistralConfig's eps
    partial = PixtralVisionTower({"vision_config": {}, "text_config": {}}, 64, dtype=torch.float32, device=META).config
    assert (partial.patch_size, partial.norm_eps) == (16, 1e-6)


@pytest.mark.parametrize(
    "config, key",
    [
        ({"vision_config": {**VISION, "hidden_size": 30}}, "hidden_size"),
        ({"vision_config": {**VISION, "head_dim": 16}}, "head_dim"),
        ({"vision_config": {**VISION, "hidden_size": 24, "head_dim": 6}}, "head_dim"),
        ({"vision_config": {**VISION, "hidden_act": "swiglu"}}, "hidden_act"),
        ({"vision_config": {**VISION, "patch_size": [4, 4]}}, "patch_size"),
        ({"vision_config": {**VISION, "model_type": "siglip_vision_model"}}, "model_type"),
        ({"vision_config": {**VISION, "rope_parameters": {"rope_type": "linear"}}}, "rope_type"),
        ({"vision_config": VISION, "vision_feature_layer": [0, -1]}, "vision_feature_layer"),
        ({"vision_config": VISION, "vision_feature_layer": 3}, "vision_feature_layer"),
        ({"vision_config": VISION, "projector_hidden_act": "swiglu"}, "projector_hidden_act"),
        ({"vision_config": VISION, "text_config": {"model_type": "llama4_text"}}, "rms_norm_eps"),
    ],
)
def test_unsupported_config_is_refused(config: dict[str, Any], key: str) -> None:
    with refused(ErrorKind.UNSUPPORTED_ARCH, key):
        PixtralVisionTower({"text_config": TEXT, **config}, TEXT_HIDDEN, dtype=torch.float32, device=META)


@pytest.mark.parametrize(
    "shape, sizes",
    [
        ((1, 3, 16, 16), [(16, 20)]),  # wider than pixel_values
        ((1, 3, 16, 16), [(16, 7)]),  # 1 patch wide: no merge block
        ((2, 3, 16, 16), [(16, 16)]),  # one size for two images
        ((1, 4, 16, 16), [(16, 16)]),  # channels
        ((3, 16, 16), [(16, 16)]),
    ],
)
def test_bad_inputs_are_refused(shape: tuple[int, ...], sizes: list[tuple[int, int]]) -> None:
    tower = PixtralVisionTower(
        {"vision_config": VISION, "text_config": TEXT}, TEXT_HIDDEN, dtype=torch.float32, device=CPU
    )
    with refused(ErrorKind.BAD_REQUEST):
        tower(torch.zeros(shape), torch.tensor(sizes))
