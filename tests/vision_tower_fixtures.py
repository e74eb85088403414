"""Helpers for the vision tower tests (test_vision_tower, test_qwen_vision, test_qwen3_vision,
test_pixtral_vision): save a tiny random transformers model, load a tower from it as the model
loader does (open_checkpoint, checkpoint_table, each parameter's weight_loader), and the checks
every tower shares."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from model_fixtures import randomize
from safetensors.torch import load_file, save_file

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading import open_checkpoint

ATOL = 1e-5
CPU = torch.device("cpu")
META = torch.device("meta")
# A tiny text model's config keys the tests share; each adds hidden_size and its family's keys.
TINY_TEXT: dict[str, Any] = {
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 128,
}

Tower = TypeVar("Tower", bound=torch.nn.Module)


def save_random(model_cls: Any, config: Any, path: Path) -> Any:
    """A `model_cls(config)` with random weights (seed 0, norms too) saved to `path`; the model, in eval mode."""
    torch.manual_seed(0)
    model = randomize(model_cls(config)).eval()
    model.save_pretrained(path)
    return model


def load_checkpoint_tower(
    path: Path,
    build: Callable[[dict[str, Any]], Tower],
    table: Callable[[Tower, list[str]], dict[str, Any]],
    prefixes: tuple[str, ...],
) -> Tower:
    """build(config.json)'s tower with the checkpoint at `path` loaded through table(tower, names)
    and each parameter's weight_loader; the table must be exactly the tensors under `prefixes`."""
    with open_checkpoint(path) as checkpoint:
        tower = build(checkpoint.hf_config)
        names = checkpoint.names()
        params = table(tower, names)
        assert set(params) == {n for n in names if n.startswith(prefixes)}
        for name, param in params.items():
            param.weight_loader(param, checkpoint.source(name), None)
    return tower


def assert_table_is_saved(table: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], names: set[str]) -> None:
    """The table names exactly `names`, each parameter equal to its saved tensor."""
    assert set(table) == names
    for name, param in table.items():
        torch.testing.assert_close(param, tensors[name], rtol=0, atol=0)


def save_renamed(saved: Path, path: Path, rename: Callable[[str], str]) -> dict[str, torch.Tensor]:
    """The checkpoint at `saved` copied to `path` with each tensor named rename(name); its tensors."""
    path.mkdir(exist_ok=True)
    shutil.copy(saved / "config.json", path / "config.json")
    tensors = {rename(n): t for n, t in load_file(saved / "model.safetensors").items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return tensors


def assert_replicated_and_frozen(table: dict[str, torch.nn.Parameter], dtype: torch.dtype) -> None:
    for p in table.values():
        assert p.dtype == dtype and not p.requires_grad and p.tp_sharded is False


@contextmanager
def refused(kind: ErrorKind, key: str = "") -> Iterator[None]:
    """The block raises a CeleryTPError of `kind` whose message names `key`."""
    with pytest.raises(CeleryTPError) as err:
        yield
    assert err.value.kind == kind
    assert key in str(err.value)


def random_images(shapes: list[tuple[int, int]], seed: int = 2) -> list[Any]:
    """RGB PIL images of the given (height, width)s, random pixels."""
    from PIL import Image

    rng = torch.Generator().manual_seed(seed)
    return [
        Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=rng, dtype=torch.uint8).numpy()) for h, w in shapes
    ]


# Qwen2.5-VL's and Qwen3-VL's tiny towers: patch 4, 2 frames a patch, merge 2.
QWEN_PATCH, QWEN_TEMPORAL, QWEN_MERGE, QWEN_OUT_HIDDEN = 4, 2, 2, 64
QWEN_PATCH_DIM = 3 * QWEN_TEMPORAL * QWEN_PATCH * QWEN_PATCH
# Qwen2VLImageProcessorPil's arguments for those towers (each test adds its resize bounds)
QWEN_PROCESSOR: dict[str, Any] = {
    "patch_size": QWEN_PATCH,
    "temporal_patch_size": QWEN_TEMPORAL,
    "merge_size": QWEN_MERGE,
}
QWEN_VISION: dict[str, Any] = {
    "hidden_size": 32,
    "num_heads": 4,
    "intermediate_size": 64,
    "out_hidden_size": QWEN_OUT_HIDDEN,
    "patch_size": QWEN_PATCH,
    "temporal_patch_size": QWEN_TEMPORAL,
    "spatial_merge_size": QWEN_MERGE,
}
# vision_config changes both Qwen towers refuse, and the key their message names
QWEN_UNSUPPORTED: list[tuple[dict[str, Any], str]] = [
    ({"hidden_size": 30, "num_heads": 4}, "hidden_size"),
    ({"hidden_size": 24, "num_heads": 4}, "head_dim"),
    ({"hidden_act": "swiglu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "default"}}, "rope_type"),
]
# (pixel_values rows, image_grid_thw) both Qwen towers refuse
QWEN_BAD_INPUTS: list[tuple[int, list[tuple[int, ...]]]] = [
    (96, [(1, 8, 13)]),  # w not a multiple of spatial_merge_size
    (95, [(1, 8, 12)]),  # rows != t*h*w
    (96, [(1, 8, 12, 1)]),
]


def qwen_patches(grid: list[tuple[int, int, int]], seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values, grid_thw): random patch rows for `grid`, as Qwen2VLImageProcessor lays them out."""
    grid_thw = torch.tensor(grid)
    patches = int(grid_thw.prod(-1).sum())
    return torch.randn(patches, QWEN_PATCH_DIM, generator=torch.Generator().manual_seed(seed)), grid_thw
