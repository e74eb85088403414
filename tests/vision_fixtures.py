"""Tiny random vision-language models saved as Hugging Face directories with a real tokenizer
(SmolLM2's plus the family's image tokens), a chat template that places images, and the family's
image processor: llava (CLIP tower, llama text model), gemma3 (SigLIP tower, its text model,
image tokens that see their whole image), qwen2_5_vl (windowed ViT, tokens by image size,
multimodal rotary), qwen3_vl (deepstack features into the first text layers, interleaved
multimodal rotary) and mistral3 (Pixtral tower, rows of image tokens ending in [IMG_BREAK]); and
transformers' own processor and model over each, the independent reference."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import load_tokenizer

IMAGE_SIZE, PATCH = 32, 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2  # llava's: CLIP, "default" strategy (the class position dropped)
GEMMA3_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")  # begin, end, image
GEMMA3_TOKENS_PER_IMAGE = 4
QWEN_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_PROCESSOR = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2, "min_pixels": 16 * 16,
                  "max_pixels": 64 * 64}


def chat_template(image_mark: str) -> str:
    """A chat template that writes `image_mark` for each image part."""
    return (
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
        "{% for part in message['content'] %}{% if part['type'] == 'image' %}" + image_mark +
        "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )  # fmt: skip


def _tokenizer(path: Path, added: tuple[str, ...], template: str) -> list[int]:
    """SmolLM2's tokenizer saved at `path` with `added` special tokens and `template`: their ids."""
    from tokenizers import AddedToken

    load_tokenizer(default_model_path()).save(path)
    backend = load_tokenizer(default_model_path()).backend.__class__.from_file(str(path / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in added])
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return [backend.token_to_id(t) for t in added]


def _randomized(model: Any, seed: int) -> Any:
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    return model.eval()


def write_tiny_llava(path: Path, seed: int = 5) -> Path:
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    (image,) = _tokenizer(path, ("<image>",), chat_template("<image>"))
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       image_size=IMAGE_SIZE, patch_size=PATCH),
        text_config=LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=image + 1, max_position_embeddings=512, eos_token_id=2),
        image_token_index=image, vision_feature_layer=-2,
    )  # fmt: skip
    _randomized(LlavaForConditionalGeneration(config), seed).save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                       crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    return path


def write_tiny_gemma3(path: Path, seed: int = 6) -> Path:
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3ImageProcessorPil,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    begin, end, image = _tokenizer(path, GEMMA3_TOKENS, chat_template(GEMMA3_TOKENS[0]))
    config = Gemma3Config(
        vision_config=SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                         image_size=IMAGE_SIZE, patch_size=PATCH, vision_use_head=False),
        text_config=Gemma3TextConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=16, vocab_size=image + 1, sliding_window=64,
                                     max_position_embeddings=512, layer_types=["sliding_attention", "full_attention"]),
        mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE, boi_token_index=begin, eoi_token_index=end, image_token_index=image,
    )  # fmt: skip
    _randomized(Gemma3ForConditionalGeneration(config), seed).save_pretrained(path)
    Gemma3ImageProcessorPil(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
    return path


def _write_tiny_qwen(path: Path, seed: int, family: str, text: dict[str, Any], vision: dict[str, Any]) -> Path:
    """A tiny random qwen2_5_vl or qwen3_vl model at `path`: `text` and `vision` on top of the
    keys both families share, SmolLM2's tokenizer with the Qwen vision tokens, its image processor."""
    import transformers

    config_cls, model_cls = {
        "qwen2_5_vl": (transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration),
    }[family]
    start, end, image, video = _tokenizer(path, QWEN_TOKENS, chat_template(QWEN_MARK))
    config = config_cls(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=video + 1, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, **text),
        vision_config=dict(hidden_size=32, num_heads=4, intermediate_size=64, out_hidden_size=64,
                           patch_size=QWEN_PROCESSOR["patch_size"], spatial_merge_size=2, temporal_patch_size=2,
                           **vision),
        image_token_id=image, video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
    )  # fmt: skip
    _randomized(model_cls(config), seed).save_pretrained(path)
    transformers.Qwen2VLImageProcessorPil(**QWEN_PROCESSOR).save_pretrained(path)
    return path


def write_tiny_qwen2_5_vl(path: Path, seed: int = 7) -> Path:
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    vision = dict(depth=4, window_size=16, fullatt_block_indexes=[1, 3])
    return _write_tiny_qwen(path, seed, "qwen2_5_vl", dict(rope_parameters=rope), vision)


def write_tiny_qwen3_vl(path: Path, seed: int = 9) -> Path:
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0, "mrope_interleaved": True}
    vision = dict(depth=3, num_position_embeddings=16, deepstack_visual_indexes=[0, 2])
    return _write_tiny_qwen(path, seed, "qwen3_vl", dict(head_dim=16, rope_parameters=rope), vision)


MISTRAL3_TOKENS = ("[IMG]", "[IMG_BREAK]", "[IMG_END]")
MISTRAL3_CELL = 4 * 2  # patch x spatial merge


def write_tiny_mistral3(path: Path, seed: int = 8) -> Path:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralImageProcessorPil

    image, _, _ = _tokenizer(path, MISTRAL3_TOKENS, chat_template(MISTRAL3_TOKENS[0]))
    config = Mistral3Config(
        vision_config=dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, head_dim=8, image_size=64, patch_size=4, hidden_act="silu"),
        text_config=dict(model_type="mistral", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=image + 3,
                         max_position_embeddings=512, sliding_window=None),
        image_token_index=image, spatial_merge_size=2,
    )  # fmt: skip
    _randomized(Mistral3ForConditionalGeneration(config), seed).save_pretrained(path)
    PixtralImageProcessorPil(size={"longest_edge": 48}, patch_size=4).save_pretrained(path)
    return path


