"""The control path of a rank: a thread beside the op thread that answers ping and status at once.

A rank worker runs one op at a time (worker/main.py), so a ping sent through its op queue waits
for a whole load or serving loop, and a ping taken by a rank that then dies is lost for the op's
timeout. Control requests go instead to the rank's own Redis list (core/keys.control_queue_key),
which this thread pops; replies go to the call's reply list. What it answers only reads the rank
state, so it never waits for the op thread.

Wire format (JSON only): a request is {"id": call id, "op": "ping", "deadline": unix time}; a
reply is the op's reply (protocol Pong) or an error reply, JSON. A request past its deadline is
dropped unanswered (its caller gave up); a malformed one is logged and dropped.
"""

from __future__ import annotations

import json
import logging
import threading
import time

import redis
from pydantic import BaseModel, Field, ValidationError

from celerytp.core.keys import control_queue_key, control_reply_key
from celerytp.worker import group_ops
from celerytp.worker.state import RankState

log = logging.getLogger(__name__)

POP_BLOCK_S = 1.0
REPLY_TTL_S = 60  # a reply nobody read (its caller gave up) goes with this
MAX_REQUEST_BYTES = 4096


class ControlRequest(BaseModel):
    id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    op: str = Field(pattern=r"^ping$")
    deadline: float


class ControlThread:
    def __init__(self, state: RankState):
        self._state = state
        self._queue = control_queue_key(state.config.group, state.rank)

    def start(self) -> None:
        threading.Thread(target=self._run, name="celerytp-control", daemon=True).start()

    def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                popped = self._state.redis.blpop([self._queue], timeout=POP_BLOCK_S)
                backoff = 0.1
                if popped is not None:
                    self._answer(popped[1])
            except redis.RedisError as exc:  # Redis restarting: try again, never die
                log.warning("control path: %s; retrying in %.1f s", exc, backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except Exception:  # whatever a message does, the control path stays up
                log.exception("control path: unexpected failure")

    def _answer(self, raw: bytes) -> None:
        try:
            if len(raw) > MAX_REQUEST_BYTES:
                raise ValueError(f"{len(raw)} bytes")
            request = ControlRequest.model_validate(json.loads(raw))
        except (ValueError, ValidationError) as exc:
            log.warning("control path: dropping a malformed request %.200r: %s", raw, exc)
            return
        if time.time() > request.deadline:
            return
        reply = group_ops.ping(self._state, None).model_dump(mode="json")
        key = control_reply_key(self._state.config.group, request.id)
        pipe = self._state.redis.pipeline()
        pipe.rpush(key, json.dumps(reply))
        pipe.expire(key, REPLY_TTL_S)
        pipe.execute()
