"""Fused generation on the real default model: the serving loop (tokens broadcast inside the
process group, no broker hop per token), streaming, cancellation, batching, liveness while busy."""

from __future__ import annotations

import json
import threading
import time

import pytest

from celerytp import CeleryTPError
from celerytp.cluster import LocalCluster
from celerytp.core.errors import ErrorKind

pytestmark = pytest.mark.slow

PROMPT = "The three primary colors are"
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.1, seed=5)


@pytest.fixture(scope="module", params=[1, 2, 3])
def leader(request):
    """SmolLM2 at TP 1, 2 (KV groups 2+1) and 3 (one each)."""
    with LocalCluster(world_size=request.param, group=f"fused{request.param}") as cluster:
        # f32: exact float weights, so batched and single forwards agree to the last bit of argmax
        cluster.leader.load("smol", None, max_batch=4, quant="f32")
        yield cluster.leader


def test_fused_equals_step_mode(leader):
    # SAMPLED gathers the whole logits; a temperature alone draws in the ranks' vocabulary slices
    for options in (dict(temperature=0), SAMPLED, dict(temperature=1.0, seed=6)):
        step = leader.generate("smol", prompt=PROMPT, max_tokens=12, mode="step", **options)
        fused = leader.generate("smol", prompt=PROMPT, max_tokens=12, **options)
        assert fused.mode == "fused" and step.mode == "step"
        assert fused.token_ids == step.token_ids and fused.text == step.text
        assert fused.finish_reason == step.finish_reason == "length"
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    step = leader.generate("smol", messages=chat, max_tokens=40, temperature=0, stop=["."], mode="step")
    fused = leader.generate("smol", messages=chat, max_tokens=40, temperature=0, stop=["."])
    assert fused.token_ids == step.token_ids and fused.text == step.text and "Paris" in fused.text
    assert fused.finish_reason == "stop" and "." not in fused.text


def test_stream_arrives_before_the_end_and_keeps_multibyte_text(leader):
    stream = leader.stream("smol", prompt="Emojis: 😀😃😄😁🎉", max_tokens=12, temperature=0)
    arrivals, deltas = [], []
    for delta in stream:
        arrivals.append(time.perf_counter())
        deltas.append(delta)
    finished = time.perf_counter()
    result = stream.result
    assert "".join(deltas) == result.text
    assert not any("\ufffd" in d for d in deltas)  # no half characters on the way
    assert any(ord(ch) > 0xFFFF for ch in result.text)  # 4-byte UTF-8 characters did come
    assert len(arrivals) >= 3 and arrivals[0] < finished - 0.2  # the first text came well before the end
    assert 0 < stream.ttft_s < result.total_s
    plain = leader.generate("smol", prompt="Emojis: 😀😃😄😁🎉", max_tokens=12, temperature=0)
    assert plain.token_ids == result.token_ids


def test_stream_holds_back_stop_strings(leader):
    reference = leader.generate("smol", prompt=PROMPT, max_tokens=16, temperature=0)
    stop = reference.text[len(reference.text) // 2 : len(reference.text) // 2 + 3]
    stream = leader.stream("smol", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    text = "".join(stream)
    assert text == stream.result.text == reference.text[: reference.text.index(stop)]
    assert stream.result.finish_reason == "stop"


def test_cancel_mid_generation_then_next_request_is_right(leader):
    reference = leader.generate("smol", prompt=PROMPT, max_tokens=10, temperature=0)
    stream = leader.stream("smol", prompt="Once upon a time", max_tokens=400, temperature=0)
    for i, _ in enumerate(stream):
        if i == 3:
            leader.cancel(stream.request_id)
    assert stream.result.finish_reason == "cancelled"
    assert 4 <= stream.result.completion_tokens < 100
    again = leader.generate("smol", prompt=PROMPT, max_tokens=10, temperature=0)
    assert again.token_ids == reference.token_ids


def test_concurrent_requests_batch_and_match_running_alone(leader):
    requests = [
        dict(prompt="Story number one:", max_tokens=6, temperature=0),
        dict(prompt="A much longer prompt about the history of tensor parallelism in", max_tokens=14, **SAMPLED),
        dict(prompt="Colors:", max_tokens=10, temperature=0.7, seed=1),
        dict(messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=8, temperature=0),
    ]
    results: list = [None] * len(requests)

    def run(i: int) -> None:
        results[i] = leader.generate("smol", **requests[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert leader.serving_stats("smol")["peak_rows"] > 1  # requests that waited together ran together
    for request, result in zip(requests, results):
        alone = leader.generate("smol", **request)
        assert result.token_ids == alone.token_ids, request
        assert len(result.token_ids) <= request["max_tokens"]


def test_bad_requests_are_refused_on_the_leader_and_on_rank_0(leader):
    spec = {"request_id": "r1", "prompt": [1, 2, 3], "max_tokens": 4}
    cases = [
        (dict(spec, prompt=[10**6]), "vocabulary"),
        (dict(spec, sampling={"top_p": 2}), "top_p"),
        (dict(spec, max_tokens=0), "max_tokens"),
        (dict(spec, prompt=[]), "prompt"),
        (dict(spec, request_id="no spaces allowed"), "request_id"),
    ]
    for bad, needle in cases:
        with pytest.raises(CeleryTPError) as info:
            leader.submit("smol", bad)
        assert info.value.kinds == {ErrorKind.BAD_REQUEST}, info.value
        assert needle in str(info.value)
    with pytest.raises(CeleryTPError, match="mode"):
        leader.generate("smol", prompt=PROMPT, mode="warp")
    # Written straight into the queue (another client, an old version): rank 0 refuses them
    # by request id and serves the rest.
    from celerytp.client.requests import Done
    from celerytp.core.keys import queue_key, stream_key

    queue = queue_key("smol")
    leader.redis.rpush(queue, json.dumps(dict(spec, request_id="direct1", prompt=[10**6])), b"\xff not json")
    good = leader.submit("smol", dict(spec, request_id="direct2"))
    assert isinstance(list(good.events(60))[-1], Done)
    reply = leader.redis.xread({stream_key("direct1"): "0-0"}, block=5000)
    error = json.loads(reply[0][1][0][1][b"error"])
    assert error["kind"] == "bad_request" and "vocabulary" in error["message"]
    assert leader.generate("smol", prompt=PROMPT, max_tokens=3).completion_tokens == 3


def test_ranks_stay_alive_to_celery_and_leader_while_generating(leader):
    stream = leader.stream("smol", prompt="Once upon a time", max_tokens=1000, temperature=0)
    seen: dict = {}

    def watch() -> None:
        time.sleep(1.0)  # the generation is running by now
        seen["ping"] = leader.app.control.inspect(timeout=3).ping() or {}
        seen["health"] = leader.health()
        leader.cancel(stream.request_id)

    watcher = threading.Thread(target=watch)
    watcher.start()
    text = "".join(stream)
    watcher.join(30)
    assert stream.result.finish_reason == "cancelled" and text
    assert len(seen["ping"]) == leader.world_size, seen["ping"]
    assert all(reply == {"ok": "pong"} for reply in seen["ping"].values())
    assert all(h is not None for h in seen["health"])


def test_kept_quantized_gguf_runs_fused_and_step_alike(leader):
    # No quant: the file's Q4_1 blocks stay quantized on every rank (bfloat16 kernels).
    leader.load("smolq", None, max_batch=2)
    try:
        step = leader.generate("smolq", prompt=PROMPT, max_tokens=8, temperature=0, mode="step")
        fused = leader.generate("smolq", prompt=PROMPT, max_tokens=8, temperature=0)
        assert fused.token_ids == step.token_ids and len(fused.token_ids) == 8
    finally:
        leader.unload("smolq")