def picture(seed: int, size: tuple[int, int] = (40, 52), fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(size[1], size[0], 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def user_turn(text: str, *images: bytes, mime: str = "image/png") -> dict[str, Any]:
    """A user message with `images` as OpenAI image parts (data URLs), then `text`."""
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": data_url(i, mime)}} for i in images]
    return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}


def _family(path: Path) -> str:
    return json.loads((path / "config.json").read_text())["model_type"]


def _processor(path: Path) -> Any:
    from transformers import AutoImageProcessor, Gemma3Processor, LlavaProcessor, PreTrainedTokenizerFast

    images = AutoImageProcessor.from_pretrained(path)
    if _family(path) == "gemma3":
        begin, end, image = GEMMA3_TOKENS
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"), extra_special_tokens={
            "boi_token": begin, "eoi_token": end, "image_token": image})  # fmt: skip
        return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=GEMMA3_TOKENS_PER_IMAGE,
                               chat_template=chat_template(begin))
    return LlavaProcessor(
        image_processor=images, chat_template=chat_template("<image>"), patch_size=PATCH,
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json")),
        vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
    )


def reference_inputs(path: Path, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """transformers' processor's inputs (input_ids, pixel_values, and gemma3's token_type_ids)
    for `messages`, rendered by the test's template."""
    import jinja2
    from PIL import Image

    images = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
              for m in messages for p in (m["content"] if isinstance(m["content"], list) else [])
              if p["type"] == "image_url"]  # fmt: skip
    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else
              [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]} for m in messages]
    if _family(path) in ("qwen2_5_vl", "qwen3_vl"):
        return _qwen_inputs(path, jinja2.Template(chat_template(QWEN_MARK)).render(
            messages=plain, add_generation_prompt=True), images)  # fmt: skip
    if _family(path) == "mistral3":
        return _mistral3_inputs(path, jinja2.Template(chat_template(MISTRAL3_TOKENS[0])).render(
            messages=plain, add_generation_prompt=True), images)  # fmt: skip
    processor = _processor(path)
    text = jinja2.Template(processor.chat_template).render(messages=plain, add_generation_prompt=True)
    return processor(text=text, images=images or None, return_tensors="pt")


def _qwen_inputs(path: Path, text: str, images: list[Any]) -> dict[str, Any]:
    """What Qwen2_5_VLProcessor makes (it cannot be built here: it wants torchvision's video
    processor): its image processor's pixels and grids, each `<|image_pad|>` repeated for its
    image's merged patches, tokenized, and the image tokens' type ids."""
    import torch
    from transformers import AutoImageProcessor, PreTrainedTokenizerFast

    pixels = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    pad = QWEN_TOKENS[2]
    pieces = text.split(pad)
    counts = [int(g.prod()) // QWEN_PROCESSOR["merge_size"] ** 2 for g in pixels["image_grid_thw"]]
    text = pieces[0] + "".join(pad * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))(text, return_tensors="pt")["input_ids"]
    image = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json")).convert_tokens_to_ids(pad)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == image).int(),
            **pixels}


def _mistral3_inputs(path: Path, text: str, images: list[Any]) -> dict[str, Any]:
    """What PixtralProcessor makes (it cannot be built here: it wants torchvision): its image
    processor's pixels with patch x merge as the patch, each `[IMG]` replaced by the image's rows
    of `[IMG]`s, each row ending in `[IMG_BREAK]` but the last in `[IMG_END]`, tokenized."""
    from transformers import AutoImageProcessor, PreTrainedTokenizerFast

    cell = {"height": MISTRAL3_CELL, "width": MISTRAL3_CELL}
    pixels = AutoImageProcessor.from_pretrained(path)(images=images, patch_size=cell, return_tensors="pt")
    image, row_end, end = MISTRAL3_TOKENS
    pieces = text.split(image)
    rows = [[image * (w // MISTRAL3_CELL)] * (h // MISTRAL3_CELL) for h, w in pixels["image_sizes"].tolist()]
    text = pieces[0] + "".join(row_end.join(r) + end + piece for r, piece in zip(rows, pieces[1:]))
    ids = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))(text, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, **pixels}


def reference_model(path: Path) -> Any:
    from transformers import (
        Gemma3ForConditionalGeneration,
        LlavaForConditionalGeneration,
        Mistral3ForConditionalGeneration,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLForConditionalGeneration,
    )

    model_cls = {"gemma3": Gemma3ForConditionalGeneration, "qwen2_5_vl": Qwen2_5_VLForConditionalGeneration,
                 "qwen3_vl": Qwen3VLForConditionalGeneration, "mistral3": Mistral3ForConditionalGeneration}.get(
        _family(path), LlavaForConditionalGeneration)
    return model_cls.from_pretrained(path).eval()


def reference(path: Path, messages: list[dict[str, Any]], steps: int) -> tuple[list[int], list[float], list[int]]:
    """transformers' own: the model's greedy tokens over `reference_inputs`, each one's
    log-probability, and the prompt's ids."""
    import torch

    inputs = reference_inputs(path, messages)
    with torch.no_grad():
        out = reference_model(path).generate(**inputs, max_new_tokens=steps, do_sample=False, output_scores=True,
                                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    prompt = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]
    return tokens, logprobs, prompt
