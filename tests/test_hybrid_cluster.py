"""A hybrid model (Qwen3-Next: Gated DeltaNet + gated attention + MoE) through real rank workers:
step chords and the serving loop agree with each other and with transformers, with several
sequences batched in their own recurrent-state rows."""

from __future__ import annotations

import pytest
from model_fixtures import hf_greedy, make_prompt
from test_models_hybrid import HYBRID_CONFIGS, make_hybrid_model, set_chunk_size

from celerytp.cluster import LocalCluster
from celerytp.core.errors import CeleryTPError, ErrorKind

STEPS = 12


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    family, extra, chunk = HYBRID_CONFIGS["qwen3_next_uneven"]  # 3 key heads, 3 KV groups: 2 + 1
    model = make_hybrid_model(family, extra, seed=11)
    path = tmp_path_factory.mktemp("hybrid") / "qwen3-next"
    model.save_pretrained(path, safe_serialization=True)
    set_chunk_size(path, chunk)
    return model, path


@pytest.fixture(scope="module")
def leader(qwen3_next):
    _, path = qwen3_next
    with LocalCluster(world_size=2, group="hybrid", model_roots=[str(path.parent)]) as cluster:
        yield cluster.leader


def test_step_and_fused_agree_with_transformers_at_tp2(qwen3_next, leader):
    hf, path = qwen3_next
    prompt = make_prompt(hf.config.vocab_size, length=40)
    expected = hf_greedy(hf, prompt, steps=STEPS).tokens
    assert leader.load("next", path)[0].model_type == "qwen3_next"
    reply = leader.step("next", prompt, 0)
    stepped = [reply.token]
    while len(stepped) < STEPS:
        stepped.append(leader.step("next", [stepped[-1]], len(prompt) + len(stepped) - 1).token)
    spec = {"request_id": "h1", "prompt": prompt, "max_tokens": STEPS}
    fused = leader.submit("next", spec).result(120)
    # The recurrent state restarts with each sequence: running again gives the same tokens.
    again = leader.submit("next", dict(spec, request_id="h2")).result(120)
    # Beside other sequences, and joining them mid-way, it still gives the same tokens.
    others = [
        leader.submit("next", {"request_id": f"o{i}", "prompt": make_prompt(hf.config.vocab_size, 20 + i, seed=i),
                               "max_tokens": 30})
        for i in range(3)
    ]
    batched = leader.submit("next", dict(spec, request_id="h3")).result(120)
    assert all(len(o.result(120).token_ids) == 30 for o in others)
    assert leader.serving_stats("next")["peak_rows"] == 4
    assert stepped == expected
    assert fused.token_ids == expected == again.token_ids == batched.token_ids
    leader.unload("next")


def test_a_full_queue_is_overloaded_and_loses_nothing_below_it(qwen3_next, leader):
    hf, path = qwen3_next
    leader.load("one", path, max_batch=1, max_queue=2)
    try:
        busy = leader.submit("one", {"request_id": "busy", "prompt": [1, 2, 3], "max_tokens": 100_000, "stream": True})
        events = busy.events(120)
        next(events)  # it holds the only row now
        queued = [leader.submit("one", {"request_id": f"q{i}", "prompt": [4, i + 1], "max_tokens": 3}) for i in range(2)]
        with pytest.raises(CeleryTPError) as info:
            leader.submit("one", {"request_id": "q2", "prompt": [5], "max_tokens": 3})
        assert info.value.kind is ErrorKind.OVERLOADED and "2 requests queued" in str(info.value)
        leader.cancel("busy")
        assert [len(q.result(120).token_ids) for q in queued] == [3, 3]  # nothing queued was lost
        assert list(events)[-1].result.finish_reason == "cancelled"
    finally:
        leader.unload("one")
