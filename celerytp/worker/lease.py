"""Rank ownership: one live worker per (group, rank), proven by a heartbeat key with a TTL."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import redis

from celerytp.core.keys import owner_key
from celerytp.core.redis_scripts import RELEASE_IF_HOLDER

log = logging.getLogger(__name__)

TTL_S = 6
REFRESH_S = 2

# Refresh our own claim, or take it back if it lapsed (e.g. the process was suspended);
# never take over a claim that another worker holds now.
_REFRESH = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
if holder == false then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) return 1 end
return 0
"""


class RankTaken(Exception):
    """Another live worker owns this group and rank."""


class RankLease:
    """Claims a rank for this process and keeps the claim alive from a daemon thread."""

    def __init__(self, client: redis.Redis, group: str, rank: int, device: str):
        self._redis = client
        self._key = owner_key(group, rank)
        self._value = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "device": device, "since": time.time()}
        )
        self._stop = threading.Event()

    def acquire(self) -> None:
        if not self._redis.set(self._key, self._value, nx=True, ex=TTL_S):
            holder = self._redis.get(self._key)
            raise RankTaken(f"{self._key} is held by a live worker: {holder.decode() if holder else '?'}")
        threading.Thread(target=self._beat, name="celerytp-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                if not self._redis.eval(_REFRESH, 1, self._key, self._value, TTL_S):
                    log.error("%s is held by another worker; this worker no longer owns its rank", self._key)
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)

    def release(self) -> None:
        self._stop.set()
        try:
            self._redis.eval(RELEASE_IF_HOLDER, 1, self._key, self._value)
        except redis.RedisError as exc:
            log.warning("could not release %s: %s", self._key, exc)
