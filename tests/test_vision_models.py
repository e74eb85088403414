"""A vision-language model (llava: CLIP tower, llama text model) against transformers' own
processor and model, in one forward, in prefill pieces, and through the serving loop at TP 1 and 2:
alone, beside text rows, in one request with two images, and resumed after a failure."""

from __future__ import annotations

import pytest
import torch
from bare_loop import serve_bare
from model_fixtures import LOGITS_ATOL, make_prompt
from vision_fixtures import TOKENS_PER_IMAGE, picture, reference, reference_inputs, user_turn, write_tiny_llava

from celerytp.client.generation import tokenized
from celerytp.core.images import encode
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.image_features import ImageFeatures

STEPS = 6
TURNS = {
    "one": [user_turn("What is in it?", picture(1))],
    "two": [user_turn("Compare them.", picture(1), picture(2, (64, 30), "JPEG"))],
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("llava") / "tiny")


@pytest.fixture(scope="module")
def references(llava):
    return {name: reference(llava, messages, STEPS) for name, messages in TURNS.items()}


def ours(path, messages) -> tuple[list[int], list[bytes]]:
    _, ids, images = tokenized({"path": str(path), "max_context": 512}, None, messages)
    return ids, images


def test_prompt_ids_are_the_llava_processors(llava, references):
    for name, messages in TURNS.items():
        ids, images = ours(llava, messages)
        assert ids == references[name][2]
        assert ids.count(max(ids)) == len(images) * TOKENS_PER_IMAGE  # the image token is the vocabulary's last


@pytest.mark.parametrize("piece", [None, 7])
def test_logits_match_transformers_in_one_forward_and_in_pieces(llava, piece):
    from transformers import LlavaForConditionalGeneration

    model = load_model(llava, TPContext(0, 1), max_batch=2, max_context=256)
    features = ImageFeatures(llava, model)
    reference_model = LlavaForConditionalGeneration.from_pretrained(llava).eval()
    for messages in TURNS.values():
        ids, images = ours(llava, messages)
        rows = features(images)
        at = [i for i, t in enumerate(ids) if t == model.vision.image_token_id]
        logits, start = [], 0
        model.clear_cache(0)
        for end in ([len(ids)] if piece is None else range(piece, len(ids) + piece, piece)):
            end = min(end, len(ids))
            mine = [(i - start, k) for k, i in enumerate(at) if start <= i < end]
            embeds = ([i for i, _ in mine], rows[[k for _, k in mine]]) if mine else None
            logits.append(model.forward_tokens(torch.tensor(ids[start:end]), start, row=0, embeds=embeds))
            start = end
        with torch.no_grad():
            expected = reference_model(**reference_inputs(llava, messages)).logits[0]
        torch.testing.assert_close(torch.cat(logits), expected, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("world", [1, 2])
def test_serving_loop_gives_transformers_tokens_alone_beside_text_and_resumed(llava, references, tmp_path, world):
    vocab = references["one"][2][0] + 1  # any id below the image token's
    specs = {}
    for name, messages in TURNS.items():
        ids, images = ours(llava, messages)
        specs[name] = dict(request_id=name, prompt=ids, max_tokens=STEPS, images=encode(images),
                           sampling=dict(temperature=0, logprobs=1))
    text = [dict(request_id=f"t{i}", prompt=make_prompt(min(vocab, 1000), 5 + 7 * i, seed=i), max_tokens=4)
            for i in range(3)]
    runs = serve_bare(tmp_path, llava, world, [
        ([specs["one"]], []),
        ([text[0], specs["two"], text[1], {**specs["one"], "request_id": "one_again"}, text[2]], []),
        ([{**specs["two"], "request_id": "two_resumed", "resume": ["two", 3]}], []),
    ], max_batch=4)  # fmt: skip
    rows = {rid: row for run in runs for rid, row in run["rows"].items()}
    for rid, name in (("one", "one"), ("one_again", "one"), ("two", "two"), ("two_resumed", "two")):
        tokens, logprobs, _ = references[name]
        assert rows[rid]["tokens"] == tokens, rid
        got = [entry[0] for entry in rows[rid]["logprobs"]]
        skip = 3 if rid == "two_resumed" else 0  # tokens it had streamed come back without log-probabilities
        assert got == pytest.approx(logprobs[skip:] if len(got) < len(logprobs) else logprobs, abs=1e-3), rid
    assert all("tokens" in rows[t["request_id"]] for t in text)
    assert runs[1]["stats"]["images"] == 3
