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
from celerytp.core.liveness import HeartbeatTiming
from celerytp.core.redis_scripts import RELEASE_IF_HOLDER
from celerytp.worker import exits

log = logging.getLogger(__name__)

# Refresh our own claim, or take it back if it lapsed (e.g. the process was suspended);
# never take over a claim that another worker holds now.
_REFRESH = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if holder == false then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
return 0
"""
# ARGV: the value held, the new one, TTL ms. 1: replaced; 0: the claim is someone else's or gone.
_REPLACE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return 1 end
return 0
"""


class RankTaken(Exception):
    """Another live worker owns this group and rank."""


class RankLease:
    """Claims a rank for this process and keeps the claim alive from a daemon thread.

    Losing the claim to another live worker ends this process (exits.LEASE_LOST): two workers
    consuming one rank queue would split its ops between two process groups.
    """

    def __init__(self, client: redis.Redis, group: str, rank: int, device: str):
        self._redis = client
        self._key = owner_key(group, rank)
        self.value = json.dumps(
            {"host": socket.gethostname(), "pid": os.getpid(), "device": device, "since": time.time()}
        )
        self.timing = HeartbeatTiming.from_env()
        self._stop = threading.Event()
        self._value_lock = threading.Lock()  # a beat never compares against a value being replaced

    def acquire(self) -> None:
        if not self._redis.set(self._key, self.value, nx=True, px=int(self.timing.ttl_s * 1000)):
            holder = self._redis.get(self._key)
            raise RankTaken(f"{self._key} is held by a live worker: {holder.decode() if holder else '?'}")
        threading.Thread(target=self._beat, name="celerytp-heartbeat", daemon=True).start()

    def _beat(self) -> None:
        ttl_ms = int(self.timing.ttl_s * 1000)
        while not self._stop.wait(self.timing.refresh_s):
            try:
                with self._value_lock:
                    held = self._redis.eval(_REFRESH, 1, self._key, self.value, ttl_ms)
            except redis.RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
                continue
            if not held and not self._stop.is_set():
                exits.exit_now(exits.LEASE_LOST, f"{self._key} is held by another live worker")

    def show_device(self, device: str) -> None:
        """Put the device the rank resolved (`auto` -> `cuda:0`) in the claim its heartbeat shows."""
        value = json.dumps({**json.loads(self.value), "device": device})
        with self._value_lock:
            try:
                if self._redis.eval(_REPLACE, 1, self._key, self.value, value, int(self.timing.ttl_s * 1000)):
                    self.value = value
            except redis.RedisError as exc:  # the next beat reports a lasting failure
                log.warning("could not update %s: %s", self._key, exc)

    def release(self) -> None:
        self._stop.set()
        try:
            self._redis.eval(RELEASE_IF_HOLDER, 1, self._key, self.value)
        except redis.RedisError as exc:
            log.warning("could not release %s: %s", self._key, exc)
