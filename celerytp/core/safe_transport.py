"""kombu's Redis transport with a gate in front of delivery: a malformed message is dead-lettered.

kombu decodes each queue entry as a JSON envelope and hands it to Celery, which trusts its
shape. Garbage bytes, non-JSON text, an envelope that is not an object, has a body that is not
base64 text, a content type other than JSON, no task `id` header, or a body that is not a
Celery task message (args list, kwargs object, embed object) end the worker or loop it through
endless redeliveries. Here every entry is checked before it is delivered; one that fails is
logged, copied to the group's dead-letter list (keys: `<queue>.deadletter`, newest first,
bounded) and dropped, so it is never redelivered. Task queues (a rank's, the front door's) get
every check; other queues (remote-control replies) only need JSON objects. Set with the Celery
`broker_transport` option.

A message dropped from the front door's queue (`celerytp.<group>.requests`) whose headers name a
task id fails that task: a FAILURE result (`RuntimeError("bad_request: ...")`, as the front door
fails a bad request) is written where Celery's Redis result backend keeps it, on this broker's
Redis, so its producer's `result.get()` raises at once instead of waiting PENDING to its timeout.
A result already stored for that id is never overwritten.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import re
from datetime import UTC, datetime
from typing import Any

from kombu.transport import redis as kombu_redis
from kombu.utils.encoding import bytes_to_str

log = logging.getLogger(__name__)

# `Channel._brpop_read` below is kombu 5.7's with the gate added: kombu has no public hook in front
# of delivery. pyproject.toml pins kombu below 5.8, and tests/test_boundaries.py fails when
# kombu's own method changes from the one copied (by this hash of its source), so an upgrade
# re-reads the copy first.
KOMBU_BRPOP_READ_SHA256 = "c42518699709f2df90f55a048fe6346612ae5527e5c4a6819f2c0920dc62088f"

DEAD_LETTER_MAX = 1000
RESULT_KEY_PREFIX = "celery-task-meta-"  # Celery's Redis result backend: the key (and channel) of a task's result
RESULT_TTL_S = 3600  # result_expires (core/app.py)
_TASK_ID = re.compile(r"[A-Za-z0-9._:-]{1,255}")
MAX_MESSAGE_BYTES = 8 << 20  # the largest op (a step of 131,072 tokens) is about 1 MiB of JSON
JSON = "application/json"
SIGNED = "application/data"  # Celery's `auth` serializer: a signed JSON body, checked by Celery itself
ALLOWED_CONTENT_TYPES = (JSON, SIGNED)


class MalformedMessage(ValueError):
    pass


def dead_letter_key(queue: str) -> str:
    return f"{queue}.deadletter"


def is_task_queue(queue: str) -> bool:
    """A queue of celerytp task messages: a rank's, or the `celerytp.generate` front door's."""
    return queue.startswith("celerytp.") and (".rank." in queue or queue.endswith(".requests"))


def is_requests_queue(queue: str) -> bool:
    """The `celerytp.generate` front door's queue, whose producers wait on a task result."""
    return queue.startswith("celerytp.") and queue.endswith(".requests")


def refused_task_id(raw: bytes | str) -> str | None:
    """The task id a refused message names in its headers, when it names a plausible one."""
    try:
        envelope = json.loads(bytes_to_str(raw)) if len(raw) <= MAX_MESSAGE_BYTES else None
    except (ValueError, UnicodeDecodeError):
        return None
    headers = envelope.get("headers") if isinstance(envelope, dict) else None
    task_id = headers.get("id") if isinstance(headers, dict) else None
    return task_id if isinstance(task_id, str) and _TASK_ID.fullmatch(task_id) else None


def failure_result(task_id: str, message: str) -> str:
    """A FAILURE as Celery's JSON result backend stores it; the producer rebuilds a RuntimeError."""
    return json.dumps({
        "status": "FAILURE", "task_id": task_id, "traceback": None, "children": [],
        "date_done": datetime.now(UTC).isoformat(),
        "result": {"exc_type": "RuntimeError", "exc_module": "builtins", "exc_message": [message]},
    })


def check_json_object(raw: bytes | str) -> dict[str, Any]:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise MalformedMessage(f"{len(raw)} bytes: more than the {MAX_MESSAGE_BYTES} a message may have")
    try:
        envelope = json.loads(bytes_to_str(raw))
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedMessage(f"not JSON: {exc}") from None
    if not isinstance(envelope, dict):
        raise MalformedMessage(f"envelope is a JSON {type(envelope).__name__}, not an object")
    return envelope


