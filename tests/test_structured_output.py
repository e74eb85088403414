"""Structured output and tool calls through a real `celerytp serve` (TP=2: the vocabulary is split
over the ranks, so a constrained row takes the whole-logits path) driven by the real openai client:
`response_format` json_object/json_schema, `tools` with tool_choice auto/required/named, a
constrained row batched with unconstrained ones, and bad input refused before anything is queued."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_fixtures import MODEL, ROOT, start_served

from celerytp.server.tools import CallStream, ToolMode

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with start_served(tmp_path_factory, "--max-batch", "8", tp=2) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


def matches_person(value: dict) -> None:
    assert set(value) == {"name", "age", "colour"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 24
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 150
    assert value["colour"] in ("red", "green", "blue")


def test_json_object(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Answer with exactly this JSON: {"ok": true}'}], max_tokens=60,
        temperature=0, response_format={"type": "json_object"})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(json.loads(choice.message.content), dict)


def test_json_schema_strict(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=80, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # the grammar's end ends the row
    matches_person(json.loads(choice.message.content))


def test_json_schema_sampled_and_streamed(client):
    chunks = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=80, temperature=1.0,
        seed=7, stream=True, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    matches_person(json.loads(text))


def test_json_schema_on_completions(client):
    """`response_format` on /v1/completions (vLLM's extension): the text matches the schema."""
    reply = client.completions.create(
        model=MODEL, prompt="A person, as JSON:", max_tokens=60, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}})
    assert reply.choices[0].finish_reason == "stop"
    matches_person(json.loads(reply.choices[0].text))


def test_tool_choice_required(client):
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=80, temperature=0,
                                           tools=[WEATHER, TIME], tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
        else:
            assert call.function.name == "get_time" and set(args) == {"zone"}


def streamed_answer(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """A streamed chat's content, calls (name, arguments) and finish_reason, checking the chunks
    are what a LangChain-style consumer merges: a call's first chunk has its index, id, type and
    name; later ones only its index and an arguments piece."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for entry in delta.tool_calls or []:
            if entry.index not in calls:
                assert entry.id.startswith("call_") and entry.type == "function" and entry.function.name, entry
                assert entry.function.arguments == "" and entry.index == len(calls), entry
                calls[entry.index] = [entry.function.name, ""]
            else:
                assert entry.id is None and entry.type is None and entry.function.name is None, entry
                calls[entry.index][1] += entry.function.arguments
        reason = chunk.choices[0].finish_reason or reason
    return content, [tuple(call) for _, call in sorted(calls.items())], reason


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}, "auto"])
def test_streamed_tool_calls_add_up_to_the_answer(client, choice):
    """Greedy, the calls streamed piece by piece are the non-streamed answer's calls."""
    request = dict(model=MODEL, messages=ASK, max_tokens=40, temperature=0, tools=[WEATHER, TIME], tool_choice=choice)
    whole = client.chat.completions.create(**request).choices[0]
    content, calls, reason = streamed_answer(client.chat.completions.create(**request, stream=True))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert content == (whole.message.content or "") and reason == whole.finish_reason
    if choice != "auto":
        assert calls and reason == "tool_calls"
        assert all(json.loads(args) for _, args in calls)


def test_auto_parses_the_models_tool_call_text():
    mode = ToolMode([WEATHER, TIME], None, True)
    text = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    [call] = mode.calls(text)
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert mode.calls("It is sunny.") is None
    assert mode.calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>') is None


def test_auto_streams_content_until_a_call_starts():
    """The text before `<tool_call>` streams as content (a marker split over pieces held back),
    the call's arguments stream in pieces, and all adds up to the whole answer read at once."""
    mode = ToolMode([WEATHER, TIME], None, True)
    text = 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    stream = CallStream(mode)
    deltas = [stream.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [stream.feed("", final=True)]
    content, [call] = mode.answer(text)
    assert "".join(d.get("content", "") for d in deltas) == content == "Let me look."
    assert all("<" not in d.get("content", "") for d in deltas)
    pieces = [e["function"]["arguments"] for d in deltas for e in d.get("tool_calls", [])]
    assert len(pieces) > 3 and "".join(pieces) == call["function"]["arguments"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}


def test_constrained_row_leaves_unconstrained_rows_unchanged(client):
    """Greedy unconstrained rows batched with constrained ones decode what they decode alone."""
    prompts = [f"Write a short poem about {thing}." for thing in ("rain", "bread")]

    def plain(prompt: str) -> str:
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                              max_tokens=24, temperature=0).choices[0].message.content

    def constrained(_: int) -> dict:
        content = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Invent a person."}], max_tokens=80, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        ).choices[0].message.content
        return json.loads(content)

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        people = [pool.submit(constrained, i) for i in range(2)]
        together = list(pool.map(plain, prompts))
        for person in people:
            matches_person(person.result())
    assert together == alone


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"tools": []}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
]


