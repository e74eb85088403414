"""Rank 0's Redis side of a model's serving loop (serving.RequestSource over Redis).

It takes requests from the model's queue, which every group serving the model shares, into its
group's in-flight list (core/redis_scripts.py), streams tokens and results to each request's
Redis Stream (core/stream_record.py), reads cancellations, and keeps the loop flag, its lease
on what it holds, alive. A request taken again after a failed group resumes: its stream says
which tokens its client already has, and the loop goes on after them.
"""

from __future__ import annotations

import json
import logging
import time

import redis

from celerytp.core import protocol as p
from celerytp.core.app import op_task_name, queue_name
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.keys import (
    MAX_ATTEMPTS,
    attempts_key,
    cancel_key,
    inflight_key,
    loop_failures_key,
    loop_key,
    loop_stats_key,
    queue_key,
    replicas_key,
    stream_key,
)
from celerytp.core.protocol import GenSpec, RowResult
from celerytp.core.redis_client import block_timeout
from celerytp.core.redis_scripts import EXIT_IF_IDLE, GIVE_BACK, RECLAIM, RELEASE_IF_HOLDER, RENEW_IF_HOLDER, TAKE
from celerytp.core.safe_transport import DEAD_LETTER_MAX, dead_letter_key
from celerytp.core.stream_record import StreamRecord
from celerytp.worker.publisher import Publisher
from celerytp.worker.serving import Events, Finished

log = logging.getLogger(__name__)

STREAM_TTL_S = 600  # a finished request's stream outlives any sane wait for it, then goes
STATS_S = 0.1  # a busy loop's stats are written at most this often (and whenever its running rows change)
LOOP_TTL_S = 10  # the loop flag (the lease on its in-flight requests), renewed every step
BLOCK_S = 0.2  # an idle loop blocks on the queue this long at a time, then looks for other ops
YIELD_CHECK_S = 0.05  # how often a busy rank 0 looks for other ops waiting in its queue
RECLAIM_S = 1.0  # how often a loop gives back the in-flight requests of groups whose lease lapsed
FAILURES_TTL_S = 60  # a group's count of failed loops lapses this long after its last failure
SERVE_TASK = op_task_name("serve")


class LeaseLost(CeleryTPError):
    """This loop's flag lapsed or was taken: its requests were given back, another loop has them."""

    def __init__(self, model_id: str):
        super().__init__(ErrorKind.TIMEOUT, f"the serving loop of {model_id!r} lost its lease (it stalled); its requests were requeued")


