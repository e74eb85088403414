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
import weakref
from dataclasses import dataclass, field

import redis

from celerytp.core.keys import wake_key

log = logging.getLogger(__name__)

READ_BLOCK_S = 1.0  # the reader's XREAD timeout: a registration wakes it sooner
READ_COUNT = 256  # entries at most per stream and read
WAKE_TTL_S = 60  # the wake stream outlives any XREAD on it, not the process


StreamId = tuple[int, int]  # an entry id, "<ms>-<seq>", as numbers (compared in order)


def stream_id(entry_id: bytes | str) -> StreamId:
    ms, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")
    return int(ms), int(seq)


@dataclass(eq=False)
class Follow:
    """One waiter's stream: the reader puts each read's new entries (or its failure) on `inbox`."""

    key: str
    inbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    last: StreamId = (0, 0)  # the last entry handed over (owned by the reader, under the follower's lock)
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
    with the first stream). Two waiters may follow one stream (a front door's redelivered task
    follows a request its first delivery still follows): each gets every entry."""

    def __init__(self, client: redis.Redis):
        self._redis = client
        self._wake = wake_key(uuid.uuid4().hex)
        self._reset()
        method = weakref.WeakMethod(self._reset)  # a forked child has neither the reader nor its waiters
        os.register_at_fork(after_in_child=lambda: (reset := method()) and reset())

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._follows: dict[str, list[Follow]] = {}
        self._reader: threading.Thread | None = None

    def follow(self, key: str) -> Follow:
        """Start following the stream `key` from its first entry."""
        follow = Follow(key)
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(target=self._read, name="celerytp-streams", daemon=True)
                self._reader.start()
            self._follows.setdefault(key, []).append(follow)
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
            follow.last, follow.epoch = (0, 0), follow.epoch + 1
        self._wake_reader()

    def drop(self, follow: Follow) -> None:
        with self._lock:
            self._drop_locked(follow)

    def _drop_locked(self, follow: Follow) -> None:
        follows = self._follows.get(follow.key, [])
        if follow in follows:
            follows.remove(follow)
            if not follows:
                del self._follows[follow.key]

    def _wake_reader(self) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.xadd(self._wake, {"w": 1}, maxlen=1, approximate=False)
        pipe.expire(self._wake, WAKE_TTL_S)
        pipe.execute()

    def _read(self) -> None:
        woken = "0-0"  # the last wake entry seen
        while True:
            with self._lock:
                while not self._follows:
                    self._idle.wait()
                reading = {key: [(follow, follow.epoch) for follow in follows] for key, follows in self._follows.items()}
                # From the earliest position of each stream's waiters; each gets only what is new to it.
                streams = {key: "%d-%d" % min(follow.last for follow in follows) for key, follows in self._follows.items()}
            streams[self._wake] = woken
            try:
                woken = self._read_once(streams, reading, woken)
            except Exception as exc:  # noqa: BLE001 - the waiters of this read raise it; the reader lives on
                log.warning("reading request streams failed: %s", exc)
                with self._lock:
                    for follows in reading.values():
                        for follow, _ in follows:
                            follow.inbox.put(exc)
                            self._drop_locked(follow)

    def _read_once(self, streams: dict[str, str], reading: dict[str, list[tuple[Follow, int]]], woken: str) -> str:
        """One XREAD of `streams` (key -> last id read, the wake stream's among them); hands each
        waiter in `reading` what is new to it. Returns the last wake entry seen."""
        reply = self._redis.xread(streams, count=READ_COUNT, block=int(READ_BLOCK_S * 1000))
        with self._lock:
            for raw_key, entries in reply or ():
                key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
                if key == self._wake:
                    woken = entries[-1][0]
                    continue
                for follow, epoch in reading[key]:
                    if follow.epoch != epoch or follow not in self._follows.get(key, []):
                        continue  # rewound or dropped while the read was under way
                    new = [entry for entry in entries if stream_id(entry[0]) > follow.last]
                    if new:
                        follow.last = stream_id(new[-1][0])
                        follow.inbox.put(new)
        return woken
