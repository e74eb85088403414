"""Fault containment on a real two-rank group: a dead or stuck rank is named within seconds,
the supervisor restarts it, the leader re-forms the group and reloads the model, Redis restarts
are survived, and the op order resynchronises. One shared cluster; each test leaves it healed."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from celerytp import Leader
from celerytp.client import requests as requests_module
from celerytp.client.requests import RequestQueues
from celerytp.cluster import LocalCluster
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.liveness import HeartbeatTiming, RankWatch

pytestmark = pytest.mark.slow

PROMPT = dict(prompt="The capital of France is", max_tokens=8, temperature=0)
DETECT_S = 10  # a lost rank is named within this


@pytest.fixture(scope="module")
def rel():
    with LocalCluster(world_size=2, group="rel") as cluster:
        cluster.leader.load("smol", None, idle_s=0.2)
        expected = cluster.leader.generate("smol", **PROMPT).token_ids
        yield cluster, expected


def _long_generation(leader, outcome: list) -> threading.Thread:
    """A long streamed generation in a thread; returns once its first tokens arrived."""
    started = threading.Event()

    def run():
        try:
            for _ in leader.stream("smol", prompt="Once upon a time", max_tokens=2000, ignore_eos=True):
                started.set()
            outcome.append("completed")
        except CeleryTPError as exc:
            outcome.append((exc, time.monotonic()))
        started.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(30), "the long generation never started"
    return thread


def _assert_named(outcome: list, rank: int, since: float) -> None:
    error, at = outcome[0]
    assert isinstance(error, CeleryTPError), outcome
    assert error.kind in (ErrorKind.RANK_LOST, ErrorKind.TIMEOUT), error
    assert any(f.rank == rank and f.kind is ErrorKind.RANK_LOST for f in error.failures), error
    assert at - since < DETECT_S, at - since


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_mid_generation_is_named_and_the_group_heals(rel, victim):
    cluster, expected = rel
    leader = cluster.leader
    restarts = cluster.restarts[victim]
    outcome: list = []
    thread = _long_generation(leader, outcome)
    killed_at = time.monotonic()
    os.killpg(cluster.workers[victim].pid, signal.SIGKILL)
    thread.join(DETECT_S + 5)
    assert not thread.is_alive()
    _assert_named(outcome, victim, killed_at)
    # No manual step: the supervisor restarts the rank, the next request heals the group.
    assert leader.generate("smol", **PROMPT).token_ids == expected
    assert cluster.restarts[victim] == restarts + 1


def test_a_stuck_rank_is_handled_like_a_lost_one(rel):
    cluster, expected = rel
    leader = cluster.leader
    outcome: list = []
    thread = _long_generation(leader, outcome)
    stopped_at = time.monotonic()
    psutil.Process(cluster.workers[1].pid).suspend()  # alive, but its heartbeat stops
    thread.join(DETECT_S + 5)
    assert not thread.is_alive()
    _assert_named(outcome, 1, stopped_at)
    assert leader.generate("smol", **PROMPT).token_ids == expected


def test_an_op_to_ranks_with_no_worker_fails_at_once():
    with LocalCluster(world_size=2, group="nobody", supervise=False) as cluster:
        impatient = Leader(cluster.broker_url, "nobody", 2, recovery_timeout=0)
        for rank in (1, 0):
            os.killpg(cluster.workers[rank].pid, signal.SIGKILL)
            cluster.workers[rank].wait()
            impatient.redis.delete(f"celerytp:nobody:rank:{rank}:owner")  # as after its heartbeat lapsed
            for leader in (impatient, cluster.leader) if rank == 0 else (impatient,):
                started = time.monotonic()
                with pytest.raises(CeleryTPError) as info:
                    leader.sanity_check()
                # at once, or (no worker at all) once a restarted one would have claimed its rank
                assert time.monotonic() - started < (3 if leader is impatient else DETECT_S)
                lost = sorted(f.rank for f in info.value.failures if f.kind is ErrorKind.RANK_LOST)
                assert lost == ([0, 1] if rank == 0 else [1]), info.value


def test_a_bogus_sequence_number_does_not_block_a_rank(rel):
    cluster, expected = rel
    leader = cluster.leader
    publisher = leader._publisher
    publisher.publish(  # one rank hears an absurd number, as from a confused or hostile client
        "celerytp.rank.ping", lambda seq, epoch: {"op": "ping", "seq": 10**15, "epoch": epoch}, expires=10, lock_wait=10
    )
    time.sleep(0.5)
    assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]
    assert leader.generate("smol", **PROMPT).token_ids == expected


def test_redis_restarted_between_requests(rel):
    cluster, expected = rel
    leader = cluster.leader
    cluster.restart_redis()  # the sequence counter, the model registry and the queues are gone
    deadline = time.monotonic() + 30
    while None in leader.health():  # the workers reconnect and write their heartbeats again
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert leader.generate("smol", **PROMPT).token_ids == expected
    assert "smol" in leader.held_models() and "smol" in leader.models()


def test_a_request_redis_lost_fails_instead_of_waiting_for_its_deadline(rel, monkeypatch):
    cluster, _ = rel
    monkeypatch.setattr(requests_module, "LOST_AFTER_S", 1.0)  # 15 s by default
    client = cluster.leader.redis
    timing = HeartbeatTiming.from_env()
    queues = RequestQueues(client, "lost", lambda model, loop: None, lambda: RankWatch(client, "lost", [], timing))
    pending = queues.submit("m", {"request_id": "r1", "prompt": [1, 2], "max_tokens": 4}, max_queue=8)
    client.delete("celerytp:lost:queue:m", "celerytp:lost:loop:m")  # what a Redis restart does
    started = time.monotonic()
    with pytest.raises(CeleryTPError, match="was lost"):
        pending.result(timeout=60)
    assert time.monotonic() - started < 5


def test_a_failed_init_is_cured_by_restarting_only_the_dead_rank(rel):
    cluster, expected = rel
    leader = cluster.leader
    survivor = cluster.workers[0].pid
    os.killpg(cluster.workers[1].pid, signal.SIGKILL)
    with pytest.raises(CeleryTPError) as info:
        leader.init(timeout_s=3)  # rank 1 is gone: the rendezvous cannot complete
    assert info.value.kinds & {ErrorKind.RANK_LOST, ErrorKind.INIT_FAILED}, info.value
    deadline = time.monotonic() + 60
    while True:  # the supervisor restarts rank 1 alone; a plain init then forms the group
        try:
            leader.init(timeout_s=10)
            break
        except CeleryTPError:
            assert time.monotonic() < deadline
            time.sleep(0.5)
    assert cluster.workers[0].pid == survivor
    assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]
    # The new rank 1 never loaded the model: the next request loads it again first.
    assert leader.generate("smol", **PROMPT).token_ids == expected
