"""`celerytp serve --tp 2` exactly as a user starts it: the default model (SmolLM2 Q4_1 GGUF), no
environment switch set (compiled decode, packed linears, quant kernels, KV dtype and batch at
their defaults), driven by the real openai client. Each feature is checked against its content;
at the end no serving loop may have failed over the whole module.

Every other module that starts `celerytp serve` runs these defaults too; this one keeps the
tour of features in one place, beside each other on one server, as users hit them."""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter

import httpx
import jsonschema
import openai
import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MODEL, flower_api, rows_free_within, start_flower, start_served
from test_structured_output import ASK, PERSON, WEATHER

from celerytp.core.model_files import default_model_path
from celerytp.core.switches import SWITCHES
from celerytp.core.tokenizer import load_tokenizer

KEY = "as-shipped-key"
GROUP = "srv"
REQUESTS_QUEUE = f"celerytp.{GROUP}.requests"
STORY = [{"role": "user", "content": "Tell me a story about a dragon."}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    for name in SWITCHES:
        assert name not in os.environ, f"{name} is set: this module runs the shipped defaults"
    with start_served(tmp_path_factory, env={"CELERYTP_API_KEY": KEY}) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_decode_is_compiled_as_shipped(served):
    """The precondition of the whole module: the ranks' load compiled decode (the default for a
    quantized model)."""
    assert served.leader.models()[MODEL]["decode"] == "compiled"


def test_chat_and_completions_plain_and_streamed_with_usage(client):
    for create, ask, text_of in (
        (client.chat.completions.create, {"messages": STORY}, lambda c: c.message.content),
        (client.completions.create, {"prompt": "Once upon a time"}, lambda c: c.text),
    ):
        whole = create(model=MODEL, max_tokens=12, temperature=0, **ask)
        assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
        chunks = list(create(model=MODEL, max_tokens=12, temperature=0, stream=True,
                             stream_options={"include_usage": True}, **ask))
        streamed = "".join((c.choices[0].delta.content or "") if hasattr(c.choices[0], "delta") else c.choices[0].text
                           for c in chunks if c.choices)
        assert streamed == text_of(whole.choices[0]) and streamed
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_n_choices_and_n_three_without_a_temperature_differ(client):
    """No temperature: the default is 1 (OpenAI's), so the choices draw apart."""
    reply = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=16, n=3)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and len(set(texts)) > 1, texts
    two = client.chat.completions.create(model=MODEL, messages=STORY, max_tokens=4, n=2, temperature=0)
    assert len(two.choices) == 2 and two.choices[0].message.content == two.choices[1].message.content
    assert two.usage.completion_tokens == 8


def test_logprobs_with_top_logprobs_plain_and_streamed(client):
    ask = dict(model=MODEL, messages=STORY, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    plain = client.chat.completions.create(**ask).choices[0].logprobs.content
    assert len(plain) == 8
    for entry in plain:
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and entry.logprob <= 0
        assert entry.logprob == pytest.approx(tops[0], abs=1e-4)  # greedy: the most likely token
    streamed = [e for c in client.chat.completions.create(**ask, stream=True) if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 3)) for e in streamed] == [(e.token, round(e.logprob, 3)) for e in plain]


def test_json_object_and_strict_json_schema(client):
    ask = [{"role": "user", "content": 'Reply with a JSON object with one key, "name".'}]
    reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=100, temperature=0,
                                           response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop", reply
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    for temperature in (0, 1):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=80,
            temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


@pytest.mark.parametrize("choice", ["auto", "required", "named"])
def test_tool_calls_validate_against_their_parameters(client, choice):
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else choice
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                           max_tokens=60, temperature=0)
    calls = reply.choices[0].message.tool_calls or []
    if choice != "auto":
        assert calls and reply.choices[0].finish_reason == "tool_calls", reply
    for call in calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_stop_strings(client):
    whole = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0).choices[0].text
    assert " 6" in whole, whole  # precondition: the count goes on
    cut = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 6"])
    assert cut.choices[0].text == whole[: whole.index(" 6")] and cut.choices[0].finish_reason == "stop"


def completion(client, **options) -> tuple[list[str], list[float], list[dict[str, float]]]:
    """12 tokens of a completion, their log-probabilities (the model's own) and each one's top 5."""
    extra = {k: options.pop(k) for k in ("min_p", "ignore_eos") if k in options}
    reply = client.completions.create(model=MODEL, prompt="My favourite fruits are", max_tokens=12, logprobs=5,
                                      extra_body={"ignore_eos": True, **extra}, **options)
    logprobs = reply.choices[0].logprobs
    return logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs


def most_likely(tokens: list[str], logprobs: list[float], tops: list[dict[str, float]]) -> list[bool]:
    return [lp >= max(top.values()) - 1e-6 for lp, top in zip(logprobs, tops)]


def test_top_p_and_min_p_cut_the_draw_to_the_most_likely_token(client):
    """At temperature 2 the draw wanders; with a tiny top_p or min_p 1 only the argmax is left."""
    assert not all(all(most_likely(*completion(client, temperature=2, seed=s))) for s in range(2))
    for cut in ({"top_p": 1e-6}, {"min_p": 1.0}):
        assert all(most_likely(*completion(client, temperature=2, seed=0, **cut))), cut


def test_presence_and_frequency_penalties_and_logit_bias_take_effect(client):
    greedy, _, _ = completion(client, temperature=0, seed=0)
    for penalty in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
        chosen, logprobs, tops = completion(client, temperature=0, seed=0, **penalty)
        assert chosen != greedy, penalty
        assert max(Counter(chosen).values()) <= max(Counter(greedy).values()), (penalty, chosen, greedy)
    banned = greedy[0]
    token = load_tokenizer(default_model_path()).encode(banned)
    assert len(token) == 1, token
    other, _, _ = completion(client, temperature=0, logit_bias={str(token[0]): -100})
    assert banned not in other
    forced, _, _ = completion(client, temperature=0, logit_bias={str(token[0]): 100})
    assert forced == [banned] * 12


