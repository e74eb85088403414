"""The Celery front door (`celerytp.generate`) of a real `celerytp serve --tp 1`, driven by a plain
Celery producer that knows only the task name, the queue and the broker: progress in the task's
state, revoke with terminate, refused kwargs and arguments, the same error kinds as over HTTP,
dead-lettered messages failing their task, and the traffic counted in the server's /metrics."""

from __future__ import annotations

import base64
import json
import time
import uuid

import httpx
import openai
import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError
from celery.result import AsyncResult
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MODEL, start_served

from celerytp.core.keys import queue_key
from celerytp.core.safe_transport import dead_letter_key

QUEUE = "celerytp.srv.requests"
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with start_served(tmp_path_factory, "--max-batch", "2", tp=1) as served:
        yield served


@pytest.fixture(scope="module")
def producer(served):
    app = Celery("plain-producer", broker=served.broker_url, backend=served.broker_url)
    yield app
    app.close()


def send(producer: Celery, *args, **kwargs) -> AsyncResult:
    return producer.send_task("celerytp.generate", args=list(args), kwargs=kwargs, queue=QUEUE)


def progress_of(result: AsyncResult, after: int = 0, deadline_s: float = 60) -> dict:
    """The first PROGRESS info of a running task that shows text and more than `after` tokens."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if result.state == "PROGRESS" and result.info.get("tokens", 0) > after and result.info.get("text"):
            return result.info
        assert result.state in ("PENDING", "PROGRESS"), (result.state, result.info)
        time.sleep(0.05)
    raise AssertionError(f"the task never reported progress past {after} tokens")


def test_progress_moves_and_revoke_with_terminate_cancels(producer, served):
    """Long enough on any hardware to be seen running; Celery's threads pool cannot kill it
    (`TaskPool does not implement kill_job`), the task sees its revocation and cancels its request."""
    result = send(producer, prompt="Tell me a long story.", max_tokens=3000, ignore_eos=True, temperature=0)
    first = progress_of(result)
    assert first["model"] == MODEL and 0 < first["tokens"] < 3000
    later = progress_of(result, after=first["tokens"])
    assert later["text"].startswith(first["text"]) and len(later["text"]) > len(first["text"])
    producer.control.revoke(result.id, terminate=True)
    with pytest.raises(TaskRevokedError, match="revoked"):
        result.get(timeout=30)
    assert result.state == "REVOKED"
    deadline = time.monotonic() + 30
    while served.leader.serving_stats(MODEL).get("running_rows", 0):  # its row frees
        assert time.monotonic() < deadline, served.leader.serving_stats(MODEL)
        time.sleep(0.1)


@pytest.mark.parametrize(("args", "kwargs", "field"), [
    ((), {"prompt": "x", "max_token": 5}, "max_token"),  # a typo is not ignored
    ((), {"prompt": "x", "stream": True}, "stream"),  # progress is the task's state, not a stream
    (("x",), {"max_tokens": 5}, "args"),  # positional
    ((), {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ((), {"prompt": "x", "n": 2}, "n"),
    ((), {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
     "response_format.json_schema.schema"),
    ((), {"prompt": "x", "response_format": "json"}, "response_format"),
    ((), {"prompt": "x", "tools": [WEATHER]}, "tools"),  # tools need messages
])
def test_bad_calls_fail_with_a_typed_error_naming_the_field(producer, served, args, kwargs, field):
    result = send(producer, *args, **kwargs)
    with pytest.raises(RuntimeError, match=rf"^bad_request: field '{field}': "):
        result.get(timeout=60)
    assert result.state == "FAILURE"
    assert served.leader.redis.llen(queue_key(MODEL)) == 0  # nothing queued
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_structured_output_and_tool_calls_as_over_http(producer, served):
    """`response_format` and a forced tool call through the task: greedy, the HTTP API's answer."""
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "properties": {"wet": {"type": "boolean"}}, "required": ["wet"], "additionalProperties": False}}}
    asks = [({"response_format": fmt}, "Is water wet?"), ({"tools": [WEATHER], "tool_choice": "required"}, "Weather in Oslo?")]
    for extra, question in asks:
        request = {"messages": [{"role": "user", "content": question}], "max_tokens": 24, "temperature": 0, **extra}
        reply = send(producer, **request).get(timeout=120)
        http = client.chat.completions.create(model=MODEL, **request).choices[0]
        assert reply["finish_reason"] == http.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in http.message.tool_calls or []]
        assert bool(calls) == ("tools" in extra)
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in reply.get("tool_calls", [])] == calls
        if calls:
            assert reply["finish_reason"] == "tool_calls" and json.loads(calls[0][1])["city"]
        else:
            assert reply["text"] == http.message.content and isinstance(json.loads(reply["text"])["wet"], bool)


def test_an_unknown_model_is_the_same_kind_over_http_and_celery(producer, served):
    with pytest.raises(RuntimeError, match=r"^model_not_found: model 'nope' is not loaded"):
        send(producer, model="nope", prompt="x", max_tokens=2).get(timeout=60)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    assert caught.value.body["code"] == "model_not_found"


def _envelope(task_id: str, body: str, content_type: str = "application/json") -> str:
    return json.dumps({
        "body": base64.b64encode(body.encode()).decode(), "content-encoding": "utf-8", "content-type": content_type,
        "headers": {"id": task_id, "task": "celerytp.generate", "lang": "py"},
        "properties": {"delivery_tag": str(uuid.uuid4()), "body_encoding": "base64", "delivery_info": {
            "exchange": "", "routing_key": QUEUE}, "correlation_id": task_id},
    })


@pytest.mark.parametrize(("body", "content_type", "why"), [
    ('"not a task"', "application/json", "not a task message"),
    ("cos\nsystem\n(S'true'\ntR.", "application/x-python-serialize", "JSON only"),  # a pickle: never run
])
def test_a_dead_lettered_message_fails_its_task(producer, served, body, content_type, why):
    """Without this the producer would wait PENDING to its own timeout."""
    task_id = str(uuid.uuid4())
    served.leader.redis.lpush(QUEUE, _envelope(task_id, body, content_type))
    result = producer.AsyncResult(task_id)
    with pytest.raises(RuntimeError, match=rf"^bad_request: the message was refused and dead-lettered: .*{why}"):
        result.get(timeout=30)
    assert result.state == "FAILURE"
    assert any(task_id.encode() in item for item in served.leader.redis.lrange(dead_letter_key(QUEUE), 0, -1))
    assert send(producer, prompt="Hi", max_tokens=2).get(timeout=60)["usage"]["completion_tokens"] <= 2


def _generated(url: str) -> float:
    samples = {s.name: s.value for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
               for s in family.samples if s.labels.get("model") == MODEL}
    return samples.get("celerytp_generation_tokens_total", samples.get("celerytp_generated_tokens_total", 0.0))


def test_celery_traffic_is_counted_in_the_servers_metrics(producer, served):
    before = _generated(served.url)
    reply = send(producer, prompt="Count:", max_tokens=7, ignore_eos=True).get(timeout=60)
    assert reply["usage"]["completion_tokens"] == 7
    assert _generated(served.url) - before == 7
