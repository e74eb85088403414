"""`celerytp serve` as users meet it: a real server process attached to a real two-rank group,
driven by the real OpenAI client, plain HTTP, and a plain Celery app (its own `Celery(...)`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from celery import Celery
from celery.exceptions import TaskRevokedError
from server_fixtures import MODEL, ROOT, cli, free_port, metric_samples, rows_free_within, running, start_served

from celerytp.client.registry import keep_replica
from celerytp.core.liveness import read_owners

KEY = "test-key-123"
ADMIN_KEY = "test-admin-key-456"


REDIS_PASSWORD = "served-test-password"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`celerytp serve --tp 2` (embedded: private Redis + 2 rank workers) in a subprocess, once the
    model answers; on teardown Ctrl-C must stop it and its workers."""
    with start_served(tmp_path_factory, "--max-batch", "4", redis_password=REDIS_PASSWORD,
                      env={"CELERYTP_API_KEY": KEY, "CELERYTP_ADMIN_KEY": ADMIN_KEY}) as served:
        yield served


@pytest.fixture(scope="module")
def server(served):
    return served.url


@pytest.fixture(scope="module")
def group(served):
    return served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


CHAT = [{"role": "user", "content": "Name three colours."}]


def test_chat_greedy_equals_leader(client, group):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    direct = group.leader.generate(MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content == direct.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("length" if direct.finish_reason == "length" else "stop")
    assert reply.usage.prompt_tokens == direct.prompt_tokens
    assert reply.usage.completion_tokens == direct.completion_tokens
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_stream_equals_non_stream(client):
    options = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0}
    whole = client.completions.create(**options)
    chunks = list(client.completions.create(**options, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_chat_stream_and_stop_string(client):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    stop = text.split()[2]  # a word the greedy answer reaches
    cut = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.index(stop)]


def test_logprobs_from_the_ranks(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=2)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens and "".join(c.token for c in content) == \
        reply.choices[0].message.content
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item.top_logprobs) == 2 and item.top_logprobs[0].token == item.token
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob) and item.logprob <= 0
    text = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=3, temperature=0, logprobs=1)
    assert "".join(text.choices[0].logprobs.tokens) == text.choices[0].text


def test_errors_in_openai_shape(client, server):
    for bad, param in [({"n": 17}, "n"), ({"max_tokens": 0}, "max_tokens"), ({"temperature": 3}, "temperature")]:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=CHAT, **bad)
        assert caught.value.body["param"] == param, caught.value.body
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=CHAT)
    assert caught.value.body["code"] == "model_not_found"
    wrong = openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server}/v1/models").status_code == 401
    bad_json = httpx.post(f"{server}/v1/completions", content=b"{", headers={"Authorization": f"Bearer {KEY}"})
    assert bad_json.status_code == 400 and bad_json.json()["error"]["param"] == "body"



def test_hostile_requests_get_a_quick_4xx_while_others_are_served(client, server):
    """Issue 41 on the real server: each was slow (a 100 KB model name: 20 s, with /health waiting;
    a 10 MB prompt: 6.8 s and +0.9 GB of tokens) or a 500 (a lone surrogate); now each is a 4xx in
    well under a second, and a normal request is served beside them."""
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}

    def sent(path: str, body: dict | bytes) -> tuple[httpx.Response, float]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        started = time.monotonic()
        response = httpx.post(f"{server}{path}", content=content, headers=auth, timeout=30)
        return response, time.monotonic() - started

    cases = [
        ("/v1/chat/completions", {"model": "a" * 100_000, "messages": CHAT}, 404, None),
        ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "b" * 100_000: 1}, 400, "b" * 64 + "…"),
        ("/v1/completions", b'{"model": "smol", "prompt": "hi \\ud800"}', 400, "prompt"),
        ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 3_000_000}]}, 400,
         "messages"),
        ("/v1/completions", b"{" * (4 << 20 | 1), 413, None),
    ]
    with ThreadPoolExecutor(1) as pool:
        normal = pool.submit(client.chat.completions.create, model=MODEL, messages=CHAT, max_tokens=4, temperature=0)
        for path, body, status, param in cases:
            response, took = sent(path, body)
            assert response.status_code == status and response.json()["error"]["param"] == param, response.text[:300]
            assert took < 2, (path, status, took)
            assert len(response.json()["error"]["message"]) < 400
        assert normal.result(timeout=60).choices[0].message.content
    started = time.monotonic()
    assert httpx.get(f"{server}/health").status_code == 200 and time.monotonic() - started < 1


CANCELLED = f"celerytp_finished_requests_total[('model', '{MODEL}'), ('reason', 'cancelled')]"


def cancelled_count(server: str) -> float:
    """The server's count of requests that ended cancelled."""
    return metric_samples(httpx.get(f"{server}/metrics").text).get(CANCELLED, 0)