def test_a_seed_gives_the_same_text_twice(client):
    ask = dict(model=MODEL, messages=STORY, max_tokens=16, temperature=1.0, seed=1234)
    first, second = (client.chat.completions.create(**ask).choices[0].message.content for _ in range(2))
    assert first == second
    assert any(client.chat.completions.create(**{**ask, "seed": s}).choices[0].message.content != first
               for s in (1, 2, 3))


def test_a_client_disconnect_frees_the_row_within_a_second(served):
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}) as reply:
        for n, _ in enumerate(reply.iter_lines()):
            if n >= 4:
                break
    assert rows_free_within(served, 1.0) <= 1.0


def test_a_structured_request_beside_a_long_stream(client, served):
    """The stream finishes whole, the structured request is answered, and the model stays listed
    throughout."""
    listed, done = [], threading.Event()

    def watch() -> None:
        while not done.is_set():
            listed.append([m.id for m in client.models.list().data])
            time.sleep(0.1)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=120, stream=True,
                                           extra_body={"ignore_eos": True}, stream_options={"include_usage": True})
        chunks = iter(stream)
        first = next(chunks)
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=80,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True, "schema": PERSON}})
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)
        rest = [first, *chunks]
    finally:
        done.set()
        watcher.join()
    assert rest[-1].usage.completion_tokens == 120
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"
    assert listed and all(MODEL in ids for ids in listed)


@pytest.fixture(scope="module")
def producer(served):
    """A plain Celery app, as an application sends `celerytp.generate` (no celerytp needed)."""
    app = Celery("as-shipped-producer", broker=served.broker_url, backend=served.broker_url)
    yield app
    app.close()


def generate_task(producer: Celery, **kwargs):
    return producer.send_task("celerytp.generate", kwargs=kwargs, queue=REQUESTS_QUEUE)


@pytest.fixture(scope="module")
def flower(served, producer):
    env = {"CELERYTP_BROKER": served.broker_url, "CELERYTP_GROUP": GROUP, "CELERYTP_WORLD_SIZE": "2"}
    with start_flower(env, {REQUESTS_QUEUE, f"celerytp.{GROUP}.rank.0"},
                      lambda: generate_task(producer, prompt="Hi", max_tokens=1)) as base:
        yield base


def test_a_celery_generate_task_as_flower_shows_it(flower, producer, served):
    """Its result; its PROGRESS while it runs (the text so far in the backend's meta); revoked as
    docs/serving.md says (the task cancels its own request), REVOKED in the backend and in
    Flower's event-fed task info."""
    finished = generate_task(producer, prompt="Hi", max_tokens=3)
    reply = finished.get(timeout=120)
    assert reply["model"] == MODEL and reply["usage"]["completion_tokens"] <= 3
    assert flower_api(flower, f"task/result/{finished.id}", lambda r: True) == {
        "task-id": finished.id, "state": "SUCCESS", "result": reply}
    info = flower_api(flower, f"task/info/{finished.id}", lambda r: r["state"] == "SUCCESS")
    assert info["name"] == "celerytp.generate" and info["worker"].startswith(f"celerytp.{GROUP}.frontend@")

    room = served.leader.models()[MODEL]["max_context"] - 64  # long enough on any machine to be seen running
    running = generate_task(producer, prompt="Tell me a long story.", max_tokens=room, ignore_eos=True)
    seen = flower_api(flower, f"task/result/{running.id}", lambda r: r["state"] != "PENDING", deadline_s=60)
    assert seen == {"task-id": running.id, "state": "PROGRESS"}, seen  # Flower shows no meta before the end
    assert running.info["model"] == MODEL and running.info["tokens"] > 0
    flower_api(flower, f"task/info/{running.id}", lambda r: r["state"] == "STARTED")
    producer.control.revoke(running.id)
    with pytest.raises(TaskRevokedError, match="revoked"):
        running.get(timeout=30)
    done = flower_api(flower, f"task/result/{running.id}", lambda r: r["state"] != "PROGRESS")
    assert done["state"] == "REVOKED" and "revoked" in done["result"], done
    info = flower_api(flower, f"task/info/{running.id}", lambda r: r["state"] != "STARTED")
    assert info["state"] == "REVOKED" and info["revoked"], info


def loop_failures(served) -> dict[str, float]:
    text = httpx.get(f"{served.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {s.labels["kind"]: s.value for f in text_string_to_metric_families(text)
            if f.name == "celerytp_serving_loop_failures" for s in f.samples
            if s.name.endswith("_total") and s.labels["model"] == MODEL}


def test_no_serving_loop_failed_over_the_module(served):
    """Last: the loops this module ran all ended well (their idle exits included): the failure
    counter is zero for every kind and no rank logged a failed op."""
    deadline = time.monotonic() + 10
    while served.leader.serving_stats(MODEL)["loop_running"]:  # the last loop's idle exit, to count it
        assert time.monotonic() < deadline
        time.sleep(0.2)
    failures = loop_failures(served)
    assert "internal" in failures and not any(failures.values()), failures
    for pid in (beat["pid"] for beat in served.leader.health()):
        log = open(os.readlink(f"/proc/{pid}/fd/1")).read()  # the rank worker's log (LocalCluster's workdir)
        assert "op serve failed" not in log and "failed in the serving loop" not in log, log[-3000:]
        assert "serve" in log  # it is the log the loops wrote to
