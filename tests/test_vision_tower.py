"""The llava and gemma3 vision tower and projector (celerytp/models/vision.py) against
transformers' LlavaModel / Gemma3Model.get_image_features, on tiny random CLIP and SigLIP towers
saved with save_pretrained and loaded through the checkpoint table, as the model loader does.
"""

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
    TINY_TEXT,
    assert_replicated_and_frozen,
    assert_table_is_saved,
    load_checkpoint_tower,
    refused,
    save_random,
    save_renamed,
)

from celerytp.core.errors import ErrorKind
from celerytp.models.vision import VISION_TENSOR_PREFIXES, VisionTower, checkpoint_layout

transformers = pytest.importorskip("transformers")

TEXT_HIDDEN = 48
TOWER = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}

# name -> (vision config class, vision_feature_layer, vision_feature_select_strategy, extra LlavaConfig keys)
CASES: dict[str, tuple[str, Any, str, dict[str, Any]]] = {
    "clip_penultimate": ("CLIPVisionConfig", -2, "default", {}),
    "clip_layer_list": ("CLIPVisionConfig", [-2, -1], "default", {"multimodal_projector_bias": False}),
    # index 0: the embeddings after pre_layrnorm, before any encoder layer
    "clip_full_embeddings": ("CLIPVisionConfig", [0, 2], "full", {"projector_hidden_act": "quick_gelu"}),
    "siglip_last_full": ("SiglipVisionConfig", -1, "full", {}),
    "siglip_first_layer": ("SiglipVisionConfig", 1, "default", {}),
}


def save_llava(path: Path, case: str) -> Any:
    """A random tiny LlavaForConditionalGeneration saved to `path`; returns the model."""
    vision_cls, layer, strategy, extra = CASES[case]
    config = transformers.LlavaConfig(
        vision_config=getattr(transformers, vision_cls)(**TOWER, image_size=32, patch_size=8),
        text_config=transformers.LlamaConfig(**TINY_TEXT, hidden_size=TEXT_HIDDEN),
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        image_token_index=127,
        **extra,
    )
    return save_random(transformers.LlavaForConditionalGeneration, config, path)


def load_tower(path: Path, text_hidden: int = TEXT_HIDDEN) -> VisionTower:
    return load_checkpoint_tower(
        path,
        lambda config: VisionTower(config, text_hidden, dtype=torch.float32, device=CPU),
        lambda tower, names: tower.checkpoint_table(*checkpoint_layout(names)),
        VISION_TENSOR_PREFIXES,
    )


@pytest.mark.parametrize("case", list(CASES))
def test_matches_transformers(tmp_path: Path, case: str) -> None:
    model = save_llava(tmp_path, case)
    tower = load_tower(tmp_path)
    pixel_values = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = torch.stack(list(model.get_image_features(pixel_values=pixel_values).pooler_output))
    ours = tower(pixel_values)
    assert ours.shape == (3, tower.tokens_per_image, TEXT_HIDDEN)
    assert tower.image_size == 32
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-5)


GEMMA3_TEXT_HIDDEN = 64


def save_gemma3(path: Path, use_head: bool) -> Any:
    """A random tiny Gemma3ForConditionalGeneration saved to `path`: a 4x4 patch grid pooled to
    2x2 positions; returns the model."""
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(
            **{**TOWER, "num_hidden_layers": 2}, image_size=32, patch_size=8, vision_use_head=use_head
        ),
        text_config=transformers.Gemma3TextConfig(
            **TINY_TEXT, hidden_size=GEMMA3_TEXT_HIDDEN, head_dim=16, query_pre_attn_scalar=16, sliding_window=8
        ),
        mm_tokens_per_image=4,
        image_token_index=127,
        boi_token_index=125,
        eoi_token_index=126,
    )
    return save_random(transformers.Gemma3ForConditionalGeneration, config, path)


@pytest.mark.parametrize("use_head", [False, True])
def test_gemma3_matches_transformers(tmp_path: Path, use_head: bool) -> None:
    """SigLIP's last_hidden_state (after post_layernorm), pooled, normed and projected; the table
    is exactly the saved tower and projector tensors (the pooling head only where saved)."""
    model = save_gemma3(tmp_path, use_head)
    saved = load_file(tmp_path / "model.safetensors")
    tower_names = {n for n in saved if n.startswith(("vision_tower.", "multi_modal_projector."))}
    assert {n for n in saved if n.startswith("multi_modal_projector.")} == {
        "multi_modal_projector.mm_input_projection_weight",
        "multi_modal_projector.mm_soft_emb_norm.weight",
    }
    assert any(n.startswith("vision_tower.head.") for n in saved) == use_head
    tower = load_tower(tmp_path, GEMMA3_TEXT_HIDDEN)
    assert checkpoint_layout(saved) == ("", False)
    assert_table_is_saved(tower.checkpoint_table(), saved, tower_names)
    pixel_values = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model.model.get_image_features(pixel_values=pixel_values).pooler_output
    ours = tower(pixel_values)
    assert tower.tokens_per_image == 4 and ours.shape == expected.shape == (3, 4, GEMMA3_TEXT_HIDDEN)
    torch.testing.assert_close(ours, expected, atol=ATOL, rtol=1e-5)


