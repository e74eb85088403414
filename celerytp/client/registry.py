"""The registry of served models in Redis: which groups hold each model (its replicas) and each
group's record of it (core/registry.py). What the ranks hold is the truth; this is its index,
and `discover_groups` plus the ranks' pongs rebuild it when Redis lost it."""

from __future__ import annotations

import json
from typing import Any

import redis

from celerytp.core.keys import models_key, owner_pattern, replicas_key, served_models_key


def keep_replica(
    client: redis.Redis, group: str, world_size: int, model_id: str, record: dict[str, Any], holders: list[bytes | None]
) -> None:
    """Record `model_id` as held by `group`'s workers `holders` (a replaced one will have lost it)."""
    record = {**record, "holders": [h.decode() if h else None for h in holders]}
    pipe = client.pipeline()
    pipe.hset(models_key(group), model_id, json.dumps(record))
    pipe.hset(replicas_key(model_id), group, json.dumps({"world_size": world_size}))
    pipe.sadd(served_models_key(), model_id)
    pipe.execute()


def drop_replica(client: redis.Redis, group: str, model_id: str) -> None:
    """`group` no longer holds `model_id`."""
    pipe = client.pipeline()
    pipe.hdel(models_key(group), model_id)
    pipe.hdel(replicas_key(model_id), group)
    pipe.execute()
    if not client.hlen(replicas_key(model_id)):
        client.srem(served_models_key(), model_id)


def replicas(client: redis.Redis, model_id: str) -> dict[str, int]:
    """The groups that serve `model_id`: group -> world size."""
    return {g.decode(): json.loads(v)["world_size"] for g, v in client.hgetall(replicas_key(model_id)).items()}


def record_of(client: redis.Redis, model_id: str, prefer: str) -> dict[str, Any] | None:
    """The model's record, from group `prefer` when it is a replica, else from any replica."""
    groups = sorted(replicas(client, model_id), key=lambda g: g != prefer)
    for group in groups:
        raw = client.hget(models_key(group), model_id)
        if raw is not None:
            return json.loads(raw)
    return None


def served(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Every served model: model_id -> its record, with `replicas` (group -> world size)."""
    models = {}
    for model_id in sorted(m.decode() for m in client.smembers(served_models_key())):
        found = replicas(client, model_id)
        record = record_of(client, model_id, prefer="")
        if found and record is not None:
            models[model_id] = {**record, "replicas": found}
    return models


def discover_groups(client: redis.Redis) -> dict[str, int]:
    """The groups whose rank workers heartbeat now: group -> its world size (highest live rank + 1)."""
    found: dict[str, int] = {}
    for key in client.scan_iter(match=owner_pattern(), count=1000):
        parts = key.decode().split(":")  # celerytp:<group>:rank:<r>:owner
        if len(parts) == 5 and parts[3].isdigit():
            found[parts[1]] = max(found.get(parts[1], 0), int(parts[3]) + 1)
    return found
