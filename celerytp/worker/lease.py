"""Rank ownership: one live worker per (group, rank), proven by a heartbeat key with a TTL."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path

import psutil
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


def _pid_space() -> dict[str, str | int]:
    """This kernel boot and pid namespace: where a claim's pid can be looked up ({} off Linux)."""
    try:
        return {"boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
                "pid_ns": os.stat("/proc/self/ns/pid").st_ino}
    except OSError:
        return {}


def claim_is_stale(holder: bytes) -> bool:
    """Whether a claim, still within its TTL, was made by a process that is gone: one of this host,
    kernel boot and pid namespace, whose pid is free, a zombie, or another process's (started after
    the claim). Its supervisor restarted the rank at once after a crash: waiting out the TTL would
    only delay the heal. Anything else (another host, a live or stopped process, an unreadable
    claim) is a claim the new worker must wait out."""
    try:
        claim = json.loads(holder)
        pid, since = int(claim["pid"]), float(claim["since"])
    except (ValueError, TypeError, KeyError):
        return False
    here = _pid_space()
    if not here or claim.get("host") != socket.gethostname() or any(claim.get(k) != v for k, v in here.items()):
        return False
    try:
        process = psutil.Process(pid)
        # a reused pid's process started after the claim (which its holder made once running)
        return process.status() == psutil.STATUS_ZOMBIE or process.create_time() > since + 0.5
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


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
            {"host": socket.gethostname(), "pid": os.getpid(), "device": device, "since": time.time(), **_pid_space()}
        )
        self.timing = HeartbeatTiming.from_env()
        self._stop = threading.Event()
        self._value_lock = threading.Lock()  # a beat never compares against a value being replaced

    def acquire(self) -> None:
        ttl_ms = int(self.timing.ttl_s * 1000)
        if not self._redis.set(self._key, self.value, nx=True, px=ttl_ms):
            holder = self._redis.get(self._key)
            if not (holder and claim_is_stale(holder) and self._redis.eval(_REPLACE, 1, self._key, holder, self.value, ttl_ms)):
                raise RankTaken(f"{self._key} is held by a live worker: {holder.decode() if holder else '?'}")
            log.warning("took over %s from a worker that is gone (%s), without waiting out its TTL", self._key, holder.decode())
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
