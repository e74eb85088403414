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

from celerytp.core.errors import CeleryTPError
from celerytp.core.grammar import check_grammar
from celerytp.core.model_files import default_model_path
from celerytp.core.tokenizer import load_tokenizer
from celerytp.server.schemas import ChatRequest
from celerytp.server.tools import CallStream, ToolMode, structure
from celerytp.worker.grammar import RowGrammar

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
    # strict: a keyword the grammar cannot enforce is refused, not ignored
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer", "nullable": True}}}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "maxLenght": 3}}}}}], "tool_choice": "required"},
     "tools.0.function.parameters"),
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


# ---- strict schemas, at the mask: the real tokenizer of the default model, no server --------------

# PERSON as clients often send it under strict: no `additionalProperties` stated anywhere
STRICT_PERSON = {
    "type": "object",
    "properties": {
        **PERSON["properties"],
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string", "minLength": 2}}, "required": ["city"]},
    },
    "required": PERSON["required"],
}
GOOD_PERSON = '{"name": "Al", "age": 30, "colour": "red", "tags": ["a"], "home": {"city": "Rome"}}'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def strict(schema: dict) -> dict:
    return {"json_schema": schema, "strict": True}


def matcher(tokenizer, grammar: dict) -> RowGrammar:
    return RowGrammar.create(tokenizer, tokenizer.backend.get_vocab_size(), grammar)


def refused_at(tokenizer, grammar: dict, text: str) -> str | None:
    """Feed `text`'s tokens one by one, each checked against the mask first: the text up to and
    including the first token the mask forbids (None when all are allowed)."""
    row = matcher(tokenizer, grammar)
    ids = tokenizer.encode(text)
    for n, token in enumerate(ids):
        if not bool(row.allowed()[token]):
            return tokenizer.decode(ids[: n + 1])
        row.advance([token])
    return None


def ends_after(tokenizer, grammar: dict, text: str) -> bool:
    """Whether, after `text`, the mask lets the model end the value: a token that closes the
    object, or EOS (the grammar is complete)."""
    row = matcher(tokenizer, grammar)
    assert not row.advance(tokenizer.encode(text)) or row.matcher.is_accepting()
    allowed = row.allowed()
    if any(bool(allowed[eos]) for eos in tokenizer.eos_token_ids) and row.matcher.is_accepting():
        return True
    return any(tokenizer.decode([t]).lstrip().startswith("}") for t in allowed.nonzero().flatten().tolist())


def test_strict_schema_forbids_keys_it_does_not_name(tokenizer):
    """Strict, an object that declares its keys takes no other (nested ones too), though the
    schema states no `additionalProperties`; not strict, JSON Schema leaves such keys open."""
    assert refused_at(tokenizer, strict(STRICT_PERSON), GOOD_PERSON) is None
    extra = '{"name": "Al", "age": 30, "colour": "red", "x": 1}'
    assert refused_at(tokenizer, strict(STRICT_PERSON), extra) == '{"name": "Al", "age": 30, "colour": "red", "x'
    nested = '{"name": "Al", "age": 30, "colour": "red", "home": {"city": "Rome", "zip": "1"}}'
    assert refused_at(tokenizer, strict(STRICT_PERSON), nested).endswith('"city": "Rome",')  # no key after city
    assert refused_at(tokenizer, {"json_schema": STRICT_PERSON}, extra) is None  # not strict: open
    # stated explicitly, `additionalProperties: false` holds whether strict or not
    closed = {**STRICT_PERSON, "additionalProperties": False}
    for grammar in ({"json_schema": closed}, strict(closed)):
        assert refused_at(tokenizer, grammar, extra) == '{"name": "Al", "age": 30, "colour": "red", "x'


def test_strict_additional_properties_schema_is_enforced_in_full(tokenizer):
    """`additionalProperties` as a schema: extra keys must match it, bounds and all, and an
    object it describes is closed too under strict."""
    schema = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
              "additionalProperties": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}},
                                       "required": ["n"]}}
    assert refused_at(tokenizer, strict(schema), '{"id": 1, "x": {"n": 5}}') is None
    assert refused_at(tokenizer, strict(schema), '{"id": 1, "x": "s"}') == '{"id": 1, "x": "'
    assert refused_at(tokenizer, strict(schema), '{"id": 1, "x": {"n": 10}}') == '{"id": 1, "x": {"n": 10'
    assert refused_at(tokenizer, strict(schema), '{"id": 1, "x": {"n": 5, "m": 1}}') == '{"id": 1, "x": {"n": 5,'