def check_envelope(raw: bytes | str) -> dict[str, Any]:
    """The decoded envelope of a well-formed Celery JSON task message; MalformedMessage otherwise."""
    envelope = check_json_object(raw)
    if envelope.get("content-type") not in ALLOWED_CONTENT_TYPES:
        raise MalformedMessage(f"content type {envelope.get('content-type')!r} refused: JSON only, never pickle")
    headers, properties = envelope.get("headers"), envelope.get("properties")
    if not isinstance(headers, dict) or not isinstance(headers.get("id"), str) or not isinstance(headers.get("task"), str):
        raise MalformedMessage("headers must be an object with string 'id' and 'task'")
    if not isinstance(properties, dict) or "delivery_tag" not in properties:
        raise MalformedMessage("properties must be an object with a delivery_tag")
    body = envelope.get("body")
    if not isinstance(body, str):
        raise MalformedMessage(f"body is a JSON {type(body).__name__}, not text")
    if envelope["content-type"] == SIGNED:
        return envelope  # the signature check (celery.security) decides; the app accepts only this then
    if properties.get("body_encoding") == "base64":
        try:
            body = base64.b64decode(body, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise MalformedMessage(f"body is not base64 text: {exc}") from None
    try:
        message = json.loads(body)
    except ValueError as exc:
        raise MalformedMessage(f"body is not JSON: {exc}") from None
    if not (
        isinstance(message, list) and len(message) == 3 and isinstance(message[0], list)
        and isinstance(message[1], dict) and isinstance(message[2], dict)
    ):
        raise MalformedMessage("body is not a task message [args, kwargs, embed]")
    return envelope


class Channel(kombu_redis.Channel):
    def _dead_letter(self, queue: str, raw: bytes, why: str) -> None:
        log.error("dropping a malformed message from %s (%s): %.200r", queue, why, raw)
        try:
            with self.conn_or_acquire() as client:
                key = dead_letter_key(queue)
                client.pipeline().lpush(key, raw[:65536]).ltrim(key, 0, DEAD_LETTER_MAX - 1).execute()
        except Exception as exc:  # the broker went away: the message is logged above
            log.warning("could not dead-letter the message: %s", exc)
        task_id = refused_task_id(raw) if is_requests_queue(queue) else None
        if task_id is not None:
            self._fail_task(task_id, f"bad_request: the message was refused and dead-lettered: {why[:300]}")

    def _fail_task(self, task_id: str, message: str) -> None:
        """Fail the task a refused message named, so its producer stops waiting."""
        key, value = RESULT_KEY_PREFIX + task_id, failure_result(task_id, message)
        try:
            with self.conn_or_acquire() as client:
                if client.set(key, value, ex=RESULT_TTL_S, nx=True):  # never over a real result
                    client.publish(key, value)
        except Exception as exc:  # the broker went away: the producer waits to its own timeout
            log.warning("could not fail task %s of a refused message: %s", task_id, exc)

    def _checked(self, queue: str, raw: bytes) -> dict[str, Any] | None:
        try:
            if not is_task_queue(queue):  # remote-control replies and the like: any JSON object
                return check_json_object(raw)
            return check_envelope(raw)
        except MalformedMessage as exc:
            self._dead_letter(queue, raw, str(exc))
            return None

    def _brpop_read(self, **options):
        try:
            try:
                dest__item = self.client.parse_response(self.client.connection, "BRPOP", **options)
            except self.connection_errors:
                self.client.connection.disconnect()  # the next poll reconnects
                raise
            if not dest__item:
                raise kombu_redis.Empty()
            dest, item = dest__item
            dest = bytes_to_str(dest).rsplit(self.sep, 1)[0]
            self._queue_cycle.rotate(dest)
            envelope = self._checked(dest, item)
            if envelope is not None:
                self.connection._deliver(envelope, dest)
            return True
        finally:
            self._in_poll = None
            self._flush_brpop_reauth()

    def _get(self, queue):
        with self.conn_or_acquire() as client:
            for pri in self.priority_steps:
                item = client.rpop(self._q_for_pri(queue, pri))
                if item:
                    self._maybe_update_queues_expire(client, queue)
                    envelope = self._checked(queue, item)
                    if envelope is None:
                        raise kombu_redis.Empty()
                    return envelope
            self._maybe_update_queues_expire(client, queue)
            raise kombu_redis.Empty()


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT = f"{__name__}:Transport"  # the `broker_transport` setting (core/app.py)


def as_redis_url(uri: str) -> str:
    """kombu names a broker URI after its transport: `celerytp.core.safe_transport:Transport://...`
    for ours. The plain `redis://` URL of the same Redis, for tools that read its queues themselves."""
    prefix = f"{TRANSPORT}://"
    return "redis://" + uri[len(prefix):] if uri.startswith(prefix) else uri


def teach_flower() -> None:
    """Flower's Broker page and /api/queues/length pick their queue reader by the broker URI's scheme
    and know `redis://`, not ours (they answer 404). Give them the same Redis as `redis://`: they only
    read queue lengths (LLEN); Flower's own consumers (events, replies) still use this transport.
    Called where `celery -A celerytp.app` runs with Flower loaded (celerytp/app.py)."""
    from flower.utils import broker

    if getattr(broker.Broker, "_celerytp_scheme", False):
        return
    flower_new = broker.Broker.__new__

    def __new__(cls, broker_url, *args, **kwargs):
        return flower_new(cls, as_redis_url(broker_url), *args, **kwargs)

    broker.Broker.__new__ = staticmethod(__new__)
    broker.Broker._celerytp_scheme = True
