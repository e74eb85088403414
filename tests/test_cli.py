"""The command line as a person meets it: bad input refused before anything starts, in one line
with exit code 2 (runtime errors exit 1: tests/test_cli_status.py); secrets never printed; rank
workers that wait for a late Redis."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import redis

from celerytp.cluster import find_redis_server
from celerytp.core.errors import CeleryTPError
from celerytp.embedded_devices import embedded_device, gpu_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SECRET = "hunter2-not-shown"


def celerytp(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "celerytp", *args], check=False, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": ROOT})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("args", "expected"), [
    (["serve", "--tp", "0"], "error: bad_request: celerytp serve: argument --tp: must be >= 1, got 0"),
    (["generate", "--prompt", "x", "--max-tokens", "-1"],
     "error: bad_request: celerytp generate: argument --max-tokens: must be >= 1, got -1"),
    (["serve", "/no/such/model.gguf"], "error: bad_request: no such file or directory: /no/such/model.gguf"),
    (["serve", "--quant", "q9_9"], "error: bad_request: unknown quant 'q9_9'"),
    (["serve", "--tp", "4"], ("error: bad_request: --tp 4 does not fit SmolLM2-135M-Instruct.Q4_1.gguf: world size 4 "
                             "exceeds num_kv_heads 3")),
    (["serve", "--port", "70000"], "error: bad_request: --port must be in 1..65535, got 70000"),
    (["serve", "--device", "tpu"], "error: bad_request: --device must be one of auto, cpu, cuda, got 'tpu'"),
    (["serve", "--kv-memory-fraction", "1.5"],
     "error: bad_request: celerytp serve: argument --kv-memory-fraction: must be within (0, 1], got 1.5"),
    # an unreachable broker is a runtime error: exit 1 (tests/test_cli_status.py)
])
def test_bad_input_is_one_line_and_exit_2(args, expected):
    started = time.monotonic()
    done = celerytp(*args)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(expected), done.stderr
    assert SECRET not in done.stderr + done.stdout
    assert "starting" not in done.stderr and time.monotonic() - started < 30  # refused before any cluster


@pytest.mark.parametrize(("args", "variable"), [
    (["generate", "--prompt", "x"], "CELERYTP_PACK_LINEARS"),
    (["serve"], "CELERYTP_COMPILE"),
    (["worker", "--rank", "0", "--world-size", "1", "--broker", "redis://127.0.0.1:1/0"], "CELERYTP_PACK_LINEARS"),
    (["serve"], "CELERYTP_QUANT_KERNEL"),
    (["check"], "CELERYTP_SHM"),
    (["generate", "--prompt", "x"], "CELERYTP_ALLOW_SLOW_HALF"),
])
def test_a_mistyped_worker_switch_is_refused_before_anything_starts(args, variable):
    """The rank workers' switches (core/switches.py) are read by the command that starts them: a
    typo is a usage error there, not a failed load later."""
    done = subprocess.run([sys.executable, "-m", "celerytp", *args], check=False, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": ROOT, variable: "yes please"})
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(f"error: bad_request: {variable} must be ") and done.stderr.count("\n") == 1
    assert done.stderr.endswith(", got 'yes please'\n"), done.stderr


def test_the_embedded_cluster_takes_a_gpu_per_rank_or_the_cpu():
    """`--device` of generate/serve/check without --broker (embedded_devices.py): NCCL refuses two
    ranks on one GPU, so `auto` takes GPUs only when there is one per rank. GPU counts are passed
    in (this machine has none: its own count is checked to be 0, and `cuda` refused before
    anything starts)."""
    assert [embedded_device("auto", 2, gpus=n) for n in (0, 1, 2, 8)] == ["cpu", "cpu", "auto", "auto"]
    assert embedded_device("cuda", 2, gpus=2) == "auto" and embedded_device("cpu", 2, gpus=8) == "cpu"
    with pytest.raises(CeleryTPError, match="2 rank.s. need a GPU each, found 1"):
        embedded_device("cuda", 2, gpus=1)
    if gpu_count():
        pytest.skip("this machine has a GPU: the refusal below needs one without")
    assert embedded_device("auto", 1) == "cpu"
    done = celerytp("generate", "--prompt", "x", "--device", "cuda")
    assert done.returncode == 2 and done.stderr.startswith(
        "error: bad_request: --device cuda: 2 rank(s) need a GPU each, found 0"), done.stderr
    assert "starting" not in done.stderr


def test_debug_shows_the_traceback():
    done = celerytp("serve", "/no/such/model.gguf", "--debug")
    assert done.returncode != 0 and "Traceback" in done.stderr


def test_version():
    assert celerytp("--version").stdout.startswith("celerytp ")


@pytest.fixture
def redis_port(tmp_path):
    """A port with no Redis yet; `start(password)` starts one there."""
    port, procs = free_port(), []

    def start(password: str | None = None) -> redis.Redis:
        args = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(tmp_path)]
        procs.append(subprocess.Popen([*args, *(["--requirepass", password] if password else [])],
                                      stdout=subprocess.DEVNULL))
        client = redis.Redis(port=port, password=password)
        for _ in range(100):
            try:
                client.ping()
                return client
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis did not start")

    yield port, start
    for proc in procs:
        proc.terminate()
        proc.wait()


def test_worker_hides_a_wrong_password(redis_port):
    port, start = redis_port
    start(password="right-password")
    done = celerytp("worker", "--rank", "0", "--world-size", "1", "--broker", f"redis://:{SECRET}@127.0.0.1:{port}/0")
    assert done.returncode == 2
    assert SECRET not in done.stderr + done.stdout and "redis://:***@" in done.stderr, done.stderr


def test_worker_waits_for_a_late_redis(redis_port):
    port, start = redis_port
    worker = subprocess.Popen(
        [sys.executable, "-m", "celerytp", "worker", "--rank", "0", "--world-size", "1",  # --device auto
         "--broker", f"redis://127.0.0.1:{port}/0", "--redis-wait", "60"],
        env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        time.sleep(2)
        assert worker.poll() is None
        client = start()
        deadline = time.monotonic() + 60
        # the worker took its rank, and its heartbeat names the device `auto` resolved to
        while json.loads(client.get("celerytp:default:rank:0:owner") or "{}").get("device") != "cpu":
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        worker.send_signal(signal.SIGTERM)
        out = worker.communicate(timeout=30)[0]
    assert "is not reachable" in out and "retrying" in out
