"""The fused `generate` op on a rank: validate the batch, run the lockstep loop, stream tokens."""

from __future__ import annotations

import time

import redis

from celerytp.core import protocol as p
from celerytp.core.keys import cancel_key, stream_key
from celerytp.core.sampling import SamplingParams
from celerytp.core.tokenizer import load_tokenizer
from celerytp.core.validation import bad_request, check_tokens, sampling_params
from celerytp.worker.fused import FusedGeneration, Rank0Hooks, Row, make_rows
from celerytp.worker.loaded_model import LoadedModel
from celerytp.worker.model_ops import model_entry
from celerytp.worker.state import RankState

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


def _validate(entry: LoadedModel, request: p.GenerateRequest) -> list[SamplingParams]:
    """The same checks give the same answer on every rank, so no rank enters the loop alone."""
    model = entry.model
    if len(request.requests) > model.max_batch:
        raise bad_request("requests", f"{len(request.requests)} requests exceed the model's {model.max_batch} batch rows")
    ids = [spec.request_id for spec in request.requests]
    if len(set(ids)) != len(ids):
        raise bad_request("requests", "request ids repeat")
    params = []
    for i, spec in enumerate(request.requests):
        check_tokens(spec.prompt, max_context=model.max_context, vocab_size=model.config.vocab_size, field=f"requests.{i}.prompt")
        params.append(sampling_params(spec.sampling, field=f"requests.{i}.sampling"))
    return params


def generate(state: RankState, request: p.GenerateRequest) -> p.GenerateResult:
    entry = model_entry(state, request.model_id)
    params = _validate(entry, request)
    is_sampler = state.rank == 0
    decode = None
    if is_sampler and any(spec.stop for spec in request.requests):
        decode = load_tokenizer(entry.path).decode
    rows = make_rows(request.requests, params, entry.model.max_context, decode, is_sampler=is_sampler)
    entry.reset_sequence()  # the batch reuses the cache rows step mode works in
    streamed = {spec.request_id for spec in request.requests if spec.stream}
    hooks = RedisHooks(state.redis, state.config.group, streamed) if is_sampler else None
    started = time.perf_counter()
    results = state.run_model(FusedGeneration(entry.model, state.tp, rows, hooks).run)
    return p.GenerateResult(
        rank=state.rank, model_id=request.model_id, rows=results or [], total_s=time.perf_counter() - started
    )
