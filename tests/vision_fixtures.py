"""A tiny random llava (CLIP tower, llama text model) saved as a Hugging Face directory with a real
tokenizer (SmolLM2's plus an `<image>` token), a chat template that places images, and a CLIP image
processor; and transformers' own processor and model over it, the independent reference."""

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
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH) ** 2  # CLIP, "default" strategy: the class position dropped
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}<image>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_llava(path: Path, seed: int = 5) -> Path:
    import torch
    from tokenizers import AddedToken
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    tokenizer = load_tokenizer(default_model_path())
    tokenizer.save(path)
    backend = tokenizer.backend.__class__.from_file(str(path / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    image_token = backend.token_to_id("<image>")
    backend.save(str(path / "tokenizer.json"))
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    torch.manual_seed(seed)
    llava = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                       image_size=IMAGE_SIZE, patch_size=PATCH),
        text_config=LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=image_token + 1, max_position_embeddings=512,
                                eos_token_id=config.get("eos_token_id", 2) if isinstance(config.get("eos_token_id"), int) else 2),
        image_token_index=image_token, vision_feature_layer=-2,
    )
    model = LlavaForConditionalGeneration(llava).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15)
    model.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}).save_pretrained(path)
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


def _processor(path: Path) -> Any:
    from transformers import AutoImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    return LlavaProcessor(
        image_processor=AutoImageProcessor.from_pretrained(path), chat_template=CHAT_TEMPLATE, patch_size=PATCH,
        tokenizer=PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json")),
        vision_feature_select_strategy="default", image_token="<image>", num_additional_image_tokens=1,
    )


def reference_inputs(path: Path, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """transformers' LlavaProcessor's input_ids and pixel_values for `messages` (our template, rendered)."""
    from PIL import Image

    images = [Image.open(io.BytesIO(base64.b64decode(p["image_url"]["url"].split(",", 1)[1])))
              for m in messages for p in (m["content"] if isinstance(m["content"], list) else [])
              if p["type"] == "image_url"]
    return _processor(path)(text=_render(messages), images=images or None, return_tensors="pt")


def reference(path: Path, messages: list[dict[str, Any]], steps: int) -> tuple[list[int], list[float], list[int]]:
    """transformers' own: LlavaForConditionalGeneration's greedy tokens over `reference_inputs`,
    each one's log-probability, and the prompt's ids."""
    import torch
    from transformers import LlavaForConditionalGeneration

    inputs = reference_inputs(path, messages)
    model = LlavaForConditionalGeneration.from_pretrained(path).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=steps, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    prompt = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt):].tolist()
    logprobs = [float(torch.log_softmax(s[0].float(), -1)[t]) for s, t in zip(out.scores, tokens)]
    return tokens, logprobs, prompt


def _render(messages: list[dict[str, Any]]) -> str:
    import jinja2

    plain = [{**m, "content": m["content"] if isinstance(m["content"], str) else
              [{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]} for m in messages]
    return jinja2.Template(CHAT_TEMPLATE).render(messages=plain, add_generation_prompt=True)
