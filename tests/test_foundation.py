"""Foundation: real Redis, real rank worker processes, real gloo groups, chords for every op."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
from kombu import Connection, Producer

from celerytp import CeleryTPError, Leader
from celerytp.cluster import LocalCluster
from celerytp.core.app import op_task_name, queue_name
from celerytp.core.errors import ErrorKind
from celerytp.worker.lease import RankLease, claim_is_stale


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ping_init_sanity(world_size):
    with LocalCluster(world_size=world_size, group=f"ws{world_size}") as cluster:
        leader = cluster.leader
        pongs = leader.ping()
        assert [p.rank for p in pongs] == list(range(world_size))
        assert all(p.world_size == world_size and p.device == "cpu" for p in pongs)
        assert len({p.comm_id for p in pongs}) == 1 and pongs[0].comm_id is not None
        sums = leader.sanity_check()
        assert [s.rank for s in sums] == list(range(world_size))
        assert [s.observed_sum for s in sums] == [world_size] * world_size

        # A new comm_id tears the old group down and forms a new epoch.
        old = pongs[0].comm_id
        replies = leader.init("epoch-2")
        assert {r.comm_id for r in replies} == {"epoch-2"} and {r.backend for r in replies} == {"gloo"}
        assert {p.comm_id for p in leader.ping()} == {"epoch-2"} != {old}
        assert [s.observed_sum for s in leader.sanity_check()] == [world_size] * world_size


def test_a_restarted_rank_rejoins_without_a_manual_init(cluster2):
    leader = cluster2.leader
    before = {p.comm_id for p in leader.ping()}
    cluster2.restart_worker(1, kill=True)
    # The group's workers changed since it formed: the next op re-forms it first.
    assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]
    after = {p.comm_id for p in leader.ping()}
    assert len(after) == 1 and after != before


def test_a_killed_workers_claim_is_taken_over_at_once(cluster2):
    """The supervisor's new worker for a SIGKILLed rank, on the same host and pid namespace, sees
    that the claim's process is gone and takes the rank without waiting out the claim's TTL."""
    old = cluster2.workers[1].pid
    os.killpg(old, signal.SIGKILL)  # LocalCluster's supervisor starts a new worker
    deadline = time.monotonic() + 30
    while (cluster2.leader.health()[1] or {}).get("pid") in (None, old):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert f'from a worker that is gone ({{"host": "{socket.gethostname()}", "pid": {old}' in cluster2.log(1)
    assert [s.observed_sum for s in cluster2.leader.sanity_check()] == [2, 2]


def test_only_a_gone_process_of_this_pid_space_has_a_stale_claim(tmp_path):
    """claim_is_stale: a claim of a live process, of another host, boot or pid namespace, or
    unreadable must be waited out; one whose process exited, or whose pid another process took
    since, need not."""
    mine = json.loads(RankLease(None, "g", 0, "cpu").value)

    def stale(**changes) -> bool:
        return claim_is_stale(json.dumps({**mine, **changes}).encode())

    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    assert not stale()  # this live process
    assert stale(pid=exited.pid)
    assert stale(since=mine["since"] - 3600)  # the pid is this process's, which started after the claim: reused
    assert not stale(pid=exited.pid, host="another-host")
    assert not stale(pid=exited.pid, boot="another-boot")
    assert not stale(pid=exited.pid, pid_ns=1)
    assert not claim_is_stale(b"not json") and not claim_is_stale(b'{"pid": "x"}')


def test_collective_with_a_stuck_peer_times_out(cluster2):
    leader = cluster2.leader
    leader.init(timeout_s=3)
    stuck = psutil.Process(cluster2.workers[1].pid)
    stuck.suspend()
    try:
        start = time.monotonic()
        with pytest.raises(CeleryTPError) as info:
            leader.call("sanity_check", timeout=8)
        elapsed = time.monotonic() - start
    finally:
        stuck.resume()
    by_rank = {f.rank: f.kind for f in info.value.failures}
    # Rank 0's all-reduce gives up after the group's 3 s; rank 1 never answered (suspended
    # longer than its heartbeat lasts, so it may also count as lost).
    assert by_rank[0] is ErrorKind.TIMEOUT, info.value
    assert by_rank[1] in (ErrorKind.TIMEOUT, ErrorKind.RANK_LOST), info.value
    assert elapsed < 8.5
    leader.init(timeout_s=30)
    assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]


def test_uninitialised_group_gives_typed_error_on_every_rank(cluster2):
    with LocalCluster(world_size=2, group="noinit", form_group=False) as cluster:
        with pytest.raises(CeleryTPError) as info:
            cluster.leader.sanity_check()
        assert [(f.rank, f.kind) for f in info.value.failures] == [
            (0, ErrorKind.NOT_INITIALISED),
            (1, ErrorKind.NOT_INITIALISED),
        ]


def test_unavailable_device_is_typed():
    with LocalCluster(world_size=1, group="nocuda", device="cuda:0", form_group=False) as cluster:
        assert cluster.leader.ping()[0].device.startswith("unavailable")
        with pytest.raises(CeleryTPError) as info:
            cluster.leader.init(timeout_s=5)
        assert info.value.kinds == {ErrorKind.DEVICE_UNAVAILABLE}


def test_malformed_requests_get_bad_request_and_workers_survive(cluster2):
    leader = cluster2.leader
    cases = [
        ("init", {"comm_id": 5}, "comm_id"),
        ("init", {"comm_id": "ok", "timeout_s": "soon"}, "timeout_s"),
        ("ping", {"surprise": 1}, "surprise"),
        ("ping", {"op": "bogus"}, "op"),
        ("sanity_check", {"op": "ping"}, "op"),
    ]
    for op, fields, field in cases:
        with pytest.raises(CeleryTPError) as info:
            leader.call(op, fields)
        assert [f.rank for f in info.value.failures] == [0, 1]
        assert info.value.kinds == {ErrorKind.BAD_REQUEST}
        assert f"'{field}'" in str(info.value)
    with pytest.raises(CeleryTPError) as info:
        leader.call("no_such_op")
    assert info.value.kinds == {ErrorKind.BAD_REQUEST}
    assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]


def test_pickled_and_unknown_messages_are_refused(cluster2):
    leader = cluster2.leader
    queue = queue_name(cluster2.group, 0)
    with Connection(cluster2.broker_url) as conn:
        producer = Producer(conn)
        # A pickled task message: the worker must refuse to deserialize it.
        producer.publish(
            ((), {}, {}), routing_key=queue, serializer="pickle",
            headers={"task": op_task_name("ping"), "id": "pickled-1", "lang": "py", "argsrepr": "", "kwargsrepr": ""},
        )
        # A JSON message for a task that does not exist, and one that is not a task at all.
        producer.publish(
            [[{"op": "ping", "seq": 1}], {}, {}], routing_key=queue, serializer="json",
            headers={"task": "celerytp.rank.no_such_task", "id": "unknown-1", "lang": "py"},
        )
        producer.publish({"hello": "world"}, routing_key=queue, serializer="json")
    time.sleep(1.0)
    assert all(p.poll() is None for p in cluster2.workers)
    assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]
    assert "pickle" in cluster2.log(0).lower()


def _envelope(queue: str, **change) -> dict:
    """A well-formed Celery task message as it lies in a Redis queue (a ping with no reply)."""
    body = [[{"op": "ping", "seq": 1, "epoch": "never-used"}], {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
    envelope = {
        "body": base64.b64encode(json.dumps(body).encode()).decode(), "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": {"lang": "py", "task": op_task_name("ping"), "id": "poison", "root_id": "poison", "parent_id": None},
        "properties": {"delivery_tag": "tag", "body_encoding": "base64", "priority": 0,
                       "delivery_info": {"exchange": "", "routing_key": queue}},
    }
    for key, value in change.items():
        envelope[key] = value
    return envelope


def test_malformed_messages_are_dead_lettered_and_the_workers_live(cluster2):
    queue = queue_name(cluster2.group, 1)
    good = _envelope(queue)
    poison = [
        b"\x00\xff\xfe garbage", b"not json at all", b"[1, 2, 3]", json.dumps(good)[:-20].encode(),  # truncated
        json.dumps(_envelope(queue, body={"op": "ping"})).encode(),  # a JSON object body
        json.dumps(_envelope(queue, body="%%% not base64 %%%")).encode(),
        json.dumps(_envelope(queue, headers={"task": op_task_name("ping")})).encode(),  # no id header
        json.dumps(_envelope(queue, **{"content-type": "application/x-python-serialize"})).encode(),
        json.dumps(_envelope(queue, body=base64.b64encode(b'{"op": "ping"}').decode())).encode(),  # not a task body
        json.dumps(_envelope(queue, padding="x" * (9 << 20))).encode(),  # too large
    ]
    client = cluster2.leader.redis
    client.delete(f"{queue}.deadletter")
    client.lpush(queue, *poison)
    deadline = time.monotonic() + 10
    while client.llen(f"{queue}.deadletter") < len(poison):
        assert time.monotonic() < deadline, client.lrange(f"{queue}.deadletter", 0, -1)
        time.sleep(0.1)
    assert all(p.poll() is None for p in cluster2.workers)
    assert [s.observed_sum for s in cluster2.leader.sanity_check()] == [2, 2]
    assert "dropping a malformed message" in cluster2.log(1)
    assert len(cluster2.leader.dead_letters()[1]) == len(poison)


def test_stale_sequence_is_out_of_order(cluster2):
    leader = cluster2.leader
    leader.ping()
    # Replay an old sequence number of this epoch straight to rank 0's queue, as a redelivery would.
    epoch = leader.redis.get(f"celerytp:{cluster2.group}:epoch").decode()
    stale = {"op": "ping", "seq": 1, "epoch": epoch}
    result = leader.app.send_task(op_task_name("ping"), args=(stale,), queue=queue_name(cluster2.group, 0))
    reply = result.get(timeout=10)
    assert reply["type"] == "error" and reply["kind"] == "out_of_order"
    assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]


def _hammer(leader: Leader, ops: int, errors: list) -> None:
    try:
        for _ in range(ops):
            assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]
    except Exception as exc:  # reported to the main thread
        errors.append(exc)


def test_two_leaders_in_threads(cluster2):
    errors: list = []
    leaders = [Leader(cluster2.broker_url, cluster2.group, 2, timeout=30) for _ in range(2)]
    threads = [threading.Thread(target=_hammer, args=(leader, 100, errors)) for leader in leaders]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_two_leaders_in_processes(cluster2):
    script = textwrap.dedent(
        f"""
        from celerytp import Leader
        leader = Leader({cluster2.broker_url!r}, {cluster2.group!r}, 2, timeout=30)
        for _ in range(100):
            assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]
        print("done")
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert out.strip() == b"done"
    assert [s.observed_sum for s in cluster2.leader.sanity_check()] == [2, 2]


