"""The server's pure parts, without a cluster: request validation, error statuses, secret masking."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celerytp.client.generation import PROMPT_CHARS_PER_TOKEN, prepare
from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.secrets import clipped, mask_secrets
from celerytp.server.errors import MAX_MESSAGE, MAX_PARAM, error_body, from_celerytp
from celerytp.server.limits import RequestLimits
from celerytp.server.schemas import ChatRequest, CompletionRequest, TaskRequest, parse
from celerytp.server.service import Service


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
    assert refused(CompletionRequest, {"model": "m", "prompt": ["a", [1, 2]]}).startswith("field 'prompt'")
    assert refused(CompletionRequest, {"model": "m", "prompt": [1, True]}).startswith("field 'prompt'")
    assert refused(CompletionRequest, {"model": "m", "prompt": "a", "stop": list("abcde")}).startswith("field 'stop'")
    assert refused(TaskRequest, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}).startswith(
        "field 'body': give exactly one")
    assert refused(TaskRequest, ["not", "an", "object"]).startswith("field 'body'")
    hi = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert refused(ChatRequest, {**hi, "unknown_sdk_field": 1}).startswith(
        "field 'unknown_sdk_field': not a field")  # never silently ignored
    for name, value in [("best_of", 2), ("best_of", True)]:
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


def test_masking_is_linear_in_what_callers_send():
    """The regex it replaced took quadratic time on runs of letters (16k: 0.27 s, 64k: about 4 s,
    1 MB: most of an hour) and on "a://:a://:..." (every start read the rest): error messages
    echo caller input, on the event loop."""
    for text, bound in [("a" * 64_000 + "://u:pw@h", 0.1),  # the old regex: about 4 s
                        ("a://:" * 20_000, 0.1),  # 100 KB; the old regex: about 13 s
                        ("a" * 1_000_000 + "://u:pw@h", 0.5), ("a://:" * 200_000, 1.0)]:
        started = time.perf_counter()
        masked = mask_secrets(text)
        assert time.perf_counter() - started < bound, (len(text), text[:10])
        assert "pw" not in masked or text.startswith("a://")


def test_masking_still_finds_every_password():
    cases = {
        "x redis://:p@h y": "x redis://:***@h y", "1redis://u:p:q/r@h": "1redis://u:***@h",
        "a.b+c-d://u:p@h": "a.b+c-d://u:***@h", "redis://:pa://:x@h redis://:y@h": "redis://:***@h redis://:***@h",
        "1+://u:p@h": "1+://u:p@h", "redis://u@h redis://:@h redis://:p h@": "redis://u@h redis://:@h redis://:p h@",
        "https://user:pw@host/path?q=1 and redis://:pw2@h": "https://user:***@host/path?q=1 and redis://:***@h",
    }
    for text, expected in cases.items():
        assert mask_secrets(text) == expected, text


def test_error_messages_clip_what_callers_sent():
    assert clipped("m" * 10_000) == "m" * 64 + "…" and clipped("short") == "short"
    assert clipped("\ud800x") == "\\ud800x"  # encodable as UTF-8
    body = error_body(404, "model " + "m" * 100_000 + " redis://:secret@h", "model_not_found", "p" * 10_000)
    assert len(body["error"]["message"]) <= MAX_MESSAGE + 1 and len(body["error"]["param"]) <= MAX_PARAM + 1
    assert "secret" not in error_body(400, "x" * (MAX_MESSAGE - 12) + " redis://:secret-password@h", None)["error"][
        "message"]  # masked before it is cut: a cut never shows the start of a password
    assert "secret" not in error_body(400, "broker redis://:secret@h unreachable", None)["error"]["message"]


def test_errors_name_what_the_caller_wrote():
    status, body = from_celerytp(CeleryTPError(ErrorKind.BAD_REQUEST, "field 'grammar': cannot compile"),
                                 "response_format")
    assert status == 400 and body["error"]["param"] == "response_format"
    assert body["error"]["message"] == "field 'response_format': cannot compile"
    message = error_body(422, "field 'path': OSError: [Errno 36] File name too long: 'x'", None)["error"]["message"]
    assert message == "field 'path': File name too long: 'x'"
    message = error_body(400, "field 'tools': RecursionError: maximum recursion depth exceeded", None)["error"]["message"]
    assert message == "field 'tools': nested too deeply"


def test_prompts_are_checked_before_tokenizing():
    """A prompt the context cannot hold, or one with a lone surrogate, is refused naming its field
    before the tokenizer is even loaded (the record's path does not exist: loading it would fail)."""
    record = {"path": "/nonexistent/model", "max_context": 100, "vocab_size": 1000}

    def refused(**request) -> CeleryTPError:
        with pytest.raises(CeleryTPError) as caught:
            prepare(record, **request)
        return caught.value

    too_long = refused(prompt="x" * (100 * PROMPT_CHARS_PER_TOKEN + 1))
    assert too_long.kind is ErrorKind.BAD_REQUEST and too_long.message.startswith("field 'prompt': longer than")
    many = [{"role": "user", "content": "y" * 1000}] * 4
    assert refused(messages=many).message.startswith("field 'messages': longer than")
    surrogate = refused(messages=[{"role": "user", "content": "hi \ud800"}])
    assert surrogate.kind is ErrorKind.BAD_REQUEST and surrogate.message.startswith("field 'messages': not valid Unicode")
    assert refused(prompt="\udfff").message.startswith("field 'prompt': not valid Unicode")
    fits = refused(prompt="x" * (100 * PROMPT_CHARS_PER_TOKEN))  # within the cap: on to the tokenizer
    assert "no such file" in fits.message


class _Leader:
    """A leader with one model and no cluster: a generation runs the leader's own checks (prepare)."""

    group, world_size = "g", 2

    def models(self) -> dict:
        return {"m": {"path": "/nonexistent/model", "max_context": 100, "vocab_size": 1000, "replicas": {}}}

    def rebuild_registry(self) -> None:
        pass

    def generate(self, model_id: str, prompt=None, messages=None, **options):
        if options.get("grammar"):  # as rank 0 refuses a grammar it cannot compile (worker/grammar.py)
            raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'grammar': cannot compile it")
        prepare(self.models()[model_id], prompt=prompt, messages=messages, **options)
        raise AssertionError("not reached: the record's path does not exist")

    stream = generate  # raises as generate does, before any stream opens


class _Service(Service):
    """The real service over _Leader, with no Redis to check the ranks in or count errors in."""

    def require_ranks(self, model_id: str) -> None:
        pass

    def count_error(self, model_id: str, exc: CeleryTPError) -> None:
        pass


@pytest.fixture
def api():
    from fastapi.testclient import TestClient

    from celerytp.server.http import create_app

    def client(limits: RequestLimits | None = None, **options) -> TestClient:
        return TestClient(create_app(_Service(_Leader(), limits=limits), **options), raise_server_exceptions=False)

    return client


def test_a_body_over_the_limit_is_refused_before_it_is_parsed(api):
    client = api(payload_limit=10_000)
    for body in (b"{" * 10_001, (b"[" * 1000 for _ in range(11))):  # by its Content-Length; chunked, as it comes
        refused = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
        assert refused.status_code == 413, refused.text
        assert refused.json()["error"] == {
            "message": "request body larger than 10000 bytes (the server's limit, celerytp serve --payload-limit)",
            "type": "invalid_request_error", "param": None, "code": "request_too_large"}
    fits = client.post("/v1/chat/completions", content=b"{" * 9_000, headers={"Content-Type": "application/json"})
    assert fits.status_code == 400 and fits.json()["error"]["param"] == "body"  # read, then parsed: not JSON


def test_hostile_values_get_a_quick_4xx(api):
    client = api()
    hi = [{"role": "user", "content": "hi"}]
    started = time.perf_counter()
    unknown = client.post("/v1/chat/completions", json={"model": "a" * 100_000, "messages": hi})
    assert unknown.status_code == 404 and len(unknown.json()["error"]["message"]) < 200
    field = client.post("/v1/chat/completions", json={"model": "m", "messages": hi, "b" * 100_000: 1})
    assert field.status_code == 400 and len(field.json()["error"]["param"]) <= MAX_PARAM + 1
    assert time.perf_counter() - started < 2  # each took 15-20 s on the event loop
    surrogate = client.post("/v1/chat/completions", content=b'{"model": "m", "messages": [{"role": "user", '
                                                            b'"content": "\\ud800"}]}')
    assert surrogate.status_code == 400 and surrogate.json()["error"]["param"] == "messages"
    named = client.post("/v1/chat/completions", content=b'{"model": "\\ud800", "messages": []}')
    assert named.status_code == 400 and named.json()["error"]["param"] == "messages"
    echoed = client.post("/v1/chat/completions", content=b'{"model": "\\ud800x", "messages": [{"role": "user", '
                                                         b'"content": "hi"}]}')
    assert echoed.status_code == 404 and "\\ud800x" in echoed.json()["error"]["message"]
    grammar = client.post("/v1/chat/completions", json={"model": "m", "messages": hi,
                                                         "response_format": {"type": "json_object"}})
    assert grammar.status_code == 400 and grammar.json()["error"]["param"] == "response_format"
    assert grammar.json()["error"]["message"] == "field 'response_format': cannot compile it"
    long_prompt = client.post("/v1/completions", json={"model": "m", "prompt": "x" * 1_000_000})
    assert long_prompt.status_code == 400 and long_prompt.json()["error"]["param"] == "prompt"
    assert "longer than the model's context" in long_prompt.json()["error"]["message"]


def test_stop_strings_and_schemas_over_their_limits_get_a_400_naming_them(api):
    client = api(RequestLimits(schema_bytes=2000, stop_chars=8))
    hi = [{"role": "user", "content": "hi"}]

    def refused(**fields) -> dict:
        answer = client.post("/v1/chat/completions", json={"model": "m", "messages": hi, **fields})
        assert answer.status_code == 400, answer.text
        return answer.json()["error"]

    assert refused(stop=["end", "x" * 9])["param"] == "stop[1]"
    assert refused(stop="x" * 9)["message"] == "field 'stop': 9 characters; a stop string may have at most 8"
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(100)}}
    error = refused(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": big}})
    assert error["param"] == "response_format.json_schema.schema" and "at most 2000 are taken" in error["message"]
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": "string"} for j in range(12)}}}} for i in range(10)]
    assert refused(tools=tools)["param"] == "tools"  # each fits; together they do not
    within = client.post("/v1/chat/completions", json={"model": "m", "messages": hi, "stop": "x" * 8,
                                                        "tools": tools[:2]})
    assert "no such file" in within.json()["error"]["message"]  # on to the tokenizer: nothing refused


def test_the_request_limits_are_serve_options_and_front_door_variables(monkeypatch):
    from celerytp.cli import build_parser, request_limits

    monkeypatch.delenv("CELERYTP_MAX_SCHEMA_BYTES", raising=False)
    monkeypatch.setenv("CELERYTP_MAX_STOP_CHARS", "64")
    parse = build_parser().parse_args
    assert request_limits(parse(["serve"])) == RequestLimits(stop_chars=64)
    assert request_limits(parse(["serve", "--max-schema-bytes", "1000", "--max-stop-chars", "9"])) == RequestLimits(
        schema_bytes=1000, stop_chars=9)
    with pytest.raises(CeleryTPError, match=r"--max-stop-chars, \$CELERYTP_MAX_STOP_CHARS\) must be in 1..4096"):
        request_limits(parse(["serve", "--max-stop-chars", "5000"]))
    monkeypatch.setenv("CELERYTP_MAX_SCHEMA_BYTES", "lots")
    with pytest.raises(CeleryTPError, match="CELERYTP_MAX_SCHEMA_BYTES must be an integer, got 'lots'"):
        request_limits(parse(["serve"]))
    assert RequestLimits.from_env(RequestLimits(schema_bytes=5).as_env()) == RequestLimits(schema_bytes=5)


def test_the_celery_task_names_the_field_its_grammar_came_from():
    from celerytp.server.frontend import run_request

    body = parse(TaskRequest, {"model": "m", "prompt": "hi", "response_format": {"type": "json_object"}})
    with pytest.raises(CeleryTPError) as info:
        run_request(_Service(_Leader()), body)
    assert info.value.message == "field 'response_format': cannot compile it"


def test_the_payload_limit_is_a_serve_option():
    from celerytp.cli import build_parser
    from celerytp.server.config import ServeConfig
    from celerytp.server.http import DEFAULT_PAYLOAD_LIMIT

    assert ServeConfig("m.gguf", "m").payload_limit == DEFAULT_PAYLOAD_LIMIT == 4 << 20
    with pytest.raises(CeleryTPError, match="--payload-limit must be >= 1"):
        ServeConfig("m.gguf", "m", payload_limit=0)
    assert build_parser().parse_args(["serve", "--payload-limit", "1000"]).payload_limit == 1000


def test_an_admin_path_with_a_name_too_long_for_any_file_system_is_refused_here():
    """Before: the ranks tried it and answered `OSError: [Errno 36] File name too long`."""
    from celerytp.server.http import load_fields

    with pytest.raises(CeleryTPError, match=r"field 'path': a file or directory name is at most 255 bytes"):
        load_fields({"model": "x", "path": "/models/" + "a" * 256 + "/model.gguf"})
    assert load_fields({"model": "x", "path": "/models/" + "a" * 255})[1] == "/models/" + "a" * 255


_TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udfffb", "x" * 5000, "{\"$ref\": \"#\"}"])
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner, max_size=4),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=st.lists(_JSON, max_size=1),
       kwargs=st.dictionaries(st.sampled_from([*sorted(TaskRequest.model_fields), "surprise"]), _JSON, max_size=6))
def test_celery_task_arguments_of_any_shape_get_a_typed_error(args, kwargs):
    """What a producer can send `celerytp.generate`: the task checks it as it would in a worker
    (up to the leader's own checks, which find no model file here) and raises only CeleryTPError."""
    from celerytp.server.frontend import check_call, run_request

    with pytest.raises(CeleryTPError):
        run_request(_Service(_Leader()), check_call(tuple(args), kwargs))
