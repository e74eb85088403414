"""A Gemma 3 and a Qwen2.5-VL language-model GGUF with llama.cpp's mmproj GGUF (the vision tower and
projector, as convert_hf_to_gguf.py --mmproj writes them) against the Hugging Face directory both
were converted from, and against transformers: the leader's prompt ids, the image processor's
pixels, the image features and the logits of a chat with images (Qwen2.5-VL's with multimodal
rotary positions). Then what is refused: another projector, a language model of another
architecture, an mmproj outside the model roots."""

from __future__ import annotations

import io
import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from model_fixtures import LOGITS_ATOL
from safetensors.torch import load_file, save_file
from test_arch_gemma3 import write_gemma3_gguf
from vision_fixtures import (
    picture,
    reference_inputs,
    reference_model,
    user_turn,
    write_tiny_gemma3,
    write_tiny_qwen2_5_vl,
)

from celerytp.cli import build_parser
from celerytp.client.generation import tokenized
from celerytp.core.errors import CeleryTPError
from celerytp.core.gguf_metadata import read_gguf_metadata
from celerytp.core.model_files import default_model_path
from celerytp.core.protocol import LoadRequest
from celerytp.core.registry import LOAD_FIELDS, model_record
from celerytp.core.vision_inputs import checkpoint_vision, mrope_positions, runs, whole_images
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.image_features import ImageFeatures, image_features
from celerytp.worker.model_ops import confine

