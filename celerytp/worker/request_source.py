"""Rank 0's Redis side of a model's serving loop (serving.RequestSource over Redis).

It takes requests from the model's queue, streams tokens and results to each request's Redis
Stream (core/stream_record.py), reads cancellations, and ends the loop atomically with
submitters (core/redis_scripts.py).
"""

from __future__ import annotations

import json
import logging
import time

import redis

from celerytp.core import protocol as p
from celerytp.core.app import op_task_name, queue_name
from celerytp.core.errors import CeleryTPError
from celerytp.core.keys import cancel_key, loop_key, loop_stats_key, queue_key, stream_key
from celerytp.core.protocol import GenSpec, RowResult
from celerytp.core.redis_scripts import EXIT_IF_IDLE, RELEASE_IF_HOLDER
from celerytp.core.stream_record import StreamRecord
from celerytp.worker.serving import Events, Finished

log = logging.getLogger(__name__)

STREAM_TTL_S = 600  # a finished request's stream outlives any sane wait for it, then goes
LOOP_TTL_S = 10  # the loop flag, refreshed every step: a dead rank 0 frees it within this
POLL_S = 0.005  # how often an idle loop looks at the queue
YIELD_CHECK_S = 0.05  # how often rank 0 looks for other ops waiting in its queue
SERVE_TASK = op_task_name("serve")


class RedisRequestSource:
    """Rank 0's end of one model's request queue (see serving.RequestSource)."""

    def __init__(self, client: redis.Redis, group: str, model_id: str, loop_id: str):
        self._redis = client
        self._group = group
        self._queue = queue_key(group, model_id)
        self._flag = loop_key(group, model_id)
        self._stats = loop_stats_key(group, model_id)
        self._rank0_queue = queue_name(group, 0)
        self._loop_id = loop_id
        self._exit = client.register_script(EXIT_IF_IDLE)
        self._yield_checked = 0.0
        self._yield = False

    def start(self) -> None:
        self._redis.set(self._flag, self._loop_id, ex=LOOP_TTL_S)

    def release(self) -> None:
        self._redis.eval(RELEASE_IF_HOLDER, 1, self._flag, self._loop_id)

    def take(self, count: int) -> list[GenSpec]:
        raw = self._redis.lpop(self._queue, count) or []
        specs = [spec for item in raw if (spec := self._parse(item)) is not None]
        if not specs:
            return []
        flags = self._redis.mget([cancel_key(self._group, s.request_id) for s in specs])
        cancelled = [s for s, flag in zip(specs, flags) if flag is not None]
        if cancelled:  # cancelled while queued: never runs
            events = Events(finished=[(s, Finished(_empty_result(s, "cancelled"))) for s in cancelled])
            self.publish(events, [], {})
        return [s for s, flag in zip(specs, flags) if flag is None]

    def _parse(self, item: bytes) -> GenSpec | None:
        """A queued request, or None for a malformed entry (answered when it names its request)."""
        try:
            data = json.loads(item)
        except ValueError:
            data = None
        try:
            return p.validate_message(GenSpec, data, "queued request")
        except CeleryTPError as exc:
            log.warning("dropping a malformed queued request %.200r: %s", item, exc)
            request_id = data.get("request_id") if isinstance(data, dict) else None
            if isinstance(request_id, str) and 0 < len(request_id) <= 64:
                self._finish_stream(self._redis, request_id, StreamRecord.of_error(exc))
            return None

    def wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._redis.llen(self._queue):
                return True
            if self.yield_wanted():
                return False
            self._redis.expire(self._flag, LOOP_TTL_S)
            time.sleep(POLL_S)
        return bool(self._redis.llen(self._queue))

    def publish(self, events: Events, running: list[str], stats: dict[str, int]) -> set[str]:
        pipe = self._redis.pipeline(transaction=False)
        for spec, token in events.tokens:
            pipe.xadd(stream_key(self._group, spec.request_id), StreamRecord.of_token(token).to_fields())
        for spec, finished in events.finished:
            record = StreamRecord.of_error(finished.error) if finished.error else StreamRecord.of_result(finished.result)
            self._finish_stream(pipe, spec.request_id, record)
        for key in {stream_key(self._group, spec.request_id) for spec, _ in events.tokens}:
            pipe.expire(key, STREAM_TTL_S)
        if stats:
            pipe.hset(self._stats, mapping=stats)
            pipe.expire(self._stats, 3600)
            pipe.expire(self._flag, LOOP_TTL_S)
        if running:
            pipe.mget([cancel_key(self._group, rid) for rid in running])
        results = pipe.execute() if len(pipe) else []
        if not running:
            return set()
        return {rid for rid, flag in zip(running, results[-1]) if flag is not None}

    def _finish_stream(self, client: redis.Redis | redis.client.Pipeline, request_id: str, record: StreamRecord) -> None:
        key = stream_key(self._group, request_id)
        client.xadd(key, record.to_fields())
        client.expire(key, STREAM_TTL_S)

    def yield_wanted(self) -> bool:
        """True when rank 0's own queue holds an op other than a serving loop."""
        now = time.monotonic()
        if now - self._yield_checked >= YIELD_CHECK_S:
            self._yield_checked = now
            waiting = self._redis.lrange(self._rank0_queue, 0, -1)
            self._yield = any(_task_name(message) != SERVE_TASK for message in waiting)
        return self._yield

    def try_exit(self) -> bool:
        return bool(self._exit(keys=[self._queue, self._flag], args=[self._loop_id]))

    def fail(self, specs: list[GenSpec], error: CeleryTPError) -> None:
        """Answer `specs` with `error`."""
        if specs:
            self.publish(Events(finished=[(s, Finished(error=error)) for s in specs]), [], {})

    def fail_queued(self, error: CeleryTPError) -> None:
        """Answer every queued request with `error` (no loop will take them)."""
        self.fail([s for item in self._redis.lpop(self._queue, 1 << 16) or [] if (s := self._parse(item))], error)


def _task_name(message: bytes) -> str | None:
    try:
        return json.loads(message)["headers"]["task"]
    except (ValueError, KeyError, TypeError):
        return None


def _empty_result(spec: GenSpec, reason: str) -> RowResult:
    return RowResult(
        request_id=spec.request_id, token_ids=[], finish_reason=reason, prompt_tokens=len(spec.prompt),
        ttft_s=0.0, decode_s=0.0,
    )
