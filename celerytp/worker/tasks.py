"""Celery task adapters: decode a request, call the rank state, encode the reply."""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from celerytp.core.app import GATHER_TASK, UNREAD_PREFIX, op_task_name
from celerytp.worker.handlers import HANDLERS, handle
from celerytp.worker.state import RankState


def gather(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """Chord body: order the per-rank replies and list every failing rank."""
    ordered = sorted(replies, key=lambda r: r.get("rank", -1) if isinstance(r, dict) else -1)
    failures = [
        f"rank {r.get('rank')} [{r.get('kind')}]: {r.get('message')}"
        for r in ordered
        if not isinstance(r, dict) or r.get("type") == "error"
    ]
    return {"ok": not failures, "replies": ordered, "failures": failures}


class InlineChordBody(Task):
    """A chord body that runs where the last header part finished, saving a broker hop.

    The Redis backend publishes the body with `callback.delay(results)` once every rank
    has replied; doing the (tiny) gather right there and storing its result under the
    body's id is what the body task would do one queue later, possibly behind a long op.
    """

    def apply_async(self, args=None, kwargs=None, task_id=None, **options):
        if task_id is None:  # not called as a chord body
            return super().apply_async(args, kwargs, **options)
        try:
            value = self.run(*(args or ()), **(kwargs or {}))
        except Exception as exc:
            self.backend.mark_as_failure(task_id, exc)
        else:
            if not task_id.startswith(UNREAD_PREFIX):  # e.g. a serving loop's chord: nobody reads it
                self.backend.mark_as_done(task_id, value)
        return self.AsyncResult(task_id)


def register_tasks(app: Celery, state: RankState) -> None:
    """Register one task per op (stable names for Flower) and the gather body."""
    for op in HANDLERS:

        def run(request: Any, _op: str = op) -> dict:
            return handle(state, _op, request)

        app.task(name=op_task_name(op), ignore_result=False)(run)
    app.task(name=GATHER_TASK, base=InlineChordBody)(gather)
