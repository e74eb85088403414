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
from kombu.exceptions import KombuError

from celerytp.client.control_rpc import control_call
from celerytp.client.dispatch import ChordPublisher, DispatchLockTimeout
from celerytp.client.generation import MODES, GenerationResult, TokenStream, check_spec, finish, prepare, run_steps
from celerytp.client.healer import Healer
from celerytp.client.progress import LoadProgress
from celerytp.client.registry import discover_groups, drop_replica, keep_replica, record_of, replicas, served
from celerytp.client.requests import LOOP_START_TTL_S, PendingRequest, RequestQueues
from celerytp.client.waiting import ChordWaiter, no_worker
from celerytp.core import protocol as p
from celerytp.core.app import DEFAULT_GROUP, GATHER_TASK, make_app, op_task_name, queue_name
from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.keys import comm_key, loop_key, loop_stats_key, members_key, owner_key, queue_key
from celerytp.core.liveness import HeartbeatTiming, RankWatch, read_owners
from celerytp.core.model_files import default_model_path
from celerytp.core.read_deadline import DEFAULT_READ_DEADLINE_S
from celerytp.core.redis_client import broker_errors, connect
from celerytp.core.redis_scripts import RELEASE_IF_HOLDER
from celerytp.core.registry import model_record
from celerytp.core.safe_transport import dead_letter_key
from celerytp.core.sampling import SamplingParams

log = logging.getLogger(__name__)

GROUP_FORMING_OPS = ("ping", "init", "shutdown")  # run on the workers as they are, healed or not
REBUILD_EVERY_S = 2.0  # the registry is rebuilt from the ranks at most this often


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
        self.redis = connect(broker_url)
        self._local_lock = threading.Lock()
        self._publisher = ChordPublisher(self.app, self.redis, group, world_size, GATHER_TASK)
        self.recovery_timeout = recovery_timeout
        self._timing = HeartbeatTiming.from_env()
        self._queues = RequestQueues(self.redis, self._serve)
        self._peers: dict[str, Leader] = {}  # leaders of the other groups serving our models (replicas)
        self._peers_lock = threading.Lock()
        self._rebuilt_at = -REBUILD_EVERY_S
        self.generate_timeout = 3600.0
        self._waiter = ChordWaiter(self.app, self.redis, group, world_size, self._publisher, self._timing)
        self._healer = Healer(self)

    # ---- foundation ops ---------------------------------------------------------------

    @broker_errors
    def ping(self, timeout: float | None = None) -> list[p.Pong]:
        """Every rank's pong, through the ranks' control path: it never waits behind an op."""
        owners = self._live_owners("ping")
        watch = RankWatch(self.redis, self.group, owners, self._timing)
        replies = control_call(self.redis, self.group, self.world_size, "ping", self.timeout if timeout is None else timeout, watch)
        return [p.parse_reply(r) for r in replies]

    @broker_errors
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

    @broker_errors
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

    @broker_errors
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
        kv_memory_fraction: float | None = None,
        kv_dtype: str | None = None,
        prefill_budget: int = 256,
        idle_s: float = 1.0,
        max_queue: int = 256,
        read_deadline_s: float = DEFAULT_READ_DEADLINE_S,
        mmproj: str | os.PathLike | None = None,
    ) -> list[p.Loaded]:
        """Load a model on every rank (or on none). `path` None: the default SmolLM2 GGUF.
        `mmproj`: llama.cpp's mmproj file of a gemma3 or qwen2vl .gguf at `path`, its vision tower (the
        ranks confine it to their model roots as they do `path`).

        Serving settings: `max_batch` requests decode together (KV cache rows), each rank's KV
        cache stays within `kv_cache_bytes`, or without it within `kv_memory_fraction` (default
        0.8) of the memory its device has free after the weights (a CPU: the host's available
        RAM shared by the ranks), max_context, unless given, being what fits; it is
        stored in `kv_dtype` (default: the model's dtype; "bfloat16" halves a float32 cache),
        `prefill_budget` prompt tokens run per step beside the decoding rows, a serving loop
        ends `idle_s` after its last request, and past `max_queue` waiting requests a new one
        is refused as `overloaded`. A read of the model's files that takes over `read_deadline_s`
        (a stalled file system) fails the load, rolled back on every rank.
        """
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'max_queue': an integer >= 1 is required, got {max_queue!r}")
        path = os.path.abspath(path if path is not None else default_model_path())
        fields = {
            "path": path, "dtype": dtype, "max_context": max_context, "max_batch": max_batch, "quant": quant,
            "kv_cache_bytes": kv_cache_bytes, "kv_memory_fraction": kv_memory_fraction, "kv_dtype": kv_dtype, "prefill_budget": prefill_budget, "idle_s": idle_s, "max_queue": max_queue,
            "read_deadline_s": read_deadline_s,
        }
        if mmproj is not None:  # only then on the wire: a text model's load request is as before
            fields["mmproj"] = os.path.abspath(mmproj)
        self._ensure_group()
        return self._load(model_id, fields, progress, timeout)

    def _load(self, model_id: str, fields: dict[str, Any], progress: bool = False, timeout: float = 1800.0,
              keep: bool = False) -> list:
        """Load with `fields` (core.registry.LOAD_FIELDS) and record the model (no healing first).
        `keep`: ranks that hold it so loaded keep their shards (a heal)."""
        with LoadProgress(self.redis, self.group, model_id, self.world_size, enabled=progress) as bar:
            request = {"model_id": model_id, **fields, **({"keep": True} if keep else {})}
            replies = self._call("load", request, timeout, bar.update)
        first = replies[0]
        record = model_record(
            fields, dtype=first.dtype, model_type=first.model_type, vocab_size=first.vocab_size,
            max_context=first.max_context, max_batch=first.max_batch, decode=first.decode,
            batch_invariant=all(reply.batch_invariant for reply in replies), attention=first.attention,
        )
        self._keep_record(model_id, record, read_owners(self.redis, self.group, self.world_size))
        return replies

    @broker_errors
    def models(self) -> dict[str, dict]:
        """Every served model, by any group: model_id -> its record {path, dtype, ...} with
        `replicas` (group -> world size). A record can outlive what a restarted rank holds;
        `held_models` asks this group's ranks, `rebuild_registry` rebuilds it from the ranks."""
        return served(self.redis)

    @broker_errors
    def rebuild_registry(self) -> None:
        """After Redis lost its state (restarted without persistence, or a new Redis): each live
        group's members, comm id and model records again, from what its ranks report."""
        if time.monotonic() - self._rebuilt_at < REBUILD_EVERY_S:
            return  # a burst of requests for an unknown model asks the ranks once
        self._rebuilt_at = time.monotonic()
        groups = {**discover_groups(self.redis), self.group: self.world_size}
        for group, world_size in groups.items():
            try:
                self._peer(group, world_size)._healer.rebuild()
            except CeleryTPError as exc:  # a group with a missing rank: rebuilt once it heals
                log.warning("could not rebuild the registry of group %s: %s", group, exc)

    @broker_errors
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

    @broker_errors
    def unload(self, model_id: str, everywhere: bool = False) -> list[p.Unloaded]:
        """Free the model on every rank of this group (`everywhere`: of every group serving it;
        the replies of every group, in group order)."""
        groups = sorted(replicas(self.redis, model_id).items()) if everywhere else []
        if groups:
            return [reply for group, size in groups for reply in self._peer(group, size).unload(model_id)]
        try:
            return self.call("unload", {"model_id": model_id})
        finally:
            drop_replica(self.redis, self.group, model_id)

    @broker_errors
    def generate(
        self, model_id: str, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
        mode: str = "fused", **options
    ) -> GenerationResult:
        """Generate one completion from `prompt` (raw text, or token ids as they are) or `messages`
        (chat template applied). A message's content may hold images on a vision-language
        model (fused mode): OpenAI's `{"type": "image_url", "image_url": {"url": "data:..."}}`, or
        `{"type": "image", "image": <the file's bytes, or its path in the model's directory>}`.

        Options: max_tokens, temperature, top_k, top_p, repetition_penalty, presence_penalty,
        frequency_penalty, logit_bias ({token id: bias}), min_p, seed, logprobs, prompt_logprobs
        (the prompt tokens' log-probabilities with this many alternatives each, fused mode only:
        `result.prompt_logprobs`), stop, request_id
        (to cancel it), ignore_eos (run to max_tokens, for benchmarks). Unset sampling options
        come from generation_config.json. `mode="fused"` queues the request for the model's
        serving loop, where it joins whatever else is running; `mode="step"` drives one step
        chord per token (no presence or frequency penalty). Both give the same tokens.
        """
        if mode not in MODES:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'mode': one of {MODES} is required, got {mode!r}")
        record = self._record(model_id)
        prepared = prepare(record, prompt=prompt, messages=messages, **options)
        if mode == "step" and "prompt_logprobs" in prepared.spec:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'prompt_logprobs': fused mode only")
        if mode == "step" and "images" in prepared.spec:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'messages': images are taken in fused mode only")
        if mode == "step":
            row = run_steps(partial(self.step, model_id), prepared, record["max_context"])
        else:
            row = self._queues.submit(model_id, prepared.spec, record["max_queue"], self.generate_timeout).result()
        return finish(prepared, row, mode)

    @broker_errors
    def stream(
        self, model_id: str, prompt: str | list[int] | None = None, messages: list[dict] | None = None, **options
    ) -> TokenStream:
        """Like generate (fused), but iterate the returned stream for text deltas as they come.

        `stream.request_id` names the request for `cancel`; `stream.result` is the final
        GenerationResult once the iteration ends.
        """
        record = self._record(model_id)
        prepared = prepare(record, prompt=prompt, messages=messages, stream=True, **options)
        pending = self._queues.submit(model_id, prepared.spec, record["max_queue"], self.generate_timeout)
        return TokenStream(pending, prepared, self.generate_timeout)

    @broker_errors
    def submit(self, model_id: str, spec: dict[str, Any]) -> PendingRequest:
        """Queue a token-level request (protocol GenSpec fields: request_id, prompt ids,
        max_tokens, sampling, stop, eos_token_ids, stream) for the model's serving loop.

        For clients that tokenize themselves; `generate` and `stream` are built on it.
        """
        record = self._record(model_id)
        check_spec(record, spec)
        return self._queues.submit(model_id, spec, record["max_queue"], self.generate_timeout)

    def cancel(self, request_id: str) -> None:
        """Cancel a fused request, from any leader: a queued one never runs, a running one stops
        within a few steps. It ends as "cancelled"."""
        self._queues.cancel(request_id)

    @broker_errors
    def serving_stats(self, model_id: str) -> dict[str, int]:
        """The model's queue (shared by its replicas) and this group's serving loop: `queued`,
        `loop_running` (0/1), `running_rows`, `peak_rows`, `steps`, `requests`, `reused_tokens`
        (prompt tokens a row held already), `shared_prompt_tokens` (copied from a row that
        prefilled the same prompt) of the current or last loop."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.llen(queue_key(model_id))
        pipe.exists(loop_key(self.group, model_id))
        pipe.hgetall(loop_stats_key(self.group, model_id))
        queued, running, stats = pipe.execute()
        return {"queued": queued, "loop_running": int(running), **{k.decode(): int(v) for k, v in stats.items()}}

    def _start_loop(self, model_id: str, loop_id: str) -> None:
        """Publish a `serve` chord: every rank runs the model's serving loop (nobody waits on it)."""
        fields = {"op": "serve", "model_id": model_id, "loop_id": loop_id}
        try:
            self._publisher.publish(
                op_task_name("serve"), lambda seq, epoch: {**fields, "seq": seq, "epoch": epoch}, expires=LOOP_START_TTL_S,
                lock_wait=self.timeout, subscribe=False,
            )
        except DispatchLockTimeout as exc:
            raise CeleryTPError(ErrorKind.TIMEOUT, f"the serving loop of {model_id!r} was not started: {exc}", op="generate") from None
        except (redis.RedisError, OSError, KombuError) as exc:
            raise CeleryTPError(
                ErrorKind.INTERNAL, f"the serving loop of {model_id!r} was not started: {type(exc).__name__}: {exc}",
                op="generate",
            ) from None

    def _record(self, model_id: str) -> dict[str, Any]:
        """The model's record (this group's when it serves the model, healing it first when it
        must); after Redis lost the registry, rebuilt from the ranks."""
        if self.group in replicas(self.redis, model_id):
            self._ensure_group()
        record = record_of(self.redis, model_id, prefer=self.group)
        if record is None:
            self._ensure_group()
            self.rebuild_registry()
            record = record_of(self.redis, model_id, prefer=self.group)
        if record is None:
            raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded", op="generate")
        return record

    def _keep_record(self, model_id: str, record: dict[str, Any], holders: list[bytes | None]) -> None:
        """Register a model as held by this group's workers `holders` (a replaced one will have lost it)."""
        keep_replica(self.redis, self.group, self.world_size, model_id, record, holders)

    # ---- replicas: the groups serving one model ---------------------------------------

    def _peer(self, group: str, world_size: int) -> Leader:
        """The leader of a group serving a model with this one (same broker and settings)."""
        if group == self.group:
            return self
        with self._peers_lock:
            if group not in self._peers:
                self._peers[group] = Leader(self.broker_url, group, world_size, self.timeout, self.recovery_timeout)
            return self._peers[group]

    def _serve(self, model_id: str, heal: bool) -> None:
        """Start the serving loop of `model_id` on each replica group that has none and is whole;
        loops pull from the shared queue, so a busy or slow group takes less.

        `heal` (a waiter whose request no loop will take): when no replica runs a loop or can
        start one, heal one (this group first) and start its loop.
        """
        groups = replicas(self.redis, model_id)
        if not groups:
            self.rebuild_registry()
            groups = replicas(self.redis, model_id)
        if not groups:
            raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded", op="generate")
        flags = self.redis.mget([loop_key(group, model_id) for group in groups])
        serving, failure = any(flags), None
        for (group, world_size), flag in zip(groups.items(), flags, strict=True):
            peer = self._peer(group, world_size)
            if flag is not None or peer._needs_heal():
                continue
            try:
                peer._start_loop_if_idle(model_id)
                serving = True
            except CeleryTPError as exc:
                failure = exc
        if serving:
            return
        if not heal:
            if failure is not None:
                raise failure
            return  # every replica needs healing: the request's waiter heals one
        group = self.group if self.group in groups else next(iter(groups))
        peer = self._peer(group, groups[group])
        peer.heal()
        peer._start_loop_if_idle(model_id)

    def _needs_heal(self) -> bool:
        regroup, stale = self._healer.damage()
        return regroup or bool(stale) or None in read_owners(self.redis, self.group, self.world_size)

    def _start_loop_if_idle(self, model_id: str) -> None:
        """Start this group's loop of `model_id` unless one runs or is being started."""
        loop_id = uuid.uuid4().hex
        flag = loop_key(self.group, model_id)
        if not self.redis.set(flag, loop_id, nx=True, ex=LOOP_START_TTL_S):
            return
        try:
            self._start_loop(model_id, loop_id)
        except CeleryTPError:
            self.redis.eval(RELEASE_IF_HOLDER, 1, flag, loop_id)  # the next submitter tries again
            raise

    @broker_errors
    def dead_letters(self, limit: int = 100) -> dict[int, list[str]]:
        """Per rank, the newest malformed messages its worker dropped (core/safe_transport.py)."""
        keys = [dead_letter_key(queue_name(self.group, r)) for r in range(self.world_size)]
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.lrange(key, 0, limit - 1)
        return {rank: [m.decode(errors="replace") for m in found] for rank, found in enumerate(pipe.execute())}

    @broker_errors
    def health(self) -> list[dict | None]:
        """Each rank's heartbeat record (host, pid, device), or None for a rank with no live worker."""
        values = self.redis.mget([owner_key(self.group, r) for r in range(self.world_size)])
        return [json.loads(v) if v else None for v in values]

    # ---- healing (client/healer.py) ---------------------------------------------------

    @broker_errors
    def heal(self, timeout: float | None = None) -> None:
        """Re-form the group once every rank has a live worker (or after a rank reported it broken),
        and load again every model that a replaced worker lost; see Healer.heal."""
        self._healer.heal(timeout)

    def _ensure_group(self) -> None:
        self._healer.ensure()

    # ---- dispatch ---------------------------------------------------------------------

    @broker_errors
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
            combined = self._waiter.wait(op, sent, timeout, on_wait, owners)
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
                raise no_worker(op, missing, "no live worker holds this rank")
            time.sleep(0.05)

