"""Shared fixtures: real Redis, real rank worker processes, real gloo groups."""

from __future__ import annotations

# hypothesis is imported at start-up: imported late (by its plugin's end-of-run summary, under
# assertion rewriting) it trips CPython 3.11.7's AST recursion check and fails the whole run.
import socket
import subprocess
import time

import hypothesis  # noqa: F401
import pytest
import redis

from celerytp.cluster import LocalCluster, find_redis_server


@pytest.fixture(scope="module")
def cluster2():
    """A two-rank LocalCluster shared by a module's tests (each test leaves it usable)."""
    with LocalCluster(world_size=2, group="t2") as cluster:
        yield cluster


@pytest.fixture(scope="module")
def redis_url():
    """A private redis-server alone (no ranks), for a module's tests of Redis clients."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", ""],
                              stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
    yield url
    server.terminate()
    server.wait(10)