def _counted_once_more(server: str, before: float) -> None:
    deadline = time.monotonic() + 5
    while cancelled_count(server) != before + 1:  # counted once its (cancelled) result came back
        assert time.monotonic() < deadline, "the cancelled request was not counted"
        time.sleep(0.1)


def test_disconnect_cancels_generation(server, group):
    """A stream read for a few tokens, then dropped: the ranks stop long before max_tokens, and
    the request is counted as cancelled."""
    before = cancelled_count(server)
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 8:
                break
    rows_free_within(group, 2)
    assert group.leader.serving_stats(MODEL)["steps"] < 500
    _counted_once_more(server, before)


def test_a_non_streaming_client_that_gives_up_cancels_its_request(server, group):
    """The request counter is plain ASGI, so the server sees the disconnect: the row frees
    within about a second and the request is counted as cancelled."""
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True}
    before = cancelled_count(server)
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=2.0)
    rows_free_within(group, 2)
    _counted_once_more(server, before)


@pytest.mark.parametrize("how", ["revoke", "terminate", "expires"])
def test_a_revoked_or_expired_generate_task_cancels_its_request(group, how):
    """The front door's threads pool cannot kill a running task (terminate only logs that); the
    task sees its revocation or expiry itself, cancels its request and ends REVOKED."""
    app = Celery("plain-producer", broker=group.broker_url, backend=group.broker_url)
    kwargs = {"prompt": "Tell me a story.", "max_tokens": 1500, "ignore_eos": True}
    expires = {"expires": 3.0} if how == "expires" else {}
    sent = app.send_task("celerytp.generate", kwargs=kwargs, queue="celerytp.srv.requests", **expires)
    running(group)
    if how != "expires":
        app.control.revoke(sent.id, terminate=how == "terminate")
    rows_free_within(group, 5 if how == "expires" else 2)
    with pytest.raises(TaskRevokedError, match="expired" if how == "expires" else "revoked"):
        sent.get(timeout=10)
    assert sent.state == "REVOKED"


def test_plain_celery_app_sends_generate(group):
    """A producer that knows only the task name, the queue and the broker."""
    app = Celery("plain-producer", broker=group.broker_url, backend=group.broker_url)
    kwargs = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    reply = app.send_task("celerytp.generate", kwargs=kwargs, queue="celerytp.srv.requests").get(timeout=60)
    direct = group.leader.generate(MODEL, **kwargs)
    assert reply["text"] == direct.text and reply["token_ids"] == direct.token_ids
    assert reply["usage"]["completion_tokens"] == direct.completion_tokens and reply["model"] == MODEL
    failed = app.send_task("celerytp.generate", kwargs={"prompt": "x", "max_tokens": -1}, queue="celerytp.srv.requests")
    with pytest.raises(Exception, match=r"bad_request: field 'max_tokens'"):
        failed.get(timeout=60)


def test_two_models_and_admin_endpoints(client, server, group):
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    loaded = httpx.post(f"{server}/admin/models", json={"model": "smol-b", "max_batch": 1, "max_queue": 1},
                        headers=auth, timeout=120)
    assert loaded.status_code == 200, loaded.text
    assert sorted(m.id for m in client.models.list().data) == [MODEL, "smol-b"]
    a = client.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0).choices[0].text
    b = client.completions.create(model="smol-b", prompt="One, two,", max_tokens=6, temperature=0).choices[0].text
    assert a == b  # the same weights under two ids

    def one(_: int) -> str:  # one row and one queue place: of 4 at once, some are refused
        try:
            client.completions.create(model="smol-b", prompt="Hi", max_tokens=16, extra_body={"ignore_eos": True})
            return "ok"
        except openai.RateLimitError as exc:
            assert exc.body["code"] == "overloaded"
            return "429"

    with ThreadPoolExecutor(4) as pool:
        outcomes = sorted(pool.map(one, range(4)))
    assert "429" in outcomes and "ok" in outcomes, outcomes
    listed = cli("celerytp", "models", "list", "--broker", group.broker_url, "--group", "srv", "--tp", "2")
    assert sorted(json.loads(listed.stdout)) == [MODEL, "smol-b"], listed.stderr
    assert json.loads(listed.stdout)["smol-b"]["held_by_ranks"] == [0, 1]
    assert httpx.delete(f"{server}/admin/models/smol-b", headers=auth, timeout=60).status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL]
    gone = cli("celerytp", "models", "unload", "smol-b", "--broker", group.broker_url, "--group", "srv", "--tp", "2")
    assert gone.returncode == 1 and gone.stderr.startswith("error: model_not_loaded: "), gone.stderr
    assert client.completions.create(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0).choices[0].text == a
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="smol-b", prompt="One", max_tokens=2)


