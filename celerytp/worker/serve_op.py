"""The `serve` op on a rank: run a model's serving loop, rank 0 feeding it from Redis
(worker/request_source.py).

Rank 0's own setup is guarded and agreed on the control group before the loop starts.
Whatever makes the loop fail, the requests it held go back to the head of the model's queue
(`serve`), to resume on this group once healed or on another replica; when no group is left to
serve the model, the queued requests are answered with the error (`refuse_queued`), so no
requester waits for a loop that will not come. A failed loop is counted by kind (`refuse_queued`,
core/loop_failures.py) for `celerytp status` and /metrics; a loop that ends well counts nothing.
"""

from __future__ import annotations

import logging
import time

import redis

from celerytp.core import protocol as p
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.loop_failures import record_loop_failure
from celerytp.worker.model_ops import model_entry
from celerytp.worker.request_source import RedisRequestSource
from celerytp.worker.serving import ServingLoop
from celerytp.worker.state import RankState

log = logging.getLogger(__name__)


def serve(state: RankState, request: p.ServeRequest) -> p.ServeResult:
    entry = model_entry(state, request.model_id)
    source, failure = None, None
    if state.rank == 0:  # rank 0's own setup, guarded: whatever fails here fails the op on every rank
        source = RedisRequestSource(state.redis, state.config.group, request.model_id, request.loop_id)
        try:
            source.start()
        except Exception as exc:  # whatever rank 0 meets alone is agreed on, never left for a peer to wait out
            failure = CeleryTPError(ErrorKind.INTERNAL, f"rank 0 could not start the serving loop: {type(exc).__name__}: {exc}")
    state.collective(lambda: state.control.agree(failure))
    decode = entry.tokenizer.decode if entry.tokenizer is not None else None  # read and checked at load
    loop = ServingLoop(entry.model, state.control, entry.row_tokens, entry.prefill_budget, entry.idle_s, source, decode,
                       entry.tokenizer, entry.images)
    started = time.perf_counter()
    try:
        stats = state.run_model(loop.run)
    except CeleryTPError:
        entry.forget_all()  # a forward may have stopped half way: no row's cache is trusted
        if source is not None:
            try:  # what the last step made reaches its clients, so a resumed request goes on after it
                loop.flush()
            except Exception as exc:
                log.warning("could not deliver the last step of %s: %s", request.model_id, exc)
        raise
    else:
        if source is not None:
            source.ended_well()
    finally:
        if source is not None:
            try:  # whatever the loop still holds goes back to the queue, for this group healed or a replica
                source.release()
            except Exception as exc:
                log.warning("could not requeue the requests of %s (they go back when the lease lapses): %s",
                            request.model_id, exc)
    return p.ServeResult(
        rank=state.rank, model_id=request.model_id, total_s=time.perf_counter() - started,
        host_waits=dict(loop.host_waits), **stats
    )


def refuse_queued(state: RankState, request: p.Request, error: CeleryTPError) -> None:
    """A serve op failed: every rank counts it (once per loop, whichever rank reports first;
    core/loop_failures.py), and rank 0 gives back what it held and, when no group is left to serve
    the model, answers the queued requests with the error (see RedisRequestSource.refuse)."""
    if not isinstance(request, p.ServeRequest):
        return
    record_loop_failure(state.redis, state.config.group, request.model_id, request.loop_id, error.kind)
    if state.rank != 0:
        return
    source = RedisRequestSource(state.redis, state.config.group, request.model_id, request.loop_id)
    try:
        source.refuse(error)
    except redis.RedisError as exc:
        log.warning("could not answer the queued requests of %s: %s", request.model_id, exc)
