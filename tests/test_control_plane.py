"""The two channels and guarded steps (docs/design.md): control data never travels on the model's
group, a failure that one rank alone meets fails the op on every rank at once, and a model is
loaded only if it can serve.

Strict mode (CELERYTP_STRICT_MODEL_GROUP=1) stands in for NCCL, which cannot run here: the model's
group refuses every tensor that is not a floating-point activation, as NCCL refuses CPU tensors.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from model_fixtures import TINY_CONFIGS, make_hf_model, make_prompt

from celerytp import Leader
from celerytp.client.healer import _LockRenewal
from celerytp.cluster import LocalCluster
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.keys import broken_key, comm_key, dispatch_lock_key, loop_key, loop_stats_key
from celerytp.core.model_files import default_model_path
from celerytp.core.switches import ASYNC_FAILURES_ENV, SHM_ENV
from celerytp.core.tokenizer import load_tokenizer
from celerytp.distributed import tp as tp_module
from celerytp.distributed.tp import TPContext


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama with a real tokenizer (SmolLM2's, saved beside it as a Hugging Face directory has it)."""
    model_type, kwargs = TINY_CONFIGS["llama_gqa_bias"]
    model = make_hf_model(model_type, kwargs, seed=3)
    path = tmp_path_factory.mktemp("control") / "tiny"
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).save(path)
    return model.config.vocab_size, path


@pytest.fixture(scope="module")
def strict(tiny):
    _, path = tiny
    env = {"CELERYTP_STRICT_MODEL_GROUP": "1"}
    with LocalCluster(world_size=2, group="strict", model_roots=[str(path.parent)], env=env) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """A tiny llama of 8 layers (16 model collectives a step) with SmolLM2's tokenizer."""
    model_type, kwargs = TINY_CONFIGS["llama_gqa_bias"]
    model = make_hf_model(model_type, dict(kwargs, num_hidden_layers=8, max_position_embeddings=256), seed=4)
    path = tmp_path_factory.mktemp("late") / "deep"
    model.save_pretrained(path, safe_serialization=True)
    load_tokenizer(default_model_path()).save(path)
    return model.config.vocab_size, path


@pytest.mark.parametrize("mode", ["raise", "block", "hang"])
def test_a_peer_lost_under_a_collective_that_fails_late_is_healed_and_no_rank_hangs(deep, mode):
    """NCCL (no GPU here) queues a collective and returns at once: a peer lost under it shows only
    when the host next waits for the device, the step's one copy to the host, and the step's
    outputs are undefined. CELERYTP_ASYNC_FAILURES makes a CPU group's model collectives fail so
    (distributed/late_failures.py): raised at that sync ("raise"); or the sync waits until the
    model group is aborted ("block", as a copy behind a collective that never ends, until
    ncclCommAbort ends it); or waits for good ("hang": a device that not even the abort frees).
    Rank 1 is SIGKILLed mid-stream until rank 0 meets the loss in a model collective (not first
    in a control one, which fails at once on every backend). Raise: rank 0 marks the group broken
    and keeps its process. Block: the deadman aborts the model group within seconds, the freed
    sync raises, and rank 0 keeps its process. Hang: the deadman ends rank 0 and it restarts.
    Either way the group heals with no person and the stream goes on where it stopped, with no
    token of the failed step (the one the abort freed included): its text equals an unbroken run's."""
    vocab, path = deep
    env = {ASYNC_FAILURES_ENV: mode,  # what this test checks
           # gloo fails a collective at once when its peer's socket closes, as NCCL reports a lost
           # peer; the shared-memory path would wait out its deadline instead
           SHM_ENV: "0"}
    with LocalCluster(world_size=2, group=f"late-{mode}", model_roots=[str(path.parent)], env=env) as cluster:
        leader = cluster.leader
        leader.load("deep", path, idle_s=0.2)
        ask = dict(prompt=make_prompt(vocab, 6), max_tokens=160, ignore_eos=True, temperature=0)
        reference = leader.generate("deep", **ask)
        for _ in range(4):
            restarts = list(cluster.restarts)
            stream, deltas, killed = leader.stream("deep", **ask), [], 0.0
            for delta in stream:
                deltas.append(delta)
                if len(deltas) == 8:
                    os.killpg(cluster.workers[1].pid, signal.SIGKILL)
                    killed = time.monotonic()
            assert "".join(deltas) == reference.text and stream.result.token_ids == reference.token_ids
            assert killed and time.monotonic() - killed < 30
            if "failed unseen" in cluster.log(0):
                break
        else:
            pytest.fail("rank 0 met the lost peer in a control collective every time")
        said = {"raise": "collective failed", "block": "the op failed, this worker goes on",
                "hang": "exiting with code 4: a peer of this collective op is gone"}
        assert said[mode] in cluster.log(0)
        assert cluster.restarts[1] == restarts[1] + 1
        assert cluster.restarts[0] == restarts[0] + (mode == "hang")
        assert [r.observed_sum for r in leader.sanity_check()] == [2, 2]


