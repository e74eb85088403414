"""Blocking Redis commands with a computed timeout, against a real redis-server: a wait with under
a millisecond left must not turn into Redis's "block forever" (a timeout of 0). An idle serving
loop's BLMOVE did exactly that once, and the rank wedged until its peer's collective timed out."""

from __future__ import annotations

import time

import pytest
import redis

from celerytp.core.redis_client import block_timeout


@pytest.mark.parametrize("left", [0.0004, 1e-9])
def test_a_wait_with_under_a_millisecond_left_still_ends(redis_url, left):
    client = redis.Redis.from_url(redis_url)
    started = time.monotonic()
    assert client.blmove("empty", "elsewhere", block_timeout(left), "LEFT", "RIGHT") is None
    assert client.blpop(["empty"], timeout=block_timeout(left)) is None
    assert time.monotonic() - started < 1
    # The raw value is what wedged the loop: Redis reads it as 0 ms, "block forever".
    bounded = redis.Redis.from_url(redis_url, socket_timeout=0.5)
    with pytest.raises(redis.TimeoutError):
        bounded.blmove("empty", "elsewhere", left, "LEFT", "RIGHT")