def test_a_record_no_rank_holds_is_not_listed_and_can_be_cleared(client, group):
    """As after the rank workers restarted: Redis lists a model the ranks never loaded."""
    record = group.leader.models()[MODEL]
    keep_replica(group.leader.redis, group.group, 2, "ghost", record, read_owners(group.leader.redis, group.group, 2))
    assert [m.id for m in client.models.list().data] == [MODEL]  # asked of the ranks
    args = ("--broker", group.broker_url, "--group", "srv", "--tp", "2")
    assert json.loads(cli("celerytp", "models", "list", *args).stdout)["ghost"]["held_by_ranks"] == []
    cleared = cli("celerytp", "models", "unload", "ghost", *args)
    assert cleared.returncode == 0 and "cleared the record of ghost" in cleared.stdout, cleared.stderr
    assert "ghost" not in group.leader.models()


def test_celery_tools_see_the_ranks(group):
    """`celery -A celerytp.app ...` works as for any Celery project (configured from CELERYTP_*)."""
    ping = cli("celery", "-A", "celerytp.app", "inspect", "ping", "-t", "2",
               CELERYTP_BROKER=group.broker_url, CELERYTP_GROUP="srv", CELERYTP_WORLD_SIZE="2")
    assert ping.returncode == 0, ping.stderr
    for name in ("celerytp.srv.rank0@", "celerytp.srv.rank1@", "celerytp.srv.frontend@"):
        assert name in ping.stdout
    app = Celery("plain-inspector", broker=group.broker_url)
    status = app.control.inspect(timeout=2)._request("celerytp_status")
    ranks = {reply["rank"]: reply for reply in status.values() if "rank" in reply}
    assert sorted(ranks) == [0, 1] and ranks[0]["comm_id"] == ranks[1]["comm_id"] is not None
    assert MODEL in ranks[0]["models"] and ranks[1]["rss_bytes"] > 0


def test_flower_lists_the_ranks_and_their_tasks(client, group):
    """Flower (`celerytp flower`, i.e. `celery -A celerytp.app flower`) sees every rank worker and, once it has turned the
    workers' task events on (its default `enable_events`, every 5 s), celerytp tasks."""
    port = free_port()
    flower = subprocess.Popen(
        [sys.executable, "-m", "celerytp", "flower", "--port", str(port), "--basic-auth", "admin:pw",
         "--broker", group.broker_url, "--group", "srv", "--tp", "2"],  # execs `celery -A celerytp.app flower`
        env={**os.environ, "PYTHONPATH": ROOT},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                workers = httpx.get(f"{api}/workers", params={"refresh": 1}, auth=("admin", "pw"), timeout=10).json()
                if {"celerytp.srv.rank0", "celerytp.srv.rank1"} <= {w.split("@")[0] for w in workers}:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline, "flower did not list the ranks"
            time.sleep(0.5)
        while not {t.get("name") for t in httpx.get(f"{api}/tasks", auth=("admin", "pw")).json().values()} & {
            "celerytp.rank.serve", "celerytp.gather"}:
            assert time.monotonic() < deadline, "flower saw no celerytp task"
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            time.sleep(1.5)  # past the serving loop's idle time: the next request starts a new serve chord
    finally:
        flower.terminate()
        flower.wait(30)


def test_metrics_count_requests(client, server):
    def scrape() -> dict[str, float]:
        return metric_samples(httpx.get(f"{server}/metrics").text)  # no key needed

    before = scrape()
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    after = scrape()
    served = "celerytp_requests_total[('endpoint', '/v1/completions'), ('status', '200')]"
    assert after[served] == before.get(served, 0) + 1
    tokens = f"celerytp_generated_tokens_total[('model', '{MODEL}')]"
    assert after[tokens] == before.get(tokens, 0) + 5
    ttft = f"celerytp_time_to_first_token_seconds_count[('model', '{MODEL}')]"
    assert after[ttft] == before.get(ttft, 0) + 1
    assert after["celerytp_rank_up[('rank', '0')]"] == 1 and after["celerytp_rank_up[('rank', '1')]"] == 1
    assert f"celerytp_queue_depth[('model', '{MODEL}')]" in after


def test_health_names_a_stopped_rank(client, server, group):
    """Last in the module: it stops rank 1's worker."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}  # the ranks' pids are for the admin key only
    assert httpx.get(f"{server}/health").json()["ok"] is True
    os.kill(httpx.get(f"{server}/health", headers=admin).json()["ranks"][1]["pid"], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while (health := httpx.get(f"{server}/health", headers=admin)).status_code != 503:
        assert time.monotonic() < deadline, health.text
        time.sleep(0.2)
    assert health.json()["dead_ranks"] == [1]
    assert [r["status"] for r in health.json()["ranks"]] == ["up", "down"]
    with pytest.raises(openai.InternalServerError) as caught:  # refused at once, not left to time out
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert caught.value.status_code == 503 and "rank(s) [1]" in caught.value.body["message"]