def test_missing_required_keys_cannot_end_the_object(tokenizer):
    """The mask offers no `}` (nor EOS) until every required key is written, nested ones too;
    and strict, a requirement llguidance cannot enforce is refused even where the schema's own
    `x-guidance` asks to drop what it cannot enforce (`lenient`)."""
    grammar = strict(STRICT_PERSON)
    assert not ends_after(tokenizer, grammar, '{"name": "Al", "age": 30')
    assert not ends_after(tokenizer, grammar, '{"name": "Al", "age": 30, "colour": "red", "home": {')
    assert ends_after(tokenizer, grammar, '{"name": "Al", "age": 30, "colour": "red"')
    assert ends_after(tokenizer, grammar, '{"name": "Al", "age": 30, "colour": "red", "home": {"city": "Rome"')
    assert refused_at(tokenizer, grammar, '{"name": "Al", "age": 30}') == '{"name": "Al", "age": 30}'
    lenient = {**STRICT_PERSON, "dependentRequired": {"home": ["tags"]}, "x-guidance": {"lenient": True}}
    assert "dependentRequired" in check_grammar(strict(lenient))
    with pytest.raises(CeleryTPError, match="dependentRequired"):
        matcher(tokenizer, strict(lenient))
    assert check_grammar({"json_schema": lenient}) is None  # not strict: the schema's own options apply


def test_out_of_enum_values_are_refused(tokenizer):
    """Only the enum's values (and a const's) pass the mask; strict, an enum-like keyword the
    grammar cannot enforce (OpenAPI's `nullable`, `not`) is refused rather than ignored."""
    grammar = strict(STRICT_PERSON)
    assert refused_at(tokenizer, grammar, '{"name": "Al", "age": 30, "colour": "blue"}') is None
    assert refused_at(tokenizer, grammar, '{"name": "Al", "age": 30, "colour": "pink"}') == (
        '{"name": "Al", "age": 30, "colour": "p')
    wrong_type = refused_at(tokenizer, grammar, '{"name": "Al", "age": 30, "colour": 1}')
    assert wrong_type.startswith('{"name": "Al", "age": 30, "colour":'), wrong_type  # at " " or "1": no string
    const = {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]}
    assert refused_at(tokenizer, strict(const), '{"kind": "dog"}') == '{"kind": "dog'
    for keyword in ({"nullable": True}, {"not": {"const": "red"}}):
        schema = {**STRICT_PERSON, "properties": {**STRICT_PERSON["properties"],
                                                  "colour": {"enum": ["red", "green", "blue"], **keyword}}}
        problem = check_grammar(strict(schema))
        assert problem and f"'properties.colour.{next(iter(keyword))}'" in problem, problem


OUT_OF_BOUNDS = [  # text, and the prefix whose last token the mask refuses
    ('{"name": "Al", "age": 151', '{"name": "Al", "age": 151'),  # maximum
    ('{"name": "Al", "age": -1', '{"name": "Al", "age": -'),  # minimum
    ('{"name": "Al", "age": 1.5', '{"name": "Al", "age": 1.'),  # integer
    ('{"name": "Al", "age": 30, "colour": "red", "tags": []', '{"name": "Al", "age": 30, "colour": "red", "tags": []'),
    ('{"name": "Al", "age": 30, "colour": "red", "tags": ["a", "b", "c"]',  # maxItems
     '{"name": "Al", "age": 30, "colour": "red", "tags": ["a", "b",'),
    ('{"name": "Al", "age": 30, "colour": "red", "home": {"city": "R"}',  # minLength
     '{"name": "Al", "age": 30, "colour": "red", "home": {"city": "R"}'),
]


