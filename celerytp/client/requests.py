"""Generation requests from any leader: queue them for a model's serving loops and follow them.

A request goes onto the model's Redis queue, which every group serving the model (its replicas)
pulls from; the submitter starts the serving loop of each replica that has none. Its tokens
(when streamed) and its result come back on the request's Redis Stream, readable from any
process (a process reads all the streams it follows with one XREAD: client/stream_follower.py).
A request outlives the group that runs it: when that group fails, its requests go back to the
queue and resume elsewhere (worker/request_source.py), and the waiter here only makes sure some
loop will take them: it gives back what a dead group held, starts a loop, or heals a group when
none can run. A waiter whose request Redis lost queues it again.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from celerytp.client.stream_follower import StreamFollower
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.keys import cancel_key, inflight_key, loop_key, queue_key, replicas_key, request_key, stream_key
from celerytp.core.protocol import RowResult
from celerytp.core.redis_client import unavailable
from celerytp.core.redis_scripts import RECLAIM, SUBMIT
from celerytp.core.stream_record import StreamRecord

log = logging.getLogger(__name__)

LOOP_START_TTL_S = 120  # the loop flag until the loop's rank 0 takes it over (it may queue behind an op)
EVENT_WAIT_S = 0.25  # a waiter's longest wait for its stream's next entries between its checks
STRANDED_CHECK_S = 0.5  # how often a waiter with no news checks that a loop will take its request
LOST_AFTER_S = 1.0  # no marker, no stream, not queued this long: Redis lost the request, queue it again
MAX_REQUEUES = 3  # times a waiter queues again a request that Redis lost
CANCEL_TTL_S = 600
MARKER_TTL_S = 4 * 3600  # a request's marker (its queued JSON) outlives any wait for it

Serve = Callable[[str, bool], None]  # (model_id, heal): start loops on the model's replicas (see Leader._serve)


@dataclass(frozen=True)
class Token:
    id: int
    logprob: tuple[float, list] | None = None  # [logprob, [[id, logprob], ...]] when the request asked for them


@dataclass(frozen=True)
class Done:
    result: RowResult


class RequestQueues:
    """The leader side of every model's request queue.

    Args:
        client: the Redis of the groups.
        serve: starts a serving loop on each replica of a model that has none; with heal True
            (a request waits and no loop runs anywhere) it heals a replica first.
    """

    def __init__(self, client: redis.Redis, serve: Serve):
        self._redis = client
        self._serve = serve
        self._submit = client.register_script(SUBMIT)
        self._reclaim = client.register_script(RECLAIM)
        self._followed: dict[str, tuple[str, str]] = {}  # request id -> (model id, queued JSON)
        self._streams = StreamFollower(client)

    def submit(self, model_id: str, spec: dict, max_queue: int, timeout: float) -> PendingRequest:
        """Queue `spec` (a GenSpec) for `model_id`, to be taken within `timeout` seconds;
        CeleryTPError(overloaded) when the queue is full. A request id that is already queued or
        running is followed, not run twice (a redelivered front-door task)."""
        now = time.time()
        item = json.dumps({**spec, "submitted_at": now, "queue_deadline": now + timeout})
        request_id = spec["request_id"]
        try:
            outcome = self._submit(keys=[queue_key(model_id), request_key(request_id)], args=[item, max_queue, MARKER_TTL_S])
            if outcome == -1:
                raise CeleryTPError(
                    ErrorKind.OVERLOADED, f"model {model_id!r} has {max_queue} requests queued already; try again later"
                )
            if isinstance(outcome, bytes):  # already submitted: follow that one
                item = outcome.decode()
            else:
                self._start(model_id, request_id, item)
        except redis.RedisError as exc:
            raise unavailable(exc) from None
        self._followed[request_id] = (model_id, item)
        return PendingRequest(self, model_id, request_id, item, timeout)

    def _start(self, model_id: str, request_id: str, item: str) -> None:
        """Start the model's loops for a new request. When no loop can run (a typed error), nothing
        is left behind: the request leaves the queue."""
        try:
            self._serve(model_id, False)
        except CeleryTPError:
            pipe = self._redis.pipeline()
            pipe.lrem(queue_key(model_id), 1, item)
            pipe.delete(request_key(request_id))
            pipe.execute()
            raise

    def cancel(self, request_id: str) -> None:
        """Cancel a request: a queued one never runs, a running one stops within a few steps.

        A request this leader submitted is taken off the queue at once (with its done record);
        any other is stopped by its rank 0, which sees the cancel key when it takes or steps it.
        """
        try:
            self._redis.set(cancel_key(request_id), 1, ex=CANCEL_TTL_S)
            model_id, item = self._followed.get(request_id, (None, None))
            if item is not None and self._redis.lrem(queue_key(model_id), 1, item):
                spec = json.loads(item)
                result = RowResult(
                    request_id=request_id, token_ids=[], finish_reason="cancelled", prompt_tokens=len(spec["prompt"]),
                    ttft_s=0.0, decode_s=0.0,
                )
                key = stream_key(request_id)
                self._redis.xadd(key, StreamRecord.of_result(result).to_fields())
                self._redis.expire(key, CANCEL_TTL_S)
        except redis.RedisError as exc:
            raise unavailable(exc) from None

    def events(self, model_id: str, request_id: str, item: str, deadline: float) -> Iterator[Token | Done]:
        """The request's tokens (if streamed), each once and in order, then its result; raises its
        error or a timeout (and leaves the queue)."""
        key = stream_key(request_id)
        checked, missing, requeued, expected = time.monotonic(), 0, 0, 0
        finished = False
        follow = None
        try:
            follow = self._streams.follow(key)
            while True:
                now = time.monotonic()
                if now > deadline:
                    self._redis.lrem(queue_key(model_id), 1, item)
                    raise CeleryTPError(ErrorKind.TIMEOUT, f"request {request_id}: no result within the deadline")
                entries = follow.get(timeout=min(EVENT_WAIT_S, deadline - now))
                if entries is None:
                    if now - checked > STRANDED_CHECK_S:
                        checked = now
                        missing = 0 if self._ensure_taken(model_id, request_id, item) else missing + 1
                        if missing * STRANDED_CHECK_S > LOST_AFTER_S:  # for longer than any flag refresh gap
                            requeued, missing = self._requeue(model_id, request_id, item, requeued), 0
                            self._streams.rewind(follow)
                    continue
                for _, fields in entries:
                    record = StreamRecord.from_fields(fields)
                    if record.token is not None:
                        if record.index >= expected:  # below: a resumed request's earlier holder wrote it too
                            if record.index > expected:  # Redis lost tokens (its fsync window): go on without them
                                log.warning("request %s: tokens %d-%d were lost", request_id, expected, record.index - 1)
                            expected = record.index + 1
                            yield Token(record.token, record.logprob)
                    elif record.done is not None:
                        finished = True
                        yield Done(record.done)
                        return
                    else:
                        finished = True
                        record.raise_error()
        except redis.RedisError as exc:
            raise unavailable(exc) from None
        finally:
            if follow is not None:
                self._streams.drop(follow)
            # Abandoned (the caller stopped iterating, was interrupted, or its wait failed): cancel it,
            # so its row frees within a few steps. The cancel key is left to its TTL: rank 0 reads it later.
            self._followed_end(request_id, key, abandoned=not finished)

    def _ensure_taken(self, model_id: str, request_id: str, item: str) -> bool:
        """Make sure a loop will take the request: give back what dead groups held, start loops, heal
        a replica when no loop runs anywhere. False: the request is nowhere (Redis lost it)."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.hkeys(replicas_key(model_id))
        pipe.lpos(queue_key(model_id), item)
        pipe.exists(request_key(request_id), stream_key(request_id))
        groups, queued, known = pipe.execute()
        groups = [g.decode() for g in groups]
        flags = self._redis.mget([loop_key(g, model_id) for g in groups]) if groups else []
        if not all(flags):  # a group with no loop may have died holding requests: give them back
            keys = [queue_key(model_id)]
            for group in groups:
                keys += [inflight_key(group, model_id), loop_key(group, model_id)]
            if self._reclaim(keys=keys):
                queued = self._redis.lpos(queue_key(model_id), item)
        if queued is not None and not any(flags):
            self._serve(model_id, True)  # may heal: this waiter waits anyway
        return queued is not None or known > 0

    def _requeue(self, model_id: str, request_id: str, item: str, requeued: int) -> int:
        """Queue again a request that Redis lost (restarted without its data). Tokens its reader
        already has are not repeated: the new run's stream is read from the same index on."""
        if requeued >= MAX_REQUEUES:
            raise CeleryTPError(ErrorKind.INTERNAL, f"request {request_id} was lost {requeued + 1} times (did Redis restart?)")
        log.warning("request %s was lost (did Redis restart without its data?); queueing it again", request_id)
        pipe = self._redis.pipeline()
        pipe.rpush(queue_key(model_id), item)
        pipe.set(request_key(request_id), item, ex=MARKER_TTL_S)
        pipe.execute()
        self._serve(model_id, True)
        return requeued + 1

    def _followed_end(self, request_id: str, key: str, abandoned: bool) -> None:
        try:
            if abandoned:
                self.cancel(request_id)
            self._redis.delete(key, request_key(request_id))
        except (redis.RedisError, CeleryTPError) as exc:  # the caller already has its answer or its error
            log.warning("request %s: could not clean up after it: %s", request_id, exc)
        self._followed.pop(request_id, None)


@dataclass
class PendingRequest:
    """A queued request: follow it with `events` or wait for `result`."""

    queues: RequestQueues
    model_id: str
    request_id: str
    item: str  # the queued JSON (identifies it in the queue)
    timeout: float  # the wait `result` and `events` use by default

    def events(self, timeout: float | None = None) -> Iterator[Token | Done]:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        return self.queues.events(self.model_id, self.request_id, self.item, deadline)

    def result(self, timeout: float | None = None) -> RowResult:
        for event in self.events(timeout):
            if isinstance(event, Done):
                return event.result
        raise CeleryTPError(ErrorKind.INTERNAL, f"request {self.request_id}: its stream ended without a result")
