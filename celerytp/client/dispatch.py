"""Publishing one op to every rank as a Celery chord, in the same order on every rank queue.

Celery's canvas (`chord(header)(body)`) spends milliseconds of Python per call and
subscribes the caller to every header result. This builds the same chord from
Celery's own message primitives: the backend's chord counter, header task messages
that carry the body and the group id, and nothing more; the body's result is what the
leader waits for.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from celerytp.core.app import UNREAD_PREFIX, queue_name
from celerytp.core.keys import dispatch_lock_key, epoch_key, seq_key
from celerytp.core.redis_scripts import RELEASE_IF_HOLDER

# One round trip: take the group's dispatch lock, the next op sequence number and its epoch
# (created if Redis lost it), and set the chord's size key (what the result backend's
# `set_chord_size` writes for a fresh group id).
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[4])
  redis.call('SET', KEYS[4], ARGV[5], 'NX')
  return {redis.call('INCR', KEYS[2]), redis.call('GET', KEYS[4])}
end
return 0
"""
# A new epoch: ranks that see it start counting sequence numbers again (after a refusal).
_NEW_EPOCH = "redis.call('SET', KEYS[2], ARGV[1]) redis.call('SET', KEYS[1], 0) return 1"

LOCK_TTL_MS = 30_000  # a leader that dies while publishing frees the group after this


class DispatchLockTimeout(Exception):
    """The group's dispatch lock stayed taken for the whole wait."""


@dataclass(frozen=True)
class PublishedChord:
    seq: int
    epoch: str
    group_id: str
    body_id: str
    header_ids: list[str]


class ChordPublisher:
    """Publishes chords for one group, serialized across threads and processes by a Redis lock."""

    def __init__(self, app: Celery, client: redis.Redis, group: str, world_size: int, body_task: str):
        self.app = app
        self.group = group
        self.world_size = world_size
        self.body_task = body_task
        self._acquire = client.register_script(_ACQUIRE)
        self._release = client.register_script(RELEASE_IF_HOLDER)
        self._new_epoch = client.register_script(_NEW_EPOCH)
        self._keys = [dispatch_lock_key(group), seq_key(group)]
        self._epoch_key = epoch_key(group)

    def publish(
        self,
        task_name: str,
        make_request: Callable[[int, str], dict[str, Any]],
        expires: float,
        lock_wait: float,
        subscribe: bool = True,
    ) -> PublishedChord:
        """Publish `task_name(make_request(seq, epoch))` to every rank queue, body = the gather task.

        `subscribe` False: nobody will wait for the combined reply (it expires in the backend).
        """
        token, group_id, body_id = uuid.uuid4().hex, uuid.uuid4().hex, uuid.uuid4().hex
        if not subscribe:
            body_id = UNREAD_PREFIX + body_id  # the inline body stores no reply for it
        if subscribe:  # subscribe to the body's result first, so the reply cannot be missed
            self.app.backend.on_task_call(None, body_id)
        seq, epoch = self._take_lock(token, group_id, lock_wait)
        try:
            return self._send(task_name, make_request(seq, epoch), seq, epoch, group_id, body_id, expires)
        finally:
            self._release(keys=self._keys[:1], args=[token])

    def new_epoch(self) -> None:
        """Start a new sequence epoch (a rank refused an op as out of order: resynchronise)."""
        self._new_epoch(keys=[self._keys[1], self._epoch_key], args=[uuid.uuid4().hex])

    def _take_lock(self, token: str, group_id: str, wait: float) -> tuple[int, str]:
        deadline = time.monotonic() + wait
        pause = 0.0005
        size_key = self.app.backend.get_key_for_group(group_id, ".s")
        expires = int(self.app.backend.chord_expires or 86400)
        while True:
            taken = self._acquire(
                keys=[*self._keys, size_key, self._epoch_key],
                args=[token, LOCK_TTL_MS, self.world_size, expires, uuid.uuid4().hex],
            )
            if taken:
                return int(taken[0]), taken[1].decode()
            if time.monotonic() > deadline:
                raise DispatchLockTimeout(f"dispatch lock of group {self.group!r} still taken after {wait:.1f}s")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _send(
        self, task_name: str, request: dict[str, Any], seq: int, epoch: str, group_id: str, body_id: str, expires: float
    ) -> PublishedChord:
        app, amqp = self.app, self.app.amqp
        body = app.signature(self.body_task, options={"task_id": body_id})
        header_ids = [uuid.uuid4().hex for _ in range(self.world_size)]
        # One Redis pipeline for all rank queues (kombu's publish batch), not a round trip each.
        with app.producer_or_acquire() as producer, producer.batch():
            for rank, task_id in enumerate(header_ids):
                message = amqp.create_task_message(
                    task_id, task_name, (request,), {}, group_id=group_id, group_index=rank,
                    expires=expires, chord=body, root_id=task_id, ignore_result=True,
                )
                amqp.send_task_message(producer, task_name, message, queue=queue_name(self.group, rank), expiration=expires)
        return PublishedChord(seq, epoch, group_id, body_id, header_ids)

    def finished_parts(self, sent: PublishedChord) -> dict[int, tuple[str, Any]]:
        """Ranks whose part of an unfinished chord is done: rank -> (state, result).

        Header results are not stored one by one (the body carries them all), so this
        reads the backend's chord join list, where each finished part is recorded.
        """
        backend = self.app.backend
        entries = backend.client.zrange(backend.get_key_for_group(sent.group_id, ".j"), 0, -1)
        rank_of = {task_id: rank for rank, task_id in enumerate(sent.header_ids)}
        parts = {}
        for entry in entries:
            _, task_id, state, result = backend.decode(entry)
            if task_id in rank_of:
                parts[rank_of[task_id]] = (state, result)
        return parts
