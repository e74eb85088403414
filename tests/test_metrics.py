"""/metrics as dashboards read it: vLLM's metric set under one-to-one names, from a real
`celerytp serve` (its rank worker and Redis), with traffic from the real OpenAI client and from a
plain Celery producer; and the Grafana dashboard in deploy/grafana names only exported metrics."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import MODEL, ROOT, metric_samples, start_served

GROUP = "metrics"
DASHBOARD = Path(ROOT) / "deploy" / "grafana" / "celerytp.json"

# vLLM's name -> ours (docs/serving.md has the same table)
VLLM_NAMES = {
    "vllm:num_requests_running": "celerytp_num_requests_running",
    "vllm:num_requests_waiting": "celerytp_num_requests_waiting",
    "vllm:kv_cache_usage_perc": "celerytp_kv_cache_usage_perc",
    "vllm:time_to_first_token_seconds": "celerytp_time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds": "celerytp_inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds": "celerytp_e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds": "celerytp_request_queue_time_seconds",
    "vllm:prompt_tokens": "celerytp_prompt_tokens",
    "vllm:generation_tokens": "celerytp_generation_tokens",
    "vllm:request_success": "celerytp_request_success",
    "vllm:num_preemptions": "celerytp_num_preemptions",
}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with start_served(tmp_path_factory, "--max-batch", "4", tp=1, group=GROUP) as served:
        yield served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)


def scrape(url: str) -> tuple[dict[str, str], dict[str, float]]:
    """(family name -> type, sample name with sorted labels -> value) of /metrics."""
    text = httpx.get(f"{url}/metrics").text
    return {f.name: f.type for f in text_string_to_metric_families(text)}, metric_samples(text)


def key(name: str, **labels: str) -> str:
    return f"{name}{sorted(labels.items())}"


def delta(before: dict[str, float], after: dict[str, float], name: str, **labels: str) -> float:
    return after.get(key(name, **labels), 0) - before.get(key(name, **labels), 0)


def wait_for(url: str, check, seconds: float = 20) -> dict[str, float]:
    deadline = time.monotonic() + seconds
    while True:
        samples = scrape(url)[1]
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


def test_vllm_metric_set_with_one_to_one_names(served, client):
    _, before = scrape(served.url)
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 8
    types, after = scrape(served.url)
    for ours in VLLM_NAMES.values():
        assert ours in types, f"{ours} is not exported"
    assert types["celerytp_inter_token_latency_seconds"] == "histogram"
    assert types["celerytp_kv_cache_usage_perc"] == "gauge"
    # one observation per gap between tokens, not one mean per request
    assert delta(before, after, "celerytp_inter_token_latency_seconds_count", model=MODEL) == 7
    assert delta(before, after, "celerytp_time_to_first_token_seconds_count", model=MODEL) == 1
    assert delta(before, after, "celerytp_e2e_request_latency_seconds_count", model=MODEL) == 1
    assert delta(before, after, "celerytp_request_queue_time_seconds_count", model=MODEL) == 1
    assert delta(before, after, "celerytp_generation_tokens_total", model=MODEL) == 8
    assert delta(before, after, "celerytp_generated_tokens_total", model=MODEL) == 8  # the older name still works
    assert delta(before, after, "celerytp_prompt_tokens_total", model=MODEL) == reply.usage.prompt_tokens
    assert delta(before, after, "celerytp_request_success_total", model=MODEL, finished_reason="length") == 1
    assert key("celerytp_request_success_total", model=MODEL, finished_reason="error") in after
    assert key("celerytp_num_preemptions_total", model=MODEL) in after
    assert after[key("celerytp_num_requests_running", model=MODEL, group=GROUP)] >= 0
    assert 0 <= after[key("celerytp_kv_cache_usage_perc", model=MODEL, group=GROUP)] <= 1
    assert after[key("celerytp_num_requests_waiting", model=MODEL)] == 0
    # health: per group and per rank
    assert after[key("celerytp_group_up", group=GROUP)] == 1
    assert after[key("celerytp_group_rank_up", group=GROUP, rank="0")] == 1
    assert after[key("celerytp_rank_up", rank="0")] == 1


def test_running_requests_and_kv_usage_while_decoding(served, client):
    """While a long request decodes, the running gauge and the KV-cache usage say so."""
    cancelled = key("celerytp_request_success_total", model=MODEL, finished_reason="cancelled")
    before = scrape(served.url)[1].get(cancelled, 0)
    stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        samples = wait_for(served.url, lambda s: s.get(key("celerytp_num_requests_running", model=MODEL, group=GROUP)))
        assert samples[key("celerytp_num_requests_running", model=MODEL, group=GROUP)] == 1
        assert samples[key("celerytp_kv_cache_usage_perc", model=MODEL, group=GROUP)] == pytest.approx(1 / 4)
        assert samples[key("celerytp_serving_loop_running", model=MODEL, group=GROUP)] == 1
    finally:
        stream.close()
        wait_for(served.url, lambda s: s.get(cancelled, 0) == before + 1)  # counted before the next test looks


def test_a_cancelled_stream_is_counted_with_its_tokens(served, client):
    _, before = scrape(served.url)
    cancelled = key("celerytp_request_success_total", model=MODEL, finished_reason="cancelled")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Tell a long story."}],
                                            max_tokens=400, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received >= 4:
            break
    stream.close()  # the client goes away: the server cancels the request
    after = wait_for(served.url, lambda s: s.get(cancelled, 0) == before.get(cancelled, 0) + 1)
    assert after.get(cancelled, 0) == before.get(cancelled, 0) + 1, "the cancelled stream was not counted"
    generated = delta(before, after, "celerytp_generation_tokens_total", model=MODEL)
    assert 4 <= generated < 400
    assert delta(before, after, "celerytp_inter_token_latency_seconds_count", model=MODEL) == generated - 1


def test_celery_front_door_traffic_is_counted_once(served):
    _, before = scrape(served.url)
    app = Celery("plain-producer", broker=served.broker_url, backend=served.broker_url)
    kwargs = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    reply = app.send_task("celerytp.generate", kwargs=kwargs, queue=f"celerytp.{GROUP}.requests").get(timeout=60)
    assert reply["usage"]["completion_tokens"] == 6
    tokens = key("celerytp_generation_tokens_total", model=MODEL)
    after = wait_for(served.url, lambda s: s.get(tokens, 0) >= before.get(tokens, 0) + 6)
    time.sleep(1)  # a second count (double counting) would show by now
    after = scrape(served.url)[1]
    assert delta(before, after, "celerytp_generation_tokens_total", model=MODEL) == 6
    assert delta(before, after, "celerytp_request_success_total", model=MODEL, finished_reason="length") == 1
    assert delta(before, after, "celerytp_inter_token_latency_seconds_count", model=MODEL) == 5


PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "rate", "irate", "increase", "histogram_quantile", "by", "without",
    "and", "or", "unless", "on", "ignoring", "group_left", "group_right", "offset", "bool", "topk", "bottomk",
    "delta", "deriv", "clamp_min", "clamp_max", "abs", "time", "vector", "scalar", "label_replace",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label lists, selectors, ranges and strings removed)."""
    text = re.sub(r'"[^"]*"', "", expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word, rest = match.group(), text[match.end():].lstrip()
        if word in PROMQL_WORDS or rest.startswith("("):
            assert word in PROMQL_WORDS, f"unknown PromQL function {word!r} in {expr!r}"
            continue
        names.add(word)
    return names


def test_every_dashboard_query_names_an_exported_metric(served, client):
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0)  # histograms have samples
    httpx.get(f"{served.url}/v1/models")  # and the HTTP counter
    text = httpx.get(f"{served.url}/metrics").text
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            names = promql_metric_names(target["expr"])
            assert names, f"panel {panel['title']!r}: no metric in {target['expr']!r}"
            missing = names - exported
            assert not missing, f"panel {panel['title']!r} queries {sorted(missing)}, which /metrics does not export"
            queried |= names
    for ours in VLLM_NAMES.values():  # every vLLM-mapped family is on the dashboard
        assert any(name == ours or name.startswith(f"{ours}_") for name in queried), f"{ours} has no panel"


