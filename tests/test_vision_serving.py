"""Images over HTTP and through the Leader, on a served tiny llava at TP=2 (`celerytp serve DIR`):
OpenAI image parts as data URLs in PNG, JPEG and WebP, batched beside text requests, equal to
transformers' own model; the Leader's bytes and paths; the cache of a follow-up turn about the
same image; the Responses API's input_image; every bad image refused with a 400 naming the
problem while the group serves on; images counted in /metrics."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from model_fixtures import TINY_CONFIGS, make_hf_model
from server_fixtures import MODEL, metric_samples, start_served
from vision_fixtures import data_url, picture, reference, user_turn, write_tiny_llava

from celerytp.core.tokenizer import load_tokenizer

STEPS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return write_tiny_llava(tmp_path_factory.mktemp("vision") / "llava")


@pytest.fixture(scope="module")
def served(tmp_path_factory, llava):
    with start_served(tmp_path_factory, str(llava), "--max-batch", "4", tp=2, group="vis") as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, **options):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=STEPS, temperature=0,
                                          logprobs=True, extra_body={"ignore_eos": True}, **options)


def test_image_chats_over_http_equal_transformers_beside_text_requests(client, llava):
    turns = [
        [user_turn("What is in it?", picture(1))],
        [user_turn("Compare them.", picture(2, fmt="JPEG"), mime="image/jpeg"),
         user_turn("And this one?", picture(3, (31, 47), fmt="WEBP"), mime="image/webp")],
    ]
    texts = [[{"role": "user", "content": f"Count to {n}."}] for n in (3, 7)]
    with ThreadPoolExecutor(4) as pool:  # one batch: image rows beside text rows
        replies = list(pool.map(lambda m: chat(client, m), [*turns, *texts]))
    decode = load_tokenizer(llava).decode
    for messages, reply in zip(turns, replies):
        tokens, logprobs, prompt = reference(llava, messages, STEPS)
        assert reply.usage.prompt_tokens == len(prompt)
        assert reply.choices[0].message.content == decode(tokens)
        assert [t.logprob for t in reply.choices[0].logprobs.content] == pytest.approx(logprobs, abs=1e-3)
    assert all(r.choices[0].message.content for r in replies[2:])


def test_the_leader_takes_bytes_and_paths_in_the_models_directory(served, llava):
    tokens, _, _ = reference(llava, [user_turn("What is in it?", picture(4))], STEPS)
    (llava / "four.png").write_bytes(picture(4))
    for image in (picture(4), llava / "four.png", str(llava / "four.png")):
        result = served.leader.generate(MODEL, messages=[{"role": "user", "content": [
            {"type": "image", "image": image}, {"type": "text", "text": "What is in it?"}]}],
            max_tokens=STEPS, temperature=0, ignore_eos=True)  # fmt: skip
        assert result.token_ids == tokens and result.images == 1
    outside = llava.parent.parent / "outside.png"
    outside.write_bytes(picture(4))
    with pytest.raises(Exception, match="model's directory"):
        served.leader.generate(MODEL, messages=[{"role": "user", "content": [{"type": "image", "image": outside}]}],
                               max_tokens=2)


def test_a_follow_up_turn_about_the_same_image_reuses_its_cache(served):
    first = [user_turn("Describe it.", picture(5))]
    answer = served.leader.generate(MODEL, messages=first, max_tokens=4, temperature=0)
    follow = [*first, {"role": "assistant", "content": answer.text}, {"role": "user", "content": "More?"}]
    again = served.leader.generate(MODEL, messages=follow, max_tokens=2, temperature=0)
    assert again.reused_tokens >= answer.prompt_tokens - 1  # the image's places too
    other = [user_turn("Describe it.", picture(6)), *follow[1:]]
    changed = served.leader.generate(MODEL, messages=other, max_tokens=2, temperature=0)
    tokenizer = load_tokenizer(served.leader.models()[MODEL]["path"])
    text = tokenizer.render_chat([{"role": "user", "content": [{"type": "image"}]}])
    header = len(tokenizer.encode_rendered(text[: text.index("<image>")]))  # the tokens before the first image
    assert 0 < changed.reused_tokens <= header  # not the other image's places


def test_the_celery_task_takes_image_parts(served, llava):
    """The `celerytp.generate` task, sent by a plain Celery producer, with the HTTP API's messages."""
    from celery import Celery

    messages = [user_turn("What is in it?", picture(12))]
    tokens, _, _ = reference(llava, messages, STEPS)
    producer = Celery("plain-producer", broker=served.broker_url, backend=served.broker_url)
    try:
        done = producer.send_task("celerytp.generate", queue=f"celerytp.{served.group}.requests", kwargs={
            "model": MODEL, "messages": messages, "max_tokens": STEPS, "temperature": 0, "ignore_eos": True,
        }).get(timeout=120)  # fmt: skip
    finally:
        producer.close()
    assert done["token_ids"] == tokens


