"""Fault containment on a real two-rank group: a dead or stuck rank is named within seconds,
the supervisor restarts it, the leader re-forms the group and reloads the model, requests in
flight resume exactly once, Redis restarts (with or without their data) are survived, and the op
order resynchronises. One shared cluster; each test leaves it healed."""

from __future__ import annotations

import os
import signal
import threading
import time

import psutil
import pytest

from celerytp import Leader
from celerytp.client.requests import RequestQueues
from celerytp.cluster import LocalCluster
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.keys import queue_key, request_key

pytestmark = pytest.mark.slow

PROMPT = dict(prompt="The capital of France is", max_tokens=8, temperature=0)
LONG = dict(prompt="Once upon a time", max_tokens=24, temperature=0, ignore_eos=True)
RESUME_S = 30  # a request whose group lost a rank completes within this of the loss
DETECT_S = 10  # a lost rank is named within this


@pytest.fixture(scope="module")
def rel():
    with LocalCluster(world_size=2, group="rel") as cluster:
        # As it ships (Q4_1, compiled decode): batch invariance makes a greedy text independent of the
        # batch and of a resume's prefill of its earlier tokens (docs/models.md).
        cluster.leader.load("smol", None, idle_s=0.2)
        expected = cluster.leader.generate("smol", **PROMPT).token_ids
        yield cluster, expected


def _stream_with_fault(leader, fault) -> tuple[str, list[int], float]:
    """A long greedy stream; `fault()` runs after its 8th text delta. Returns the text streamed,
    the result's token ids, and the seconds from the fault to the end."""
    stream = leader.stream("smol", **LONG)
    deltas, faulted_at = [], None
    for delta in stream:
        deltas.append(delta)
        if len(deltas) == 8:
            faulted_at = time.monotonic()
            fault()
    assert faulted_at is not None, "the stream ended before the fault"
    return "".join(deltas), stream.result.token_ids, time.monotonic() - faulted_at


@pytest.mark.parametrize("victim", [1, 0])
def test_a_request_resumes_exactly_once_after_a_rank_is_killed_mid_generation(rel, victim):
    """The group's requests go back to the queue, the supervisor restarts the rank, the group
    heals with no person, and the stream goes on where it stopped: no token twice, none missing."""
    cluster, _ = rel
    leader = cluster.leader
    reference = leader.generate("smol", **LONG)
    restarts = cluster.restarts[victim]
    survivor = 1 - victim
    kept, survivors_restarts = cluster.log(survivor).count("model smol: kept its weights"), cluster.restarts[survivor]
    text, token_ids, took = _stream_with_fault(leader, lambda: os.killpg(cluster.workers[victim].pid, signal.SIGKILL))
    assert text == reference.text and token_ids == reference.token_ids
    assert took < RESUME_S, took
    assert cluster.restarts[victim] == restarts + 1
    # The survivor's collective failed (its shared-memory wait aborted by the deadman, or gloo's
    # socket closed): it kept its process, and its shards through the heal, where its compiled
    # decode warmed up again in the new group
    assert cluster.restarts[survivor] == survivors_restarts
    assert cluster.log(survivor).count("model smol: kept its weights") == kept + 1


def test_a_stuck_rank_is_replaced_and_its_requests_resume(rel):
    cluster, _ = rel
    leader = cluster.leader
    reference = leader.generate("smol", **LONG)
    stuck = psutil.Process(cluster.workers[1].pid)
    kept, restarts = cluster.log(0).count("model smol: kept its weights"), cluster.restarts[0]
    text, token_ids, took = _stream_with_fault(leader, stuck.suspend)  # alive, but its heartbeat stops
    assert text == reference.text and token_ids == reference.token_ids
    assert took < RESUME_S + DETECT_S, took
    # rank 0 sat in a shared-memory wait for the stuck rank: its deadman aborted it once the
    # supervisor replaced rank 1, and rank 0 kept its process and its weights
    assert cluster.restarts[0] == restarts and cluster.log(0).count("model smol: kept its weights") == kept + 1


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


def test_a_redis_restart_loses_no_request_and_no_registry_entry(rel):
    """Redis is killed and restarted from its append-only file while requests run and wait: every
    one completes, as an uninterrupted run does, and the registry is still there."""
    cluster, _ = rel
    leader = cluster.leader
    reference = leader.generate("smol", **LONG)
    streams = [leader.stream("smol", **LONG) for _ in range(3)]
    running = iter(streams[0])
    first = next(running)  # running by now
    time.sleep(1.1)  # past the append-only file's one-second fsync
    cluster.restart_redis(kill=True, down_s=0.5)
    texts = [first + "".join(running), *("".join(s) for s in streams[1:])]
    assert texts == [reference.text] * 3
    assert "smol" in leader.models()


def test_redis_restarted_without_its_data_then_a_rank_killed_heals_with_no_person(rel):
    """The registry, the members and the comm id are rebuilt from the ranks; the heal that the
    lost rank needs then reloads the model instead of dropping its record."""
    cluster, expected = rel
    leader = cluster.leader
    cluster.restart_redis(wipe=True)
    deadline = time.monotonic() + 30
    while None in leader.health():  # the workers reconnect and write their heartbeats again
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(cluster.workers[1].pid, signal.SIGKILL)
    assert leader.generate("smol", **PROMPT).token_ids == expected
    assert "smol" in leader.held_models() and "smol" in leader.models()


def test_a_request_redis_lost_is_queued_again(rel, monkeypatch):
    cluster, _ = rel
    client = cluster.leader.redis
    queues = RequestQueues(client, lambda model, heal: None)  # no loop: the request stays queued
    pending = queues.submit("m", {"request_id": "r1", "prompt": [1, 2], "max_tokens": 4}, max_queue=8, timeout=60)
    client.delete(queue_key("m"), request_key("r1"))  # what a Redis restart without persistence does
    outcome: list = []
    waiter = threading.Thread(target=lambda: outcome.append(pytest.raises(CeleryTPError, pending.result, 4)))
    waiter.start()
    deadline = time.monotonic() + 4
    while client.lpos(queue_key("m"), pending.item) is None:
        assert time.monotonic() < deadline, "the lost request was not queued again"
        time.sleep(0.1)
    waiter.join()
    assert outcome[0].value.kind is ErrorKind.TIMEOUT  # no loop ever took it; its waiter left the queue
    assert client.lpos(queue_key("m"), pending.item) is None


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
