"""Multi-host without a second machine: Redis and the leader in one network namespace, both rank
workers in another, joined by a veth pair. Rendezvous, the result backend, token streaming and
the heartbeats all cross the link: nothing may assume localhost. A second group (one rank, in
Redis's namespace) serves the same model as a replica from the same queue: both hosts take work.
Skips where namespaces cannot be created (not root, no `ip`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from celerytp.cluster import find_redis_server

pytestmark = pytest.mark.slow

REDIS_IP, RANKS_IP, PORT, PASSWORD = "10.213.0.1", "10.213.0.2", 6390, "netns-secret"
URL = f"redis://:{PASSWORD}@{REDIS_IP}:{PORT}/0"

LEADER = textwrap.dedent(
    """
    import json, sys, time
    from celerytp import Leader
    from celerytp.core.errors import CeleryTPError
    leader = Leader(sys.argv[1], "netns", 2)
    deadline = time.monotonic() + 120
    while True:
        try:
            leader.ping(timeout=5)
            break
        except CeleryTPError:
            assert time.monotonic() < deadline, "ranks never answered"
    init = leader.init()
    sums = [s.observed_sum for s in leader.sanity_check()]
    leader.load("smol", None, max_batch=2, idle_s=30)
    whole = leader.generate("smol", prompt="The capital of France is", max_tokens=6, temperature=0)
    stream = leader.stream("smol", prompt="The capital of France is", max_tokens=6, temperature=0)
    streamed = "".join(stream)
    # A replica on the other host: group "replica" (one rank, beside Redis) serves the same model
    # from the same queue; streams sent through the first group's leader run on both.
    replica = Leader(sys.argv[1], "replica", 1)
    replica.init()
    replica.load("smol", None, max_batch=2, idle_s=30)  # idle_s: one loop per group counts the whole run
    before = [leader.serving_stats("smol").get("requests", 0), replica.serving_stats("smol").get("requests", 0)]
    streams = [leader.stream("smol", prompt=f"Story {i}:", max_tokens=8, temperature=0) for i in range(6)]
    texts = ["".join(s) for s in streams]
    after = [leader.serving_stats("smol").get("requests", 0), replica.serving_stats("smol").get("requests", 0)]
    print(json.dumps({"backend": init[0].backend, "sums": sums, "hosts": [h["host"] for h in leader.health()],
                      "text": whole.text, "streamed": streamed, "replicas": sorted(leader.models()["smol"]["replicas"]),
                      "took": [a - b for a, b in zip(after, before)], "texts": texts}))
    """
)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture
def namespaces():
    if shutil.which("ip") is None:
        pytest.skip("no `ip` command")
    tag = f"{os.getpid() % 100000}"
    a, b = f"ctpa{tag}", f"ctpb{tag}"
    try:
        _ip("netns", "add", a)
    except (subprocess.CalledProcessError, PermissionError) as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        _ip("netns", "add", b)
        _ip("link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        for ns, dev, ip in ((a, f"va{tag}", REDIS_IP), (b, f"vb{tag}", RANKS_IP)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield a, b, f"vb{tag}"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_ranks_and_redis_on_two_hosts(namespaces, tmp_path):
    redis_ns, ranks_ns, ranks_dev = namespaces
    procs = []
    try:
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", redis_ns, find_redis_server(), "--bind", REDIS_IP, "--port", str(PORT),
             "--requirepass", PASSWORD, "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
        env = {**os.environ, "CELERYTP_BROKER": URL, "GLOO_SOCKET_IFNAME": ranks_dev}
        for rank in range(2):
            log = open(tmp_path / f"rank{rank}.log", "wb")
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", ranks_ns, sys.executable, "-m", "celerytp", "worker", "--rank", str(rank),
                 "--world-size", "2", "--group", "netns", "--device", "cpu", "--threads", "1"],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            ))
        log = open(tmp_path / "replica.log", "wb")
        procs.append(subprocess.Popen(  # the replica group's rank, on the Redis host
            ["ip", "netns", "exec", redis_ns, sys.executable, "-m", "celerytp", "worker", "--rank", "0",
             "--world-size", "1", "--group", "replica", "--device", "cpu", "--threads", "1"],
            env={**os.environ, "CELERYTP_BROKER": URL}, stdout=log, stderr=subprocess.STDOUT,
        ))
        time.sleep(0.5)
        run = subprocess.run(
            ["ip", "netns", "exec", redis_ns, sys.executable, "-c", LEADER, URL],
            capture_output=True, text=True, timeout=300,
        )
        logs = "\n".join((tmp_path / f"rank{r}.log").read_text(errors="replace")[-2000:] for r in range(2))
        assert run.returncode == 0, run.stderr[-3000:] + logs
        outcome = json.loads(run.stdout.strip().splitlines()[-1])
        assert outcome["backend"] == "gloo" and outcome["sums"] == [2, 2]
        assert outcome["text"] and outcome["streamed"] == outcome["text"]
        assert outcome["replicas"] == ["netns", "replica"] and all(outcome["took"]), outcome  # both hosts took work
        assert all(outcome["texts"]), outcome
        assert PASSWORD not in logs
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
