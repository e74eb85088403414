"""Blocking Redis commands with a computed timeout, against a real redis-server: a wait with under
a millisecond left must not turn into Redis's "block forever" (a timeout of 0). An idle serving
loop's BLMOVE did exactly that once, and the rank wedged until its peer's collective timed out."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest
import redis

from celerytp.cluster import find_redis_server
from celerytp.core.redis_client import block_timeout


@pytest.fixture(scope="module")
def url():
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


@pytest.mark.parametrize("left", [0.0004, 1e-9])
def test_a_wait_with_under_a_millisecond_left_still_ends(url, left):
    client = redis.Redis.from_url(url)
    started = time.monotonic()
    assert client.blmove("empty", "elsewhere", block_timeout(left), "LEFT", "RIGHT") is None
    assert client.blpop(["empty"], timeout=block_timeout(left)) is None
    assert time.monotonic() - started < 1
    # The raw value is what wedged the loop: Redis reads it as 0 ms, "block forever".
    bounded = redis.Redis.from_url(url, socket_timeout=0.5)
    with pytest.raises(redis.TimeoutError):
        bounded.blmove("empty", "elsewhere", left, "LEFT", "RIGHT")
