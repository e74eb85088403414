"""The leader: sends every op to all ranks as one chord and combines the replies."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from celery.exceptions import TimeoutError as CeleryTimeout
from celery.result import allow_join_result

from celerytp.client.control_rpc import control_call
from celerytp.client.dispatch import ChordPublisher, DispatchLockTimeout, PublishedChord
from celerytp.client.generation import MODES, GenerationResult, TokenStream, check_spec, finish, prepare, run_steps
from celerytp.client.progress import LoadProgress
from celerytp.client.requests import LOOP_START_TTL_S, PendingRequest, RequestQueues
from celerytp.core import protocol as p
from celerytp.core.app import DEFAULT_GROUP, GATHER_TASK, make_app, op_task_name, queue_name
from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.keys import (
    broken_key, comm_key, heal_lock_key, loop_key, loop_stats_key, members_key, models_key, owner_key, queue_key,
)
from celerytp.core.liveness import HeartbeatTiming, RankWatch, read_owners
from celerytp.core.model_files import default_model_path
from celerytp.core.redis_scripts import RELEASE_IF_HOLDER, RENEW_IF_HOLDER
from celerytp.core.registry import model_record
from celerytp.core.safe_transport import dead_letter_key
from celerytp.core.sampling import SamplingParams

log = logging.getLogger(__name__)

GROUP_FORMING_OPS = ("ping", "init", "shutdown")  # run on the workers as they are, healed or not
LIVENESS_CHECK_S = 0.25  # how often a waiting op looks at the ranks' heartbeats
HEAL_LOCK_TTL_S = 10  # renewed while the heal runs; a leader that dies while healing frees it after this
HEAL_WAIT_S = 10.0  # one wait of a heal's ping/init/unload: a message eaten by a dying rank costs this, then a retry


def _no_worker(op: str, ranks: list[int], why: str) -> CeleryTPError:
    return CeleryTPError.from_failures(op, [RankFailure(r, ErrorKind.RANK_LOST, why) for r in ranks])


# Failures after which a heal (or an op that meets them) tries again once the group re-formed.
_HEAL_AGAIN = {ErrorKind.RANK_LOST, ErrorKind.TIMEOUT, ErrorKind.INIT_FAILED, ErrorKind.GROUP_BROKEN}


class _LockRenewal:
    """Keeps a Redis lock held while its holder works: extends its TTL every third of it, so the
    lock outlives a long heal (model reloads) yet frees within one TTL of its holder's death."""

    def __init__(self, client: redis.Redis, key: str, token: str, ttl_s: float):
        self._stopped = threading.Event()
        self._renew = client.register_script(RENEW_IF_HOLDER)

        def run() -> None:
            while not self._stopped.wait(ttl_s / 3):
                try:
                    if not self._renew(keys=[key], args=[token, int(ttl_s * 1000)]):
                        return  # lost it (expired while this process stalled): nothing to renew
                except redis.RedisError as exc:
                    log.warning("renewing the heal lock: %s", exc)

        threading.Thread(target=run, name="celerytp-heal-lock", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()


class _RanksLost(Exception):
    def __init__(self, lost: dict[int, str]):
        self.lost = lost


class Leader:
    """Drives the rank workers of one group through chords.

    Args:
        broker_url: Redis URL of the group's broker and result backend.
        group: group name (queues ``celerytp.<group>.rank.<r>``).
        world_size: number of ranks.
        timeout: default seconds to wait for an op's replies.
        recovery_timeout: how long a request waits for lost ranks to come back (their supervisor
            restarts them) before the group is re-formed and its models reloaded; 0: fail at once.
    """

    def __init__(
        self,
        broker_url: str,
        group: str = DEFAULT_GROUP,
        world_size: int = 1,
        timeout: float = 60.0,
        recovery_timeout: float = 120.0,
    ):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"world_size must be an integer >= 1, got {world_size!r}")
        self.broker_url = broker_url
        self.group = group
        self.world_size = world_size
        self.timeout = timeout
        self.app = make_app(broker_url, group, world_size, main="celerytp-leader")
        self.redis = redis.Redis.from_url(broker_url)
        self._local_lock = threading.Lock()
        self._publisher = ChordPublisher(self.app, self.redis, group, world_size, GATHER_TASK)
        self.recovery_timeout = recovery_timeout
        self._timing = HeartbeatTiming.from_env()
        self._queues = RequestQueues(self.redis, group, self._start_loop, self._rank_watch)
        self.generate_timeout = 3600.0

    # ---- foundation ops ---------------------------------------------------------------

    def ping(self, timeout: float | None = None) -> list[p.Pong]:
        """Every rank's pong, through the ranks' control path: it never waits behind an op."""
        owners = self._live_owners("ping")
        watch = RankWatch(self.redis, self.group, owners, self._timing)
        replies = control_call(self.redis, self.group, self.world_size, "ping", self.timeout if timeout is None else timeout, watch)
        return [p.parse_reply(r) for r in replies]

    def init(self, comm_id: str | None = None, timeout_s: float = 60.0) -> list[p.InitOk]:
        """Form a new process group epoch (a fresh comm_id unless one is given)."""
        comm_id = comm_id or uuid.uuid4().hex
        replies = self.call("init", {"comm_id": comm_id, "timeout_s": timeout_s}, timeout=timeout_s + 30)
        owners = read_owners(self.redis, self.group, self.world_size)
        pipe = self.redis.pipeline()
        pipe.set(members_key(self.group), json.dumps([o.decode() if o else None for o in owners]))
        pipe.set(comm_key(self.group), comm_id)
        pipe.execute()
        return replies

    def ensure_formed(self) -> None:
        """Form the group only when it is not: a rank with no group, ranks in different epochs, or a
        broken one. A live group is used as it is, with its models loaded (`celerytp check`)."""
        pongs = self.ping()
        comms = {pong.comm_id for pong in pongs}
        if None in comms or len(comms) != 1 or any(pong.group_broken for pong in pongs):
            self.init()
        else:
            self._ensure_group()  # a replaced worker or a broken epoch: heal

    def sanity_check(self) -> list[p.SanityResult]:
        return self.call("sanity_check")

    def shutdown(self) -> list[p.Bye]:
        return self.call("shutdown")

    # ---- models -----------------------------------------------------------------------

    def load(
        self,
        model_id: str,
        path: str | os.PathLike | None = None,
        dtype: str | None = None,
        quant: str | None = None,
        max_context: int | None = None,
        max_batch: int = 16,
        progress: bool = False,
        timeout: float = 1800.0,
        *,
        kv_cache_bytes: int | None = None,
        kv_dtype: str | None = None,
        prefill_budget: int = 256,
        idle_s: float = 1.0,
        max_queue: int = 256,
    ) -> list[p.Loaded]:
        """Load a model on every rank (or on none). `path` None: the default SmolLM2 GGUF.

        Serving settings: `max_batch` requests decode together (KV cache rows), each rank's KV
        cache stays within `kv_cache_bytes` (max_context, unless given, is what fits) and is
        stored in `kv_dtype` (default: the model's dtype; "bfloat16" halves a float32 cache),
        `prefill_budget` prompt tokens run per step beside the decoding rows, a serving loop
        ends `idle_s` after its last request, and past `max_queue` waiting requests a new one
        is refused as `overloaded`.
        """
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'max_queue': an integer >= 1 is required, got {max_queue!r}")
        path = os.path.abspath(path if path is not None else default_model_path())
        fields = {
            "path": path, "dtype": dtype, "max_context": max_context, "max_batch": max_batch, "quant": quant,
            "kv_cache_bytes": kv_cache_bytes, "kv_dtype": kv_dtype, "prefill_budget": prefill_budget, "idle_s": idle_s, "max_queue": max_queue,
        }
        self._ensure_group()
        return self._load(model_id, fields, progress, timeout)

    def _load(self, model_id: str, fields: dict[str, Any], progress: bool = False, timeout: float = 1800.0) -> list:
        """Load with `fields` (core.registry.LOAD_FIELDS) and record the model (no healing first)."""
        with LoadProgress(self.redis, self.group, model_id, self.world_size, enabled=progress) as bar:
            replies = self._call("load", {"model_id": model_id, **fields}, timeout, bar.update)
        first = replies[0]
        record = model_record(
            fields, dtype=first.dtype, model_type=first.model_type, vocab_size=first.vocab_size,
            max_context=first.max_context, max_batch=first.max_batch,
        )
        self._keep_record(model_id, record, read_owners(self.redis, self.group, self.world_size))
        return replies

    def models(self) -> dict[str, dict]:
        """The group's model records in Redis (by any leader): model_id -> {path, dtype, ...}. A
        record can outlive what a restarted rank holds; `held_models` asks the ranks."""
        return {k.decode(): json.loads(v) for k, v in self.redis.hgetall(models_key(self.group)).items()}

    def held_models(self) -> dict[str, dict]:
        """Models every rank holds now, as the ranks report them (a ping): model_id -> its record."""
        pongs = self.ping()
        return {model_id: record for model_id, record in pongs[0].models.items() if all(model_id in p.models for p in pongs)}

    def step(
        self,
        model_id: str,
        tokens: list[int],
        offset: int,
        sampling: SamplingParams | dict | None = None,
        *,
        sample: bool = True,
        return_logits: bool = False,
    ) -> p.StepResult:
        """One forward step on every rank; returns rank 0's reply (its `token` is the sample)."""
        if isinstance(sampling, SamplingParams):
            sampling = sampling.to_dict()
        fields = {"model_id": model_id, "tokens": list(tokens), "offset": offset, "sampling": sampling,
                  "sample": sample, "return_logits": return_logits}
        return self.call("step", fields)[0]

    def clear_kv_cache(self, model_id: str) -> list[p.Cleared]:
        return self.call("clear_kv_cache", {"model_id": model_id})

    def unload(self, model_id: str) -> list[p.Unloaded]:
        """Free the model on every rank."""
        try:
            return self.call("unload", {"model_id": model_id})
        finally:
            self.redis.hdel(models_key(self.group), model_id)

    def generate(
        self, model_id: str, prompt: str | None = None, messages: list[dict] | None = None, mode: str = "fused", **options
    ) -> GenerationResult:
        """Generate one completion from `prompt` (raw text) or `messages` (chat template applied).

        Options: max_tokens, temperature, top_k, top_p, repetition_penalty, seed, logprobs, stop,
        request_id (to cancel it), ignore_eos (run to max_tokens, for benchmarks). Unset
        sampling options come from generation_config.json. `mode="fused"` queues the request
        for the model's serving loop, where it joins whatever else is running; `mode="step"`
        drives one step chord per token. Both give the same tokens.
        """
        if mode not in MODES:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'mode': one of {MODES} is required, got {mode!r}")
        record = self._record(model_id)
        prepared = prepare(record, prompt=prompt, messages=messages, **options)
        if mode == "step":
            row = run_steps(partial(self.step, model_id), prepared, record["max_context"])
        else:
            row = self._queues.submit(model_id, prepared.spec, record["max_queue"]).result(self.generate_timeout)
        return finish(prepared, row, mode)

    def stream(self, model_id: str, prompt: str | None = None, messages: list[dict] | None = None, **options) -> TokenStream:
        """Like generate (fused), but iterate the returned stream for text deltas as they come.

        `stream.request_id` names the request for `cancel`; `stream.result` is the final
        GenerationResult once the iteration ends.
        """
        record = self._record(model_id)
        prepared = prepare(record, prompt=prompt, messages=messages, stream=True, **options)
        pending = self._queues.submit(model_id, prepared.spec, record["max_queue"])
        return TokenStream(pending, prepared, self.generate_timeout)

    def submit(self, model_id: str, spec: dict[str, Any]) -> PendingRequest:
        """Queue a token-level request (protocol GenSpec fields: request_id, prompt ids,
        max_tokens, sampling, stop, eos_token_ids, stream) for the model's serving loop.

        For clients that tokenize themselves; `generate` and `stream` are built on it.
        """
        record = self._record(model_id)
        check_spec(record, spec)
        return self._queues.submit(model_id, spec, record["max_queue"])

    def cancel(self, request_id: str) -> None:
        """Cancel a fused request, from any leader: a queued one never runs, a running one stops
        within a step. It ends as "cancelled"."""
        self._queues.cancel(request_id)

    def serving_stats(self, model_id: str) -> dict[str, int]:
        """The model's queue and serving loop: `queued`, `loop_running` (0/1), `running_rows`,
        `peak_rows`, `steps`, `requests`, `reused_tokens` of the current or last loop."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(queue_key(self.group, model_id))
        pipe.exists(loop_key(self.group, model_id))
        pipe.hgetall(loop_stats_key(self.group, model_id))
        queued, running, stats = pipe.execute()
        return {"queued": queued, "loop_running": int(running), **{k.decode(): int(v) for k, v in stats.items()}}

    def _start_loop(self, model_id: str, loop_id: str) -> None:
        """Publish a `serve` chord: every rank runs the model's serving loop (nobody waits on it)."""
        fields = {"op": "serve", "model_id": model_id, "loop_id": loop_id}
        self._publisher.publish(
            op_task_name("serve"), lambda seq, epoch: {**fields, "seq": seq, "epoch": epoch}, expires=LOOP_START_TTL_S,
            lock_wait=self.timeout, subscribe=False,
        )

    def _record(self, model_id: str) -> dict[str, Any]:
        """The model's record, from Redis; after a Redis restart, from the ranks (and kept again)."""
        self._ensure_group()
        raw = self.redis.hget(models_key(self.group), model_id)
        if raw is not None:
            return json.loads(raw)
        holders = read_owners(self.redis, self.group, self.world_size)
        record = self.held_models().get(model_id)
        if record is None:
            raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded", op="generate")
        self._keep_record(model_id, record, holders)
        return record

    def _keep_record(self, model_id: str, record: dict[str, Any], holders: list[bytes | None]) -> None:
        """Register a model as held by the workers `holders` (a replaced one will have lost it)."""
        record = {**record, "holders": [h.decode() if h else None for h in holders]}
        self.redis.hset(models_key(self.group), model_id, json.dumps(record))

    def dead_letters(self, limit: int = 100) -> dict[int, list[str]]:
        """Per rank, the newest malformed messages its worker dropped (core/safe_transport.py)."""
        keys = [dead_letter_key(queue_name(self.group, r)) for r in range(self.world_size)]
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.lrange(key, 0, limit - 1)
        return {rank: [m.decode(errors="replace") for m in found] for rank, found in enumerate(pipe.execute())}

    def health(self) -> list[dict | None]:
        """Each rank's heartbeat record (host, pid, device), or None for a rank with no live worker."""
        values = self.redis.mget([owner_key(self.group, r) for r in range(self.world_size)])
        return [json.loads(v) if v else None for v in values]

    # ---- healing ----------------------------------------------------------------------

    def _damage(self) -> tuple[bool, list[str]]:
        """What changed since the group formed and since each model was loaded: (the group must
        form again, the models to load again). A rank's worker was replaced, or a model is
        recorded as loaded by workers that no longer hold the ranks."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.get(members_key(self.group))
        pipe.mget([owner_key(self.group, r) for r in range(self.world_size)])
        pipe.hgetall(models_key(self.group))
        pipe.mget([comm_key(self.group), broken_key(self.group)])
        members, owners, models, (comm, broken) = pipe.execute()
        now = [o.decode() if o else None for o in owners]
        regroup = members is not None and json.loads(members) != now  # no record (Redis restarted): it stands
        regroup = regroup or (broken is not None and broken == comm)  # a rank reported this epoch broken
        stale = [k.decode() for k, v in models.items() if json.loads(v).get("holders", now) != now]
        return regroup, stale

    def _ensure_group(self) -> None:
        regroup, stale = self._damage()
        if regroup or stale:
            self.heal()

    def heal(self, timeout: float | None = None) -> None:
        """Re-form the group once every rank has a live worker, and load again every model that a
        replaced worker lost.

        Waits up to `timeout` (default: recovery_timeout) for the supervisors to restart lost
        ranks. The models and their load settings come from the Redis registry and from what
        the surviving ranks report. Ops queued for the broken group are dropped. One leader
        heals at a time; the others wait for it.
        """
        deadline = time.monotonic() + (self.recovery_timeout if timeout is None else timeout)
        # No live worker at all for a heartbeat's lifetime: nobody is restarting them, fail now.
        none_until = min(deadline, time.monotonic() + self._timing.ttl_s + self._timing.missing_grace_s)
        while not any(read_owners(self.redis, self.group, self.world_size)):
            if time.monotonic() > none_until:
                self._live_owners("heal")
            time.sleep(0.1)
        token, lock = uuid.uuid4().hex, heal_lock_key(self.group)
        while not self.redis.set(lock, token, nx=True, ex=HEAL_LOCK_TTL_S):
            if time.monotonic() > deadline:
                raise CeleryTPError(ErrorKind.TIMEOUT, "another leader is still healing the group", op="heal")
            time.sleep(0.2)
        renewing = _LockRenewal(self.redis, lock, token, HEAL_LOCK_TTL_S)
        try:
            while any(self._damage()):
                try:
                    self._heal_once(deadline)
                except CeleryTPError as exc:
                    if not exc.kinds & _HEAL_AGAIN:
                        raise
                    if time.monotonic() > deadline:
                        raise CeleryTPError.from_failures("heal", exc.failures) from None
                    time.sleep(0.5)  # a rank was lost again while healing: wait for it
        finally:
            renewing.stop()
            self.redis.eval(RELEASE_IF_HOLDER, 1, lock, token)

    def _heal_once(self, deadline: float) -> None:
        while missing := [r for r, o in enumerate(read_owners(self.redis, self.group, self.world_size)) if o is None]:
            if time.monotonic() > deadline:
                raise _no_worker("heal", missing, "no live worker came back for this rank")
            time.sleep(0.2)
        regroup, stale = self._damage()
        pongs = self.ping(HEAL_WAIT_S)
        records = {model_id: record for pong in reversed(pongs) for model_id, record in pong.models.items()}
        records.update((k.decode(), json.loads(v)) for k, v in self.redis.hgetall(models_key(self.group)).items())
        if regroup:
            with self.app.connection_for_write() as conn:  # ops published to the broken group
                for rank in range(self.world_size):
                    conn.default_channel.queue_purge(queue_name(self.group, rank))
            self.init(timeout_s=HEAL_WAIT_S * 3)
        for model_id, record in records.items():
            if not regroup and model_id not in stale:
                continue
            self.redis.delete(loop_key(self.group, model_id))
            if any(model_id in pong.models for pong in pongs):
                try:
                    self._call("unload", {"model_id": model_id}, HEAL_WAIT_S)
                except CeleryTPError as exc:
                    if exc.kinds != {ErrorKind.MODEL_NOT_LOADED}:
                        raise
            try:
                self._load(model_id, record["load"])
            except CeleryTPError as exc:
                if exc.kinds & _HEAL_AGAIN:
                    raise  # the group broke again: heal again
                log.error("model %s could not be loaded again after a rank was replaced, so it is unloaded: %s", model_id, exc)
                self.redis.hdel(models_key(self.group), model_id)

    # ---- dispatch ---------------------------------------------------------------------

    def call(
        self,
        op: str,
        fields: dict[str, Any] | None = None,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Send `op` to every rank as one chord; return the typed replies in rank order.

        Fails with rank_lost at once when a rank has no live worker, or as soon as one dies
        while the op runs. Ops on a group whose workers changed since it formed wait for the
        group to heal first (`heal`). `on_wait` is called every few milliseconds while waiting.
        """
        if op not in p.REQUESTS:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"unknown op {op!r}; known: {sorted(p.REQUESTS)}", op=op)
        if op not in GROUP_FORMING_OPS:
            self._ensure_group()
        return self._call(op, fields, self.timeout if timeout is None else timeout, on_wait)

    def _call(
        self, op: str, fields: dict[str, Any] | None, timeout: float, on_wait: Callable[[], None] | None = None
    ) -> list[Any]:
        for attempt in range(2):
            owners = self._live_owners(op)
            with self._local_lock:  # publishing only: a ping never waits for another thread's op
                try:
                    sent = self._publisher.publish(
                        op_task_name(op), lambda seq, epoch: {"op": op, "seq": seq, "epoch": epoch, **(fields or {})},
                        expires=timeout, lock_wait=timeout,
                    )
                except DispatchLockTimeout as exc:
                    raise CeleryTPError(ErrorKind.TIMEOUT, str(exc), op=op) from None
            combined = self._wait(op, sent, timeout, on_wait, owners)
            failures = [
                RankFailure(r.get("rank"), ErrorKind(r["kind"]), r.get("message", ""))
                for r in combined["replies"]
                if r.get("type") == "error"
            ]
            if failures and attempt == 0 and {f.kind for f in failures} == {ErrorKind.OUT_OF_ORDER}:
                self._publisher.new_epoch()  # a rank counts from a number we never sent: start again
                continue
            if failures:
                raise CeleryTPError.from_failures(op, failures)
            return [p.parse_reply(r) for r in combined["replies"]]
        raise AssertionError("unreachable")

    def _live_owners(self, op: str) -> list[bytes | None]:
        """Every rank's worker identity; rank_lost naming the ranks that have none.

        A key missing for less than the heartbeat grace is waited for (a Redis restart)."""
        deadline = time.monotonic() + self._timing.missing_grace_s
        while True:
            owners = read_owners(self.redis, self.group, self.world_size)
            missing = [r for r, o in enumerate(owners) if o is None]
            if not missing:
                return owners
            if time.monotonic() > deadline:
                raise _no_worker(op, missing, "no live worker holds this rank")
            time.sleep(0.05)

    def _rank_watch(self) -> RankWatch:
        """A watch over the ranks' workers as they are now (generation requests use it while they wait)."""
        return RankWatch(self.redis, self.group, read_owners(self.redis, self.group, self.world_size), self._timing)

    def _wait(
        self, op: str, sent: PublishedChord, timeout: float, on_wait: Callable[[], None] | None, owners: list
    ) -> dict:
        watch = RankWatch(self.redis, self.group, owners, self._timing)
        checked = [time.monotonic()]

        def on_interval() -> None:
            if on_wait is not None:
                on_wait()
            if time.monotonic() - checked[0] >= LIVENESS_CHECK_S:
                checked[0] = time.monotonic()
                lost = watch.lost()
                if lost:
                    finished = self._publisher.finished_parts(sent)
                    lost = {r: why for r, why in lost.items() if r not in finished}
                if lost:
                    raise _RanksLost(lost)

        try:
            # Allowed inside a task (the celerytp.generate front door): the chord runs on the rank
            # workers, never on the pool that waits for it.
            with allow_join_result():
                return self.app.AsyncResult(sent.body_id).get(timeout=timeout, interval=0.005, on_interval=on_interval)
        except _RanksLost as exc:
            failures = [RankFailure(r, ErrorKind.RANK_LOST, why) for r, why in sorted(exc.lost.items())]
            raise CeleryTPError.from_failures(op, failures) from None
        except CeleryTimeout:
            raise CeleryTPError.from_failures(op, self._unfinished_ranks(sent, timeout)) from None
        except Exception as exc:  # a header task raised or its worker died
            raise CeleryTPError.from_failures(op, self._failed_ranks(sent, exc)) from None
        finally:
            self.redis.delete(self.app.backend.get_key_for_task(sent.body_id))

    def _unfinished_ranks(self, sent: PublishedChord, timeout: float) -> list[RankFailure]:
        """Name the ranks that did not answer (and whether their worker lives) and those that failed."""
        finished = self._publisher.finished_parts(sent)
        alive = self.health()
        failures = []
        for rank in range(self.world_size):
            if rank in finished:
                _, reply = finished[rank]
                if isinstance(reply, dict) and reply.get("type") == "error":
                    failures.append(RankFailure(rank, ErrorKind(reply["kind"]), reply.get("message", "")))
            elif alive[rank] is None:
                failures.append(RankFailure(rank, ErrorKind.RANK_LOST, "no live worker holds this rank"))
            else:
                failures.append(RankFailure(rank, ErrorKind.TIMEOUT, f"no reply within {timeout:.1f}s (worker alive: busy or stuck)"))
        return failures or [RankFailure(None, ErrorKind.TIMEOUT, f"no combined reply within {timeout:.1f}s")]

    def _failed_ranks(self, sent: PublishedChord, exc: Exception) -> list[RankFailure]:
        failures = [
            RankFailure(rank, ErrorKind.RANK_LOST, f"task failed: {result}")
            for rank, (state, result) in sorted(self._publisher.finished_parts(sent).items())
            if state != "SUCCESS"
        ]
        return failures or [RankFailure(None, ErrorKind.INTERNAL, f"chord failed: {exc!r}")]