class RedisRequestSource:
    """Rank 0's end of one model's request queue (see serving.RequestSource)."""

    def __init__(self, client: redis.Redis, group: str, model_id: str, loop_id: str):
        self._redis = client
        self._group = group
        self._model_id = model_id
        self._queue = queue_key(model_id)
        self._inflight = inflight_key(group, model_id)
        self._attempts = attempts_key(model_id)
        self._flag = loop_key(group, model_id)
        self._stats = loop_stats_key(group, model_id)
        self._rank0_queue = queue_name(group, 0)
        self._loop_id = loop_id
        self._take = client.register_script(TAKE)
        self._give_back = client.register_script(GIVE_BACK)
        self._reclaim = client.register_script(RECLAIM)
        self._renew = client.register_script(RENEW_IF_HOLDER)  # alone; in a step's transaction: GET + PEXPIRE
        self._exit = client.register_script(EXIT_IF_IDLE)
        self._items: dict[str, bytes] = {}  # request id -> its queued JSON (names it in the in-flight list)
        self._stash: list[bytes] = []  # taken by a blocking wait, not yet handed to the loop
        self._yield_checked = 0.0
        self._reclaimed = 0.0
        self._yield = False
        self._leased = False  # between start and release: every publish renews the lease
        self._queued: int | None = None  # the queue's length at the last write (None: unknown)
        self._ttl_set: dict[str, float] = {}  # request id -> when its stream's TTL was last set (once, not per token)
        self._stats_written: tuple[float, int | None] = (0.0, None)  # when, with how many running rows
        self._publisher: Publisher[tuple[Events, list[str], dict[str, int]]] | None = None

    def start(self) -> None:
        """Hold the flag, give back what a dead earlier loop of this group left in flight, and
        start the publisher thread (worker/publisher.py) that writes the steps' events."""
        pipe = self._redis.pipeline()
        pipe.set(self._flag, self._loop_id, ex=LOOP_TTL_S)
        self._give_back(keys=[self._inflight, self._queue], client=pipe)
        pipe.execute()
        self._leased = True
        self._publisher = Publisher(self._write, name=f"publisher-{self._model_id}")

    def release(self) -> None:
        """Write what the loop made, give back whatever it still holds, then free the flag."""
        self._stop_publisher()
        self._leased = False
        self.give_back()
        self._redis.eval(RELEASE_IF_HOLDER, 1, self._flag, self._loop_id)

    def _stop_publisher(self) -> None:
        if self._publisher is not None:
            failure, self._publisher = self._publisher.close(), None
            if failure is not None:  # those tokens are not in their streams: a resumed request redoes them
                log.warning("the last events of %s were not written: %s", self._model_id, failure)

    def give_back(self) -> int:
        """Every request this group holds goes back to the head of the queue (the loop failed)."""
        self._stash.clear()
        self._items.clear()
        return int(self._give_back(keys=[self._inflight, self._queue]))

    # ---- taking work ------------------------------------------------------------------

    def take(self, count: int) -> list[GenSpec]:
        if time.monotonic() - self._reclaimed > RECLAIM_S:
            self.reclaim_lapsed()
        raw, self._stash = self._stash[:count], self._stash[count:]
        if len(raw) < count and self._queued != 0:  # the last write saw an empty queue: no round trip
            raw += self._take(keys=[self._queue, self._inflight], args=[count - len(raw)])
            self._queued = None
        specs = [spec for item in raw if (spec := self._parse(item)) is not None]
        if not specs:
            return []
        pipe = self._redis.pipeline(transaction=False)
        pipe.mget([cancel_key(s.request_id) for s in specs])
        pipe.hmget(self._attempts, [s.request_id for s in specs])
        for spec in specs:
            pipe.xrange(stream_key(spec.request_id))
        cancels, attempts, *streams = pipe.execute()
        answers, runnable = Events(), []
        record = self._redis.pipeline(transaction=False)
        for spec, cancelled, tried, stream in zip(specs, cancels, attempts, streams, strict=True):
            tried = json.loads(tried) if tried else []
            delivered, answered = _delivered(stream)
            if answered:  # its holder answered it and died before it said so here: nothing to run
                self._forget(record, spec.request_id)
            elif cancelled is not None:  # cancelled while queued: never runs
                answers.finished.append((spec, Finished(_empty_result(spec, "cancelled"))))
            elif spec.queue_deadline and time.time() > spec.queue_deadline:
                error = CeleryTPError(ErrorKind.TIMEOUT, f"request {spec.request_id} waited in the queue past its deadline")
                answers.finished.append((spec, Finished(error=error)))
            elif len(tried) >= MAX_ATTEMPTS:
                answers.finished.append((spec, Finished(error=self._exhausted(spec.request_id, tried))))
            else:
                record.hset(self._attempts, spec.request_id, json.dumps([*tried, self._group]))
                if tried and spec.stream and delivered:  # resume after what its client already has
                    spec = spec.model_copy(update={"resumed": delivered})
                runnable.append(spec)
        record.execute()
        if answers.finished:
            self._publish_now(answers, [], {})
        return runnable

    def _exhausted(self, request_id: str, tried: list[str]) -> CeleryTPError:
        failures = {g.decode(): json.loads(v)["error"] for g, v in self._redis.hgetall(loop_failures_key(self._model_id)).items()}
        last = "; ".join(f"group {g}: {e}" for g, e in sorted(failures.items()))
        return CeleryTPError(
            ErrorKind.RETRIES_EXHAUSTED,
            f"request {request_id} was given up: the serving loop holding it failed on each of {len(tried)} attempts "
            f"(groups {', '.join(tried)})" + (f"; last errors: {last}" if last else ""),
        )

    def _parse(self, item: bytes) -> GenSpec | None:
        """A taken request, or None for a malformed entry: dead-lettered (and answered when it
        names its request), never retried."""
        try:
            data = json.loads(item)
        except ValueError:
            data = None
        try:
            spec = p.validate_message(GenSpec, data, "queued request")
        except CeleryTPError as exc:
            log.warning("dead-lettering a malformed queued request %.200r: %s", item, exc)
            pipe = self._redis.pipeline()
            pipe.lrem(self._inflight, 1, item)
            pipe.lpush(dead_letter_key(self._queue), item[:65536])
            pipe.ltrim(dead_letter_key(self._queue), 0, DEAD_LETTER_MAX - 1)
            request_id = data.get("request_id") if isinstance(data, dict) else None
            if isinstance(request_id, str) and 0 < len(request_id) <= 64:
                _finish_stream(pipe, request_id, StreamRecord.of_error(exc))
            pipe.execute()
            return None
        self._items[spec.request_id] = item
        return spec

    def reclaim_lapsed(self) -> int:
        """Give back to the queue what groups whose lease lapsed held in flight (they died)."""
        self._reclaimed = time.monotonic()
        groups = [g.decode() for g in self._redis.hkeys(replicas_key(self._model_id)) if g.decode() != self._group]
        if not groups:
            return 0
        keys = [self._queue]
        for group in groups:
            keys += [inflight_key(group, self._model_id), loop_key(group, self._model_id)]
        reclaimed = int(self._reclaim(keys=keys))
        if reclaimed:
            log.warning("%d request(s) of %s held by a lapsed group went back to the queue", reclaimed, self._model_id)
        return reclaimed

    def wait(self, seconds: float) -> bool:
        """Block on the queue (BLMOVE into the in-flight list) up to `seconds`, renewing the lease
        and looking for other ops every BLOCK_S; True when a request arrived."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.yield_wanted():
                return False
            if time.monotonic() - self._reclaimed > RECLAIM_S:  # an idle replica takes over a dead one's requests
                self.reclaim_lapsed()
            if not self._renew_lease():
                raise LeaseLost(self._model_id)
            item = self._redis.blmove(self._queue, self._inflight, block_timeout(min(BLOCK_S, left)), "LEFT", "RIGHT")
            if item is not None:
                self._stash.append(item)
                self._queued = None  # more may have come with it
                return True
        return False

    def _renew_lease(self) -> bool:
        return bool(self._renew(keys=[self._flag], args=[self._loop_id, LOOP_TTL_S * 1000]))

    # ---- answering --------------------------------------------------------------------

    def publish(self, events: Events, running: list[str], stats: dict[str, int]) -> set[str]:
        """Hand `events` to the publisher thread; the `running` ids its last write found cancelled.
        A failed write (Redis gone, LeaseLost) is raised here at the next step."""
        if self._publisher is None:
            return self._publish_now(events, running, stats)
        cancelled = self._publisher.submit((events, running, stats))
        return cancelled.intersection(running)

    def _write(self, batches: list[tuple[Events, list[str], dict[str, int]]]) -> set[str]:
        """The publisher thread's write: every waiting step's events in one round trip."""
        events = Events([t for e, _, _ in batches for t in e.tokens], [f for e, _, _ in batches for f in e.finished])
        stats = next((s for _, _, s in reversed(batches) if s), {})
        now, (written_at, rows) = time.monotonic(), self._stats_written
        if stats and stats.get("running_rows") == rows and now - written_at < STATS_S:
            stats = {}  # observers see a change of rows at once, the counters within STATS_S
        elif stats:
            self._stats_written = (now, stats.get("running_rows"))
        return self._publish_now(events, batches[-1][1], stats)

    def _publish_now(self, events: Events, running: list[str], stats: dict[str, int]) -> set[str]:
        """Deliver `events`, renew the lease and read the queue's length in one round trip; raises
        LeaseLost when the flag is not ours. A request's result goes before its leaving the
        in-flight list: a rank 0 that dies between them leaves an answered request, which the next
        taker drops (`take`)."""
        pipe = self._redis.pipeline(transaction=False)
        for spec, token, index, logprob in events.tokens:
            pipe.xadd(stream_key(spec.request_id), StreamRecord.of_token(token, index, logprob).to_fields())
        now = time.monotonic()
        for request_id in {spec.request_id for spec, *_ in events.tokens}:
            if now - self._ttl_set.get(request_id, float("-inf")) > STREAM_TTL_S / 2:
                pipe.expire(stream_key(request_id), STREAM_TTL_S)
                self._ttl_set[request_id] = now
        for spec, finished in events.finished:
            record = StreamRecord.of_error(finished.error) if finished.error else StreamRecord.of_result(finished.result)
            _finish_stream(pipe, spec.request_id, record)
            self._forget(pipe, spec.request_id)
            self._ttl_set.pop(spec.request_id, None)
        if stats:
            pipe.hset(self._stats, mapping=stats)
            pipe.expire(self._stats, 3600)
        if self._leased:  # no script here: redis-py checks a pipeline's scripts with one more command
            pipe.get(self._flag)
            pipe.pexpire(self._flag, LOOP_TTL_S * 1000)  # someone else's flag (we lost it) is only extended
        if running:
            pipe.mget([cancel_key(rid) for rid in running])
        pipe.llen(self._queue)
        *results, self._queued = pipe.execute()
        if self._leased and results[-3 if running else -2] != self._loop_id.encode():
            raise LeaseLost(self._model_id)
        if not running:
            return set()
        return {rid for rid, flag in zip(running, results[-1]) if flag is not None}

    def _forget(self, client: redis.client.Pipeline, request_id: str) -> None:
        item = self._items.pop(request_id, None)
        if item is not None:
            client.lrem(self._inflight, 1, item)
        client.hdel(self._attempts, request_id)

    def yield_wanted(self) -> bool:
        """True when rank 0's own queue holds an op other than a serving loop."""
        now = time.monotonic()
        if now - self._yield_checked >= YIELD_CHECK_S:
            self._yield_checked = now
            waiting = self._redis.lrange(self._rank0_queue, 0, -1)
            self._yield = any(_task_name(message) != SERVE_TASK for message in waiting)
        return self._yield

    def try_exit(self) -> bool:
        if self._publisher is not None:
            self._publisher.drain()  # written under the lease, before the flag goes
        if not self._exit(keys=[self._queue, self._flag], args=[self._loop_id]):
            return False
        self._leased = False  # the flag is gone: what is left to deliver needs no lease
        return True

    def fail(self, specs: list[GenSpec], error: CeleryTPError) -> None:
        """Answer `specs` with `error`."""
        if specs:
            self._publish_now(Events(finished=[(s, Finished(error=error)) for s in specs]), [], {})

    def ended_well(self) -> None:
        self._redis.hdel(loop_failures_key(self._model_id), self._group)

    def refuse(self, error: CeleryTPError) -> None:
        """This group's serve op failed (before or while its loop ran); what it held went back to
        the queue. The failure is counted, and a group that does not hold the model is no replica
        of it. When no replica is left, or every replica's loops failed MAX_ATTEMPTS times in a row
        (with no heal between), the queued requests are answered with `error`: nobody waits for a
        loop that will not come, and each later request costs one more try."""
        self.release()
        failures = loop_failures_key(self._model_id)
        before = self._redis.hget(failures, self._group)
        count = (json.loads(before)["count"] if before else 0) + 1
        pipe = self._redis.pipeline()
        pipe.hset(failures, self._group, json.dumps({"count": count, "error": f"{error.kind}: {error.message}"}))
        pipe.expire(failures, FAILURES_TTL_S)
        if error.kind is ErrorKind.MODEL_NOT_LOADED:
            pipe.hdel(replicas_key(self._model_id), self._group)
        pipe.execute()
        groups = [g.decode() for g in self._redis.hkeys(replicas_key(self._model_id))]
        counts = self._redis.hmget(failures, groups) if groups else []
        if all(c is not None and json.loads(c)["count"] >= MAX_ATTEMPTS for c in counts):
            queued = self._redis.lpop(self._queue, 1 << 16) or []
            self.fail([s for item in queued if (s := self._parse(item))], error)


def _delivered(stream: list[tuple[bytes, dict[bytes, bytes]]]) -> tuple[list[int], bool]:
    """From a request's stream: the tokens its client has, in order (a token an earlier holder
    wrote twice counts once), and whether it was answered already."""
    tokens: list[int] = []
    for _, fields in stream:
        try:
            record = StreamRecord.from_fields(fields)
        except CeleryTPError:
            continue
        if record.token is None:
            return tokens, True
        if record.index == len(tokens):
            tokens.append(record.token)
    return tokens, False


def _finish_stream(client: redis.Redis | redis.client.Pipeline, request_id: str, record: StreamRecord) -> None:
    key = stream_key(request_id)
    client.xadd(key, record.to_fields())
    client.expire(key, STREAM_TTL_S)


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
