"""A decoder whose checkpoint may be a vision-language one (transformers' ...ForConditionalGeneration):
where its text model's tensors lie, and its vision tower and projector (models/vision.py),
replicated on every rank.

transformers' save_pretrained (and the hub's files) store the text model as
`language_model.model.*` with `language_model.lm_head.weight`; its module names, which some files
use, are `model.language_model.*` and `lm_head.weight`. A model built with weight_prefix
`model.language_model.` reads whichever its checkpoint has.

The tower is built when the config has a `vision_config` (models/loader.py drops it for a gemma3
checkpoint that ships no image processor: that one is served as text, its tower's tensors skipped).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from celerytp.core.vision_inputs import vision_inputs
from celerytp.loading.checkpoint import Checkpoint
from celerytp.models.base import CausalLM, Progress
from celerytp.models.vision import VISION_TENSOR_PREFIXES, VisionTower, checkpoint_layout

SAVED_PREFIX, SAVED_LM_HEAD = "language_model.model.", "language_model.lm_head.weight"
log = logging.getLogger(__name__)


class VisionLanguageModel(CausalLM):
    """Mixed in before a CausalLM whose checkpoint may be multimodal; `build_vision` after its __init__."""

    _saved_layout = False  # set by load_weights when the checkpoint uses SAVED_PREFIX
    _names: list[str] = []  # the checkpoint's tensor names (where its tower's lie), set by load_weights
    tower_prefixes = VISION_TENSOR_PREFIXES  # where a checkpoint keeps the tower's tensors

    def build_vision(self) -> None:
        """The tower, where the config has one (a module attribute: set here, not on the class)."""
        self.vision_encoder: nn.Module | None = None
        if self.config.vision_config is not None:
            self.vision = vision_inputs(self.config.vision_config, self.config.image_processor)
            self.vision_encoder = self.make_tower()

    def make_tower(self) -> nn.Module:
        return VisionTower(self.config.vision_config, self.config.hidden_size, dtype=self.options.dtype,
                           device=self.options.device)

    def tower_table(self) -> dict[str, nn.Parameter]:
        """The tower's tensors as this checkpoint names them."""
        return self.vision_encoder.checkpoint_table(*checkpoint_layout(self._names))

    def checkpoint_table(self) -> dict[str, Any]:
        tower = {id(p) for p in self.vision_encoder.parameters()} if self.vision_encoder is not None else set()
        table = {name: entry for name, entry in super().checkpoint_table().items() if id(entry[0]) not in tower}
        if self._saved_layout:
            table = {_saved_name(name, self.config.weight_prefix): entry for name, entry in table.items()}
        if self.vision_encoder is not None:
            table.update({name: (p, None) for name, p in self.tower_table().items()})
        return table

    def is_ignorable(self, name: str) -> bool:
        if self.vision_encoder is None and name.startswith(self.tower_prefixes):
            return True  # a text-only load of a multimodal checkpoint
        return (name == SAVED_LM_HEAD and self.config.tie_word_embeddings) or super().is_ignorable(name)

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        names = checkpoint.names()
        self._saved_layout = self.config.weight_prefix != "model." and any(n.startswith(SAVED_PREFIX) for n in names)
        self._names = names
        skipped = sum(n.startswith(self.tower_prefixes) for n in names) if self.vision_encoder is None else 0
        if skipped:
            log.info("%s: text model only; skipping %d vision tower and projector tensors", checkpoint.path, skipped)
        return super().load_weights(checkpoint, progress)

    @property
    def processor_options(self) -> dict[str, Any]:
        """What the image processor is called with beside the images (as transformers' processor calls it)."""
        return {}

    @torch.inference_mode()
    def encode_images(self, processed: dict[str, torch.Tensor]) -> torch.Tensor:
        """The image processor's output (pixel_values (N, 3, H, W)) -> one row per image token,
        (N x tokens_per_image, hidden): every rank the same."""
        return self.vision_encoder(processed["pixel_values"].to(self.device)).flatten(0, 1)


def _saved_name(name: str, prefix: str) -> str:
    if name.startswith(prefix):
        return SAVED_PREFIX + name[len(prefix) :]
    return SAVED_LM_HEAD if name == "lm_head.weight" else name
