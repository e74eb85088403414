"""Generation requests from any leader: queue them for a model's serving loop and follow them.

A request goes onto the model's Redis queue; if no serving loop runs, the submitter starts one
with a `serve` chord. Its tokens (when streamed) and its result come back on the request's
Redis Stream, readable from any process. A waiter whose request is still queued while no loop
runs starts one itself, so no request is stranded (core/redis_scripts.py has the scripts).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis

from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.keys import cancel_key, loop_key, queue_key, stream_key
from celerytp.core.liveness import RankWatch
from celerytp.core.protocol import RowResult
from celerytp.core.redis_scripts import RELEASE_IF_HOLDER, RESTART_IF_STRANDED, SUBMIT
from celerytp.core.stream_record import StreamRecord

log = logging.getLogger(__name__)

LOOP_START_TTL_S = 120  # the loop flag until the loop's rank 0 takes it over (it may queue behind an op)
STRANDED_CHECK_S = 0.5  # how often a waiter with no news checks that a loop will take its request
LOST_AFTER_S = 15.0  # nowhere (not queued, no loop flag, no stream) this long: Redis lost the request
CANCEL_TTL_S = 600

StartLoop = Callable[[str, str], None]  # (model_id, loop_id): publish a serve chord
WatchRanks = Callable[[], RankWatch]  # a watch over the ranks' workers as they are now


@dataclass(frozen=True)
class Token:
    id: int


@dataclass(frozen=True)
class Done:
    result: RowResult


class RequestQueues:
    """The leader side of every model's request queue in one group.

    Args:
        client: Redis of the group.
        group: the group name.
        start_loop: publishes a `serve` chord for (model_id, loop_id).
        watch_ranks: a watch over the ranks' workers; a waiting request fails with rank_lost
            when one of them dies.
    """

    def __init__(self, client: redis.Redis, group: str, start_loop: StartLoop, watch_ranks: WatchRanks):
        self._redis = client
        self._group = group
        self._start_loop = start_loop
        self._watch_ranks = watch_ranks
        self._submit = client.register_script(SUBMIT)
        self._restart = client.register_script(RESTART_IF_STRANDED)
        self._followed: dict[str, tuple[str, str]] = {}  # request id -> (model id, queued JSON)

    def submit(self, model_id: str, spec: dict, max_queue: int) -> PendingRequest:
        """Queue `spec` (a GenSpec) for `model_id`; CeleryTPError(overloaded) when the queue is full."""
        spec = {**spec, "submitted_at": time.time()}
        item = json.dumps(spec)
        watch = self._watch_ranks()
        keys = [queue_key(self._group, model_id), loop_key(self._group, model_id)]
        loop_id = uuid.uuid4().hex
        outcome = int(self._submit(keys=keys, args=[item, max_queue, loop_id, LOOP_START_TTL_S]))
        if outcome < 0:
            raise CeleryTPError(
                ErrorKind.OVERLOADED, f"model {model_id!r} has {max_queue} requests queued already; try again later"
            )
        if outcome == 1:
            self._start(model_id, loop_id, item)
        self._followed[spec["request_id"]] = (model_id, item)
        return PendingRequest(self, model_id, spec["request_id"], item, watch)

    def ensure_loop(self, model_id: str, request_id: str, item: str) -> bool:
        """Start a loop for a request still queued with no loop to take it; False: the request
        is nowhere (not queued, no loop, no stream: Redis lost it)."""
        keys = [queue_key(self._group, model_id), loop_key(self._group, model_id), stream_key(self._group, request_id)]
        loop_id = uuid.uuid4().hex
        outcome = int(self._restart(keys=keys, args=[item, loop_id, LOOP_START_TTL_S]))
        if outcome == 1:
            self._start(model_id, loop_id, item)
        return outcome >= 0

    def _start(self, model_id: str, loop_id: str, item: str) -> None:
        """Start the model's loop for the request `item`. When that fails (a typed error), nothing is
        left behind: the request leaves the queue and the loop flag is freed for the next submitter,
        instead of stalling the queue until the flag's TTL."""
        try:
            self._start_loop(model_id, loop_id)
        except CeleryTPError:
            pipe = self._redis.pipeline()
            pipe.lrem(queue_key(self._group, model_id), 1, item)
            pipe.eval(RELEASE_IF_HOLDER, 1, loop_key(self._group, model_id), loop_id)
            pipe.execute()
            raise

    def cancel(self, request_id: str) -> None:
        """Cancel a request: a queued one never runs, a running one stops within a step.

        A request this leader submitted is taken off the queue at once (with its done record);
        any other is stopped by rank 0, which sees the cancel key when it takes or steps it.
        """
        self._redis.set(cancel_key(self._group, request_id), 1, ex=CANCEL_TTL_S)
        model_id, item = self._followed.get(request_id, (None, None))
        if item is not None and self._redis.lrem(queue_key(self._group, model_id), 1, item):
            spec = json.loads(item)
            result = RowResult(
                request_id=request_id, token_ids=[], finish_reason="cancelled", prompt_tokens=len(spec["prompt"]),
                ttft_s=0.0, decode_s=0.0,
            )
            key = stream_key(self._group, request_id)
            self._redis.xadd(key, StreamRecord.of_result(result).to_fields())
            self._redis.expire(key, CANCEL_TTL_S)

    def events(
        self, model_id: str, request_id: str, item: str, deadline: float, watch: RankWatch
    ) -> Iterator[Token | Done]:
        """The request's tokens (if streamed) then its result; raises its error, a timeout, or
        rank_lost (and leaves the queue) when a rank's worker dies while it waits."""
        key = stream_key(self._group, request_id)
        last, checked, missing = "0-0", time.monotonic(), 0
        finished = False
        try:
            while True:
                now = time.monotonic()
                if now > deadline:
                    self._redis.lrem(queue_key(self._group, model_id), 1, item)
                    raise CeleryTPError(ErrorKind.TIMEOUT, f"request {request_id}: no result within the deadline")
                reply = self._redis.xread({key: last}, count=256, block=int(min(0.25, deadline - now) * 1000) + 1)
                if not reply:
                    if now - checked > STRANDED_CHECK_S:
                        checked = now
                        self._check_ranks(model_id, item, watch)
                        missing = 0 if self.ensure_loop(model_id, request_id, item) else missing + 1
                        if missing * STRANDED_CHECK_S > LOST_AFTER_S:  # for longer than any flag refresh gap
                            raise CeleryTPError(
                                ErrorKind.INTERNAL,
                                f"request {request_id} was lost: it is neither queued nor running (did Redis restart?)",
                            )
                    continue
                for entry_id, fields in reply[0][1]:
                    last = entry_id
                    record = StreamRecord.from_fields(fields)
                    if record.token is not None:
                        yield Token(record.token)
                    elif record.done is not None:
                        finished = True
                        yield Done(record.done)
                        return
                    else:
                        finished = True
                        if record.error[0] in (ErrorKind.RANK_LOST, ErrorKind.TIMEOUT):
                            self._check_ranks(model_id, item, watch, wait=True)  # name the rank behind it
                        record.raise_error()
        except redis.RedisError as exc:
            raise CeleryTPError(ErrorKind.TIMEOUT, f"request {request_id}: Redis failed while waiting: {exc}") from None
        finally:
            # Abandoned (the caller stopped iterating, was interrupted, or its wait failed): cancel it,
            # so its row frees within a step. The cancel key is left to its TTL: rank 0 reads it later.
            self._followed_end(request_id, key, abandoned=not finished)

    def _followed_end(self, request_id: str, key: str, abandoned: bool) -> None:
        try:
            if abandoned:
                self.cancel(request_id)
            self._redis.delete(key)
        except redis.RedisError as exc:  # the caller already has its answer or its error
            log.warning("request %s: could not clean up after it: %s", request_id, exc)
        self._followed.pop(request_id, None)

    def _check_ranks(self, model_id: str, item: str, watch: RankWatch, wait: bool = False) -> None:
        lost = watch.lost_soon() if wait else watch.lost()
        if lost:
            self._redis.lrem(queue_key(self._group, model_id), 1, item)  # no loop of this group will answer it
            failures = [RankFailure(rank, ErrorKind.RANK_LOST, why) for rank, why in sorted(lost.items())]
            raise CeleryTPError.from_failures("generate", failures)


@dataclass
class PendingRequest:
    """A queued request: follow it with `events` or wait for `result`."""

    queues: RequestQueues
    model_id: str
    request_id: str
    item: str  # the queued JSON (identifies it in the queue)
    watch: RankWatch  # the ranks' workers when it was queued

    def events(self, timeout: float) -> Iterator[Token | Done]:
        return self.queues.events(self.model_id, self.request_id, self.item, time.monotonic() + timeout, self.watch)

    def result(self, timeout: float) -> RowResult:
        for event in self.events(timeout):
            if isinstance(event, Done):
                return event.result
        raise CeleryTPError(ErrorKind.INTERNAL, f"request {self.request_id}: its stream ended without a result")