TURNS = {
    "one": [user_turn("What is in it?", picture(1))],
    "two": [user_turn("Compare them.", picture(1), picture(2, (64, 30), "JPEG"))],
}
# CLIP's normalization: not Gemma 3's 0.5, so the mmproj's image_mean/std are seen to be read
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def write_gemma3_mmproj(model: Any, path: Path, processor: dict[str, Any], projector: str = "gemma3") -> Path:
    """`model` (Gemma3ForConditionalGeneration) as convert_hf_to_gguf.py --mmproj --outtype f32 writes
    it: MmprojModel's and Gemma3VisionModel's set_gguf_parameters keys (image_mean/std from
    `processor`, the preprocessor_config.json), the tower and projector from the hub's saved names
    (`vision_tower.vision_model.*`) through gguf-py's MMPROJ name map, `_weight` renamed `.weight`
    first, mm_soft_emb_norm + 1, mm.input_projection in F16 (forced whatever --outtype), the rest
    F32. The converter derives the pooling from the processor's image_seq_length, which a
    Gemma3Processor saved for this model holds as mm_tokens_per_image."""
    cfg, vision = model.config, model.config.vision_config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(cfg.text_config.hidden_size)
    w.add_vision_image_size(vision.image_size)
    w.add_vision_patch_size(vision.patch_size)
    w.add_vision_embedding_length(vision.hidden_size)
    w.add_vision_feed_forward_length(vision.intermediate_size)
    w.add_vision_block_count(vision.num_hidden_layers)
    w.add_vision_head_count(vision.num_attention_heads)
    w.add_vision_image_mean(processor["image_mean"])
    w.add_vision_image_std(processor["image_std"])
    w.add_clip_projector_type(projector)
    w.add_vision_attention_layernorm_eps(vision.layer_norm_eps)
    w.add_vision_use_gelu(True)
    scale = (vision.image_size // vision.patch_size) // math.isqrt(cfg.mm_tokens_per_image)
    if scale > 0 and scale != 4:
        w.add_vision_projector_scale_factor(scale)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            continue
        name = name.removeprefix("model.").replace("vision_tower.", "vision_tower.vision_model.")
        name = name.replace("_weight", ".weight")
        data = tensor.detach().float().numpy()
        if "soft_emb_norm.weight" in name:
            data = data + 1.0
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        dtype = np.float16 if "input_projection" in name else np.float32
        w.add_tensor(gname, np.ascontiguousarray(data, dtype=dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_text_gguf(model: Any, path: Path, directory: Path) -> Path:
    """The language model of `model` as convert_hf_to_gguf.py writes it (test_arch_gemma3.py's
    write_gemma3_gguf) with the vocabulary of `directory` (with_vocabulary)."""
    from transformers import Gemma3ForCausalLM

    text = Gemma3ForCausalLM(model.config.text_config).eval()
    text.model.load_state_dict(model.model.language_model.state_dict())
    return with_vocabulary(directory, lambda: write_gemma3_gguf(text, path))


def with_vocabulary(directory: Path, write: Callable[[], Path]) -> Path:
    """write(), each GGUFWriter it opens adding the vocabulary convert_hf_to_gguf.py's set_vocab adds
    from `directory`'s tokenizer: SmolLM2's as llama.cpp's converter wrote it (the default GGUF,
    whose tokenizer the directory's is), the directory's added tokens as control tokens, and its
    chat template."""
    smollm = read_gguf_metadata(default_model_path())
    added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    extra = [t["content"] for t in added if t["id"] >= len(smollm["tokenizer.ggml.tokens"])]
    template = json.loads((directory / "tokenizer_config.json").read_text())["chat_template"]

    class WithVocabulary(gguf.GGUFWriter):
        def write_header_to_file(self, *args: Any, **kwargs: Any) -> None:
            self.add_tokenizer_model("gpt2")
            self.add_tokenizer_pre(smollm["tokenizer.ggml.pre"])
            self.add_token_list([*smollm["tokenizer.ggml.tokens"], *extra])
            self.add_token_types([*smollm["tokenizer.ggml.token_type"], *[gguf.TokenType.CONTROL] * len(extra)])
            self.add_token_merges(smollm["tokenizer.ggml.merges"])
            self.add_bos_token_id(smollm["tokenizer.ggml.bos_token_id"])
            self.add_eos_token_id(smollm["tokenizer.ggml.eos_token_id"])
            self.add_chat_template(template)
            super().write_header_to_file(*args, **kwargs)

    writer, gguf.GGUFWriter = gguf.GGUFWriter, WithVocabulary
    try:
        return write()
    finally:
        gguf.GGUFWriter = writer


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Gemma 3 directory, its text GGUF and its mmproj. The directory as the GGUF files can
    hold it: its input projection rounded to float16 (the mmproj's type); as llama.cpp reads a
    gemma3 GGUF, both layers sliding (it makes every 6th layer global: of 2, none) and the softmax
    scaled by head_dim ** -0.5 (query_pre_attn_scalar is not written); and CLIP's normalization,
    not Gemma's, for the mmproj's image_mean/std to matter."""
    from transformers import Gemma3ForConditionalGeneration

    root = tmp_path_factory.mktemp("mmproj")
    hf = write_tiny_gemma3(root / "hf")
    config = json.loads((hf / "config.json").read_text())
    text = config["text_config"]
    text.update(layer_types=["sliding_attention"] * text["num_hidden_layers"], query_pre_attn_scalar=text["head_dim"])
    (hf / "config.json").write_text(json.dumps(config))
    weights = load_file(hf / "model.safetensors")
    name = next(n for n in weights if n.endswith("mm_input_projection_weight"))
    weights[name] = weights[name].half().float()
    save_file(weights, hf / "model.safetensors", metadata={"format": "pt"})
    processor = json.loads((hf / "preprocessor_config.json").read_text())
    processor.update(image_mean=CLIP_MEAN, image_std=CLIP_STD)
    (hf / "preprocessor_config.json").write_text(json.dumps(processor))
    model = Gemma3ForConditionalGeneration.from_pretrained(hf).eval()
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    return {
        "hf": hf,
        "text": write_text_gguf(model, gguf_dir / "tiny-gemma3-f32.gguf", hf),
        "mmproj": write_gemma3_mmproj(model, gguf_dir / "mmproj-tiny-gemma3-f32.gguf", processor),
        "idefics3": write_gemma3_mmproj(model, root / "mmproj-idefics3.gguf", processor, projector="idefics3"),
    }


def ours(path: Path, messages: list[dict], mmproj: Path | None = None) -> tuple[list[int], list[bytes]]:
    """The leader's prompt ids and images (client/generation.py), for the model's load record."""
    record = {"path": str(path), "max_context": 512, "load": {"mmproj": None if mmproj is None else str(mmproj)}}
    _, ids, images = tokenized(record, None, messages)
    return ids, images


def test_the_converter_layout_is_as_expected(files: dict[str, Path]) -> None:
    """The writer's file is what the loader's tables read: llama.cpp's names, F16 projection, +1 norm."""
    reader = gguf.GGUFReader(files["mmproj"])
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["general.architecture"].contents() == "clip"
    assert reader.fields["clip.projector_type"].contents() == "gemma3"
    assert reader.fields["clip.vision.projector.scale_factor"].contents() == 2  # 4x4 patches pooled to 2x2
    assert {"v.patch_embd.weight", "v.position_embd.weight", "v.blk.1.attn_out.bias", "v.blk.0.ln2.weight",
            "v.post_ln.bias", "mm.input_projection.weight", "mm.soft_emb_norm.weight"} <= set(tensors)
    projection = tensors["mm.input_projection.weight"]
    assert projection.tensor_type == gguf.GGMLQuantizationType.F16
    assert tuple(int(d) for d in reversed(projection.shape)) == (32, 64)  # (vision hidden, text hidden): no transpose


def test_leader_sees_the_images_the_directory_takes(files: dict[str, Path]) -> None:
    """checkpoint_vision from the two GGUF headers equals the directory's config.json; the GGUF's
    tokenizer and chat template give the directory's prompt ids, images expanded alike."""
    assert checkpoint_vision(str(files["text"])) is None  # without its mmproj: a text model
    assert checkpoint_vision(str(files["text"]), str(files["mmproj"])) == checkpoint_vision(str(files["hf"]))
    for name, messages in TURNS.items():
        assert ours(files["text"], messages, files["mmproj"]) == ours(files["hf"], messages), name


def test_image_processor_from_the_mmproj_matches_the_directorys(files: dict[str, Path]) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    model = load_model(files["text"], TPContext(0, 1), mmproj=files["mmproj"], max_batch=1, max_context=64)
    ours = image_features(files["text"], model, files["mmproj"]).processor
    theirs = AutoImageProcessor.from_pretrained(str(files["hf"]))
    images = [Image.open(io.BytesIO(picture(s, size))) for s, size in ((3, (40, 52)), (4, (90, 17)))]
    mine, expected = (p(images=images, return_tensors="pt")["pixel_values"] for p in (ours, theirs))
    assert mine.shape == (2, 3, 32, 32)
    torch.testing.assert_close(mine, expected, atol=0, rtol=0)


@pytest.mark.parametrize("piece", [None, 5])
def test_features_and_logits_match_the_directory_and_transformers(files: dict[str, Path], piece: int | None) -> None:
    """In one forward and in prefill pieces (none splitting an image): the GGUF pair's image
    features equal the directory's (atol 1e-5), its logits the directory's and transformers' (1e-4)."""
    kwargs = {"max_batch": 2, "max_context": 256}
    gguf_model = load_model(files["text"], TPContext(0, 1), mmproj=files["mmproj"], **kwargs)
    hf_model = load_model(files["hf"], TPContext(0, 1), **kwargs)
    assert gguf_model.vision == hf_model.vision and gguf_model.vision.tokens_per_image == 4
    gguf_features, hf_features = ImageFeatures(files["text"], gguf_model, files["mmproj"]), ImageFeatures(files["hf"], hf_model)
    transformers_model = reference_model(files["hf"])
    for name, messages in TURNS.items():
        ids, images = ours(files["text"], messages, files["mmproj"])
        rows, _ = gguf_features(images)
        torch.testing.assert_close(rows, hf_features(images)[0], atol=1e-5, rtol=0, msg=name)
        expected = transformers_model(**reference_inputs(files["hf"], messages)).logits[0].detach()
        for model in (gguf_model, hf_model):
            logits = forward_with_images(model, ids, rows, piece)
            torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL, rtol=0, msg=name)
        torch.testing.assert_close(forward_with_images(gguf_model, ids, rows, piece),
                                   forward_with_images(hf_model, ids, rows, piece), atol=1e-4, rtol=0, msg=name)


def forward_with_images(model: Any, ids: list[int], rows: torch.Tensor, piece: int | None,
                        grids: list[tuple[int, int, int]] | None = None) -> torch.Tensor:
    """The prompt's logits in prefill pieces of `piece` tokens (None: one), image rows in their
    tokens' places, multimodal rotary positions from the images' `grids` where the model takes
    them (as tests/test_vision_models.py runs it)."""
    at = [i for i, t in enumerate(ids) if t == model.vision.image_token_id]
    images_at = runs(at) if model.vision.bidirectional else []
    rope = mrope_positions(ids, model.vision.image_token_id, grids, model.vision.grid.merge)[0] if model.mrope else None
    logits, start = [], 0
    model.clear_cache(0)
    while start < len(ids):
        end = whole_images(len(ids) if piece is None else min(start + piece, len(ids)), images_at, start)
        mine = [(i - start, k) for k, i in enumerate(at) if start <= i < end]
        embeds = ([i for i, _ in mine], rows[[k for _, k in mine]]) if mine else None
        logits.append(model.forward_tokens(torch.tensor(ids[start:end]), start, row=0, embeds=embeds,
                                           rope=rope and [stream[start:end] for stream in rope]))
        start = end
    return torch.cat(logits)


def test_an_mmproj_of_another_projector_is_unsupported_naming_it(files: dict[str, Path]) -> None:
    for call in (lambda: load_model(files["text"], TPContext(0, 1), mmproj=files["idefics3"]),
                 lambda: checkpoint_vision(str(files["text"]), str(files["idefics3"]))):
        with pytest.raises(CeleryTPError) as info:
            call()
        assert info.value.kind == "unsupported_arch" and "'idefics3'" in str(info.value), info.value


def test_an_mmproj_with_another_language_model_is_refused(files: dict[str, Path]) -> None:
    """SmolLM2's llama GGUF, the Hugging Face directory, a file that is no mmproj: each named."""
    cases = {default_model_path(): "not 'llama'", files["hf"]: "GGUF language model file"}
    for path, message in cases.items():
        with pytest.raises(CeleryTPError) as info:
            load_model(path, TPContext(0, 1), mmproj=files["mmproj"])
        assert info.value.kind == "unsupported_arch" and message in str(info.value), info.value
    with pytest.raises(CeleryTPError) as info:
        load_model(files["text"], TPContext(0, 1), mmproj=files["text"])  # the language model as its own mmproj
    assert info.value.kind == "unsupported_arch" and "'gemma3'" in str(info.value) and "'clip'" in str(info.value)


def test_an_mmproj_outside_the_model_roots_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    roots = (str(files["text"].parent),)
    assert confine(str(files["mmproj"]), roots, "mmproj") == files["mmproj"].resolve()
    outside = tmp_path / "mmproj.gguf"
    shutil.copy(files["mmproj"], outside)
    link = files["text"].parent / "linked-mmproj.gguf"
    link.symlink_to(outside)
    try:
        for path in (outside, link):
            with pytest.raises(CeleryTPError) as info:
                confine(str(path), roots, "mmproj")
            assert info.value.kind == "bad_request" and "field 'mmproj'" in str(info.value), info.value
    finally:
        link.unlink()


def test_the_load_request_record_and_command_line_carry_the_mmproj(files: dict[str, Path]) -> None:
    """The wire's LoadRequest, the model record a healer reloads from, and `--mmproj` on the CLI."""
    request = LoadRequest(seq=1, model_id="tiny", path=str(files["text"]), mmproj=str(files["mmproj"]))
    record = model_record(request.model_dump(include=set(LOAD_FIELDS)), dtype="float32", model_type="gemma3_text",
                          vocab_size=1, max_context=1, max_batch=1)
    assert record["load"]["mmproj"] == str(files["mmproj"])
    assert LoadRequest(seq=1, model_id="tiny", path="x").mmproj is None
    parser = build_parser()
    for argv in (["generate", "m.gguf", "--prompt", "hi", "--mmproj", "p.gguf"],
                 ["models", "load", "m.gguf", "--mmproj", "p.gguf", "--broker", "redis://localhost:6379/0"]):
        assert parser.parse_args(argv).mmproj == "p.gguf"


# ---- Qwen2.5-VL: a qwen2vl language model GGUF and its qwen2.5vl_merger mmproj ---------------------

QWEN_TURNS = {
    "one": [user_turn("What is in it?", picture(1))],
    # the 130x90 image is 16 x 11 merge units: two of clip.cpp's 112-pixel windows side by side
    "windows": [user_turn("Compare them.", picture(2, (64, 30), "JPEG"), picture(3, (130, 90)))],
}


def write_qwen2vl_gguf(weights: dict[str, torch.Tensor], config: dict[str, Any], path: Path) -> Path:
    """The language model of a Qwen2.5-VL checkpoint (`weights` as saved, `config` its config.json) as
    convert_hf_to_gguf.py --outtype f32 writes it (Qwen2VLModel, a TextModel): TextModel's keys with
    the M-RoPE sections padded to 4 as `rope.dimension_sections`, gguf-py's qwen2vl tensor names for
    the saved `model.*` / `lm_head` tensors (no Q/K permutation), the `visual.*` ones left out."""
    text, rope = config["text_config"], config["text_config"]["rope_parameters"]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2VL])
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_block_count(text["num_hidden_layers"])
    w.add_context_length(text["max_position_embeddings"])
    w.add_embedding_length(text["hidden_size"])
    w.add_feed_forward_length(text["intermediate_size"])
    w.add_head_count(text["num_attention_heads"])
    w.add_head_count_kv(text["num_key_value_heads"])
    w.add_rope_dimension_sections([*rope["mrope_section"], *[0] * (4 - len(rope["mrope_section"]))])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(text["rms_norm_eps"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, text["num_hidden_layers"])
    for name, tensor in weights.items():
        if name.startswith("visual."):
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, np.ascontiguousarray(tensor.float().numpy(), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_qwen_mmproj(weights: dict[str, torch.Tensor], config: dict[str, Any], processor: dict[str, Any],
                      path: Path, projector: str = "qwen2.5vl_merger") -> Path:
    """The vision tower of a Qwen2.5-VL checkpoint as convert_hf_to_gguf.py --mmproj --outtype f32
    writes it (Qwen2VLVisionModel): MmprojModel's keys (image_size 560: Qwen's vision_config has
    none; image_mean/std from `processor`), the projector type, use_silu, n_wa_pattern from
    fullatt_block_indexes, the top-level rms_norm_eps (absent: 1e-6); the Conv3d patch embedding
    split into its two temporal slices, each qkv into q, k and v, the rest through gguf-py's MMPROJ
    name map, all F32."""
    vision = config["vision_config"]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(config["text_config"]["hidden_size"])
    w.add_vision_image_size(vision.get("image_size", 560))
    w.add_vision_patch_size(vision["patch_size"])
    w.add_vision_embedding_length(vision["hidden_size"])
    w.add_vision_feed_forward_length(vision["intermediate_size"])
    w.add_vision_block_count(vision["depth"])
    w.add_vision_head_count(vision["num_heads"])
    w.add_vision_image_mean(processor["image_mean"])
    w.add_vision_image_std(processor["image_std"])
    w.add_clip_projector_type(projector)
    w.add_vision_use_silu(True)
    w.add_vision_n_wa_pattern(vision["fullatt_block_indexes"][0] + 1)
    w.add_vision_attention_layernorm_eps(config.get("rms_norm_eps", 1e-6))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["depth"])

    def add(name: str, data: torch.Tensor) -> None:
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, np.ascontiguousarray(data.float().numpy(), dtype=np.float32))

    for name, tensor in weights.items():
        if not name.startswith("visual."):
            continue
        if ".qkv." in name:
            for part, rows in zip("qkv", tensor.chunk(3)):
                add(name.replace("qkv", part), rows)
        elif "patch_embed.proj.weight" in name:
            w.add_tensor("v.patch_embd.weight", np.ascontiguousarray(tensor[:, :, 0].float().numpy()))
            w.add_tensor("v.patch_embd.weight.1", np.ascontiguousarray(tensor[:, :, 1].float().numpy()))
        else:
            add(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def qwen_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Qwen2.5-VL directory, its text GGUF and its mmproj. The directory as the GGUF pair
    can hold it, where the converter writes no key and clip.cpp's value applies: windows of 112
    pixels (window_size; the fixture's 16), and the image processor's bounds of 8 to 4096 merged
    tokens per image, (4 * 2) ** 2 pixels each (the fixture's 256 to 4096 pixels)."""
    root = tmp_path_factory.mktemp("qwen_mmproj")
    hf = write_tiny_qwen2_5_vl(root / "hf")
    config = json.loads((hf / "config.json").read_text())
    config["vision_config"]["window_size"] = 112  # clip.cpp's attn_window_size
    (hf / "config.json").write_text(json.dumps(config))
    processor = json.loads((hf / "preprocessor_config.json").read_text())
    processor["size"] = {"shortest_edge": 8 * 8**2, "longest_edge": 4096 * 8**2}
    (hf / "preprocessor_config.json").write_text(json.dumps(processor))
    weights = load_file(hf / "model.safetensors")  # what the converter reads: the saved names
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    return {
        "hf": hf,
        "text": with_vocabulary(hf, lambda: write_qwen2vl_gguf(weights, config, gguf_dir / "tiny-qwen2.5-vl-f32.gguf")),
        "mmproj": write_qwen_mmproj(weights, config, processor, gguf_dir / "mmproj-tiny-qwen2.5-vl-f32.gguf"),
        "qwen2vl": write_qwen_mmproj(weights, config, processor, root / "mmproj-qwen2vl.gguf", "qwen2vl_merger"),
    }


def test_qwen_converter_layout_is_as_expected(qwen_files: dict[str, Path]) -> None:
    """The writer's files are what the loader's tables read: llama.cpp's names, the Conv3d in two
    temporal slices, qkv in three, the window pattern; qwen2vl's M-RoPE sections padded to four."""
    reader = gguf.GGUFReader(qwen_files["mmproj"])
    tensors = {t.name: t for t in reader.tensors}
    assert reader.fields["clip.projector_type"].contents() == "qwen2.5vl_merger"
    assert reader.fields["clip.vision.n_wa_pattern"].contents() == 2  # fullatt_block_indexes [1, 3]
    assert "clip.vision.window_size" not in reader.fields and "clip.vision.image_min_pixels" not in reader.fields
    assert {"v.patch_embd.weight", "v.patch_embd.weight.1", "v.blk.3.attn_q.bias", "v.blk.0.attn_v.weight",
            "v.blk.0.attn_out.weight", "v.blk.2.ffn_gate.bias", "v.blk.1.ln2.weight", "v.post_ln.weight",
            "mm.0.weight", "mm.2.bias"} <= set(tensors)
    assert not any(".attn_qkv." in n for n in tensors)
    assert tuple(int(d) for d in reversed(tensors["v.patch_embd.weight.1"].shape)) == (32, 3, 4, 4)
    text = gguf.GGUFReader(qwen_files["text"])
    assert text.fields["general.architecture"].contents() == "qwen2vl"
    assert text.fields["qwen2vl.rope.dimension_sections"].contents() == [2, 3, 3, 0]
    assert {"blk.0.attn_q.bias", "output.weight", "token_embd.weight"} <= {t.name for t in text.tensors}


def test_qwen_leader_sees_the_images_the_directory_takes(qwen_files: dict[str, Path]) -> None:
    """checkpoint_vision from the two GGUF headers equals the directory's (token id and ImageGrid:
    patch 4, merge 2, 512 to 262144 pixels); the GGUF's tokenizer and chat template give the
    directory's prompt ids, each image expanded to its merged patches."""
    assert checkpoint_vision(str(qwen_files["text"])) is None  # without its mmproj: a text model
    vision = checkpoint_vision(str(qwen_files["text"]), str(qwen_files["mmproj"]))
    assert vision == checkpoint_vision(str(qwen_files["hf"]))
    assert (vision.grid.patch, vision.grid.merge, vision.grid.min_pixels, vision.grid.max_pixels) == (4, 2, 512, 262144)
    for name, messages in QWEN_TURNS.items():
        ids, images = ours(qwen_files["text"], messages, qwen_files["mmproj"])
        assert (ids, images) == ours(qwen_files["hf"], messages), name
        assert ids == reference_inputs(qwen_files["hf"], messages)["input_ids"][0].tolist(), name


@pytest.mark.parametrize("piece", [None, 7])
def test_qwen_features_and_logits_match_the_directory_and_transformers(qwen_files: dict[str, Path],
                                                                       piece: int | None) -> None:
    """The GGUF pair's image processor (Qwen2VLImageProcessor from the mmproj's settings) gives the
    directory's pixels and grids, its tower the directory's features (atol 1e-5), and its logits
    with multimodal rotary positions the directory's (1e-4) and transformers' (LOGITS_ATOL)."""
    from PIL import Image

    from celerytp.loading.gguf_mmproj import mmproj_image_processor

    kwargs = {"max_batch": 2, "max_context": 512}
    gguf_model = load_model(qwen_files["text"], TPContext(0, 1), mmproj=qwen_files["mmproj"], **kwargs)
    hf_model = load_model(qwen_files["hf"], TPContext(0, 1), **kwargs)
    assert gguf_model.config.model_type == "qwen2_5_vl" and gguf_model.mrope
    assert gguf_model.config.mrope_section == hf_model.config.mrope_section == (2, 3, 3)
    assert gguf_model.vision == hf_model.vision
    # exactly the directory's tower: an image fills both temporal slices alike, so only this sees their order
    theirs = dict(hf_model.vision_encoder.named_parameters())
    for name, param in gguf_model.vision_encoder.named_parameters():
        torch.testing.assert_close(param, theirs[name], atol=0, rtol=0, msg=name)
    processor = mmproj_image_processor(gguf_model.config.image_processor)
    hf_features = ImageFeatures(qwen_files["hf"], hf_model)
    transformers_model = reference_model(qwen_files["hf"])
    for name, messages in QWEN_TURNS.items():
        ids, images = ours(qwen_files["text"], messages, qwen_files["mmproj"])
        pixels = processor(images=[Image.open(io.BytesIO(i)) for i in images], return_tensors="pt")
        expected_pixels = hf_features.processor(images=[Image.open(io.BytesIO(i)) for i in images], return_tensors="pt")
        torch.testing.assert_close(pixels["pixel_values"], expected_pixels["pixel_values"], atol=0, rtol=0, msg=name)
        grids = [tuple(g) for g in pixels["image_grid_thw"].tolist()]
        rows = gguf_model.encode_images(pixels)
        expected_rows, expected_grids = hf_features(images)
        assert grids == expected_grids, name
        torch.testing.assert_close(rows, expected_rows, atol=1e-5, rtol=0, msg=name)
        ours_logits = forward_with_images(gguf_model, ids, rows, piece, grids)
        torch.testing.assert_close(ours_logits, forward_with_images(hf_model, ids, expected_rows, piece, grids),
                                   atol=1e-4, rtol=0, msg=name)
        with torch.no_grad():
            expected = transformers_model(**reference_inputs(qwen_files["hf"], messages)).logits[0]
        torch.testing.assert_close(ours_logits, expected, atol=LOGITS_ATOL, rtol=0, msg=name)


def test_qwen_text_gguf_alone_is_served_as_qwen2(qwen_files: dict[str, Path]) -> None:
    """Without its mmproj the qwen2vl file is a qwen2 text model (its three position streams equal:
    M-RoPE is plain RoPE), with the directory's text logits."""
    ids = ours(qwen_files["hf"], [{"role": "user", "content": "Hello there, how are you?"}])[0]
    text = load_model(qwen_files["text"], TPContext(0, 1), max_context=64)
    hf_model = load_model(qwen_files["hf"], TPContext(0, 1), max_context=64)
    assert text.config.model_type == "qwen2" and text.vision is None
    torch.testing.assert_close(text.forward_tokens(torch.tensor(ids), 0, row=0),
                               hf_model.forward_tokens(torch.tensor(ids), 0, row=0), atol=1e-4, rtol=0)


def test_qwen2vl_merger_mmproj_is_unsupported_naming_it(qwen_files: dict[str, Path]) -> None:
    """Qwen2-VL's projector (LayerNorm blocks, no windows) is not Qwen2.5-VL's: refused, named."""
    for call in (lambda: load_model(qwen_files["text"], TPContext(0, 1), mmproj=qwen_files["qwen2vl"]),
                 lambda: checkpoint_vision(str(qwen_files["text"]), str(qwen_files["qwen2vl"]))):
        with pytest.raises(CeleryTPError) as info:
            call()
        assert info.value.kind == "unsupported_arch" and "'qwen2vl_merger'" in str(info.value), info.value


def test_qwen_mmproj_with_a_gemma3_language_model_is_refused(qwen_files: dict[str, Path],
                                                           files: dict[str, Path]) -> None:
    for text, mmproj, message in ((files["text"], qwen_files["mmproj"], "qwen2vl language model, not 'gemma3'"),
                                  (qwen_files["text"], files["mmproj"], "gemma3 language model, not 'qwen2vl'")):
        with pytest.raises(CeleryTPError) as info:
            load_model(text, TPContext(0, 1), mmproj=mmproj)
        assert info.value.kind == "unsupported_arch" and message in str(info.value), info.value


def test_qwen_rank_image_features_use_the_mmprojs_processor(qwen_files: dict[str, Path]) -> None:
    from transformers import Qwen2VLImageProcessorPil

    model = load_model(qwen_files["text"], TPContext(0, 1), mmproj=qwen_files["mmproj"], max_context=64)
    assert isinstance(image_features(qwen_files["text"], model, qwen_files["mmproj"]).processor, Qwen2VLImageProcessorPil)
