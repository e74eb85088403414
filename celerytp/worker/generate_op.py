"""The fused `generate` op on a rank: validate the batch, run the lockstep loop, stream tokens."""

from __future__ import annotations

import logging
import time

import redis

from celerytp import protocol as p
from celerytp.engine import FusedGeneration, Rank0Hooks, Row, make_rows
from celerytp.keys import cancel_key, stream_key
from celerytp.protocol import ErrorKind
from celerytp.tokenizer import load_tokenizer
from celerytp.worker.model_ops import LoadedModel, model_entry
from celerytp.worker.state import RankError, RankState, handles

log = logging.getLogger(__name__)

STREAM_TTL_S = 600
CANCEL_CHECK_S = 0.05  # how often rank 0 looks for cancellations (a Redis round trip)


class RedisHooks(Rank0Hooks):
    """Rank 0's side channel: tokens to per-request Redis Streams, cancellation keys from Redis."""

    def __init__(self, client: redis.Redis, group: str, streamed: set[str]):
        self._redis = client
        self._group = group
        self._streamed = streamed
        self._cancelled: set[str] = set()
        self._next_check = 0.0

    def publish(self, rows: list[Row], tokens: list[int]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for row, token in zip(rows, tokens):
            if row.request_id in self._streamed and token not in row.checker.eos_ids:
                pipe.xadd(stream_key(self._group, row.request_id), {"t": token})
        check = time.monotonic() >= self._next_check
        if check:
            self._next_check = time.monotonic() + CANCEL_CHECK_S
            pipe.mget([cancel_key(self._group, row.request_id) for row in rows])
        results = pipe.execute() if len(pipe) else []
        if check:
            self._cancelled = {row.request_id for row, flag in zip(rows, results[-1]) if flag is not None}

    def finished(self, rows: list[Row]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for row in rows:
            if row.request_id in self._streamed:
                key = stream_key(self._group, row.request_id)
                pipe.xadd(key, {"done": row.finish, "matched_stop": row.checker.matched or ""})
                pipe.expire(key, STREAM_TTL_S)
        if len(pipe):
            pipe.execute()

    def cancelled(self, rows: list[Row]) -> set[str]:
        return self._cancelled & {row.request_id for row in rows}


def _validate(entry: LoadedModel, request: p.GenerateRequest) -> None:
    """The same checks give the same answer on every rank, so no rank enters the loop alone."""
    model = entry.model
    if len(request.requests) > model.max_batch:
        raise RankError(
            ErrorKind.BAD_REQUEST,
            f"field 'requests': {len(request.requests)} requests exceed the model's {model.max_batch} batch rows",
        )
    ids = [spec.request_id for spec in request.requests]
    if len(set(ids)) != len(ids):
        raise RankError(ErrorKind.BAD_REQUEST, "field 'requests': request ids repeat")
    vocab = model.config.vocab_size
    for i, spec in enumerate(request.requests):
        if len(spec.prompt) > model.max_context:
            raise RankError(
                ErrorKind.BAD_REQUEST,
                f"field 'requests.{i}.prompt': {len(spec.prompt)} tokens exceed the context limit {model.max_context}",
            )
        if max(spec.prompt) >= vocab:
            raise RankError(ErrorKind.BAD_REQUEST, f"field 'requests.{i}.prompt': ids outside the vocabulary of {vocab}")


@handles("generate", collective=True)
def generate(state: RankState, request: p.GenerateRequest) -> p.GenerateResult:
    entry = model_entry(state, request.model_id)
    _validate(entry, request)
    specs = [spec.model_dump() for spec in request.requests]
    leader = state.rank == 0
    decode = None
    if leader and any(spec["stop"] for spec in specs):
        decode = load_tokenizer(entry.path).decode
    try:
        rows = make_rows(specs, entry.model.max_context, decode, leader=leader)
    except ValueError as exc:
        raise RankError(ErrorKind.BAD_REQUEST, f"field 'sampling': {exc}") from None
    entry.reset_sequence()  # the batch reuses the cache rows step mode works in
    streamed = {spec["request_id"] for spec in specs if spec["stream"]}
    hooks = RedisHooks(state.redis, state.config.group, streamed) if leader else None
    started = time.perf_counter()
    try:
        results = state.collective(FusedGeneration(entry.model, state.tp, rows, hooks).run)
    except RankError:
        raise
    except Exception as exc:
        log.exception("fused generation failed")
        raise RankError(ErrorKind.FORWARD_FAILED, f"{type(exc).__name__}: {exc}") from exc
    return p.GenerateResult(
        rank=state.rank, model_id=request.model_id, rows=results or [], total_s=time.perf_counter() - started
    )

