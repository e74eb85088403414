"""`celerytp status` against a real LocalCluster (private Redis, a real rank worker), as text and
as JSON, idle and while a request decodes; and the CLI's exit codes: 2 for usage errors, 1 for
runtime errors, one line each."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from celerytp.cluster import LocalCluster
from celerytp.core.keys import loop_key

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GROUP = "st"
SECRET = "hunter2-not-shown"


def celerytp(*args: str, broker: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT}
    env.pop("CELERYTP_BROKER", None)
    if broker:
        env["CELERYTP_BROKER"] = broker  # not on the command line
    return subprocess.run([sys.executable, "-m", "celerytp", *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def models_root(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def cluster(models_root):
    with LocalCluster(world_size=1, group=GROUP, model_roots=[str(models_root)]) as cluster:
        cluster.leader.load("smol", None, max_batch=2, max_context=512)
        yield cluster


def status_json(cluster: LocalCluster) -> dict:
    done = celerytp("status", "--json", "--group", GROUP, "--tp", "1", broker=cluster.broker_url)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_status_json_when_idle(cluster):
    status = status_json(cluster)
    (group,) = [g for g in status["groups"] if g["group"] == GROUP]
    assert group["up"] and group["world_size"] == 1 and group["alive_ranks"] == 1 and not group["busy"]
    (rank,) = group["ranks"]
    assert rank["alive"] and rank["pid"] == cluster.leader.health()[0]["pid"]
    assert rank["rss_bytes"] > 50 * 2**20 and rank["models"] == ["smol"]
    memory, (pong,) = rank["memory"], cluster.leader.ping()  # the ping op reports the same
    assert memory["weights"] == pong.memory["weights"] > 50 * 2**20 and memory["kv_cache"] == pong.memory["kv_cache"] > 0
    assert 0 < memory["free"] <= memory["total"] and memory["peak"] >= rank["rss_bytes"] * 0.9
    (model,) = status["models"]
    assert model["model"] == "smol" and model["replicas"] == [GROUP] and model["queued"] == 0
    assert model["max_batch"] == 2 and model["max_context"] == 512 and "path" not in model
    assert not model["loops"][GROUP]["running"]


def test_status_while_a_request_decodes(cluster):
    stream = cluster.leader.stream("smol", prompt="Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)
    with stream:
        next(iter(stream))
        status = status_json(cluster)
    (group,) = [g for g in status["groups"] if g["group"] == GROUP]
    assert group["busy"] and group["serving"] == ["smol"] and group["ranks"][0]["busy"]
    loop = status["models"][0]["loops"][GROUP]
    assert loop["running"] and loop["inflight"] == 1 and loop["steps"] >= 1


def test_a_loop_that_ends_idle_is_no_failure(cluster):
    cluster.leader.generate("smol", prompt="Hello", max_tokens=4, temperature=0)
    deadline = time.monotonic() + 30
    while cluster.leader.redis.exists(loop_key(GROUP, "smol")):  # the loop ends idle_s after its last request
        assert time.monotonic() < deadline, "the serving loop did not end"
        time.sleep(0.1)
    cluster.leader.clear_kv_cache("smol")  # an op queued behind the serve op: it ended (and counted) by now
    loop = status_json(cluster)["models"][0]["loops"][GROUP]
    assert not loop["running"] and loop["requests"] >= 1 and loop["failures"] == {}


def test_status_text_is_one_screen_without_secrets(cluster):
    done = celerytp("status", "--group", GROUP, "--tp", "1", broker=cluster.broker_url)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for heading in ("GROUPS", "RANKS", "MODELS", "LOOPS"):
        assert heading in out
    assert "smol" in out and "MiB" in out and f"{GROUP}  " in out
    password = cluster.broker_url.split(":")[2].split("@")[0]
    assert password not in out + done.stderr
    assert cluster.leader.models()["smol"]["path"] not in out  # no model root on the screen
    assert len(out.splitlines()) < 40
    header, row = [line.split() for line in out.split("LOOPS\n")[1].splitlines()[:2]]
    assert header[-1] == "failures" and row[:2] == ["smol", GROUP] and row[-1] == "0"


@pytest.mark.parametrize(("args", "code", "expected"), [
    (["status", "--broker", f"redis://:{SECRET}@127.0.0.1:1/0"], 1,
     "error: broker_unavailable: cannot reach the broker at redis://:***@127.0.0.1:1/0"),
    (["models", "list", "--broker", f"redis://:{SECRET}@127.0.0.1:1/0"], 1,
     "error: broker_unavailable: cannot reach the broker at redis://:***@127.0.0.1:1/0"),
    (["status", "--timeout", "soon", "--broker", "redis://127.0.0.1:1/0"], 2,
     "error: bad_request: celerytp status: argument --timeout: invalid float value: 'soon'"),
    (["status"], 2, "error: bad_request: celerytp status: the following arguments are required: --broker"),
    (["models", "frobnicate"], 2, "error: bad_request: celerytp models: argument action: invalid choice"),
])
def test_exit_codes_usage_2_runtime_1(args, code, expected):
    done = celerytp(*args)
    assert done.returncode == code, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(expected), done.stderr
    assert SECRET not in done.stdout + done.stderr and "Traceback" not in done.stderr


def test_a_runtime_error_shows_its_traceback_with_debug():
    done = celerytp("status", "--debug", "--broker", "redis://127.0.0.1:1/0")
    assert done.returncode == 1 and "Traceback" in done.stderr and "broker_unavailable" in done.stderr


@pytest.mark.parametrize("where", ["in_root", "outside_root"])
def test_a_load_the_ranks_refuse_exits_1(cluster, models_root, tmp_path, where):
    """A load that fails on the ranks (a broken model file; a path they do not allow) is a runtime
    error: exit 1, one line with its kind, not the usage code."""
    bogus = (models_root if where == "in_root" else tmp_path) / f"bogus-{where}.gguf"
    bogus.write_bytes(b"GGUF" + b"\0" * 64)
    done = celerytp("models", "load", str(bogus), "--model-id", "bogus", "--group", GROUP, "--tp", "1",
                    broker=cluster.broker_url)
    assert done.returncode == 1, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and "Traceback" not in done.stderr, done.stderr
    assert "bogus" not in cluster.leader.models()


def test_a_failed_loop_is_counted_by_kind(cluster):
    """A real loop failure, provoked without mocks: the loop's lease (its flag) is taken from it
    while it decodes, as when a loop stalls past its lease and another loop takes over. Rank 0 sees
    it at its next write and aborts the loop (kind internal): counted once, shown by kind."""
    stream = cluster.leader.stream("smol", prompt="Once upon a time", max_tokens=400, temperature=0, ignore_eos=True)
    with stream:
        next(iter(stream))
        cluster.leader.redis.set(loop_key(GROUP, "smol"), "taken-by-another-loop", px=2000)  # lapses: loops start again
        deadline = time.monotonic() + 30
        while not (loop := status_json(cluster)["models"][0]["loops"][GROUP])["failures"]:
            assert time.monotonic() < deadline, "the failed loop was not counted"
            time.sleep(0.2)
    assert loop["failures"] == {"internal": 1}
    done = celerytp("status", "--group", GROUP, "--tp", "1", broker=cluster.broker_url)
    assert done.returncode == 0, done.stderr
    row = next(line.split() for line in done.stdout.split("LOOPS\n")[1].splitlines() if line.startswith("smol "))
    assert row[-1] == "internal=1"
