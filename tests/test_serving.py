"""Continuous batching on the real default model: requests join and leave a running serving
loop at token boundaries, from any leader in any process, with prefix reuse and cancellation."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from bare_loop import serve_bare

from celerytp import Leader
from celerytp.cluster import LocalCluster
from celerytp.core.keys import loop_key, queue_key

pytestmark = pytest.mark.slow

TARGET = dict(prompt="The history of Rome in one sentence:", max_tokens=16, temperature=0)


def start(world_size: int):
    cluster = LocalCluster(world_size=world_size, group=f"serving{world_size}")
    cluster.start()
    # f32: exact float weights, so a row's greedy tokens do not depend on its batch
    cluster.leader.load("smol", None, quant="f32", max_batch=16, idle_s=0.3)
    return cluster


@pytest.fixture(scope="module")
def tp2():
    cluster = start(2)
    yield cluster.leader
    cluster.stop()


@pytest.fixture(scope="module")
def tp1():
    cluster = start(1)
    yield cluster.leader
    cluster.stop()


@pytest.mark.parametrize("which", ["tp1", "tp2"])
def test_greedy_tokens_alone_joining_midway_and_beside_15_others(which, request):
    leader = request.getfixturevalue(which)
    alone = leader.generate("smol", **TARGET).token_ids
    assert len(alone) == 16

    long = leader.stream("smol", prompt="Once upon a time", max_tokens=60, temperature=0, ignore_eos=True)
    deltas = iter(long)
    next(deltas), next(deltas)  # the long request is decoding now
    joined = leader.generate("smol", **TARGET)
    assert "".join(deltas) and long.result.completion_tokens == 60
    assert joined.token_ids == alone

    with ThreadPoolExecutor(16) as pool:
        others = [pool.submit(leader.generate, "smol", prompt=f"Item {i}:", max_tokens=16, temperature=0) for i in range(15)]
        beside = pool.submit(leader.generate, "smol", **TARGET)
        assert all(len(f.result(300).token_ids) <= 16 for f in others)
    assert beside.result().token_ids == alone
    assert leader.serving_stats("smol")["peak_rows"] >= 8


def test_a_seeded_draw_over_the_whole_vocabulary_is_the_same_whatever_shares_its_batch(tp2):
    """Temperature alone: every rank draws in its vocabulary slice and rank 0 keeps one rank's draw
    (no logits gathered). Beside a row that needs the whole logits gathered (a repetition penalty),
    the same draw is made from the slices: the same tokens as beside a greedy row. Both pairs are
    queued before the loop starts, so they run in the same batch shapes (bit-equal logits)."""
    seeded = dict(prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=3, ignore_eos=True)
    flag = loop_key(tp2.group, "smol")

    def beside(other: dict) -> list[int]:
        tp2.clear_kv_cache("smol")  # no prefix reuse: both runs prefill alike
        _hold(tp2, flag)
        with ThreadPoolExecutor(2) as pool:
            mine = pool.submit(tp2.generate, "smol", **seeded)
            _wait_queued(tp2, 1)
            theirs = pool.submit(tp2.generate, "smol", prompt="Once upon a day", max_tokens=12, ignore_eos=True, **other)
            _wait_queued(tp2, 2)
            tp2.redis.delete(flag)  # the waiters start a loop, which takes both at once
            assert len(theirs.result(120).token_ids) == 12
            return mine.result(120).token_ids

    tokens = beside(dict(temperature=0))
    assert beside(dict(temperature=0.9, repetition_penalty=1.2)) == tokens
    assert tp2.generate("smol", **dict(seeded, seed=4)).token_ids != tokens


def _wait_queued(leader, count: int) -> None:
    deadline = time.monotonic() + 10
    while leader.redis.llen(queue_key("smol")) < count:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_short_request_overtakes_a_long_one_and_a_running_one_cancels(tp2):
    long = tp2.stream("smol", prompt="Write a long story:", max_tokens=300, temperature=0, ignore_eos=True)
    deltas = iter(long)
    next(deltas)
    short = tp2.generate("smol", prompt="2+2=", max_tokens=5, temperature=0)
    assert short.completion_tokens == 5 and long.result is None  # the long one still runs
    assert tp2.serving_stats("smol")["running_rows"] >= 1
    tp2.cancel(long.request_id)
    rest = "".join(deltas)
    assert long.result.finish_reason == "cancelled" and 1 <= long.result.completion_tokens < 300, rest


def test_a_cancelled_queued_request_never_runs(tp2):
    # Hold the loop flag, as a loop being started would: the request waits in the queue.
    flag = loop_key(tp2.group, "smol")
    _hold(tp2, flag)
    request = tp2.submit("smol", {"request_id": "queued-cancel", "prompt": [1, 2, 3], "max_tokens": 50})
    Leader(tp2.broker_url, tp2.group, tp2.world_size).cancel("queued-cancel")  # another leader: no queue removal
    tp2.redis.delete(flag)  # as if that loop had died: the waiter starts one, which must not run the request
    result = request.result(60)
    assert result.finish_reason == "cancelled" and result.token_ids == []
    assert tp2.serving_stats("smol")["requests"] == 0
    # Cancelled by the leader that queued it: taken off the queue at once.
    _hold(tp2, flag)
    mine = tp2.submit("smol", {"request_id": "queued-cancel-2", "prompt": [1, 2, 3], "max_tokens": 50})
    tp2.cancel("queued-cancel-2")
    assert mine.result(10).finish_reason == "cancelled" and tp2.redis.llen(queue_key("smol")) == 0
    tp2.redis.delete(flag)


def _hold(leader, flag: str) -> None:
    """Hold a loop flag once the loop that has it ended (taking a live loop's lease would stop it)."""
    deadline = time.monotonic() + 10
    while not leader.redis.set(flag, "held-by-test", nx=True, ex=30):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_follow_up_chat_turn_reuses_the_cached_prefix(tp2):
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    first = tp2.generate("smol", messages=chat, max_tokens=30, temperature=0)
    follow_up = [*chat, {"role": "assistant", "content": first.text}, {"role": "user", "content": "And of Italy?"}]
    reused = tp2.generate("smol", messages=follow_up, max_tokens=20, temperature=0)
    assert reused.reused_tokens >= first.prompt_tokens + len(first.token_ids) // 2
    assert reused.prompt_tokens - reused.reused_tokens < 20  # only the new turn was prefilled
    tp2.clear_kv_cache("smol")  # no cached prefix left
    fresh = tp2.generate("smol", messages=follow_up, max_tokens=20, temperature=0)
    assert fresh.reused_tokens == 0
    assert fresh.token_ids == reused.token_ids


OTHER_PROCESS = """
import sys, time
from celerytp import Leader
leader = Leader(sys.argv[1], sys.argv[2], 2)
while not leader.redis.get("go"):
    time.sleep(0.005)
pending = [leader.submit("smol", {"request_id": f"proc-{i}", "prompt": [1, 2, 3 + i], "max_tokens": 24})
           for i in range(3)]
print(sum(len(p.result(120).token_ids) for p in pending))
"""


def test_leaders_in_two_processes_share_one_loop(tp2):
    other = subprocess.Popen(
        [sys.executable, "-c", OTHER_PROCESS, tp2.broker_url, tp2.group], stdout=subprocess.PIPE, text=True
    )
    time.sleep(3)  # its imports
    tp2.redis.set("go", 1, ex=60)
    mine = [tp2.submit("smol", {"request_id": f"main-{i}", "prompt": [4, 5, 6 + i], "max_tokens": 24}) for i in range(3)]
    assert [len(p.result(120).token_ids) for p in mine] == [24] * 3
    out, _ = other.communicate(timeout=120)
    assert other.returncode == 0 and out.strip() == "72"
    assert tp2.serving_stats("smol")["peak_rows"] >= 4  # rows of both processes in one step


def test_no_request_is_stranded_around_the_idle_window(tp2):
    """Submitters with random gaps around the loop's 0.3 s idle window: loops end and start
    again while requests arrive, and every request still completes."""
    rng = random.Random(7)
    gaps = [[rng.uniform(0.0, 0.6) for _ in range(8)] for _ in range(4)]
    results: dict[str, int] = {}

    def submitter(n: int) -> None:
        leader = Leader(tp2.broker_url, tp2.group, tp2.world_size)  # its own leader, as another process would be
        for i, gap in enumerate(gaps[n]):
            time.sleep(gap)
            rid = f"s{n}-{i}"
            results[rid] = len(leader.submit("smol", {"request_id": rid, "prompt": [7, n, i], "max_tokens": 2}).result(60).token_ids)

    threads = [threading.Thread(target=submitter, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {f"s{n}-{i}": 2 for n in range(4) for i in range(8)}
    assert json.loads(json.dumps(tp2.serving_stats("smol")))["queued"] == 0


def _tiny_llama(path):
    """A random llama whose 161-token vocabulary splits unevenly over 2 ranks, saved at `path`."""
    import torch
    from model_fixtures import COMMON, randomize
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **{**COMMON, "vocab_size": 161}, hidden_size=64, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=96)
    torch.manual_seed(0)
    model = randomize(AutoModelForCausalLM.from_config(config).eval())
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.mark.parametrize("world", [1, 2])
def test_prompt_logprobs_match_transformers(tmp_path, world):
    """Every prompt position's log-probability of the next prompt token and its top alternatives,
    from the ranks' vocabulary slices (161 tokens: uneven at TP=2), as transformers' log_softmax
    gives them, for a prompt chunked over three prefill steps and a short one beside it."""
    import torch
    from model_fixtures import make_prompt

    model = _tiny_llama(tmp_path / "tiny")
    asks = [[make_prompt(161, 20, seed=1), 3], [make_prompt(161, 6, seed=2), 0]]
    specs = [dict(request_id=f"r{i}", prompt=prompt, max_tokens=1, prompt_logprobs=n) for i, (prompt, n) in enumerate(asks)]
    specs.append(dict(request_id="plain", prompt=asks[0][0][:5], max_tokens=1))  # beside them, batched
    (run,) = serve_bare(tmp_path, tmp_path / "tiny", world, [[specs, []]])
    served = {rid: row["prompt_logprobs"] for rid, row in run["rows"].items()}
    assert served["plain"] is None
    for i, (prompt, n) in enumerate(asks):
        with torch.no_grad():
            reference = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)  # (T, V)
        entries = served[f"r{i}"]
        assert len(entries) == len(prompt) and entries[0] is None
        for position, (logprob, top) in enumerate(entries[1:]):
            expected = reference[position]
            assert abs(logprob - float(expected[prompt[position + 1]])) < 1e-4, (i, position)
            values, ids = expected.topk(n)
            assert [token for token, _ in top] == ids.tolist(), (i, position)
            assert torch.allclose(torch.tensor([lp for _, lp in top]), values, atol=1e-4), (i, position)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_equal_prompts_are_prefilled_once_and_each_row_samples_as_if_alone(tmp_path, family):
    """n choices of one prompt (seeded: seed, seed + 1, ...) and equal greedy prompts queued
    together: one row computes the prompt (20 tokens: three prefill steps at a budget of 8), the
    others copy its cache, and each samples what it samples alone (the first token's logprob bit
    for bit: a seeded prompt is computed alone, so the copy equals a cold prefill). When the
    computing row is cancelled part-way, a waiting row computes the prompt itself. At TP=2, a
    dense model (uneven vocabulary slices) and a hybrid one (recurrent state copied too)."""
    from model_fixtures import make_prompt

    if family == "llama":
        hf = _tiny_llama(tmp_path / "model")
    else:
        from test_models_hybrid import HYBRID_CONFIGS, make_hybrid_model, set_chunk_size

        kind, extra, chunk = HYBRID_CONFIGS["qwen3_next_uneven"]
        hf = make_hybrid_model(kind, extra, seed=11)
        hf.save_pretrained(tmp_path / "model", safe_serialization=True)
        set_chunk_size(tmp_path / "model", chunk)
    vocab = hf.config.vocab_size
    prompt, other = make_prompt(vocab, 20, seed=3), make_prompt(vocab, 11, seed=4)
    choices = [dict(request_id=f"c{i}", prompt=prompt, max_tokens=6,
                    sampling=dict(temperature=1.0, seed=5 + i, logprobs=1)) for i in range(3)]
    greedy = [dict(request_id=f"g{i}", prompt=other, max_tokens=6, sampling=dict(temperature=0, logprobs=1)) for i in range(2)]
    late = dict(greedy[1], request_id="late", after=3)  # while g0 decodes: it copies the prompt's first 10 tokens
    runs = [[choices + greedy, []], *([[spec], []] for spec in choices + greedy[:1]), [choices[:2], ["c0"]],
            [[greedy[0], late], []]]
    together, *alone, cancelled, later = serve_bare(tmp_path, tmp_path / "model", 2, runs)
    alone = {rid: row for run in alone for rid, row in run["rows"].items()}

    assert together["stats"]["shared_prompt_tokens"] == 2 * len(prompt) + len(other)
    for rid, row in together["rows"].items():
        lone = alone[rid if rid in alone else "g0"]
        assert row["tokens"] == lone["tokens"], rid
        if rid[0] == "c":  # seeded: the prompt's logits bit for bit (greedy ones may be chunked otherwise)
            assert row["logprobs"][0][0] == lone["logprobs"][0][0], rid
        assert [lp for lp, _ in row["logprobs"]] == pytest.approx([lp for lp, _ in lone["logprobs"]], abs=1e-4), rid
        assert row["reused"] == (0 if rid in ("c0", "g0") else len(prompt) if rid[0] == "c" else len(other)), rid
    assert len({tuple(together["rows"][f"c{i}"]["tokens"]) for i in range(3)}) > 1  # each choice draws its own

    assert cancelled["rows"]["c0"]["finish"] == "cancelled"
    assert cancelled["stats"]["shared_prompt_tokens"] == 0
    assert cancelled["rows"]["c1"]["tokens"] == alone["c1"]["tokens"]
    assert cancelled["rows"]["c1"]["logprobs"][0][0] == alone["c1"]["logprobs"][0][0]

    # Arriving once g0 decodes, the same prompt copies what g0's row holds of it (a recurrent
    # state cannot be cut to a prefix: the hybrid copies nothing then)
    copied = len(other) - 1 if family == "llama" else 0
    assert later["stats"]["shared_prompt_tokens"] == copied
    assert later["rows"]["late"]["tokens"] == alone["g0"]["tokens"] and later["rows"]["late"]["reused"] == copied


# A bug met by one request's data alone, injected (no input that passes validation fails rank 0's
# work today): the sampler's reshaping of a request whose logit_bias holds token 7 (the batched
# pick), and the stop check of a request of max_tokens 5 (each row's own bookkeeping).
FAILING_ROWS = """
from celerytp.core.stopping import StopChecker
from celerytp.worker.sampling import RowSampler

def _failing(real, fails):
    def wrapped(self, *args):
        if fails(self):
            raise RuntimeError("injected")
        return real(self, *args)
    return wrapped

RowSampler.reshape = _failing(RowSampler.reshape, lambda s: 7 in (s.params.logit_bias or {}))
StopChecker.after = _failing(StopChecker.after, lambda s: s.max_tokens == 5)
"""


def test_a_request_whose_own_processing_fails_ends_alone_and_the_loop_goes_on(tmp_path):
    """Rank 0's work for one request failing (its sampling, its stop check) answers that request
    with an `internal` error naming it; the loop does not abort, and the requests beside it end
    as they do alone (TP=2)."""
    from model_fixtures import make_prompt

    _tiny_llama(tmp_path / "tiny")
    good = [dict(request_id=f"ok{i}", prompt=make_prompt(161, 6 + i, seed=i), max_tokens=6,
                 sampling=dict(temperature=0, logit_bias={"3": 2.0})) for i in range(2)]
    bad = [dict(request_id="bad_pick", prompt=make_prompt(161, 5, seed=8), max_tokens=6,
                sampling=dict(temperature=0, logit_bias={"7": 1.0})),
           dict(request_id="bad_take", prompt=make_prompt(161, 4, seed=9), max_tokens=5, sampling=dict(temperature=0))]
    together, alone = serve_bare(tmp_path, tmp_path / "tiny", 2, [[good + bad, []], [good, []]], prelude=FAILING_ROWS)
    for rid in ("bad_pick", "bad_take"):
        kind, message = together["rows"][rid]["error"]
        assert kind == "internal" and rid in message and "injected" in message, (rid, kind, message)
    for spec in good:
        assert together["rows"][spec["request_id"]]["tokens"] == alone["rows"][spec["request_id"]]["tokens"]
        assert together["rows"][spec["request_id"]]["finish"] == "length"
