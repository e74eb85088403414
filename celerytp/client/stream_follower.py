"""One reader for every request stream a leader process follows.

A serving loop writes each step's tokens to every running request's stream at once. Were each
waiter to read its own stream, a process following 16 requests (an HTTP server, a benchmark's
client) would make 16 blocking XREADs a step, each waking one thread, on the cores the ranks
and Redis need. Here one thread makes one XREAD over all the streams the process follows and
hands each its entries; a waiter only waits on its own in-memory queue.

A new or rewound stream must join the XREAD at once, not when the one in progress times out:
each registration adds an entry to this follower's own wake stream, which the XREAD reads too.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import uuid
from dataclasses import dataclass, field

import redis

from celerytp.core.keys import wake_key

log = logging.getLogger(__name__)

READ_BLOCK_S = 1.0  # the reader's XREAD timeout: a registration wakes it sooner
READ_COUNT = 256  # entries at most per stream and read
WAKE_TTL_S = 60  # the wake stream outlives any XREAD on it, not the process


@dataclass(eq=False)
class Follow:
    """One followed stream: the reader puts each read's entries (or its failure) on `inbox`."""

    key: str
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    last: str = "0-0"  # the last entry id handed over (owned by the reader, under the follower's lock)
    epoch: int = 0  # bumped by a rewind: a read begun before it is not handed over

    def get(self, timeout: float) -> list | None:
        """The next read's entries [(id, fields), ...], None after `timeout` seconds with none;
        raises what the reader met."""
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item


class StreamFollower:
    """Follows request streams for one process, one XREAD for all of them (a daemon thread started
    with the first stream, and again after a fork)."""

    def __init__(self, client: redis.Redis):
        self._redis = client
        self._wake = wake_key(uuid.uuid4().hex)
        self._lock = threading.Lock()
        self._follows: dict[str, Follow] = {}
        self._idle = threading.Condition(self._lock)
        self._reader_pid: int | None = None

    def follow(self, key: str) -> Follow:
        """Start following the stream `key` from its first entry."""
        follow = Follow(key)
        with self._lock:
            if self._reader_pid != os.getpid():
                self._reader_pid = os.getpid()
                threading.Thread(target=self._read, name="celerytp-streams", daemon=True).start()
            self._follows[key] = follow
            self._idle.notify()
        try:
            self._wake_reader()
        except BaseException:
            self.drop(follow)
            raise
        return follow

    def rewind(self, follow: Follow) -> None:
        """Read `follow`'s stream again from its first entry (it was lost and is being rewritten)."""
        with self._lock:
            follow.last, follow.epoch = "0-0", follow.epoch + 1
        self._wake_reader()

    def drop(self, follow: Follow) -> None:
        with self._lock:
            self._drop_locked(follow)

    def _drop_locked(self, follow: Follow) -> None:
        if self._follows.get(follow.key) is follow:
            del self._follows[follow.key]

    def _wake_reader(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self._wake, {"w": 1}, maxlen=1, approximate=False)
        pipe.expire(self._wake, WAKE_TTL_S)
        pipe.execute()

    def _read(self) -> None:
        woken = "0-0"
        while True:
            with self._lock:
                while not self._follows:
                    self._idle.wait()
                reading = {key: (follow, follow.epoch) for key, follow in self._follows.items()}
                streams = {key: follow.last for key, follow in self._follows.items()}
            streams[self._wake] = woken
            try:
                reply = self._redis.xread(streams, count=READ_COUNT, block=int(READ_BLOCK_S * 1000))
            except Exception as exc:  # noqa: BLE001 - every waiter gets it; the reader lives on
                log.warning("reading request streams failed: %s", exc)
                for follow, _ in reading.values():
                    follow.inbox.put(exc)
                with self._lock:  # a waiter that goes on follows again
                    for follow, _ in reading.values():
                        self._drop_locked(follow)
                continue
            with self._lock:
                for raw_key, entries in reply or ():
                    key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                    if key == self._wake:
                        woken = entries[-1][0]
                        continue
                    follow, epoch = reading[key]
                    if self._follows.get(key) is follow and follow.epoch == epoch:
                        follow.last = entries[-1][0]
                        follow.inbox.put(entries)
