"""The operator's side of `celerytp serve`: keys (several inference keys, an admin key of its own,
none on the command line), OpenAI-shaped errors everywhere, request ids and the access log,
/health for anonymous callers, /v1/models' vLLM fields, type-checked admin loads. One real
server (`--tp 1`, embedded Redis and rank worker), the real openai client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from server_fixtures import MODEL, cli, start_served

from celerytp.client.leader import Leader
from celerytp.core.errors import CeleryTPError, ErrorKind

KEYS = ("inference-key-one", "inference-key-two")
ADMIN = "the-admin-key-789"
METRICS = "the-metrics-key-456"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "admin.key"
    key_file.write_text(f"# the operator's key\n{ADMIN}\n")
    with start_served(tmp_path_factory, "--admin-key-file", str(key_file), "--max-batch", "2", tp=1,
                      env={"CELERYTP_API_KEYS": ",".join(KEYS), "CELERYTP_METRICS_KEY": METRICS}) as served:
        yield served


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def openai_error(response: httpx.Response, status: int) -> dict:
    """The body's `error`, checked to be OpenAI's shape with the expected status."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str), error
    return error


def test_every_inference_key_works_and_none_opens_admin(served):
    for key in KEYS:
        client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=key, max_retries=0)
        assert [m.id for m in client.models.list().data] == [MODEL]
    for key in (*KEYS, "wrong"):  # the inference keys do not open /admin
        refused = httpx.post(f"{served.url}/admin/models", json={"model": "x"}, headers=bearer(key))
        assert openai_error(refused, 401)["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{served.url}/v1", api_key=ADMIN, max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # nor does the admin key open inference
        wrong.models.list()


def test_unknown_endpoints_and_methods_answer_in_openai_shape_after_the_key(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEYS[0], max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model=MODEL, input="hi")
    assert caught.value.body["code"] == "not_found"
    anonymous = openai.OpenAI(base_url=f"{served.url}/v1", api_key="nobody", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # 401 first: nothing learned about what exists
        anonymous.embeddings.create(model=MODEL, input="hi")
    assert openai_error(httpx.get(f"{served.url}/v1/embeddings"), 401)["type"] == "authentication_error"
    assert openai_error(httpx.get(f"{served.url}/v1/completions", headers=bearer(KEYS[1])), 405)["code"] == \
        "method_not_allowed"
    assert openai_error(httpx.get(f"{served.url}/no/such/thing", headers=bearer(KEYS[1])), 404)["code"] == "not_found"


def test_bad_bodies_are_400s_and_the_server_stays_healthy(served):
    auth = bearer(KEYS[0])
    deep = b'{"model": "smol", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = openai_error(httpx.post(f"{served.url}/v1/completions", content=deep, headers=auth), 400)
    assert error["param"] == "body" and "nested too deeply" in error["message"]
    assert openai_error(httpx.post(f"{served.url}/v1/chat/completions", content=b"\xff", headers=auth), 400)[
        "param"] == "body"
    assert served.leader.serving_stats(MODEL)["queued"] == 0  # nothing queued
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEYS[0], max_retries=0)
    assert client.completions.create(model=MODEL, prompt="One, two,", max_tokens=2).usage.completion_tokens >= 1


def test_request_id_is_echoed_and_logged_without_keys(served):
    auth = bearer(KEYS[0])
    mine = httpx.get(f"{served.url}/v1/models", headers={**auth, "X-Request-Id": "trace-42.a:b"})
    assert mine.headers["x-request-id"] == "trace-42.a:b"
    made = httpx.get(f"{served.url}/v1/models", headers={**auth, "X-Request-Id": "bad id\twith" + "x" * 300})
    assert made.headers["x-request-id"] != "" and " " not in made.headers["x-request-id"]
    assert len(made.headers["x-request-id"]) <= 128
    refused = httpx.get(f"{served.url}/v1/models", headers={"X-Request-Id": "refused-1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "refused-1"
    line = logged_line(served, "request_id=trace-42.a:b")
    assert "GET /v1/models 200" in line and "ms" in line
    assert "GET /v1/models 401" in logged_line(served, "request_id=refused-1")
    log = open(served.log_path).read()
    for secret in (*KEYS, ADMIN):
        assert secret not in log


def logged_line(served, needle: str, within_s: float = 5.0) -> str:
    """The server log's line with `needle`. The access line is written once the response has gone
    out, so a client can read the log before it is there: wait for it, up to `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        line = next((line for line in open(served.log_path).read().splitlines() if needle in line), None)
        if line is not None:
            return line
        assert time.monotonic() < deadline, f"no log line with {needle!r} within {within_s} s"
        time.sleep(0.05)


def test_models_list_vllm_fields(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEYS[1], max_retries=0)
    card = client.models.list().data[0]
    record = served.leader.models()[MODEL]
    assert card.max_model_len == record["max_context"] > 0
    assert card.root == record["path"] and os.path.exists(card.root)  # where tools find the tokenizer
    assert client.models.retrieve(MODEL).max_model_len == record["max_context"]


def test_health_tells_anonymous_callers_only_up_or_down(served):
    anonymous = httpx.get(f"{served.url}/health")
    assert anonymous.status_code == 200 and anonymous.json() == {"ok": True, "status": "up"}
    assert str(served.leader.health()[0]["pid"]) not in anonymous.text
    for key in (KEYS[0], "wrong"):  # an inference key or a wrong one: still the short answer
        assert httpx.get(f"{served.url}/health", headers=bearer(key)).json() == {"ok": True, "status": "up"}
    detail = httpx.get(f"{served.url}/health", headers=bearer(ADMIN)).json()
    assert detail["ranks"][0]["pid"] == served.leader.health()[0]["pid"] and detail["group"] == served.group


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "x", "path": 12}, "path"),
    ({"model": "x", "path": [1]}, "path"),
    ({"model": "x", "path": "/models/a\x00b.gguf"}, "path"),
    ({"model": 7}, "model"),
    ({"model": ""}, "model"),
    ({"model": "x", "max_batch": "2"}, "max_batch"),
    ({"model": "x", "max_batch": True}, "max_batch"),
    ({"model": "x", "max_context": 0}, "max_context"),
    ({"model": "x", "max_queue": 1.5}, "max_queue"),
    ({"model": "x", "quant": 8}, "quant"),
    ({"model": "x", "dtype": ["float32"]}, "dtype"),
    ({"model": "x", "max_btach": 2}, "max_btach"),
    (["model", "x"], "body"),
])
def test_admin_fields_are_type_checked(served, body, param):
    refused = httpx.post(f"{served.url}/admin/models", json=body, headers=bearer(ADMIN))
    assert openai_error(refused, 400)["param"] == param
    assert list(served.leader.models()) == [MODEL]


def test_an_anonymous_caller_cannot_map_the_routes(served):
    """The schema is behind the key; a trailing slash is an unknown path (401 first, never a
    redirect that confirms a route); /metrics is behind its own key (or the admin key) and counts
    refused requests as unmatched; the scheme of the Authorization header is case-insensitive."""
    assert openai_error(httpx.get(f"{served.url}/openapi.json"), 401)["code"] == "invalid_api_key"
    schema = httpx.get(f"{served.url}/openapi.json", headers=bearer(KEYS[0])).json()
    assert "/v1/chat/completions" in schema["paths"] and "/admin/models" in schema["paths"]  # admin is on here
    for path in ("/v1/models/", "/admin/models/", "/v1/chat/completions/"):
        assert openai_error(httpx.get(f"{served.url}{path}", follow_redirects=False), 401)["code"] == "invalid_api_key"
    httpx.get(f"{served.url}/admin/models")
    for key in (None, KEYS[0]):
        refused = httpx.get(f"{served.url}/metrics", headers=bearer(key) if key else None)
        assert openai_error(refused, 401)["message"].startswith("missing or wrong metrics key")
    assert httpx.get(f"{served.url}/metrics", headers=bearer(ADMIN)).status_code == 200
    metrics = httpx.get(f"{served.url}/metrics", headers=bearer(METRICS)).text
    assert 'endpoint="/admin/models",status="401"' not in metrics and 'endpoint="unmatched",status="401"' in metrics
    lowercase = httpx.get(f"{served.url}/v1/models", headers={"Authorization": f"bearer {KEYS[1]}"})
    assert lowercase.status_code == 200 and lowercase.json()["data"][0]["id"] == MODEL


def test_admin_refusals_name_no_model_root(served):
    root = os.path.dirname(served.leader.models()[MODEL]["path"])
    missing = httpx.post(f"{served.url}/admin/models", json={"model": "x", "path": os.path.join(root, "nope.gguf")},
                         headers=bearer(ADMIN), timeout=60)
    assert openai_error(missing, 400)["code"] == "unsupported_arch"
    outside = httpx.post(f"{served.url}/admin/models", json={"model": "x", "path": "/etc"}, headers=bearer(ADMIN),
                         timeout=60)
    error = openai_error(outside, 400)
    assert error["param"] == "path" and "outside the model roots" in error["message"]
    assert root not in error["message"]
    relative = httpx.post(f"{served.url}/admin/models", json={"model": "x", "path": "models/x.gguf"},
                          headers=bearer(ADMIN))  # made absolute, it would show the server's working directory
    assert openai_error(relative, 400)["param"] == "path" and os.getcwd() not in relative.text
    assert list(served.leader.models()) == [MODEL]
    assert httpx.get(f"{served.url}/health").status_code == 200


def test_a_wrong_redis_password_is_an_authentication_error(served):
    wrong = served.broker_url.replace("served-test-password", "not-the-password")
    assert wrong != served.broker_url
    started = time.monotonic()
    with pytest.raises(CeleryTPError) as caught:
        Leader(wrong, served.group, world_size=1).models()
    assert caught.value.kind is ErrorKind.BROKER_AUTH_FAILED and "authentication failed" in caught.value.message
    assert time.monotonic() - started < 15  # not retried as an outage (that takes the 30 s retry window)
    assert "not-the-password" not in str(caught.value)


def test_a_key_on_the_command_line_is_refused():
    done = cli("celerytp", "serve", "--api-key", "sekrit-value")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "CELERYTP_API_KEYS" in done.stderr and "--api-key-file" in done.stderr and "sekrit" not in done.stderr
    done = cli("celerytp", "serve", "--admin-key=sekrit-value")
    assert done.returncode == 2 and "CELERYTP_ADMIN_KEY" in done.stderr and "sekrit" not in done.stderr
    done = cli("celerytp", "serve", "--metrics-key", "sekrit-value")
    assert done.returncode == 2 and "$CELERYTP_METRICS_KEY or --metrics-key-file" in done.stderr
    assert "sekrit" not in done.stderr


class _Unreliable:
    """A stand-in service for what a real server cannot be made to do on purpose: fail unexpectedly."""

    metrics = None

    def loaded(self) -> dict:
        raise RuntimeError("something nobody expected, with /secret/path in it")


def test_without_an_admin_key_admin_is_off_and_surprises_are_openai_500s():
    from celerytp.server.http import create_app

    client = TestClient(create_app(_Unreliable()), raise_server_exceptions=False)  # no keys at all
    off = client.post("/admin/models", json={"model": "x"})
    assert off.status_code == 404 and off.json()["error"]["code"] == "not_found"
    assert not any(p.startswith("/admin") for p in client.get("/openapi.json").json()["paths"])
    assert client.delete("/admin/models/smol").status_code == 404
    broken = client.get("/v1/models", headers={"X-Request-Id": "r-1"})
    assert broken.status_code == 500 and broken.headers["x-request-id"] == "r-1"
    assert broken.json()["error"]["type"] == "server_error" and "/secret/path" not in broken.text


FUZZ_EXAMPLES = 40  # per operation: about a minute in all here, the default model answering the valid ones
PROBE_S = 30.0


def test_schema_driven_fuzzing_finds_no_5xx_and_no_stall(served):
    """tests/api_fuzzer.py (schemathesis, in a process of its own: see there) fuzzes every inference
    operation: none may get a 5xx or take longer than its limit. Meanwhile a normal chat request,
    sent over and over from here, is answered in time throughout."""
    import threading

    probe = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEYS[1], max_retries=0, timeout=PROBE_S)
    stop, probes = threading.Event(), []

    def prober() -> None:
        while not stop.is_set():
            started = time.monotonic()
            probe.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
            probes.append(time.monotonic() - started)

    thread = threading.Thread(target=prober, daemon=True)
    thread.start()
    try:
        fuzzer = subprocess.run([sys.executable, str(Path(__file__).with_name("api_fuzzer.py")), served.url, KEYS[0],
                                 MODEL, str(FUZZ_EXAMPLES)], capture_output=True, text=True, timeout=600)
    finally:
        stop.set()
        thread.join(PROBE_S + 5)
    assert fuzzer.returncode == 0, fuzzer.stderr[-3000:]
    assert json.loads(fuzzer.stdout) == []
    assert probes and max(probes) < PROBE_S, probes
    assert list(served.leader.models()) == [MODEL]