def test_out_of_bounds_values_are_refused(tokenizer):
    """minimum/maximum (and integer), minItems/maxItems, minLength/maxLength hold at the mask;
    strict, a bound the grammar cannot enforce is refused even where the schema's `x-guidance`
    asks to drop it (`lenient`)."""
    grammar = strict(STRICT_PERSON)
    for text, refused in OUT_OF_BOUNDS:
        assert refused_at(tokenizer, grammar, text) == refused, text
    # maxLength 24: 24 characters close, a 25th cannot come (wherever the tokens fall)
    for text in ('{"name": "' + "Bo" * 12 + '", "age": 1', '{"name": "' + "xyz" * 8 + '", "age": 1'):
        assert refused_at(tokenizer, grammar, text) is None
    for text in ('{"name": "' + "Bo" * 12 + 'b", "age": 1', '{"name": "' + "xyz" * 9 + '", "age": 1'):
        got = refused_at(tokenizer, grammar, text)
        assert got is not None and len(got) > len('{"name": "') + 24, (text, got)
    tags = {"type": "array", "items": {"type": "string"}, "minContains": 1, "contains": {"const": "a"}}
    lenient = {**STRICT_PERSON, "properties": {**STRICT_PERSON["properties"], "tags": tags},
               "x-guidance": {"lenient": True}}
    problem = check_grammar(strict(lenient))
    assert problem and "'properties.tags.minContains'" in problem, problem
    assert check_grammar({"json_schema": lenient}) is None  # not strict: the schema's own options apply


def test_strict_refuses_what_the_grammar_cannot_enforce(tokenizer):
    """Strict: a misspelt or unknown keyword, llguidance's unimplemented ones and its
    approximations (`coerce_one_of`) are refused naming the keyword's place; annotations,
    `format`, `pattern` and extensions are fine. Not strict, an unknown word is an annotation."""
    base = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for extra, where in [({"maximun": 3}, "properties.a.maximun"), ({"uniqueItems": True}, "properties.a.uniqueItems")]:
        schema = {**base, "properties": {"a": {"type": "integer", **extra}}}
        problem = check_grammar(strict(schema))
        assert problem and f"'{where}'" in problem, problem
        with pytest.raises(CeleryTPError, match=where.split(".")[-1]):
            matcher(tokenizer, strict(schema))
    assert check_grammar({"json_schema": {**base, "properties": {"a": {"type": "integer", "maximun": 3}}}}) is None
    overlapping = {"type": "object", "properties": {"a": {"oneOf": [{"type": "integer"}, {"type": "number"}]}},
                   "x-guidance": {"coerce_one_of": True}}
    assert check_grammar({"json_schema": overlapping}) is None
    assert "oneOf" in check_grammar(strict(overlapping))
    fine = {**base, "title": "T", "description": "d", "$defs": {"D": {"type": "string", "format": "date"}},
            "properties": {"a": {"type": "integer", "default": 1, "examples": [2]},
                           "b": {"$ref": "#/$defs/D"}, "c": {"type": "string", "pattern": "^[a-z]+$"}},
            "x-vendor": 1}
    assert check_grammar(strict(fine)) is None
    assert refused_at(tokenizer, strict(fine), '{"a": 1, "c": "A') == '{"a": 1, "c": "A'
    assert refused_at(tokenizer, strict(fine), '{"a": 1, "b": "2020-01-01", "c": "ab"}') is None


def test_strict_reaches_the_grammar_from_response_format_and_tools():
    """The server puts strict into the request's grammar (and a strict function's parameters into
    the `required` grammar closed), and refuses what strict cannot enforce naming the field."""
    hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def grammar_of(extra: dict) -> dict:
        options = {"messages": hi["messages"]}
        structure(ChatRequest.model_validate({**hi, **extra}), options, None)
        return options["grammar"]

    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": STRICT_PERSON, "strict": True}}
    assert grammar_of({"response_format": fmt}) == {"json_schema": STRICT_PERSON, "strict": True}
    fmt["json_schema"]["strict"] = False
    assert grammar_of({"response_format": fmt}) == {"json_schema": STRICT_PERSON}
    tool = {"type": "function", "function": {"name": "f", "strict": True, "parameters": STRICT_PERSON}}
    named = {"type": "function", "function": {"name": "f"}}
    assert grammar_of({"tools": [tool], "tool_choice": named}) == {"json_schema": STRICT_PERSON, "strict": True}
    required = grammar_of({"tools": [tool, WEATHER], "tool_choice": "required"})
    assert "strict" not in required  # WEATHER is not strict: its schema is read as written
    [strict_call, _] = required["json_schema"]["items"]["anyOf"]
    assert strict_call["properties"]["arguments"]["additionalProperties"] is False
    bad = {**tool, "function": {**tool["function"], "parameters": {**STRICT_PERSON, "nullable": True}}}
    with pytest.raises(CeleryTPError, match="field 'tools.0.function.parameters'.*'nullable'"):
        grammar_of({"tools": [bad], "tool_choice": "auto"})
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {**STRICT_PERSON, "nullable": True},
                                                  "strict": True}}
    with pytest.raises(CeleryTPError, match="field 'response_format.json_schema.schema'.*'nullable'"):
        grammar_of({"response_format": fmt})


