"""The Celery front door: a `celerytp.generate` task that any Celery producer can send.

It takes the HTTP API's fields as kwargs (`model`, `prompt` or `messages`, max_tokens,
temperature, top_p, seed, stop, response_format, tools with `messages`, ...), validated the same
way, and returns a JSON dict (with `tool_calls` when the model called tools). An unknown
kwarg or a positional argument is refused. A failure is a task failure whose message starts with
the error kind, the same kind the HTTP API puts in `code` (`bad_request: field 'x': ...`,
`model_not_found: ...`); it is raised as a builtin RuntimeError so that a producer without
celerytp installed can rebuild it. While it generates, the task is in state PROGRESS with
`{"model", "text", "tokens"}` so far as its info (updated at most every PROGRESS_S).
A task revoked or expired while it runs cancels its request and ends REVOKED, as Celery ends a
task revoked before it starts (the result, a `task-revoked` event for Flower, the signal). Tasks
are acknowledged late: one whose front-door worker died is redelivered, and runs as a follower of
its request (the task id is the request id), not twice. Finished and failed requests are counted
where the HTTP API counts its own (Service.count, in Redis), so any server's /metrics shows the
Celery traffic too.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import redis
from celery import Celery, Task, signals
from celery.exceptions import Ignore
from celery.worker import state as worker_state
from kombu import Queue

from celerytp.client.leader import Leader
from celerytp.core.app import make_app
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.images import ImageLimits
from celerytp.core.secrets import clipped
from celerytp.server import tools
from celerytp.server.errors import as_sent, shown
from celerytp.server.limits import RequestLimits
from celerytp.server.schemas import TaskRequest, parse
from celerytp.server.service import Service, error_code

log = logging.getLogger(__name__)

GENERATE_TASK = "celerytp.generate"
ABANDON_POLL_S = 0.2  # how often a running task looks for its own revocation or expiry
FRONT_DOOR_VISIBILITY_S = 300
PROGRESS_S = 0.25  # a running task's PROGRESS state is written at most this often
PROGRESS = "PROGRESS"
# Request fields of the HTTP API the task refuses: it reports progress through its state instead.
NOT_FOR_TASKS = frozenset({"stream", "stream_options"})


def requests_queue(group: str) -> str:
    """The queue `celerytp.generate` tasks are sent to (`queue=` in send_task)."""
    return f"celerytp.{group}.requests"


def task_fields() -> frozenset[str]:
    """The kwargs `celerytp.generate` takes: the request model's fields, less the streaming ones."""
    return frozenset(TaskRequest.model_fields) - NOT_FOR_TASKS


def check_call(args: tuple, kwargs: dict[str, Any]) -> TaskRequest:
    """The task's arguments as a request; bad_request naming the first field that is not one."""
    if args:
        raise CeleryTPError(
            ErrorKind.BAD_REQUEST,
            f"field 'args': celerytp.generate takes keyword arguments only (send_task(..., kwargs={{...}})), "
            f"got {len(args)} positional",
        )
    allowed = task_fields()
    unknown = sorted(str(name) for name in kwargs if name not in allowed)
    if unknown:
        raise CeleryTPError(
            ErrorKind.BAD_REQUEST, f"field '{clipped(unknown[0])}': not a celerytp.generate argument; it takes {sorted(allowed)}"
        )
    if kwargs.get("n", 1) != 1:  # one stream, one completion, whatever the HTTP API allows
        raise CeleryTPError(ErrorKind.BAD_REQUEST, "field 'n': celerytp.generate makes one completion (send several tasks)")
    return parse(TaskRequest, kwargs)