def test_responses_take_an_input_image(client):
    image = data_url(picture(7))
    via_chat = chat(client, [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                          {"type": "text", "text": "What is it?"}]}])
    response = client.responses.create(model=MODEL, temperature=0, max_output_tokens=STEPS, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": image},
                                     {"type": "input_text", "text": "What is it?"}]}])  # fmt: skip
    assert response.output_text == via_chat.choices[0].message.content


def _plain(size: tuple[int, int], fmt: str) -> bytes:
    """One colour: small as a file however many pixels it has."""
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size).save(out, format=fmt)
    return out.getvalue()


@pytest.mark.parametrize(("part", "problem"), [
    ({"type": "image_url", "image_url": {"url": data_url(picture(1)[:60])}}, "cannot be decoded"),
    ({"type": "image_url", "image_url": {"url": data_url(_plain((8, 8), "GIF"), "image/png")}}, "GIF images are not taken"),
    ({"type": "image_url", "image_url": {"url": data_url(b"x", "image/gif")}}, "not an image format"),
    ({"type": "image_url", "image_url": {"url": data_url(_plain((4100, 4100), "PNG"))}}, "over the limit of 16777216 pixels"),
    ({"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}, "remote image URLs are not fetched"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "not valid base64"),
])  # fmt: skip
def test_a_bad_image_is_a_400_naming_the_problem_and_the_group_serves_on(client, part, problem):
    with pytest.raises(openai.BadRequestError, match=problem) as refused:
        chat(client, [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}])
    assert refused.value.body["param"].startswith("messages[0].content[0]")
    assert chat(client, [user_turn("Still there?", picture(8))]).choices[0].message.content


def test_too_many_images_and_images_for_a_text_model_are_refused(client, served, llava):
    with pytest.raises(openai.BadRequestError, match="more than 8 images"):
        chat(client, [user_turn("So many.", *[picture(i) for i in range(9)])])
    model_type, kwargs = TINY_CONFIGS["llama_gqa_bias"]
    text_model = llava.parent / "text"
    make_hf_model(model_type, kwargs, seed=1).save_pretrained(text_model)
    load_tokenizer(llava).save(text_model)
    served.leader.load("text", str(text_model), max_batch=2, max_context=64)
    try:
        with pytest.raises(openai.BadRequestError, match="takes no images"):
            client.chat.completions.create(model="text", messages=[user_turn("Hi", picture(1))], max_tokens=2)
    finally:
        served.leader.unload("text")


def test_metrics_count_images(client, served):
    def images() -> float:
        return metric_samples(httpx.get(f"{served.url}/metrics").text)[f"celerytp_images_total{[('model', MODEL)]}"]

    before = images()
    chat(client, [user_turn("Two of them.", picture(9), picture(10))])
    assert images() == before + 2


def test_no_serving_loop_failed_over_the_module(served):
    """Last: the loops that served images all ended well, their idle exits included (a failed loop
    is hidden from its requests, which resume in the next: only this counter shows it)."""
    deadline = time.monotonic() + 10
    while served.leader.serving_stats(MODEL)["loop_running"]:  # the last loop's idle exit, to count it
        assert time.monotonic() < deadline
        time.sleep(0.2)
    samples = metric_samples(httpx.get(f"{served.url}/metrics").text)
    failures = {name: value for name, value in samples.items() if name.startswith("celerytp_serving_loop_failures_total")}
    assert failures and not any(failures.values()), failures