def test_promql_names_are_found():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{model="x"}[5m]))) / on (model) b_total'
    ) == {"a_bucket", "b_total"}


def test_errors_are_counted_and_refusals_are_not(served):
    """A request that failed after it was accepted counts as finished_reason="error"; one refused
    before it ran (bad request, unknown model, queue full) does not count at all."""
    from celerytp.server.metrics import record_error

    client = served.leader.redis
    for kind in ("timeout", "rank_lost", "bad_request", "model_not_loaded", "overloaded"):
        record_error(client, "other-model", kind)
    samples = scrape(served.url)[1]
    assert samples[key("celerytp_request_success_total", model="other-model", finished_reason="error")] == 2
    assert samples[key("celerytp_request_success_total", model="other-model", finished_reason="stop")] == 0


def test_loop_failures_count_once_per_loop_by_kind(served):
    """Every rank that saw a loop fail reports it; the loop counts once, under the kind of the first
    report, and /metrics shows it per model, kind and group (in this server's Redis, for a group
    and model that no rank serves, so the served ones stay untouched)."""
    from celerytp.core.loop_failures import record_loop_failure

    client = served.leader.redis
    assert record_loop_failure(client, "lf-group", "lf-model", "loop-a", "forward_failed")  # rank 1, where it began
    assert not record_loop_failure(client, "lf-group", "lf-model", "loop-a", "rank_lost")  # rank 0, the same loop
    assert record_loop_failure(client, "lf-group", "lf-model", "loop-b", "rank_lost")
    assert record_loop_failure(client, "lf-group", "lf-model", "loop-c", "rank_lost")
    assert record_loop_failure(client, "lf-group", "lf-model", "loop-d", "broker_unavailable")
    types, samples = scrape(served.url)
    assert types["celerytp_serving_loop_failures"] == "counter"
    failures = {k: v for k, v in samples.items() if k.startswith("celerytp_serving_loop_failures_total")
                and "('model', 'lf-model')" in k}
    assert failures == {
        key("celerytp_serving_loop_failures_total", model="lf-model", group="lf-group", kind=kind): count
        for kind, count in {"forward_failed": 1, "rank_lost": 2, "broker_unavailable": 1, "timeout": 0,
                            "group_broken": 0, "internal": 0}.items()
    }


