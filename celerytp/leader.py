"""The leader: sends every op to all ranks as one chord and combines the replies."""

from __future__ import annotations

import json
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import redis
from celery.exceptions import TimeoutError as CeleryTimeout

from celerytp import generation
from celerytp import protocol as p
from celerytp.app import DEFAULT_GROUP, make_app
from celerytp.batching import Batcher
from celerytp.dispatch import ChordPublisher, DispatchLockTimeout, PublishedChord
from celerytp.keys import cancel_key, models_key, owner_key
from celerytp.loading import default_model_path
from celerytp.progress import LoadProgress
from celerytp.protocol import ErrorKind
from celerytp.sampling import SamplingParams
from celerytp.worker.tasks import GATHER_TASK, op_task_name


@dataclass(frozen=True)
class RankFailure:
    rank: int | None
    kind: ErrorKind
    message: str

    def __str__(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "leader"
        return f"{who} [{self.kind}]: {self.message}"


class CeleryTPError(Exception):
    """An op failed; `failures` names every failing rank with its kind and message."""

    def __init__(self, op: str, failures: list[RankFailure]):
        self.op = op
        self.failures = failures
        super().__init__(f"{op} failed: " + "; ".join(str(f) for f in failures))

    @property
    def kinds(self) -> set[ErrorKind]:
        return {f.kind for f in self.failures}


class Leader:
    """Drives the rank workers of one group through chords.

    Args:
        broker_url: Redis URL of the group's broker and result backend.
        group: group name (queues ``celerytp.<group>.rank.<r>``).
        world_size: number of ranks.
        timeout: default seconds to wait for an op's replies.
    """

    def __init__(self, broker_url: str, group: str = DEFAULT_GROUP, world_size: int = 1, timeout: float = 60.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.broker_url = broker_url
        self.group = group
        self.world_size = world_size
        self.timeout = timeout
        self.app = make_app(broker_url, group, world_size, main="celerytp-leader")
        self.redis = redis.Redis.from_url(broker_url)
        self._local_lock = threading.Lock()
        self._publisher = ChordPublisher(self.app, self.redis, group, world_size, GATHER_TASK)
        self._batcher: Batcher | None = None
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
        max_batch: int = 4,
        progress: bool = False,
        timeout: float = 1800.0,
    ) -> list[p.Loaded]:
        """Load a model on every rank (or on none). `path` None: the default SmolLM2 GGUF.

        `max_batch` is how many requests one fused batch may hold (KV cache rows).
        """
        path = os.path.abspath(path if path is not None else default_model_path())
        fields = {
            "model_id": model_id, "path": path, "dtype": dtype, "max_context": max_context,
            "max_batch": max_batch, "quant": quant,
        }
        with LoadProgress(self.redis, self.group, model_id, self.world_size, enabled=progress) as bar:
            replies = self.call("load", fields, timeout=timeout, on_wait=bar.update)
        first = replies[0]
        record = {"path": path, "dtype": first.dtype, "model_type": first.model_type,
                  "vocab_size": first.vocab_size, "max_context": first.max_context, "max_batch": first.max_batch}
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
    ) -> generation.GenerationResult:
        """Generate one completion from `prompt` (raw text) or `messages` (chat template applied).

        Options: max_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop,
        request_id (to cancel it), ignore_eos (run to max_tokens, for benchmarks). Unset sampling options come from generation_config.json.
        `mode="fused"` runs the whole request (batched with concurrent ones) in one chord;
        `mode="step"` drives one step chord per token. Both give the same tokens.
        """
        return generation.generate(self, model_id, mode, prompt=prompt, messages=messages, **options)

    def stream(
        self, model_id: str, prompt: str | None = None, messages: list[dict] | None = None, **options
    ) -> generation.TokenStream:
        """Like generate (fused), but iterate the returned stream for text deltas as they come.

        `stream.request_id` names the request for `cancel`; `stream.result` is the final
        GenerationResult once the iteration ends.
        """
        prepared = generation.prepare(self, model_id, prompt=prompt, messages=messages, stream=True, **options)
        return generation.TokenStream(self, prepared, self.submit(model_id, prepared.spec))

    def cancel(self, request_id: str) -> None:
        """Ask rank 0 to stop a running (or queued) fused request; it ends as "cancelled"."""
        self.redis.set(cancel_key(self.group, request_id), 1, ex=600)

    def submit(self, model_id: str, spec: dict[str, Any]) -> Future:
        """Queue one prepared request for the next fused batch; the future gives its RowResult."""
        if self._batcher is None:
            self._batcher = Batcher(self._run_batch, lambda m: self.models()[m]["max_batch"])
        return self._batcher.submit(model_id, spec)

    def _run_batch(self, model_id: str, specs: list[dict[str, Any]]) -> list[p.RowResult]:
        reply = self.call("generate", {"model_id": model_id, "requests": specs}, timeout=self.generate_timeout)
        return reply[0].rows

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
            raise CeleryTPError(op, [RankFailure(None, ErrorKind.BAD_REQUEST, f"unknown op {op!r}; known: {sorted(p.REQUESTS)}")])
        timeout = self.timeout if timeout is None else timeout
        with self._local_lock:
            try:
                sent = self._publisher.publish(
                    op_task_name(op), lambda seq: {"op": op, "seq": seq, **(fields or {})}, expires=timeout, lock_wait=timeout
                )
            except DispatchLockTimeout as exc:
                raise CeleryTPError(op, [RankFailure(None, ErrorKind.TIMEOUT, str(exc))]) from None
            combined = self._wait(op, sent, timeout, on_wait)
        failures = [
            RankFailure(r.get("rank"), ErrorKind(r["kind"]), r.get("message", ""))
            for r in combined["replies"]
            if r.get("type") == "error"
        ]
        if failures:
            raise CeleryTPError(op, failures)
        return [p.parse_reply(r) for r in combined["replies"]]

    def _wait(self, op: str, sent: PublishedChord, timeout: float, on_wait: Callable[[], None] | None) -> dict:
        try:
            return self.app.AsyncResult(sent.body_id).get(timeout=timeout, interval=0.005, on_interval=on_wait)
        except CeleryTimeout:
            raise CeleryTPError(op, self._unfinished_ranks(sent, timeout)) from None
        except Exception as exc:  # a header task raised or its worker died
            raise CeleryTPError(op, self._failed_ranks(sent, exc)) from None
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
