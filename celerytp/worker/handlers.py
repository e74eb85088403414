"""The op table of a rank, in one place, and the entry point every rank task calls."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, NamedTuple

from celerytp.core import protocol as p
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.worker import group_ops, model_ops, serve_op
from celerytp.worker.state import RankState

log = logging.getLogger(__name__)


class Handler(NamedTuple):
    run: Callable[[RankState, Any], p.Reply]
    collective: bool  # ranks first agree on the op sequence, then enter collectives
    on_error: Callable[[RankState, Any, CeleryTPError], None] | None = None  # after any failure of the op


HANDLERS: dict[str, Handler] = {
    "ping": Handler(group_ops.ping, collective=False),
    "init": Handler(group_ops.init, collective=False),
    "sanity_check": Handler(group_ops.sanity_check, collective=True),
    "shutdown": Handler(group_ops.shutdown, collective=False),
    "load": Handler(model_ops.load, collective=True),
    "step": Handler(model_ops.step, collective=True),
    "clear_kv_cache": Handler(model_ops.clear_kv_cache, collective=False),
    "unload": Handler(model_ops.unload, collective=False),
    "serve": Handler(serve_op.serve, collective=True, on_error=serve_op.refuse_queued),
}
assert set(HANDLERS) == set(p.REQUESTS), "every protocol op has exactly one handler"


def handle(state: RankState, op: str, data: Any) -> dict:
    """Run one op and return its JSON reply; never raises for expected failures."""
    request, handler = None, HANDLERS[op]
    try:
        request = p.parse_request(data, expected_op=op)
        state.ops_started += 1
        state.in_collective_op = handler.collective
        state.check_order(request, handler.collective)
        reply = handler.run(state, request)
    except CeleryTPError as exc:
        if handler.on_error is not None and request is not None:
            handler.on_error(state, request, exc)
        return p.error_reply(state.rank, exc.kind, exc.message)
    except Exception as exc:  # the worker must survive whatever an op raises
        log.exception("op %s failed", op)
        error = CeleryTPError(ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}")
        if handler.on_error is not None and request is not None:
            handler.on_error(state, request, error)
        return p.error_reply(state.rank, error.kind, error.message)
    finally:
        state.in_collective_op = False
    return reply.model_dump(mode="json")
