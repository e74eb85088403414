"""Reaching the embedded cluster of a real `celerytp serve --tp 1 --connection-file PATH` from
outside, with only what the file says: the file itself (mode 0600, never on the terminal),
`celery -A celerytp.app inspect ping`, a plain Celery producer of `celerytp.generate`, and Flower
(`celery -A celerytp.app flower`, as docs/serving.md says) whose Broker page and
/api/queues/length show the rank queue's and the front door's queue lengths (what Flower shows of
a `celerytp.generate` task: tests/test_as_shipped.py)."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
import sys

import httpx
import pytest
from celery import Celery
from celery.result import AsyncResult
from server_fixtures import FLOWER_AUTH as AUTH
from server_fixtures import MODEL, ROOT, start_flower, start_served

GROUP = "srv"
RANK_QUEUE, REQUESTS_QUEUE = f"celerytp.{GROUP}.rank.0", f"celerytp.{GROUP}.requests"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    connection_file = tmp_path_factory.mktemp("conn") / "cluster.env"
    with start_served(tmp_path_factory, "--connection-file", str(connection_file), tp=1, group=GROUP) as served:
        served.connection_file = connection_file
        yield served
    assert not connection_file.exists()  # removed with the cluster: its Redis is gone


def connection_env(served) -> dict[str, str]:
    """The file's KEY=VALUE lines, read as a shell's `set -a; . FILE` would."""
    pairs = [shlex.split(line)[0].split("=", 1) for line in served.connection_file.read_text().splitlines() if line]
    return dict(pairs)


def test_the_connection_file_names_the_cluster_and_only_its_owner_reads_it(served):
    assert stat.S_IMODE(served.connection_file.stat().st_mode) == 0o600
    env = connection_env(served)
    assert env == {"CELERYTP_BROKER": served.broker_url, "CELERYTP_GROUP": GROUP, "CELERYTP_WORLD_SIZE": "1"}
    password = served.broker_url.split(":")[2].split("@")[0]
    assert password not in open(served.log_path).read()  # never printed


def celery_tool(served, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celery", "-A", "celerytp.app", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT, **connection_env(served)})


@pytest.fixture(scope="module")
def producer(served):
    """A plain Celery producer that knows only what the connection file says."""
    broker = connection_env(served)["CELERYTP_BROKER"]
    app = Celery("outside-producer", broker=broker, backend=broker)
    yield app
    app.close()


def send(producer: Celery, **kwargs) -> AsyncResult:
    return producer.send_task("celerytp.generate", kwargs=kwargs, queue=REQUESTS_QUEUE)


def test_celery_inspect_and_a_producer_reach_it_through_the_file(served, producer):
    ping = celery_tool(served, "inspect", "ping", "--timeout", "5")
    assert ping.returncode == 0 and f"celerytp.{GROUP}.rank0@" in ping.stdout, ping.stdout + ping.stderr
    reply = send(producer, prompt="Hi", max_tokens=2).get(timeout=120)
    assert reply["model"] == MODEL and reply["usage"]["completion_tokens"] <= 2


@pytest.fixture(scope="module")
def flower(served, producer):
    with start_flower(connection_env(served), {RANK_QUEUE, REQUESTS_QUEUE},
                      lambda: send(producer, prompt="Hi", max_tokens=1)) as base:
        yield base


def test_flower_shows_the_queue_lengths(served, flower):
    answer = httpx.get(f"{flower}/api/queues/length", auth=AUTH, timeout=10)
    lengths = {q["name"]: q["messages"] for q in answer.json()["active_queues"]}
    assert {RANK_QUEUE, REQUESTS_QUEUE} <= set(lengths) and all(isinstance(n, int) and n >= 0 for n in lengths.values())
    page = httpx.get(f"{flower}/broker", auth=AUTH, timeout=10)
    assert page.status_code == 200 and RANK_QUEUE in page.text and REQUESTS_QUEUE in page.text
    assert served.broker_url.split(":")[2].split("@")[0] not in page.text  # the page masks the password


def test_the_connection_file_replaces_a_readable_one_with_a_private_one(tmp_path):
    from celerytp.cluster import LocalCluster

    path = tmp_path / "cluster.env"
    path.write_text("old\n")
    path.chmod(0o644)
    cluster = LocalCluster(world_size=2, group="g", connection_file=path)  # not started: no processes
    cluster.broker_url = "redis://:s3cret@127.0.0.1:7000/0"
    try:
        cluster.write_connection_file(path)
    finally:
        cluster.stop()  # removes only its work directory: it never wrote the file as a started cluster
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and list(tmp_path.iterdir()) == [path]
    assert path.read_text() == ("CELERYTP_BROKER=redis://:s3cret@127.0.0.1:7000/0\nCELERYTP_GROUP=g\n"
                                "CELERYTP_WORLD_SIZE=2\n")


def test_a_connection_file_with_an_external_broker_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "celerytp", "serve", "--broker", "redis://:pw@127.0.0.1:1/0",
                          "--connection-file", str(tmp_path / "c.env")], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 2 and "--connection-file" in out.stderr and "pw" not in out.stderr + out.stdout
    assert not (tmp_path / "c.env").exists()
