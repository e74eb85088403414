"""Vision-language models (llava: CLIP tower, llama text model; gemma3: SigLIP tower, image tokens
that see their whole image; qwen2_5_vl: windowed ViT, tokens by image size, multimodal rotary;
qwen3_vl: deepstack features into the first text layers, interleaved multimodal rotary;
mistral3: Pixtral tower, rows of image tokens)
against transformers' own processor and model, in one forward, in prefill pieces, and through the
serving loop at TP 1 and 2: alone, beside text rows, in one request with two images of different
sizes, and resumed after a failure."""

from __future__ import annotations

import pytest
import torch
from bare_loop import serve_bare
from model_fixtures import LOGITS_ATOL, make_prompt
from vision_fixtures import (
    picture,
    reference,
    reference_inputs,
    reference_model,
    user_turn,
    write_tiny_gemma3,
    write_tiny_llava,
    write_tiny_mistral3,
    write_tiny_qwen2_5_vl,
    write_tiny_qwen3_vl,
)

from celerytp.client.generation import tokenized
from celerytp.core.images import encode, image_size
from celerytp.core.vision_inputs import mrope_positions, runs, whole_images
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.image_features import ImageFeatures

STEPS = 6
SMOLLM2_VOCAB = 49152  # the tiny models' tokens past it are their image tokens
TURNS = {
    "one": [user_turn("What is in it?", picture(1))],
    "two": [user_turn("Compare them.", picture(1), picture(2, (64, 30), "JPEG"))],
}


FAMILIES = {"llava": write_tiny_llava, "gemma3": write_tiny_gemma3, "qwen2_5_vl": write_tiny_qwen2_5_vl,
            "qwen3_vl": write_tiny_qwen3_vl, "mistral3": write_tiny_mistral3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def vlm(request, tmp_path_factory):
    """Each family's tiny model."""
    return FAMILIES[request.param](tmp_path_factory.mktemp(request.param) / "tiny")


def split_turn(vlm) -> list[dict]:
    """A chat whose image the serving loop's 8-token prefill pieces (its budget in bare_loop.py)
    would split, were the loop not to keep an image that sees itself whole in one piece."""
    for n in range(1, 12):
        messages = [{"role": "system", "content": "Look. " * n}, user_turn("And?", picture(11))]
        ids, _ = ours(vlm, messages)
        image = max((t for t in ids if t >= SMOLLM2_VOCAB), key=ids.count)  # the added token most repeated
        at = [i for i, t in enumerate(ids) if t == image]
        if any(at[0] < edge <= at[-1] for edge in range(8, len(ids), 8)):
            return messages
    raise AssertionError("no system prompt puts a piece's edge inside the image")


@pytest.fixture(scope="module")
def references(vlm):
    turns = {**TURNS, "split": split_turn(vlm)}
    return {name: (*reference(vlm, messages, STEPS), messages) for name, messages in turns.items()}


def ours(path, messages) -> tuple[list[int], list[bytes]]:
    _, ids, images = tokenized({"path": str(path), "max_context": 512}, None, messages)
    return ids, images


def test_prompt_ids_are_the_transformers_processors(vlm, references):
    for name, (_, _, prompt, messages) in references.items():
        ids, images = ours(vlm, messages)
        assert ids == prompt, name


@pytest.mark.parametrize("piece", [None, 3, 7])
def test_logits_match_transformers_in_one_forward_and_in_pieces(vlm, piece):
    model = load_model(vlm, TPContext(0, 1), max_batch=2, max_context=256)
    features = ImageFeatures(vlm, model)
    transformers_model = reference_model(vlm)
    for messages in TURNS.values():
        ids, images = ours(vlm, messages)
        rows, processed_grids = features(images)
        at = [i for i, t in enumerate(ids) if t == model.vision.image_token_id]
        logits, start = [], 0
        model.clear_cache(0)
        images_at = runs(at) if model.vision.bidirectional else []
        grids = [(1, *model.vision.grid.patches(*image_size(image))) for image in images] if model.mrope else []
        assert grids == (processed_grids or [])  # the serving loop's grids, from sizes alone, are the processor's
        rope = mrope_positions(ids, model.vision.image_token_id, grids, model.vision.grid.merge)[0] if model.mrope else None
        while start < len(ids):  # pieces of `piece` tokens, none splitting an image that sees itself whole
            end = whole_images(len(ids) if piece is None else min(start + piece, len(ids)), images_at, start)
            mine = [(i - start, k) for k, i in enumerate(at) if start <= i < end]
            embeds = ([i for i, _ in mine], rows[[k for _, k in mine]]) if mine else None
            logits.append(model.forward_tokens(torch.tensor(ids[start:end]), start, row=0, embeds=embeds,
                                               rope=rope and [stream[start:end] for stream in rope]))
            start = end
        with torch.no_grad():
            expected = transformers_model(**reference_inputs(vlm, messages)).logits[0]
        torch.testing.assert_close(torch.cat(logits), expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("world", [1, 2])
def test_serving_loop_gives_transformers_tokens_alone_beside_text_and_resumed(vlm, references, tmp_path, world):
    vocab = references["one"][2][0] + 1  # any id below the image token's
    specs = {}
    for name, (_, _, _, messages) in references.items():
        ids, images = ours(vlm, messages)
        specs[name] = dict(request_id=name, prompt=ids, max_tokens=STEPS, images=encode(images),
                           sampling=dict(temperature=0, logprobs=1))
    text = [dict(request_id=f"t{i}", prompt=make_prompt(min(vocab, 1000), 5 + 7 * i, seed=i), max_tokens=4)
            for i in range(3)]
    loops = serve_bare(tmp_path, vlm, world, [
        ([specs["one"]], []),
        ([specs["split"]], []),  # alone: pieces of 8 from position 0
        ([text[0], specs["two"], text[1], {**specs["one"], "request_id": "one_again"}, text[2]], []),
        ([{**specs["two"], "request_id": "two_resumed", "resume": ["two", 3]}], []),
    ], max_batch=4)  # fmt: skip
    rows = {rid: row for loop in loops for rid, row in loop["rows"].items()}
    for rid, name in (("one", "one"), ("split", "split"), ("one_again", "one"), ("two", "two"),
                      ("two_resumed", "two")):
        tokens, logprobs, _, _ = references[name]
        assert rows[rid].get("tokens") == tokens, (rid, rows[rid])
        got = [entry[0] for entry in rows[rid]["logprobs"]]
        skip = 3 if rid == "two_resumed" else 0  # tokens it had streamed come back without log-probabilities
        assert got == pytest.approx(logprobs[skip:] if len(got) < len(logprobs) else logprobs, abs=1e-3), rid
    assert all("tokens" in rows[t["request_id"]] for t in text)
    assert loops[2]["stats"]["images"] == 3