def test_normal_serving_counts_no_loop_failure(served, client):
    """Loops that served and ended idle (every test above ran some) count no failure; the counter
    is there at 0 for the served model's group all the same."""
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert reply.choices[0].text
    running = key("celerytp_serving_loop_running", model=MODEL, group=GROUP)
    samples = wait_for(served.url, lambda s: s.get(running) == 0)  # the loop ended idle (idle_s after it)
    assert samples[running] == 0
    served.leader.clear_kv_cache(MODEL)  # an op queued behind the serve op: it ended (and counted) by now
    samples = scrape(served.url)[1]
    failures = {k: v for k, v in samples.items() if k.startswith("celerytp_serving_loop_failures_total")
                and f"('model', '{MODEL}')" in k}
    assert key("celerytp_serving_loop_failures_total", model=MODEL, group=GROUP, kind="rank_lost") in failures
    assert key("celerytp_serving_loop_failures_total", model=MODEL, group=GROUP, kind="internal") in failures
    assert set(failures.values()) == {0}, failures


def test_each_ranks_memory_is_a_gauge(served):
    """What each rank reports of its memory (its device's free and total, the weights and KV cache
    it holds, its peak) is read at scrape time, as the ping op answers it."""
    _, samples = scrape(served.url)
    (pong,) = served.leader.ping()

    def gauge(kind: str) -> float:
        return samples[key("celerytp_rank_memory_bytes", group=GROUP, rank="0", kind=kind)]

    assert gauge("weights") == pong.memory["weights"] > 0 and gauge("kv_cache") == pong.memory["kv_cache"] > 0
    assert 0 < gauge("free") <= gauge("total") == pong.memory["total"] and gauge("peak") > 0