def test_the_gpu_checks_abort_row_runs_its_steps_on_gloo():
    """benchmarks/group_abort.py, the GPU check's in-process abort of the model group, run as that
    check runs it but on gloo (no GPU here; on gloo there is no communicator to abort): the mark
    refuses the next copy from the device, and the group is destroyed and formed again."""
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "group_abort.py"
    done = subprocess.run([sys.executable, str(script), "--device", "cpu"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "next copy refused (the model group was aborted" in done.stdout and "formed again and used" in done.stdout


def test_strict_mode_refuses_control_data_on_the_model_group(monkeypatch, tmp_path):
    """The check the cluster test relies on: it can fail (a 1-rank gloo group; the check runs first)."""
    monkeypatch.setattr(tp_module, "_STRICT", True)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        tp = TPContext(0, 2)
        for tensor in (torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.uint8)):
            with pytest.raises(AssertionError, match="control data on the model's group"):
                tp.all_reduce(tensor)
            with pytest.raises(AssertionError, match="control data on the model's group"):
                tp.gather_last_dim(tensor, [4, 4])
    finally:
        dist.destroy_process_group()


def test_every_op_and_batched_serving_keep_control_off_the_model_group(strict, tiny):
    vocab, path = tiny
    leader = strict.leader
    assert [r.observed_sum for r in leader.sanity_check()] == [2, 2]
    leader.load("tiny", path, idle_s=0.2)
    step = leader.step("tiny", make_prompt(vocab, 6), 0)
    assert step.token is not None
    specs = [{"request_id": f"b{i}", "prompt": make_prompt(vocab, 5 + i, seed=i), "max_tokens": 12,
              "stream": i == 0, "stop": ["zz"] if i == 1 else []} for i in range(4)]
    with ThreadPoolExecutor(4) as pool:  # together: one loop decodes them in one batch
        results = list(pool.map(lambda spec: leader.submit("tiny", spec).result(120), specs))
    assert all(r.finish_reason in ("length", "stop") and r.token_ids for r in results)
    assert leader.serving_stats("tiny")["peak_rows"] >= 2
    streamed = [e for e in leader.submit("tiny", dict(specs[0], request_id="s")).events(120)]
    assert len(streamed) >= 2  # tokens, then the result
    assert all(p.group_broken is None for p in leader.ping())
    leader.unload("tiny")


def test_a_corrupt_tokenizer_fails_the_load_on_every_rank(strict, tiny, tmp_path):
    _, good = tiny
    bad = good.parent / "bad-tokenizer"
    shutil.copytree(good, bad)
    (bad / "tokenizer.json").write_text("{ this is not a tokenizer")
    leader = strict.leader
    started = time.monotonic()
    with pytest.raises(CeleryTPError) as caught:
        leader.load("bad", bad)
    assert time.monotonic() - started < 30
    by_rank = {f.rank: f for f in caught.value.failures}
    assert set(by_rank) == {0, 1} and caught.value.kinds == {ErrorKind.LOAD_FAILED}
    assert "tokenizer" in by_rank[0].message and "rolled back: rank 0" in by_rank[1].message
    assert all("bad" not in p.models for p in leader.ping())
    assert [r.observed_sum for r in leader.sanity_check()] == [2, 2]  # the group is still whole


def test_a_tokenizer_corrupted_after_load_does_not_stop_serving(strict, tiny):
    """Rank 0 read and checked it at load: serving never reads the file again."""
    vocab, good = tiny
    path = good.parent / "later-corrupted"
    shutil.copytree(good, path)
    leader = strict.leader
    leader.load("later", path, idle_s=0.2)
    (path / "tokenizer.json").write_text("garbage")
    result = leader.submit("later", {"request_id": "c1", "prompt": make_prompt(vocab, 4), "max_tokens": 4,
                                     "stop": ["xyz"]}).result(60)
    assert len(result.token_ids) == 4
    leader.unload("later")


def test_redis_refusing_rank_0_fails_every_rank_at_once(strict, tiny):
    """Redis refuses rank 0's write in the serving loop (its stats key holds another type): the
    request gets a typed error within seconds, no rank waits in a collective, the group stays whole."""
    vocab, path = tiny
    leader = strict.leader
    leader.load("refused", path, idle_s=0.2)
    leader.redis.set(loop_stats_key(strict.group, "refused"), "not a hash")
    started = time.monotonic()
    with pytest.raises(CeleryTPError) as caught:
        leader.submit("refused", {"request_id": "r1", "prompt": make_prompt(vocab, 4), "max_tokens": 4}).result(60)
    assert time.monotonic() - started < 10
    assert caught.value.kind is ErrorKind.INTERNAL and "WRONGTYPE" in caught.value.message
    leader.redis.delete(loop_stats_key(strict.group, "refused"))
    assert [r.observed_sum for r in leader.sanity_check()] == [2, 2]
    result = leader.submit("refused", {"request_id": "r2", "prompt": make_prompt(vocab, 4), "max_tokens": 4}).result(60)
    assert len(result.token_ids) == 4
    leader.unload("refused")


def test_a_broken_group_is_reported_and_healed_while_every_process_lives(strict, tiny):
    """A rank whose group broke says so (group_broken in ping, the broken key); the next op heals.
    Every rank kept its process, so every rank keeps its weights through the heal; once the model's
    file changed, the next heal reads it again. The tokens are the unbroken group's either way."""
    vocab, path = tiny
    leader = strict.leader
    leader.load("heal", path, idle_s=0.2)
    ask = {"prompt": make_prompt(vocab, 4), "max_tokens": 4}  # greedy (the default)
    reference = leader.submit("heal", {"request_id": "h0", **ask}).result(60).token_ids

    def break_and_heal(request_id: str) -> None:
        before = leader.ping()[0].comm_id
        assert leader.redis.get(comm_key(strict.group)).decode() == before
        leader.redis.set(broken_key(strict.group), before)  # as a rank writes it when a collective fails
        result = leader.submit("heal", {"request_id": request_id, **ask}).result(120)
        assert result.token_ids == reference
        pongs = leader.ping()
        assert pongs[0].comm_id != before and all("heal" in p.models for p in pongs)

    def kept() -> list[int]:
        return [strict.log(rank).count("model heal: kept its weights") for rank in range(2)]

    was = kept()
    break_and_heal("h1")
    assert kept() == [n + 1 for n in was]
    weights = path / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    break_and_heal("h2")
    assert kept() == [n + 1 for n in was]  # read again: the file is not the one the shards came from
    assert all(strict.log(rank).count("model heal changed since this rank loaded it") == 1 for rank in range(2))
    leader.unload("heal")


def test_ping_answers_during_a_load_from_the_same_and_another_leader(strict):
    """Control never waits behind work: not in the Leader (no lock across an op's wait) and not on
    the ranks (their control path answers beside the op thread)."""
    leader = strict.leader
    other = Leader(strict.broker_url, strict.group, strict.world_size)
    loading = threading.Thread(target=lambda: leader.load("big", None, quant="f32"))
    started = time.monotonic()
    loading.start()
    pings: list[float] = []
    while loading.is_alive():
        for who in (leader, other):
            begun = time.monotonic()
            assert len(who.ping(timeout=10)) == 2
            pings.append(time.monotonic() - begun)
        time.sleep(0.1)
    load_s = time.monotonic() - started
    leader.unload("big")
    assert len(pings) >= 4, (pings, load_s)  # several pings, each from both Leaders, while the load ran
    assert max(pings) < min(1.0, load_s / 2), (pings, load_s)


def _wait_rows_free(leader, model_id: str, within_s: float) -> float:
    started = time.monotonic()
    while leader.serving_stats(model_id).get("running_rows", 0):
        assert time.monotonic() - started < within_s, "the abandoned request still holds its row"
        time.sleep(0.01)
    return time.monotonic() - started


def test_abandoned_requests_free_their_rows(strict):
    """A followed stream dropped after 3 tokens, and a wait that timed out, cancel their request:
    the row frees at once, not after 100,000 tokens (SmolLM2: a context long enough to keep going)."""
    leader = strict.leader
    leader.load("abandon", None, idle_s=5)
    endless = {"prompt": [1, 2, 3, 4], "max_tokens": 100_000, "stream": True}
    events = leader.submit("abandon", {**endless, "request_id": "drop"}).events(120)
    for _ in range(3):
        next(events)
    del events  # garbage: its generator closes, which cancels the request
    _wait_rows_free(leader, "abandon", 5)
    with pytest.raises(CeleryTPError) as caught:
        leader.submit("abandon", {**endless, "request_id": "late"}).result(0.5)
    assert caught.value.kind is ErrorKind.TIMEOUT
    _wait_rows_free(leader, "abandon", 5)
    # cancel() then leaving: the cancel key survives the caller's exit until rank 0 reads it
    pending = leader.submit("abandon", {**endless, "request_id": "quit"})
    events = pending.events(120)
    next(events)
    leader.cancel("quit")
    events.close()
    _wait_rows_free(leader, "abandon", 5)
    leader.unload("abandon")


def test_a_loop_that_cannot_start_is_a_typed_error_that_leaves_nothing_behind(strict, tiny):
    """The serve chord cannot be published (another holder keeps the dispatch lock): the caller
    gets `timeout` at once, its request leaves the queue and the loop flag is freed."""
    vocab, path = tiny
    leader = strict.leader
    leader.load("nostart", path, idle_s=0.2)
    impatient = Leader(strict.broker_url, strict.group, strict.world_size, timeout=0.5)
    leader.redis.set(dispatch_lock_key(strict.group), "someone-else", ex=30)
    try:
        with pytest.raises(CeleryTPError) as caught:
            impatient.submit("nostart", {"request_id": "ns1", "prompt": make_prompt(vocab, 4), "max_tokens": 4})
        assert caught.value.kind is ErrorKind.TIMEOUT and "not started" in caught.value.message
        assert leader.serving_stats("nostart")["queued"] == 0
        assert not leader.redis.exists(loop_key(strict.group, "nostart"))
    finally:
        leader.redis.delete(dispatch_lock_key(strict.group))
    result = impatient.submit("nostart", {"request_id": "ns2", "prompt": make_prompt(vocab, 4), "max_tokens": 4}).result(60)
    assert len(result.token_ids) == 4
    leader.unload("nostart")


def test_the_heal_lock_outlives_its_ttl_while_held_and_frees_soon_after(strict):
    """Renewed every third of its TTL while the heal runs; after the holder stops, gone within a TTL."""
    client = strict.leader.redis
    client.set("celerytp:test:lock", "me", px=600)
    renewing = _LockRenewal(client, "celerytp:test:lock", "me", 0.6)
    time.sleep(1.5)  # 2.5 TTLs
    assert client.get("celerytp:test:lock") == b"me"
    renewing.stop()
    time.sleep(0.9)
    assert client.get("celerytp:test:lock") is None
