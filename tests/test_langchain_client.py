"""A second real client, LangChain's ChatOpenAI, against a real `celerytp serve` (TP=2): chat, streaming,
tool calls and structured output (llguidance-constrained, server/tools.py) through a client stack that
builds its requests and parses the answers (streamed chunks included) itself. Where a plain openai
request is the reference, it is the same greedy request sent to the same server."""

from __future__ import annotations

import functools
import operator
from typing import Literal

import openai
import pytest
from langchain_core.messages import AIMessage
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from server_fixtures import MODEL, start_served

GREETING = "Say hello to Ada in one short sentence."
ASK = "What is the weather in Paris?"


class GetWeather(BaseModel):
    """The weather in a city now."""

    city: str = Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]


class Person(BaseModel):
    name: str = Field(max_length=16)
    age: int = Field(ge=0, le=150)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with start_served(tmp_path_factory, "--max-batch", "4", tp=2) as served:
        yield served


def chat_model(served, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{served.url}/v1", api_key="unused", model=MODEL, temperature=0,
                      max_tokens=max_tokens, max_retries=0, timeout=120)


def test_invoke_matches_the_openai_client(served):
    reply = chat_model(served, 12).invoke(GREETING)  # LangChain sends max_completion_tokens, openai max_tokens
    plain = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)
    reference = plain.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": GREETING}],
                                              max_tokens=12, temperature=0)
    assert reference.choices[0].finish_reason == "length"  # cut short: the limit reached the server
    assert isinstance(reply, AIMessage) and reply.content == reference.choices[0].message.content
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.usage_metadata["output_tokens"] == reference.usage.completion_tokens == 12


def test_stream_concatenates_to_the_invoke_text(served):
    model = chat_model(served, 24)
    chunks = list(model.stream(GREETING))
    assert len(chunks) > 2  # streamed piecewise, not one final chunk
    assert "".join(chunk.content for chunk in chunks) == model.invoke(GREETING).content


def test_bound_tool_required_gives_a_valid_call(served):
    reply = chat_model(served, 48).bind_tools([GetWeather], tool_choice="required", strict=True).invoke(ASK)
    assert reply.tool_calls, reply
    for call in reply.tool_calls:
        assert call["name"] == "GetWeather" and call["id"].startswith("call_")
        GetWeather.model_validate(call["args"])
    assert reply.response_metadata["finish_reason"] == "tool_calls"


def test_streamed_tool_call_aggregates_to_the_invoked_call(served):
    model = chat_model(served, 48).bind_tools([GetWeather], tool_choice="GetWeather", strict=True)
    [invoked] = model.invoke(ASK).tool_calls
    chunks = list(model.stream(ASK))
    aggregate = functools.reduce(operator.add, chunks)
    [streamed] = aggregate.tool_calls
    assert (streamed["name"], streamed["args"]) == (invoked["name"], invoked["args"])  # greedy: the same call
    GetWeather.model_validate(streamed["args"])
    assert aggregate.response_metadata["finish_reason"] == "tool_calls"


def test_structured_output_json_schema(served):
    person = chat_model(served, 40).with_structured_output(Person, method="json_schema").invoke("Invent a person.")
    assert isinstance(person, Person)
