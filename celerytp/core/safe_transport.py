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
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
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
