"""A torch.distributed Store kept in Redis, so rendezvous needs no free port and no leader."""

from __future__ import annotations

import time
from datetime import timedelta

import redis
import torch.distributed as dist

# Rendezvous keys outlive any sane rendezvous, then vanish on their own.
KEY_TTL_S = 24 * 3600


class RedisStore(dist.Store):
    """c10d Store on Redis: every key lives under `prefix` (one prefix per comm_id epoch).

    Args:
        client: a redis client (bytes responses).
        prefix: key prefix, e.g. ``celerytp:default:rdzv:<comm_id>:``.
        timeout: how long `get` and `wait` block for a missing key.
    """

    def __init__(self, client: redis.Redis, prefix: str, timeout: timedelta = timedelta(seconds=60)):
        super().__init__()
        self._redis = client
        self._prefix = prefix
        self._timeout = timeout

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set(self, key: str, value: bytes | str) -> None:
        self._redis.set(self._key(key), value, ex=KEY_TTL_S)

    def get(self, key: str) -> bytes:
        self.wait([key])
        value = self._redis.get(self._key(key))
        if value is None:  # deleted between wait and get
            raise dist.DistStoreError(f"key {key!r} vanished from the rendezvous store")
        return value

    def add(self, key: str, amount: int) -> int:
        with self._redis.pipeline() as pipe:
            pipe.incrby(self._key(key), amount)
            pipe.expire(self._key(key), KEY_TTL_S)
            value, _ = pipe.execute()
        return int(value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        script = (
            "local v = redis.call('GET', KEYS[1]) "
            "if (v == false and ARGV[1] == '') or v == ARGV[1] then "
            "redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) return ARGV[2] end "
            "if v == false then return ARGV[1] end return v"
        )
        return self._redis.eval(script, 1, self._key(key), expected, desired, KEY_TTL_S)

    def check(self, keys: list[str]) -> bool:
        return self._redis.exists(*[self._key(k) for k in keys]) == len(keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        pause = 0.001
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"rendezvous timed out after {timeout.total_seconds():.0f}s waiting for {keys}")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def delete_key(self, key: str) -> bool:
        return bool(self._redis.delete(self._key(key)))

    def num_keys(self) -> int:
        return sum(1 for _ in self._redis.scan_iter(match=self._prefix + "*"))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout
