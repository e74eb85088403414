"""The leader: sends every op to all ranks as one chord and combines the replies."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
from celery.exceptions import TimeoutError as CeleryTimeout

from celerytp.client.dispatch import ChordPublisher, DispatchLockTimeout, PublishedChord
from celerytp.client.generation import MODES, GenerationResult, TokenStream, check_spec, finish, prepare, run_steps
from celerytp.client.progress import LoadProgress
from celerytp.client.requests import LOOP_START_TTL_S, PendingRequest, RequestQueues
from celerytp.core import protocol as p
from celerytp.core.app import DEFAULT_GROUP, GATHER_TASK, make_app, op_task_name
from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.keys import loop_key, loop_stats_key, models_key, owner_key, queue_key
from celerytp.core.model_files import default_model_path
from celerytp.core.sampling import SamplingParams


class Leader:
    """Drives the rank workers of one group through chords.

    Args:
        broker_url: Redis URL of the group's broker and result backend.
        group: group name (queues ``celerytp.<group>.rank.<r>``).
        world_size: number of ranks.
        timeout: default seconds to wait for an op's replies.
    """

    def __init__(self, broker_url: str, group: str = DEFAULT_GROUP, world_size: int = 1, timeout: float = 60.0):
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
        self._queues = RequestQueues(self.redis, group, self._start_loop)
        self.generate_timeout = 3600.0

    # ---- foundation ops ---------------------------------------------------------------

    def ping(self, timeout: float | None = None) -> list[p.Pong]:
        return self.call("ping", timeout=timeout)

    def init(self, comm_id: str | None = None, timeout_s: float = 60.0) -> list[p.InitOk]:
        """Form a new process group epoch (a fresh comm_id unless one is given)."""
        comm_id = comm_id or uuid.uuid4().hex
        return self.call("init", {"comm_id": comm_id, "timeout_s": timeout_s}, timeout=timeout_s + 30)

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
        prefill_budget: int = 256,
        idle_s: float = 1.0,
        max_queue: int = 256,
    ) -> list[p.Loaded]:
        """Load a model on every rank (or on none). `path` None: the default SmolLM2 GGUF.

        Serving settings: `max_batch` requests decode together (KV cache rows), each rank's KV
        cache stays within `kv_cache_bytes` (max_context, unless given, is what fits),
        `prefill_budget` prompt tokens run per step beside the decoding rows, a serving loop
        ends `idle_s` after its last request, and past `max_queue` waiting requests a new one
        is refused as `overloaded`.
        """
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'max_queue': an integer >= 1 is required, got {max_queue!r}")
        path = os.path.abspath(path if path is not None else default_model_path())
        fields = {
            "model_id": model_id, "path": path, "dtype": dtype, "max_context": max_context,
            "max_batch": max_batch, "quant": quant, "kv_cache_bytes": kv_cache_bytes,
            "prefill_budget": prefill_budget, "idle_s": idle_s,
        }
        with LoadProgress(self.redis, self.group, model_id, self.world_size, enabled=progress) as bar:
            replies = self.call("load", fields, timeout=timeout, on_wait=bar.update)
        first = replies[0]
        record = {"path": path, "dtype": first.dtype, "model_type": first.model_type, "vocab_size": first.vocab_size,
                  "max_context": first.max_context, "max_batch": first.max_batch, "max_queue": max_queue}
        self.redis.hset(models_key(self.group), model_id, json.dumps(record))
        return replies

    def models(self) -> dict[str, dict]:
        """Models loaded on this group (by any leader): model_id -> {path, dtype, ...}."""
        return {k.decode(): json.loads(v) for k, v in self.redis.hgetall(models_key(self.group)).items()}

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
            op_task_name("serve"), lambda seq: {**fields, "seq": seq}, expires=LOOP_START_TTL_S,
            lock_wait=self.timeout, subscribe=False,
        )

    def _record(self, model_id: str) -> dict[str, Any]:
        record = self.models().get(model_id)
        if record is None:
            raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded", op="generate")
        return record

    def health(self) -> list[dict | None]:
        """Each rank's heartbeat record (host, pid, device), or None for a rank with no live worker."""
        values = self.redis.mget([owner_key(self.group, r) for r in range(self.world_size)])
        return [json.loads(v) if v else None for v in values]

    # ---- dispatch ---------------------------------------------------------------------

    def call(
        self,
        op: str,
        fields: dict[str, Any] | None = None,
        timeout: float | None = None,
        on_wait: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Send `op` to every rank as one chord; return the typed replies in rank order.

        `on_wait` is called every few milliseconds while waiting (progress display).
        """
        if op not in p.REQUESTS:
            raise CeleryTPError(ErrorKind.BAD_REQUEST, f"unknown op {op!r}; known: {sorted(p.REQUESTS)}", op=op)
        timeout = self.timeout if timeout is None else timeout
        with self._local_lock:
            try:
                sent = self._publisher.publish(
                    op_task_name(op), lambda seq: {"op": op, "seq": seq, **(fields or {})}, expires=timeout, lock_wait=timeout
                )
            except DispatchLockTimeout as exc:
                raise CeleryTPError(ErrorKind.TIMEOUT, str(exc), op=op) from None
            combined = self._wait(op, sent, timeout, on_wait)
        failures = [
            RankFailure(r.get("rank"), ErrorKind(r["kind"]), r.get("message", ""))
            for r in combined["replies"]
            if r.get("type") == "error"
        ]
        if failures:
            raise CeleryTPError.from_failures(op, failures)
        return [p.parse_reply(r) for r in combined["replies"]]

    def _wait(self, op: str, sent: PublishedChord, timeout: float, on_wait: Callable[[], None] | None) -> dict:
        try:
            return self.app.AsyncResult(sent.body_id).get(timeout=timeout, interval=0.005, on_interval=on_wait)
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
