"""The leader's end of the ranks' control path (worker/control_thread.py): ping every rank beside
its op queue, so a ping never waits behind a load or a serving loop, here or on the ranks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import redis

from celerytp.core.errors import CeleryTPError, ErrorKind, RankFailure
from celerytp.core.keys import control_queue_key, control_reply_key
from celerytp.core.liveness import RankWatch
from celerytp.core.redis_client import block_timeout, unavailable

POLL_S = 0.25  # one blocking pop; the ranks' liveness is checked between them
QUEUE_TTL_S = 60  # requests to a rank whose worker is gone do not pile up


def control_call(client: redis.Redis, group: str, world_size: int, op: str, timeout: float, watch: RankWatch) -> list[dict[str, Any]]:
    """Send `op` to every rank's control path; the JSON replies in rank order.

    Raises rank_lost naming the ranks whose worker died or was replaced while it waited (within
    a heartbeat), or timeout naming the ranks that did not answer in `timeout` seconds.
    """
    call_id = uuid.uuid4().hex
    reply_key = control_reply_key(group, call_id)
    request = json.dumps({"id": call_id, "op": op, "deadline": time.time() + timeout})
    pipe = client.pipeline(transaction=False)
    for rank in range(world_size):
        pipe.rpush(control_queue_key(group, rank), request)
        pipe.expire(control_queue_key(group, rank), QUEUE_TTL_S)
    pipe.execute()
    replies: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(replies) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(world_size) if r not in replies]
                raise CeleryTPError.from_failures(op, [
                    RankFailure(r, ErrorKind.TIMEOUT, f"no {op} reply within {timeout:.1f}s (worker alive: busy or stuck)")
                    for r in missing
                ])
            popped = client.blpop([reply_key], timeout=block_timeout(min(POLL_S, left)))
            if popped is not None:
                reply = json.loads(popped[1])
                replies[int(reply["rank"])] = reply
                continue
            lost = {r: why for r, why in watch.lost().items() if r not in replies}
            if lost:
                raise CeleryTPError.from_failures(op, [RankFailure(r, ErrorKind.RANK_LOST, why) for r, why in sorted(lost.items())])
    except redis.AuthenticationError as exc:  # a wrong password is no timeout
        raise unavailable(exc) from None
    except redis.RedisError as exc:
        raise CeleryTPError(ErrorKind.TIMEOUT, f"Redis failed during {op}: {exc}", op=op) from None
    finally:
        try:
            client.delete(reply_key)
        except redis.RedisError:
            pass
    return [replies[r] for r in range(world_size)]