BAD_COMPLETIONS = [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": "json"}, "response_format"),
    ({"tools": [WEATHER]}, "tools"),  # tools are for chat
]


def test_bad_input_is_refused_before_anything_is_queued(served):
    stats = served.leader.serving_stats
    deadline = time.monotonic() + 30
    while stats(MODEL)["loop_running"]:  # the earlier tests' loop ends after its idle window
        assert time.monotonic() < deadline
        time.sleep(0.2)
    before = stats(MODEL)
    bodies = [("chat/completions", {"messages": ASK, **extra}, param) for extra, param in BAD]
    bodies += [("completions", {"prompt": "Hi", **extra}, param) for extra, param in BAD_COMPLETIONS]
    for path, extra, param in bodies:
        body = {"model": MODEL, "max_tokens": 8, **extra}
        response = httpx.post(f"{served.url}/v1/{path}", json=body, timeout=30)
        assert response.status_code == 400, (extra, response.text)
        error = response.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (extra, error)
    assert stats(MODEL) == before  # nothing queued, no loop started
    assert httpx.get(f"{served.url}/health").status_code == 200
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "response_format": {"type": "json_object"}}
    assert httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


RESUME = """
import json, sys, tempfile
import torch.distributed as dist
from celerytp.core.model_files import default_model_path
from celerytp.core.protocol import GenSpec
from celerytp.core.tokenizer import load_tokenizer
from celerytp.distributed.control import ControlGroup
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.serving import ListSource, ServingLoop

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
tokenizer = load_tokenizer(default_model_path())
model = load_model(default_model_path(), TPContext(0, 1), max_batch=2)
schema = json.loads(sys.argv[1])
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Invent a person."}])

def run(request_id, resumed):
    spec = GenSpec(request_id=request_id, prompt=prompt, max_tokens=80, eos_token_ids=sorted(tokenizer.eos_token_ids),
                   grammar={"json_schema": schema}, resumed=resumed)
    source = ListSource([spec])
    ServingLoop(model, ControlGroup.on_default_group(0, 1), {}, 256, 0.0, source, tokenizer.decode, tokenizer).run()
    result = source.results[request_id].result
    return result.token_ids, result.finish_reason

whole, reason = run("whole", [])
resumed, resumed_reason = run("resumed", whole[:6])
print(json.dumps({"whole": tokenizer.decode(whole), "reason": reason, "resumed": tokenizer.decode(resumed),
                  "resumed_reason": resumed_reason}))
"""


def test_a_resumed_constrained_request_feeds_its_earlier_tokens_to_the_matcher():
    """A request resumed on another group (GenSpec.resumed) goes on in its grammar from where it
    was: greedy, it ends exactly as an uninterrupted run (the bare serving loop, TP=1)."""
    done = subprocess.run([sys.executable, "-c", RESUME, json.dumps(PERSON)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    matches_person(json.loads(out["whole"]))
    assert out["reason"] == "stop" and out["resumed_reason"] == "stop"
    assert out["resumed"] == out["whole"]
