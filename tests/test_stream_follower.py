"""A process's request streams read by one XREAD (client/stream_follower.py), against a real
redis-server: every stream gets its entries in order, a stream followed while the reader blocks
is read at once, a rewound stream is read again, and a failed read reaches its waiters without
ending the reader."""

from __future__ import annotations

import time

import pytest
import redis

from celerytp.client import stream_follower
from celerytp.client.stream_follower import StreamFollower


def xreads(client: redis.Redis) -> int:
    return client.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)


def test_one_read_a_step_serves_every_stream(redis_url):
    client = redis.Redis.from_url(redis_url)
    follower = StreamFollower(client)
    keys = [f"many:{i}" for i in range(16)]
    follows = [follower.follow(key) for key in keys]
    time.sleep(0.1)  # the registrations' wakes are read
    before, steps = xreads(client), 5
    for step in range(steps):  # a serving loop's publisher: one pipeline of one entry per stream a step
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.xadd(key, {"index": step})
        pipe.execute()
        for follow in follows:
            entries = follow.get(timeout=5)
            assert [int(fields[b"index"]) for _, fields in entries] == [step]
    # A reader per stream makes 16 reads a step; one reader makes one, or a few when a read
    # returns between the pipeline's writes.
    assert xreads(client) - before <= 3 * steps
    for follow in follows:
        follower.drop(follow)


def test_a_stream_followed_while_the_reader_blocks_is_read_at_once(redis_url, monkeypatch):
    monkeypatch.setattr(stream_follower, "READ_BLOCK_S", 5.0)  # without a wake, a new stream waits this long
    client = redis.Redis.from_url(redis_url)
    follower = StreamFollower(client)
    first = follower.follow("blocking:first")
    time.sleep(0.3)  # the reader now blocks on the first stream alone
    second = follower.follow("blocking:second")
    started = time.monotonic()
    client.xadd("blocking:second", {"index": 0})
    assert second.get(timeout=10) is not None
    assert time.monotonic() - started < 1.0
    follower.drop(first), follower.drop(second)


def test_a_rewound_stream_is_read_again_from_its_first_entry(redis_url):
    client = redis.Redis.from_url(redis_url)
    follower = StreamFollower(client)
    follow = follower.follow("rewound")
    for index in range(2):
        client.xadd("rewound", {"index": index})
    seen = []
    while len(seen) < 2:
        seen += [int(fields[b"index"]) for _, fields in follow.get(timeout=5)]
    assert seen == [0, 1]
    follower.rewind(follow)
    entries = follow.get(timeout=5)
    assert [int(fields[b"index"]) for _, fields in entries] == [0, 1]
    follower.drop(follow)
    client.xadd("rewound", {"index": 2})
    assert follow.get(timeout=0.3) is None  # dropped: nothing more is handed over


def test_a_failed_read_reaches_every_waiter_and_the_reader_lives_on(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.set("not-a-stream", "x")  # XREAD on it fails with WRONGTYPE, as a read would in an outage
    follower = StreamFollower(client)
    good = follower.follow("beside-the-bad-one")
    bad = follower.follow("not-a-stream")
    for follow in (good, bad):
        with pytest.raises(redis.ResponseError):
            follow.get(timeout=5)
    again = follower.follow("beside-the-bad-one")
    client.xadd("beside-the-bad-one", {"index": 0})
    assert again.get(timeout=5) is not None
    follower.drop(again)
