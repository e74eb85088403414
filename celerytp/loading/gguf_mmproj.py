"""A Gemma 3 language-model GGUF plus llama.cpp's mmproj GGUF (its SigLIP tower and projector) as
one checkpoint: the text file's tensors and config, the mmproj's tensors under the names
transformers' save_pretrained gives them (`vision_tower.*`, `multi_modal_projector.*`: models/vision.py
VisionTower.checkpoint_table), and the vision settings both files stand for
(core/gguf_vision.py).

convert_hf_to_gguf.py --mmproj (Gemma3VisionModel) names the tensors by gguf-py's
tensor_mapping.py for MODEL_ARCH.MMPROJ and rewrites, undone here:

- `multi_modal_projector.mm_input_projection_weight` is renamed `..._projection.weight` first
  (`name.replace("_weight", ".weight")`), then mapped to `mm.input_projection.weight`: stored as
  transformers holds it, (vision hidden, text hidden), not transposed (clip.cpp transposes it when
  it multiplies), and always in F16 (tensor_force_quant), whatever --outtype.
- `mm.soft_emb_norm.weight` + 1 (Gemma3RMSNorm scales by 1 + w, ggml's rms_norm by w): - 1 here.
  The SigLIP tower's LayerNorms are stored as they are.
- SigLIP's pooling head (`vision_model.head.*`) is not written (the gemma-3 checkpoints have none).
"""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.gguf_vision import gguf_vision
from celerytp.loading.checkpoint import Checkpoint, TensorSource
from celerytp.loading.gguf_file import open_gguf_reader
from celerytp.loading.gguf_gemma3 import SourceFactory
from celerytp.loading.gguf_hybrid import ShiftedNormSource
from celerytp.loading.gguf_source import GGUFSource

# mmproj tensor name stem -> transformers' saved name (MODEL_TENSOR.V_* in gguf-py constants.py)
GLOBAL = {
    "v.patch_embd": "vision_tower.embeddings.patch_embedding",
    "v.position_embd": "vision_tower.embeddings.position_embedding",
    "v.post_ln": "vision_tower.post_layernorm",
    "mm.soft_emb_norm": "multi_modal_projector.mm_soft_emb_norm",
}
BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_out": "self_attn.out_proj",
    "ln1": "layer_norm1",
    "ln2": "layer_norm2",
    "ffn_up": "mlp.fc1",
    "ffn_down": "mlp.fc2",
}
INPUT_PROJECTION = ("mm.input_projection.weight", "multi_modal_projector.mm_input_projection_weight")
SHIFTED = "mm.soft_emb_norm.weight"  # stored + 1
_BLOCK_RE = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")


def mmproj_name(gguf_name: str) -> str:
    """The transformers name of an mmproj tensor (unknown names pass through, for the loader to report)."""
    if gguf_name == INPUT_PROJECTION[0]:
        return INPUT_PROJECTION[1]
    if m := _BLOCK_RE.fullmatch(gguf_name):
        layer, stem, kind = m.groups()
        return f"vision_tower.encoder.layers.{layer}.{BLOCK[stem]}.{kind}" if stem in BLOCK else gguf_name
    stem, _, kind = gguf_name.rpartition(".")
    return f"{GLOBAL[stem]}.{kind}" if stem in GLOBAL else gguf_name


def mmproj_sources(tensors: dict[str, Any]) -> dict[str, SourceFactory]:
    """transformers name -> how to build its source, for every tensor of an mmproj file."""
    table: dict[str, SourceFactory] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name == SHIFTED:
            shape = tuple(int(d) for d in reversed(tensor.shape))
            table[mmproj_name(gguf_name)] = lambda name, log, t=tensor, s=shape: ShiftedNormSource(
                name, s, log, GGUFSource(t, name, []))
        else:
            table[mmproj_name(gguf_name)] = lambda name, log, t=tensor: GGUFSource(t, name, log)
    return table


class MmprojCheckpoint(Checkpoint):
    """A gemma3 language-model GGUF checkpoint (`text`) with the vision tower of the mmproj at `mmproj`.

    Args:
        text: the opened language model (closed with this checkpoint).
        mmproj: llama.cpp's mmproj file for it.
    """

    def __init__(self, text: Checkpoint, mmproj: Path) -> None:
        # the metadata first: an mmproj of another projector, or for another model, is refused before any map
        self.vision_config, self.image_processor = gguf_vision(text.path, mmproj)
        self._text = text
        self._reader = open_gguf_reader(mmproj)
        self._tower = mmproj_sources({t.name: t for t in self._reader.tensors})
        super().__init__(text.path, text.hf_config, text.reads)  # one log of every slice read

    def with_vision(self, config: Any) -> Any:
        """The language model's config with the tower's settings (what a multimodal config.json
        and its preprocessor_config.json give): models/vision_language.py builds the tower from it."""
        image = self.vision_config["image_token_index"]
        if image >= config.vocab_size:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{self.path}: the image token id {image} lies outside the "
                                                       f"language model's vocabulary of {config.vocab_size}")
        return replace(config, vision_config=self.vision_config, image_processor=self.image_processor)

    def names(self) -> list[str]:
        return [*self._text.names(), *self._tower]

    def source(self, name: str) -> TensorSource:
        if name in self._tower:
            return self._tower[name](name, self.reads)
        return self._text.source(name)

    def close(self) -> None:
        self._text.close()
        self._tower.clear()
        self._reader = None  # drop the memory map


def open_with_mmproj(path: str | os.PathLike[str], mmproj: str | os.PathLike[str]) -> MmprojCheckpoint:
    """open_checkpoint(path) with the mmproj's tower: a gemma3 .gguf file, else UNSUPPORTED_ARCH."""
    from celerytp.loading import open_checkpoint  # the package imports this module's siblings

    text = open_checkpoint(path)
    try:
        return MmprojCheckpoint(text, Path(mmproj))
    except BaseException:
        text.close()
        raise
