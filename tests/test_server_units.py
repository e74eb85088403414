"""The server's pure parts, without a cluster: request validation, error statuses, secret masking."""

from __future__ import annotations

import pytest

from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.secrets import mask_secrets
from celerytp.server.errors import from_celerytp
from celerytp.server.schemas import ChatRequest, CompletionRequest, TaskRequest, parse


@pytest.mark.parametrize(("kind", "status"), [
    (ErrorKind.BAD_REQUEST, 400), (ErrorKind.MODEL_NOT_LOADED, 404), (ErrorKind.OVERLOADED, 429),
    (ErrorKind.RANK_LOST, 503), (ErrorKind.NOT_INITIALISED, 503), (ErrorKind.TIMEOUT, 504),
    (ErrorKind.FORWARD_FAILED, 500),
])
def test_each_kind_has_its_status(kind, status):
    assert from_celerytp(CeleryTPError(kind, "x"))[0] == status


def test_a_rank_failure_is_named_and_a_field_is_the_param():
    error = CeleryTPError.from_failures("generate", [RankFailure(1, ErrorKind.RANK_LOST, "no live worker")])
    status, body = from_celerytp(error)
    assert status == 503 and "rank 1" in body["error"]["message"]
    assert from_celerytp(CeleryTPError(ErrorKind.BAD_REQUEST, "field 'top_p': too big"))[1]["error"]["param"] == "top_p"


def test_bodies_are_checked_with_the_field_named():
    def refused(model, body) -> str:
        with pytest.raises(CeleryTPError) as caught:
            parse(model, body)
        assert caught.value.kind is ErrorKind.BAD_REQUEST
        return caught.value.message

    assert refused(ChatRequest, {"model": "m", "messages": []}).startswith("field 'messages'")
    assert refused(ChatRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]}).startswith(
        "field 'messages.0.role'")
    assert refused(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).startswith("field 'prompt'")
    assert refused(CompletionRequest, {"model": "m", "prompt": "a", "stop": list("abcde")}).startswith("field 'stop'")
    assert refused(TaskRequest, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).startswith(
        "field 'body': give exactly one")
    assert refused(TaskRequest, ["not", "an", "object"]).startswith("field 'body'")
    hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert refused(ChatRequest, {**hi, "unknown_sdk_field": 1}).startswith(
        "field 'unknown_sdk_field': not a field")  # never silently ignored
    for name, value in [("suffix", "x"), ("best_of", 2), ("best_of", True)]:
        assert refused(CompletionRequest, {"model": "m", "prompt": "a", name: value}).startswith(
            f"field '{name}': not supported"), name
    assert refused(ChatRequest, {**hi, "stream": "yes"}).startswith("field 'stream'")  # no coercion
    assert refused(ChatRequest, {**hi, "max_tokens": "5"}).startswith("field 'max_tokens'")
    assert refused(ChatRequest, {**hi, "logprobs": 1}).startswith("field 'logprobs'")
    for bad in (float("nan"), float("inf")):
        assert refused(ChatRequest, {**hi, "temperature": bad}) == "field 'temperature': must be a finite number"
    assert refused(ChatRequest, {**hi, "stream_options": {"include_usage": "yes"}}).startswith(
        "field 'stream_options.include_usage'")
    assert refused(ChatRequest, {**hi, "top_k": -2}).startswith("field 'top_k'")
    assert refused(ChatRequest, {**hi, "repetition_penalty": 0}).startswith("field 'repetition_penalty'")
    assert refused(ChatRequest, {**hi, "top_logprobs": 2}) == 'field \'top_logprobs\': needs "logprobs": true'
    for n in (0, 17, "2", 2.0, True):
        assert refused(ChatRequest, {**hi, "n": n}).startswith("field 'n'"), n
    assert refused(ChatRequest, {**hi, "n": 2, "response_format": {"type": "json_object"}}).startswith("field 'n'")
    assert refused(CompletionRequest, {"model": "m", "prompt": "a", "echo": True, "logprobs": 1, "stream": True}
                   ).startswith("field 'echo': not with \"logprobs\" in a stream")


def test_options_map_openai_names_to_the_leader():
    chat = parse(ChatRequest, {"model": "m", "max_tokens": 5, "max_completion_tokens": 7, "logprobs": True,
                               "top_logprobs": 3, "presence_penalty": 0, "top_k": -1, "repetition_penalty": 1.2,
                               "messages": [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]}]})
    options = chat.options()
    assert options["max_tokens"] == 7 and options["logprobs"] == 3
    assert options["top_k"] == 0 and options["repetition_penalty"] == 1.2 and options["presence_penalty"] == 0
    assert options["messages"] == [{"role": "system", "content": "be brief"}]
    text = {"model": "m", "prompt": "a", "logprobs": 2}
    assert parse(CompletionRequest, {**text, "echo": True}).options()["prompt_logprobs"] == 2  # the prompt's too
    assert parse(CompletionRequest, text).options()["prompt_logprobs"] is None


def test_url_passwords_are_masked():
    text = "redis://:pw1@h:6379/0 rediss://user:pw2@h/1 redis://h:6379/0"
    assert mask_secrets(text) == "redis://:***@h:6379/0 rediss://user:***@h/1 redis://h:6379/0"
