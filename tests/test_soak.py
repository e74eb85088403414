"""A bounded soak: mixed operations from 4 leader processes on a two-rank group, with rank 1
SIGKILLed part way (400 in CI; CELERYTP_SOAK_OPS=250 gives the full 1,000 of docs/reliability.md). No deadlock; every operation completes or fails with a typed error; the
workers' memory and the number of Redis keys stay bounded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from celerytp.cluster import LocalCluster

pytestmark = pytest.mark.slow

PROCESSES, OPS = 4, int(os.environ.get("CELERYTP_SOAK_OPS", "100"))
RSS_BOUND = 1.5 * 2**30  # per rank worker process (SmolLM2 q4 + f32 embedding + KV cache: ~0.5 GiB)
KEYS_BOUND = 64  # keys without a TTL (coordination, queues, registry): none is per request

CLIENT = textwrap.dedent(
    """
    import json, random, sys, time
    from celerytp import Leader
    from celerytp.core.errors import CeleryTPError
    url, me, ops = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    leader = Leader(url, "soak", 2, timeout=30)
    leader.generate_timeout = 60
    rng = random.Random(me)
    outcome = {"ok": 0, "typed": {}, "untyped": []}
    for i in range(ops):
        op = rng.choice(["ping", "sanity", "generate", "stream", "cancel"])
        try:
            if op == "ping":
                leader.ping()
            elif op == "sanity":
                leader.sanity_check()
            elif op == "generate":
                leader.generate("smol", prompt=f"Count to {i}:", max_tokens=3)
            elif op == "stream":
                "".join(leader.stream("smol", prompt=f"Name {i} colours:", max_tokens=3))
            else:
                stream = leader.stream("smol", prompt="Tell me a long story.", max_tokens=50, ignore_eos=True)
                leader.cancel(stream.request_id)
                "".join(stream)
            outcome["ok"] += 1
        except CeleryTPError as exc:
            outcome["typed"][str(exc.kind)] = outcome["typed"].get(str(exc.kind), 0) + 1
        except Exception as exc:
            outcome["untyped"].append(repr(exc)[:300])
        leader.redis.incr("soak:done")
    print(json.dumps(outcome))
    """
)


def test_soak_with_a_rank_killed_mid_way():
    with LocalCluster(world_size=2, group="soak") as cluster:
        leader = cluster.leader
        leader.load("smol", None, max_batch=8, idle_s=0.2)
        procs = [
            subprocess.Popen([sys.executable, "-c", CLIENT, cluster.broker_url, str(i), str(OPS)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(PROCESSES)
        ]
        deadline = time.monotonic() + 120
        while int(leader.redis.get("soak:done") or 0) < PROCESSES * OPS * 0.4:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        os.killpg(cluster.workers[1].pid, signal.SIGKILL)
        outcomes = []
        for proc in procs:
            out, err = proc.communicate(timeout=420)  # no deadlock
            assert proc.returncode == 0, err[-3000:]
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
        ok = sum(o["ok"] for o in outcomes)
        typed = sum(sum(o["typed"].values()) for o in outcomes)
        assert [u for o in outcomes for u in o["untyped"]] == []
        assert ok + typed == PROCESSES * OPS
        assert ok > PROCESSES * OPS * 0.8, outcomes  # only operations around the kill may fail
        assert cluster.restarts[1] >= 1
        assert [s.observed_sum for s in leader.sanity_check()] == [2, 2]
        rss = [psutil.Process(p.pid).memory_info().rss for p in cluster.workers]
        # the worker processes are `python -m celerytp worker` (rank state lives in them)
        assert max(rss) < RSS_BOUND, rss
        leader.redis.delete("soak:done")
        time.sleep(1.0)
        ttls = {key: leader.redis.ttl(key) for key in leader.redis.keys("*")}
        lasting = sorted(key for key, ttl in ttls.items() if ttl < 0)
        assert len(lasting) < KEYS_BOUND, lasting
        assert max(ttls.values()) <= 24 * 3600  # everything else expires (chord bookkeeping, results, rendezvous)