def test_second_worker_for_owned_rank_is_refused(cluster2):
    proc = subprocess.run(
        [sys.executable, "-m", "celerytp", "worker", "--rank", "1", "--world-size", "2",
         "--group", cluster2.group, "--broker", cluster2.broker_url],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "refusing to start" in proc.stderr and "rank:1:owner" in proc.stderr
    assert [s.observed_sum for s in cluster2.leader.sanity_check()] == [2, 2]


def test_silent_rank_is_reported_by_number(cluster2):
    stuck = psutil.Process(cluster2.workers[1].pid)
    stuck.suspend()
    try:
        with pytest.raises(CeleryTPError) as info:
            cluster2.leader.ping(timeout=1.5)
    finally:
        stuck.resume()
    assert [(f.rank, f.kind) for f in info.value.failures] == [(1, ErrorKind.TIMEOUT)]
    assert len(cluster2.leader.ping()) == 2


def _tree(pids: list[int]) -> set[int]:
    found = set(pids)
    for pid in pids:
        try:
            found |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return found


def _gone(pids: set[int], within: float = 15) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            return True
        time.sleep(0.1)
    return False


def test_teardown_leaves_no_process():
    with LocalCluster(world_size=2, group="teardown") as cluster:
        pids = _tree(cluster.pids)
        assert len(pids) >= 3
    assert _gone(pids)


def test_teardown_on_exception_and_on_ctrl_c():
    with pytest.raises(RuntimeError), LocalCluster(world_size=1, group="boom") as cluster:
        pids = _tree(cluster.pids)
        raise RuntimeError("boom")
    assert _gone(pids)

    script = textwrap.dedent(
        """
        import sys, time
        from celerytp.cluster import LocalCluster
        with LocalCluster(world_size=2, group="ctrlc") as cluster:
            print(" ".join(map(str, cluster.pids)), flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = _tree([int(p) for p in proc.stdout.readline().split()])
    proc.send_signal(signal.SIGINT)
    proc.wait(30)
    assert _gone(pids | {proc.pid})


def test_shutdown_stops_every_worker():
    with LocalCluster(world_size=2, group="bye") as cluster:
        assert [b.rank for b in cluster.leader.shutdown()] == [0, 1]
        for proc in cluster.workers:
            assert proc.wait(30) == 0