@pytest.mark.parametrize("schema, loops", [
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, True),  # answered 200 and empty, after 9.5 s
    ({"$ref": "#"}, True),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "string"}]}}, "$ref": "#/$defs/a"}, True),
    ({"$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
      "$ref": "#/$defs/node"}, False),  # recursion through a value: a tree
    ({"$defs": {"s": {"type": "string"}}, "anyOf": [{"$ref": "#/$defs/s"}, {"$ref": "#/$defs/s"}]}, False),
])
def test_a_schema_that_recurses_before_any_value_is_refused_at_once(schema, loops):
    started = time.monotonic()
    problem = check_grammar({"json_schema": schema})
    assert time.monotonic() - started < 1.0
    assert (problem is not None and "refers back to itself" in problem) == loops, problem


# ---- the Responses API (server/responses.py) -----------------------------------------------


def test_responses_answer_as_the_chat_does_and_follow_up_by_id(client, served):
    """A text response is the chat completion of the same conversation (greedy: the same text);
    `previous_response_id` continues it, the earlier instructions left behind; a response not
    stored cannot be named."""
    hello = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=12,
                                    temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}])
    assert hello.id.startswith("resp_") and hello.object == "response"
    assert hello.output_text == chat.choices[0].message.content and hello.output[0].type == "message"
    assert hello.usage.input_tokens == chat.usage.prompt_tokens
    assert hello.usage.output_tokens == chat.usage.completion_tokens
    assert hello.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")

    more = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Again, louder."}]}], previous_response_id=hello.id, max_output_tokens=12,
        temperature=0)
    again = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "user", "content": "Say hello."}, {"role": "assistant", "content": hello.output_text},
        {"role": "user", "content": "Again, louder."}])
    assert more.output_text == again.choices[0].message.content and more.previous_response_id == hello.id

    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_responses_structured_output_and_function_calls(client):
    person = client.responses.create(model=MODEL, input="Invent a person.", max_output_tokens=80, temperature=0,
                                     text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                      "strict": True}})
    matches_person(json.loads(person.output_text))
    weather = {"type": "function", **WEATHER["function"]}
    called = client.responses.create(model=MODEL, input="What is the weather in Paris?", tools=[weather],
                                     tool_choice="required", max_output_tokens=80, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id.startswith("call_") for c in calls)
    assert all(set(json.loads(c.arguments)) == {"city", "unit"} for c in calls)
    answered = client.responses.create(model=MODEL, previous_response_id=called.id, max_output_tokens=20,
                                       tools=[weather], temperature=0, input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"celsius": 21}'}])
    assert answered.output and answered.status in ("completed", "incomplete")


def test_responses_stream_the_semantic_events(client):
    def events(max_output_tokens: int = 12, **fields) -> list:
        return list(client.responses.create(model=MODEL, stream=True, max_output_tokens=max_output_tokens,
                                            temperature=0, **fields))

    text = events(input="Say hello.")
    kinds = [e.type for e in text]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in text] == list(range(len(text)))
    deltas = "".join(e.delta for e in text if e.type == "response.output_text.delta")
    assert deltas and deltas == text[-1].response.output_text
    assert deltas == client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12,
                                             temperature=0).output_text
    weather = {"type": "function", **WEATHER["function"]}
    called = events(80, input="What is the weather in Paris?", tools=[weather], tool_choice="required")
    arguments = [e for e in called if e.type == "response.function_call_arguments.done"]
    assert arguments and all(set(json.loads(e.arguments)) == {"city", "unit"} for e in arguments)
    assert called[-1].type == "response.completed"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                             {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0].content[1]"),
    ({"instructions": "Be brief.", "input": [  # named within input, not within the chat it becomes
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]}]},
     "input[0].content[0]"),
    ({"input": "Hi", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "Hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": [{"type": "file_search_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": "Hi", "instructions": "Be brief.", "tools": [{"type": "function", "name": "f", "parameters": []}]},
     "tools.0.parameters"),
])
def test_responses_refuse_what_they_cannot_take_by_name(served, body, param):
    refused = httpx.post(f"{served.url}/v1/responses", json={"model": MODEL, **body})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
