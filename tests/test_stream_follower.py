"""A process's request streams read by one XREAD (client/stream_follower.py), against a real
redis-server: every stream gets its entries in order, a stream followed while the reader blocks
is read at once, a rewound stream is read again, two waiters of one stream get every entry each,
a forked child reads with its own thread, and a failed read reaches its waiters without ending
the reader."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import redis

from celerytp.client import stream_follower
from celerytp.client.stream_follower import StreamFollower


def indexes(follow, count: int) -> list[int]:
    """The next `count` entries' indexes, over as many reads as they take."""
    seen: list[int] = []
    while len(seen) < count:
        entries = follow.get(timeout=5)
        assert entries is not None, f"only {seen} within 5 s"
        seen += [int(fields[b"index"]) for _, fields in entries]
    return seen


def add(client: redis.Redis, key: str, *numbers: int) -> None:
    for number in numbers:
        client.xadd(key, {"index": number})


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
            assert indexes(follow, 1) == [step]
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
    add(client, "rewound", 0, 1)
    assert indexes(follow, 2) == [0, 1]
    follower.rewind(follow)
    assert indexes(follow, 2) == [0, 1]
    follower.drop(follow)
    add(client, "rewound", 2)
    assert follow.get(timeout=0.3) is None  # dropped: nothing more is handed over


def test_two_waiters_of_one_stream_each_get_every_entry(redis_url):
    client = redis.Redis.from_url(redis_url)
    follower = StreamFollower(client)
    early = follower.follow("twice")
    add(client, "twice", 0, 1, 2)
    assert indexes(early, 3) == [0, 1, 2]
    late = follower.follow("twice")  # a redelivered front-door task follows the same request
    add(client, "twice", 3)
    assert indexes(late, 4) == [0, 1, 2, 3]
    assert indexes(early, 1) == [3]  # not again what it had
    follower.drop(early), follower.drop(late)


def test_a_forked_child_follows_with_its_own_reader(redis_url):
    client = redis.Redis.from_url(redis_url)
    follower = StreamFollower(client)
    parent = follower.follow("before-fork")  # the parent's reader thread runs, and holds a follow

    def child() -> None:  # without a reader of its own the child's wait would time out
        follow = follower.follow("in-child")
        redis.Redis.from_url(redis_url).xadd("in-child", {"index": 0})
        os._exit(0 if follow.get(timeout=5) is not None else 1)

    process = multiprocessing.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == 0
    follower.drop(parent)


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
