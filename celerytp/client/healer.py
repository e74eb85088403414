"""Healing: re-form a group whose worker was replaced or whose collectives broke, and load its
models again, with no person involved. One leader heals at a time, under a renewed Redis lock."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any, Protocol

import redis
from celery import Celery

from celerytp.client.registry import drop_replica, keep_replica
from celerytp.client.waiting import no_worker
from celerytp.core.app import queue_name
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.keys import (
    broken_key,
    comm_key,
    heal_lock_key,
    loop_failures_key,
    loop_key,
    members_key,
    models_key,
    owner_key,
)
from celerytp.core.liveness import HeartbeatTiming, read_owners
from celerytp.core.redis_scripts import RELEASE_IF_HOLDER, RENEW_IF_HOLDER

log = logging.getLogger(__name__)

HEAL_LOCK_TTL_S = 10  # renewed while the heal runs; a leader that dies while healing frees it after this
HEAL_WAIT_S = 10.0  # one wait of a heal's ping/init/unload: a message eaten by a dying rank costs this, then a retry
# Failures after which a heal (or an op that meets them) tries again once the group re-formed.
HEAL_AGAIN = {ErrorKind.RANK_LOST, ErrorKind.TIMEOUT, ErrorKind.INIT_FAILED, ErrorKind.GROUP_BROKEN, ErrorKind.NOT_INITIALISED}
# Failures of a model's own files or settings: the only ones after which a heal drops a model's
# record. Any other failure of its reload is the group's, and the heal goes on.
MODEL_FAULTS = {ErrorKind.LOAD_FAILED, ErrorKind.UNSUPPORTED_ARCH, ErrorKind.BAD_REQUEST}


class _LockRenewal:
    """Keeps a Redis lock held while its holder works: extends its TTL every third of it, so the
    lock outlives a long heal (model reloads) yet frees within one TTL of its holder's death."""

    def __init__(self, client: redis.Redis, key: str, token: str, ttl_s: float):
        self._stopped = threading.Event()
        self._renew = client.register_script(RENEW_IF_HOLDER)

        def run() -> None:
            while not self._stopped.wait(ttl_s / 3):
                try:
                    if not self._renew(keys=[key], args=[token, int(ttl_s * 1000)]):
                        return  # lost it (expired while this process stalled): nothing to renew
                except redis.RedisError as exc:
                    log.warning("renewing the heal lock: %s", exc)

        threading.Thread(target=run, name="celerytp-heal-lock", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()


class GroupDriver(Protocol):
    """What a Healer drives its group's ranks through: a Leader (client/leader.py), whose ops
    with no healing of their own it calls."""

    group: str
    world_size: int
    redis: redis.Redis
    app: Celery
    recovery_timeout: float
    _timing: HeartbeatTiming

    def ping(self, timeout: float | None = None) -> list[Any]: ...

    def init(self, comm_id: str | None = None, timeout_s: float = 60.0) -> list[Any]: ...

    def _call(self, op: str, fields: dict[str, Any] | None, timeout: float) -> list[Any]: ...

    def _load(self, model_id: str, fields: dict[str, Any], keep: bool = False) -> list[Any]: ...

    def _live_owners(self, op: str) -> list[bytes | None]: ...


class Healer:
    """The healing of one group (it drives the ranks through `leader`)."""

    def __init__(self, leader: GroupDriver):
        self.leader = leader

    def damage(self) -> tuple[bool, list[str]]:
        """What changed since the group formed and since each model was loaded: (the group must
        form again, the models to load again). A rank's worker was replaced, or a model is
        recorded as loaded by workers that no longer hold the ranks."""
        pipe = self.leader.redis.pipeline(transaction=False)
        pipe.get(members_key(self.leader.group))
        pipe.mget([owner_key(self.leader.group, r) for r in range(self.leader.world_size)])
        pipe.hgetall(models_key(self.leader.group))
        pipe.mget([comm_key(self.leader.group), broken_key(self.leader.group)])
        members, owners, models, (comm, broken) = pipe.execute()
        if members is None and None not in owners and self.rebuild():  # Redis lost it: ask the ranks
            return self.damage()
        now = [o.decode() if o else None for o in owners]
        regroup = members is not None and json.loads(members) != now  # no record, no rank to ask: it stands
        regroup = regroup or (broken is not None and broken == comm)  # a rank reported this epoch broken
        stale = [k.decode() for k, v in models.items() if json.loads(v).get("holders", now) != now]
        return regroup, stale

    def rebuild(self) -> bool:
        """Rebuild what Redis lost of this group (restarted without persistence, or a new Redis)
        from what its ranks report: the members (a rank outside the ranks' common live epoch is
        recorded as no member, so the group re-forms), the comm id, and the model records (a
        model some rank lacks is recorded so, and loaded again). False: a rank could not answer."""
        lead = self.leader
        owners = read_owners(lead.redis, lead.group, lead.world_size)
        if None in owners:
            return False
        try:
            pongs = lead.ping(HEAL_WAIT_S)
        except CeleryTPError as exc:
            log.warning("cannot rebuild group %s from its ranks: %s", lead.group, exc)
            return False
        comms = [pong.comm_id for pong in pongs if pong.comm_id and not pong.group_broken]
        if not comms:
            return False  # the group never formed (or every rank lost it): nothing to rebuild, `init` forms it
        live = max(set(comms), key=comms.count)
        members = [o.decode() if pong.comm_id == live else None for o, pong in zip(owners, pongs, strict=True)]
        pipe = lead.redis.pipeline()
        pipe.set(members_key(lead.group), json.dumps(members), nx=True)
        pipe.set(comm_key(lead.group), live, nx=True)
        pipe.execute()
        recorded = lead.redis.hkeys(models_key(lead.group))
        for model_id in {m for pong in pongs for m in pong.models} - {m.decode() for m in recorded}:
            record = next(pong.models[model_id] for pong in pongs if model_id in pong.models)
            holders = [o if model_id in pong.models and pong.comm_id == live else None for o, pong in zip(owners, pongs, strict=True)]
            keep_replica(lead.redis, lead.group, lead.world_size, model_id, record, holders)
            log.warning("model %s of group %s registered again from its ranks (Redis had lost it)", model_id, lead.group)
        return True

    def ensure(self) -> None:
        """Heal first when the group or a model needs it (a replaced worker, a broken epoch)."""
        regroup, stale = self.damage()
        if regroup or stale:
            self.heal()

    def heal(self, timeout: float | None = None) -> None:
        """Re-form the group once every rank has a live worker, and load again every model that a
        replaced worker lost.

        Waits up to `timeout` (default: recovery_timeout) for the supervisors to restart lost
        ranks. The models and their load settings come from the Redis registry and from what
        the surviving ranks report; a rank that still holds a model keeps its weights. Ops queued
        for the broken group are dropped. One leader heals at a time; the others wait for it.
        """
        deadline = time.monotonic() + (self.leader.recovery_timeout if timeout is None else timeout)
        # No live worker at all for a heartbeat's lifetime: nobody is restarting them, fail now.
        none_until = min(deadline, time.monotonic() + self.leader._timing.ttl_s + self.leader._timing.missing_grace_s)
        while not any(read_owners(self.leader.redis, self.leader.group, self.leader.world_size)):
            if time.monotonic() > none_until:
                self.leader._live_owners("heal")
            time.sleep(0.1)
        token, lock = uuid.uuid4().hex, heal_lock_key(self.leader.group)
        while not self.leader.redis.set(lock, token, nx=True, ex=HEAL_LOCK_TTL_S):
            if time.monotonic() > deadline:
                raise CeleryTPError(ErrorKind.TIMEOUT, "another leader is still healing the group", op="heal")
            time.sleep(0.2)
        renewing = _LockRenewal(self.leader.redis, lock, token, HEAL_LOCK_TTL_S)
        try:
            while any(self.damage()):
                try:
                    self._heal_once(deadline)
                except CeleryTPError as exc:
                    if not exc.kinds & HEAL_AGAIN:
                        raise
                    if time.monotonic() > deadline:
                        raise CeleryTPError.from_failures("heal", exc.failures) from None
                    time.sleep(0.5)  # a rank was lost again while healing: wait for it
        finally:
            renewing.stop()
            self.leader.redis.eval(RELEASE_IF_HOLDER, 1, lock, token)

    def _heal_once(self, deadline: float) -> None:
        while missing := [r for r, o in enumerate(read_owners(self.leader.redis, self.leader.group, self.leader.world_size)) if o is None]:
            if time.monotonic() > deadline:
                raise no_worker("heal", missing, "no live worker came back for this rank")
            time.sleep(0.2)
        regroup, stale = self.damage()
        pongs = self.leader.ping(HEAL_WAIT_S)
        records = {model_id: record for pong in reversed(pongs) for model_id, record in pong.models.items()}
        records.update((k.decode(), json.loads(v)) for k, v in self.leader.redis.hgetall(models_key(self.leader.group)).items())
        if regroup:
            with self.leader.app.connection_for_write() as conn:  # ops published to the broken group
                for rank in range(self.leader.world_size):
                    conn.default_channel.queue_purge(queue_name(self.leader.group, rank))
            self.leader.init(timeout_s=HEAL_WAIT_S * 3)
        for model_id, record in records.items():
            if not regroup and model_id not in stale:
                continue
            self.leader.redis.delete(loop_key(self.leader.group, model_id))
            try:
                # The ranks that still hold it, with these settings, keep their shards (worker/model_ops.py).
                replies = self.leader._load(model_id, record["load"], keep=True)
                log.info("group %s: model %s loaded again; ranks %s kept their weights", self.leader.group, model_id,
                         [reply.rank for reply in replies if reply.kept])
                self.leader.redis.hdel(loop_failures_key(model_id), self.leader.group)  # healed: its loops start afresh
            except CeleryTPError as exc:
                if not exc.kinds <= MODEL_FAULTS:
                    raise  # the group's failure, not the model's: heal again
                log.error("model %s could not be loaded again after a rank was replaced, so it is unloaded: %s", model_id, exc)
                drop_replica(self.leader.redis, self.leader.group, model_id)
