"""A real `celerytp serve` for tests: a subprocess with its embedded group (private Redis and
rank workers), started once per module that asks for it, stopped with Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from celery.result import AsyncResult

from celerytp.client.leader import Leader

MODEL = "smol"
FLOWER_AUTH = ("admin", "flower-test-pw")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], check=False, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})


def rows_free_within(group: Served, seconds: float) -> float:
    """Seconds until the model's loop runs no row (fails after `seconds`)."""
    started = time.monotonic()
    while group.leader.serving_stats(MODEL).get("running_rows", 0):
        assert time.monotonic() - started < seconds, group.leader.serving_stats(MODEL)
        time.sleep(0.05)
    return time.monotonic() - started


def running(group: Served) -> None:
    """Wait until the model's loop runs a row (30 s at most)."""
    deadline = time.monotonic() + 30
    while not group.leader.serving_stats(MODEL).get("running_rows", 0):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.05)


class Served:
    """A running `celerytp serve` and a Leader of its embedded group."""

    def __init__(self, url: str, broker_url: str, group: str, world_size: int, log_path: str):
        self.url = url
        self.broker_url = broker_url
        self.group = group
        self.log_path = log_path
        self.leader = Leader(broker_url, group, world_size=world_size)


@contextlib.contextmanager
def start_served(
    tmp_path_factory: pytest.TempPathFactory, *args: str, tp: int = 2, group: str = "srv",
    redis_password: str = "served-test-password", env: dict[str, str] | None = None,
) -> Iterator[Served]:
    """`celerytp serve --tp TP --model-id smol ARGS` until the model answers; on exit Ctrl-C must
    stop it and its rank workers. The banner masks the Redis password; the Served has it."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    log = open(log_path, "w")  # noqa: SIM115 - the server writes to it until teardown
    port = free_port()
    full_env = {**os.environ, "PYTHONPATH": ROOT, "CELERYTP_LOCAL_REDIS_PASSWORD": redis_password, **(env or {})}
    command = [sys.executable, "-m", "celerytp", "serve", "--group", group, "--tp", str(tp), "--port", str(port),
               "--model-id", MODEL, *args]  # fmt: skip
    proc = subprocess.Popen(command, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300  # the first start on a machine compiles the default model's decode
    while not (banner := re.search(r"celerytp serving 'smol' .* broker (redis://\S+)\)", log_path.read_text())):
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.2)
    while not healthy(url):  # the banner comes just before the port opens
        assert time.monotonic() < deadline, "server did not answer"
        time.sleep(0.1)
    assert redis_password not in log_path.read_text()  # the banner masks it
    served = Served(url, banner.group(1).replace(":***@", f":{redis_password}@"), group, tp, str(log_path))
    workers = [beat["pid"] for beat in served.leader.health()]  # /health shows pids to the admin key only
    try:
        yield served
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) in (0, 130), log_path.read_text()
        log.close()
        for pid in workers:  # the embedded rank workers are gone too
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)


@contextlib.contextmanager
def start_flower(env: dict[str, str], queues: set[str], probe: Callable[[], AsyncResult]) -> Iterator[str]:
    """`celery -A celerytp.app flower` with `env` (CELERYTP_BROKER, _GROUP, _WORLD_SIZE) and basic
    auth FLOWER_AUTH: its base URL once it knows the workers' `queues` and hears the front door's
    task events (it turns them on itself, every 5 s), so it sees the tasks sent after. `probe`
    sends a short generate task."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "celerytp.app", "flower", f"--port={port}", "--address=127.0.0.1"],
        env={**os.environ, "PYTHONPATH": ROOT, **env, "FLOWER_BASIC_AUTH": ":".join(FLOWER_AUTH)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, last = time.monotonic() + 60, "no answer"
        while True:  # until Flower answers and knows the workers' queues
            try:
                answer = httpx.get(f"{base}/api/queues/length", auth=FLOWER_AUTH, timeout=10)
                last = f"{answer.status_code} {answer.text[:300]}"
                if answer.status_code == 200:
                    if queues <= {q["name"] for q in answer.json()["active_queues"]}:
                        break
                else:
                    assert answer.status_code in (401, 503), (answer.status_code, answer.text)  # not a 404
            except httpx.TransportError:
                pass
            assert proc.poll() is None, "flower exited"
            assert time.monotonic() < deadline, f"flower gave no queue lengths: {last}"
            time.sleep(0.5)
        while True:  # until it hears the front door's task events
            sent = probe()
            sent.get(timeout=60)
            time.sleep(0.5)
            if httpx.get(f"{base}/api/task/info/{sent.id}", auth=FLOWER_AUTH, timeout=10).status_code == 200:
                break
            assert time.monotonic() < deadline, "flower never heard the front door's task events"
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


def flower_api(flower: str, path: str, until: Callable[[dict], bool], deadline_s: float = 30) -> dict:
    """Flower's answer to GET /api/PATH once `until` holds for it; every answer is a 200 (or, for
    /api/task/info, a 404 until Flower has heard of the task)."""
    deadline, last = time.monotonic() + deadline_s, None
    while True:
        answer = httpx.get(f"{flower}/api/{path}", auth=FLOWER_AUTH, timeout=10)
        assert answer.status_code == 200 or (answer.status_code == 404 and path.startswith("task/info/")), (
            answer.status_code, answer.text)
        if answer.status_code == 200 and until(last := answer.json()):
            return last
        assert time.monotonic() < deadline, f"/api/{path}: {last}"
        time.sleep(0.1)


def metric_samples(text: str) -> dict[str, float]:
    """/metrics' samples by name and sorted labels, `model_name` left out once checked to be the
    `model` it goes with (vLLM's label, server/metrics.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name", None) == labels.get("model"), sample
            samples[f"{sample.name}{sorted(labels.items())}"] = sample.value
    return samples