def test_transformers4_and_module_name_layouts(tmp_path: Path) -> None:
    """`model.vision_tower.vision_model.<...>`: transformers' module prefix and the tower nested as
    transformers 4 (and the llava-hf hub files) name it; same features as the saved layout."""
    save_llava(tmp_path / "saved", "clip_penultimate")
    renamed = tmp_path / "renamed"
    rename = {
        "vision_tower.": "model.vision_tower.vision_model.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }

    def new_name(name: str) -> str:
        for old, new in rename.items():
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    tensors = save_renamed(tmp_path / "saved", renamed, new_name)
    assert checkpoint_layout(tensors) == ("model.", True)
    pixel_values = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(load_tower(renamed)(pixel_values), load_tower(tmp_path / "saved")(pixel_values))


def test_parameters_are_replicated_and_frozen(tmp_path: Path) -> None:
    save_llava(tmp_path, "siglip_last_full")
    config = json.loads((tmp_path / "config.json").read_text())
    tower = VisionTower(config, TEXT_HIDDEN, dtype=torch.bfloat16, device=CPU)
    assert_replicated_and_frozen(tower.checkpoint_table(), torch.bfloat16)
    assert tower(torch.zeros(1, 3, 32, 32)).dtype == torch.bfloat16


def test_wrong_image_size_is_refused() -> None:
    tower = VisionTower(
        {"vision_config": {"model_type": "clip_vision_model", **TOWER, "image_size": 32, "patch_size": 8}},
        TEXT_HIDDEN,
        dtype=torch.float32,
        device=CPU,
    )
    with refused(ErrorKind.BAD_REQUEST):
        tower(torch.zeros(1, 3, 48, 48))


@pytest.mark.parametrize(
    "config, key",
    [
        ({"vision_config": {"model_type": "pixtral"}}, "vision_config.model_type"),
        ({"vision_config": {"model_type": "clip_vision_model", "hidden_act": "swiglu"}}, "vision_config.hidden_act"),
        ({"projector_hidden_act": "mystery"}, "projector_hidden_act"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
        ({"vision_feature_layer": 30}, "vision_feature_layer"),
        ({"model_type": "gemma3", "vision_config": {"model_type": "clip_vision_model"}}, "vision_config.model_type"),
        # the default SigLIP tower's 14x14 patch grid cannot pool to 16x16 (or 3x3) positions
        ({"model_type": "gemma3"}, "mm_tokens_per_image"),
        ({"model_type": "gemma3", "vision_config": {"image_size": 896, "patch_size": 14},
          "mm_tokens_per_image": 9}, "mm_tokens_per_image"),
    ],
)
def test_unsupported_config_is_refused(config: dict[str, Any], key: str) -> None:
    with refused(ErrorKind.UNSUPPORTED_ARCH, key):
        VisionTower({"model_type": "llava", **config}, TEXT_HIDDEN, dtype=torch.float32, device=META)


def test_gemma3_hub_config_and_layout() -> None:
    """gemma-3-4b's vision_config: 64x64 patches pooled to 256 positions, no pooling head; its hub
    files (saved by transformers 4) nest the tower under `vision_tower.vision_model.`."""
    config = {
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": 1152,
            "intermediate_size": 4304,
            "num_hidden_layers": 27,
            "num_attention_heads": 16,
            "image_size": 896,
            "patch_size": 14,
            "vision_use_head": False,
        },
    }
    tower = VisionTower(config, 2560, dtype=torch.bfloat16, device=META)
    assert tower.tokens_per_image == 256 and tower.multi_modal_projector.kernel == 4
    names = ["language_model.model.embed_tokens.weight", "vision_tower.vision_model.post_layernorm.weight"]
    table = tower.checkpoint_table(*checkpoint_layout(names))
    assert "vision_tower.vision_model.encoder.layers.26.mlp.fc2.weight" in table
    assert not any(".head." in n for n in table)
    assert table["multi_modal_projector.mm_input_projection_weight"].shape == (1152, 2560)
