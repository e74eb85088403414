"""Rank liveness from the heartbeat keys: the timing every side shares, and a watcher.

Each rank worker refreshes its owner key (keys.owner_key: host, pid, device, since) every
`refresh_s` with a TTL of `ttl_s`. Leaders and peer ranks watch those keys while they wait:
a key that changed value means the worker was replaced; a key missing for longer than
`missing_grace_s` means the worker is gone (a shorter gap is a Redis restart, after which every
worker writes its key again at its next refresh).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import redis

from celerytp.core.keys import owner_key


@dataclass(frozen=True)
class HeartbeatTiming:
    ttl_s: float
    refresh_s: float

    @property
    def missing_grace_s(self) -> float:
        return 1.5 * self.refresh_s

    @classmethod
    def from_env(cls) -> HeartbeatTiming:
        """CELERYTP_HEARTBEAT_TTL_S (default 4) and CELERYTP_HEARTBEAT_S (default 1)."""
        ttl = float(os.environ.get("CELERYTP_HEARTBEAT_TTL_S", "4"))
        refresh = float(os.environ.get("CELERYTP_HEARTBEAT_S", "1"))
        if not 0 < refresh < ttl:
            raise ValueError(f"heartbeat: 0 < CELERYTP_HEARTBEAT_S ({refresh}) < CELERYTP_HEARTBEAT_TTL_S ({ttl}) is required")
        return cls(ttl, refresh)


def read_owners(client: redis.Redis, group: str, world_size: int) -> list[bytes | None]:
    """Each rank's heartbeat value (its worker's identity), None where no worker holds it."""
    return client.mget([owner_key(group, r) for r in range(world_size)])


def describe_owner(value: bytes | None) -> str:
    if value is None:
        return "no worker"
    try:
        owner = json.loads(value)
        return f"pid {owner['pid']} on {owner['host']}"
    except (ValueError, KeyError, TypeError):
        return "an unknown worker"


class RankWatch:
    """Which ranks' workers are gone or were replaced since `expected` (their heartbeat values).

    Args:
        client: the group's Redis.
        group: the group name.
        expected: each rank's heartbeat value when the wait began (or when the group formed).
        timing: heartbeat timing (missing_grace_s).
    """

    def __init__(self, client: redis.Redis, group: str, expected: list[bytes | None], timing: HeartbeatTiming):
        self._redis = client
        self._group = group
        self.expected = list(expected)
        self._grace = timing.missing_grace_s
        self._missing_since: dict[int, float] = {}

    def lost(self, ranks: list[int] | None = None) -> dict[int, str]:
        """rank -> why it is lost, for the watched ranks (all by default); {} when all live.

        A Redis error is not a lost rank (the caller's own wait fails or retries on it).
        """
        try:
            now_values = read_owners(self._redis, self._group, len(self.expected))
        except redis.RedisError:
            return {}
        now = time.monotonic()
        lost = {}
        for rank in range(len(self.expected)) if ranks is None else ranks:
            value, was = now_values[rank], self.expected[rank]
            if value == was and value is not None:
                self._missing_since.pop(rank, None)
            elif was is None:
                lost[rank] = "no live worker holds this rank"
            elif value is not None:
                lost[rank] = f"its worker ({describe_owner(was)}) was replaced by {describe_owner(value)}"
            elif now - self._missing_since.setdefault(rank, now) >= self._grace:
                lost[rank] = f"its worker ({describe_owner(was)}) stopped heartbeating"
        return lost
