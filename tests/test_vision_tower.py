"""The llava vision tower and projector (celerytp/models/vision.py) against transformers'
LlavaModel.get_image_features, on tiny random CLIP and SigLIP towers saved with save_pretrained
and loaded through the checkpoint table, as the model loader does.
"""

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
from celerytp.models.vision import VISION_TENSOR_PREFIXES, VisionTower, checkpoint_layout

transformers = pytest.importorskip("transformers")

TEXT_HIDDEN = 48
ATOL = 1e-5
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
        text_config=transformers.LlamaConfig(
            hidden_size=TEXT_HIDDEN,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=128,
        ),
        vision_feature_layer=layer,
        vision_feature_select_strategy=strategy,
        image_token_index=127,
        **extra,
    )
    torch.manual_seed(0)
    model = randomize(transformers.LlavaForConditionalGeneration(config)).eval()
    model.save_pretrained(path)
    return model


def load_tower(path: Path) -> VisionTower:
    with open_checkpoint(path) as checkpoint:
        tower = VisionTower(checkpoint.hf_config, TEXT_HIDDEN, dtype=torch.float32, device=torch.device("cpu"))
        names = checkpoint.names()
        table = tower.checkpoint_table(*checkpoint_layout(names))
        assert set(table) == {n for n in names if n.startswith(VISION_TENSOR_PREFIXES)}
        for name, param in table.items():
            param.weight_loader(param, checkpoint.source(name), None)
    return tower


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


def test_transformers4_and_module_name_layouts(tmp_path: Path) -> None:
    """`model.vision_tower.vision_model.<...>`: transformers' module prefix and the tower nested as
    transformers 4 (and the llava-hf hub files) name it; same features as the saved layout."""
    save_llava(tmp_path / "saved", "clip_penultimate")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(tmp_path / "saved" / "config.json", renamed / "config.json")
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    rename = {
        "vision_tower.": "model.vision_tower.vision_model.",
        "multi_modal_projector.": "model.multi_modal_projector.",
    }
    for old, new in rename.items():
        tensors = {(new + n[len(old) :] if n.startswith(old) else n): t for n, t in tensors.items()}
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_layout(tensors) == ("model.", True)
    pixel_values = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(load_tower(renamed)(pixel_values), load_tower(tmp_path / "saved")(pixel_values))


def test_parameters_are_replicated_and_frozen(tmp_path: Path) -> None:
    save_llava(tmp_path, "siglip_last_full")
    config = json.loads((tmp_path / "config.json").read_text())
    tower = VisionTower(config, TEXT_HIDDEN, dtype=torch.bfloat16, device=torch.device("cpu"))
    for p in tower.checkpoint_table().values():
        assert p.dtype == torch.bfloat16 and not p.requires_grad and p.tp_sharded is False
    assert tower(torch.zeros(1, 3, 32, 32)).dtype == torch.bfloat16


def test_wrong_image_size_is_refused() -> None:
    tower = VisionTower(
        {"vision_config": {"model_type": "clip_vision_model", **TOWER, "image_size": 32, "patch_size": 8}},
        TEXT_HIDDEN,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    with pytest.raises(CeleryTPError) as err:
        tower(torch.zeros(1, 3, 48, 48))
    assert err.value.kind == ErrorKind.BAD_REQUEST


@pytest.mark.parametrize(
    "config, key",
    [
        ({"vision_config": {"model_type": "pixtral"}}, "vision_config.model_type"),
        ({"vision_config": {"model_type": "clip_vision_model", "hidden_act": "swiglu"}}, "vision_config.hidden_act"),
        ({"projector_hidden_act": "mystery"}, "projector_hidden_act"),
        ({"vision_feature_select_strategy": "cls"}, "vision_feature_select_strategy"),
        ({"vision_feature_layer": 30}, "vision_feature_layer"),
    ],
)
def test_unsupported_config_is_refused(config: dict[str, Any], key: str) -> None:
    with pytest.raises(CeleryTPError) as err:
        VisionTower({"model_type": "llava", **config}, TEXT_HIDDEN, dtype=torch.float32, device=torch.device("meta"))
    assert err.value.kind == ErrorKind.UNSUPPORTED_ARCH
    assert key in str(err.value)
