"""A language-model GGUF plus llama.cpp's mmproj GGUF (its vision tower and projector) as one
checkpoint: the text file's tensors and config, the mmproj's tensors under the names transformers'
save_pretrained gives them, and the vision settings both files stand for (core/gguf_vision.py).
Gemma 3's SigLIP tower (`vision_tower.*`, `multi_modal_projector.*`: models/vision.py
VisionTower.checkpoint_table) is read here; Qwen2.5-VL's (`visual.*`) by gguf_qwen_mmproj.py, its
config being the qwen2_5_vl config.json with the qwen2vl GGUF's as text_config.

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
from celerytp.loading.gguf_qwen_mmproj import qwen_mmproj_sources
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
IMAGE_TOKEN_KEYS = {"gemma3": "image_token_index", "qwen2_5_vl": "image_token_id"}  # by config model_type
# image_processor_type -> transformers' class for it (the PIL backend: no torchvision)
PROCESSOR_CLASSES = {"Gemma3ImageProcessor": "Gemma3ImageProcessorPil", "Qwen2VLImageProcessor": "Qwen2VLImageProcessorPil"}
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


def qwen2_5_vl_hf_config(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """The qwen2_5_vl config.json a qwen2vl GGUF (`text`: its qwen2 config) and its mmproj
    (`vision`: gguf_vision's keys) stand for: the text config as text_config, its rotary sections merged in."""
    rope = {**text["rope_parameters"], **vision["text_config"]["rope_parameters"]}
    return {**vision, "text_config": {**text, "rope_parameters": rope}, "tie_word_embeddings": text["tie_word_embeddings"]}


class MmprojCheckpoint(Checkpoint):
    """A language-model GGUF checkpoint (`text`) with the vision tower of the mmproj at `mmproj`:
    gemma3 (its config the text model's, the tower's settings added by with_vision) or qwen2vl
    (its config the qwen2_5_vl config.json, qwen2_5_vl_hf_config).

    Args:
        text: the opened language model (closed with this checkpoint).
        mmproj: llama.cpp's mmproj file for it.
    """

    def __init__(self, text: Checkpoint, mmproj: Path) -> None:
        # the metadata first: an mmproj of another projector, or for another model, is refused before any map
        self.vision_config, self.image_processor = gguf_vision(text.path, mmproj)
        self._text = text
        self._reader = open_gguf_reader(mmproj)
        tensors = {t.name: t for t in self._reader.tensors}
        self._qwen = self.vision_config["model_type"] == "qwen2_5_vl"
        self._tower = qwen_mmproj_sources(tensors) if self._qwen else mmproj_sources(tensors)
        hf_config = qwen2_5_vl_hf_config(text.hf_config, self.vision_config) if self._qwen else text.hf_config
        super().__init__(text.path, hf_config, text.reads)  # one log of every slice read

    def with_vision(self, config: Any) -> Any:
        """The config with the tower's settings (what a multimodal config.json and its
        preprocessor_config.json give): models/vision_language.py builds the tower from it."""
        image = self.vision_config[IMAGE_TOKEN_KEYS[self.vision_config["model_type"]]]
        if image >= config.vocab_size:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{self.path}: the image token id {image} lies outside the "
                                                       f"language model's vocabulary of {config.vocab_size}")
        if self._qwen:  # its config is already the multimodal one
            return replace(config, image_processor=self.image_processor)
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


def mmproj_image_processor(settings: dict[str, Any]) -> Any:
    """transformers' image processor (PIL backend) for the settings core/gguf_vision.py read from an
    mmproj (`config.image_processor` of a model loaded with one)."""
    import transformers  # only vision-language models pay its import

    cls = getattr(transformers, PROCESSOR_CLASSES[settings["image_processor_type"]])
    return cls(**{k: v for k, v in settings.items() if k != "image_processor_type"})


def open_with_mmproj(path: str | os.PathLike[str], mmproj: str | os.PathLike[str]) -> MmprojCheckpoint:
    """open_checkpoint(path) with the mmproj's tower: a gemma3 or qwen2vl .gguf file, else UNSUPPORTED_ARCH."""
    from celerytp.loading import open_checkpoint  # the package imports this module's siblings

    text = open_checkpoint(path)
    try:
        return MmprojCheckpoint(text, Path(mmproj))
    except BaseException:
        text.close()
        raise