def run_request(
    service: Service, body: TaskRequest, request_id: str | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """One `celerytp.generate` request, as the task returns it; `progress` gets `{"model", "text",
    "tokens"}` so far at most every PROGRESS_S while it generates."""
    service.limits.check(body)
    model_id = service.resolve(body.model)
    options = {**body.options(), **({"request_id": request_id} if request_id else {})}
    mode = tools.apply(service, model_id, body, options)  # response_format, tools: refused here, before queueing
    text, shown = "", time.monotonic()
    try:
        with service.stream(model_id, options) as stream:
            for delta in stream:
                text += delta
                if progress is not None and time.monotonic() - shown >= PROGRESS_S:
                    shown = time.monotonic()
                    progress({"model": model_id, "text": text, "tokens": stream.tokens})
    except CeleryTPError as exc:
        service.count_error(model_id, exc)
        raise as_sent(exc, tools.grammar_field(mode, options)) from None
    result = stream.result
    assert result is not None  # the stream ended with its result (errors raise)
    service.count(model_id, result)
    reply = {
        "model": model_id, "text": result.text, "token_ids": result.token_ids,
        "finish_reason": result.finish_reason if result.finish_reason in ("length", "cancelled") else "stop",
        "usage": {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                  "total_tokens": result.prompt_tokens + result.completion_tokens},
    }
    calls = mode.calls(result.text) if mode is not None else None
    if calls:  # `text` stays the model's own text, as PROGRESS showed it
        reply.update(tool_calls=calls, finish_reason=tools.finish(reply["finish_reason"], True))
    return reply


def register_generate(app: Celery, service: Callable[[], Service]) -> None:
    """Add the `celerytp.generate` task to `app`; `service` gives the Service to run it on."""

    # Acknowledged when done: a front door that dies mid-request has its task redelivered, and the
    # redelivered task follows the request its task id names instead of running it again.
    # typing=False: a producer that has this task registered sends a bad call anyway, and it is
    # refused here, as for a producer that knows only the name.
    @app.task(name=GENERATE_TASK, bind=True, acks_late=True, reject_on_worker_lost=True, typing=False)
    def generate(task: Task, *args: Any, **kwargs: Any) -> dict[str, Any]:
        done, why = threading.Event(), []
        try:
            body = check_call(args, kwargs)
            svc, request_id = service(), _request_id(task.request.id)
            watch = threading.Thread(
                target=cancel_when_abandoned, args=(svc, request_id, task.request.id, task.request.expires, done, why),
                daemon=True,
            )
            watch.start()

            def progress(meta: dict[str, Any]) -> None:
                if task.request.id and not why:  # not once revoked: REVOKED comes next
                    try:
                        task.update_state(state=PROGRESS, meta=meta)
                    except redis.RedisError as exc:  # the request's own wait reports Redis failing
                        log.warning("could not record the progress of task %s: %s", task.request.id, exc)

            reply = run_request(svc, body, request_id, progress)
        except CeleryTPError as exc:
            raise RuntimeError(f"{error_code(exc.kind)}: {shown(exc.message)}") from None
        finally:
            done.set()
        if why and reply["finish_reason"] == "cancelled":
            # Celery's own ending for a revoked task, as its worker ends one revoked before it starts:
            # state REVOKED (`.get()` raises TaskRevokedError), the task-revoked event (monitors such
            # as Flower follow events, and leave the task STARTED without it) and the task_revoked
            # signal. Ignore keeps the worker from writing SUCCESS over it, and acknowledges the message.
            expired = why[0] == "expired"
            task.backend.mark_as_revoked(task.request.id, why[0], request=task.request)
            worker_request = _worker_request(task.request.id)
            if worker_request is not None:  # None where the task runs outside a worker (eagerly)
                worker_request.send_event("task-revoked", terminated=False, signum=None, expired=expired)
            signals.task_revoked.send(sender=task, request=task.request, terminated=False, signum=None, expired=expired)
            raise Ignore()
        return reply


def cancel_when_abandoned(
    service: Service, request_id: str, task_id: str, expires: Any, done: threading.Event, why: list[str]
) -> None:
    """Cancel the task's request when the task is revoked (with or without terminate: the threads
    pool cannot kill a running task, but either way the id joins the worker's revoked set) or
    expires while it runs; its row frees within a few steps. `why` gets "revoked" or "expired"."""
    deadline = _as_datetime(expires)
    while not done.wait(ABANDON_POLL_S):
        revoked = task_id in worker_state.revoked
        if revoked or (deadline is not None and datetime.now(UTC) > deadline):
            why.append("revoked" if revoked else "expired")
            try:
                service.leader.cancel(request_id)
            except redis.RedisError as exc:  # the request's own wait reports Redis failing
                log.warning("could not cancel the request of %s task %s: %s", why[0], task_id, exc)
            return


def _worker_request(task_id: str | None) -> Any:
    """The worker's own Request of a task running in this process, or None. Its `send_event` sends
    on the worker's event dispatcher, only while task events are on (Flower turns them on)."""
    for _ in range(3):
        try:  # the threads pool adds and removes other tasks' requests meanwhile
            return next((r for r in list(worker_state.active_requests) if r.id == task_id), None)
        except RuntimeError:  # the set changed size while it was read: read it again
            continue
    return None


def _request_id(task_id: str | None) -> str:
    """The request id of a task: its task id when that is one (so a redelivery finds its request)."""
    if task_id and len(task_id) <= 64 and all(c.isalnum() or c in "-_" for c in task_id):
        return task_id
    return uuid.uuid4().hex


def _as_datetime(value: Any) -> datetime | None:
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


def make_frontend_app(broker_url: str, group: str, world_size: int, limits: RequestLimits | None = None,
                      images: ImageLimits | None = None) -> Celery:
    """A Celery app that knows the rank queues and the requests queue, with `celerytp.generate`
    registered (its Leader is made on first use, in the worker process) under `limits` and `images`
    (None: from $CELERYTP_ALLOWED_MEDIA_DOMAINS and $CELERYTP_MEDIA_FETCH_TIMEOUT, read here: a bad
    value stops the worker as it starts, not its first request)."""
    images = images if images is not None else ImageLimits.from_env(os.environ)
    app = make_app(broker_url, group, world_size, main="celerytp")
    app.conf.task_queues = [*app.conf.task_queues, Queue(requests_queue(group), routing_key=requests_queue(group))]
    app.conf.task_routes = {GENERATE_TASK: {"queue": requests_queue(group)}}
    # An unacknowledged task of a front door that died comes back after this; one still running
    # that comes back meanwhile only follows its request a second time.
    app.conf.broker_transport_options = {**app.conf.broker_transport_options, "visibility_timeout": FRONT_DOOR_VISIBILITY_S}
    lock, made = threading.Lock(), []

    def service() -> Service:
        with lock:
            if not made:
                made.append(Service(Leader(broker_url, group, world_size), limits=limits, images=images))
            return made[0]

    register_generate(app, service)
    return app


def frontend_argv(group: str, concurrency: int = 16) -> list[str]:
    """`worker_main` arguments of a front-door worker: the requests queue, threads (requests block)."""
    return [
        "worker", "--queues", requests_queue(group), "--hostname", f"celerytp.{group}.frontend@%h",
        "--pool", "threads", "--concurrency", str(concurrency), "--without-gossip", "--without-mingle",
        "--loglevel", "WARNING",
    ]
