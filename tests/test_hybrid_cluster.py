"""A hybrid model (Qwen3-Next: Gated DeltaNet + gated attention + MoE) through real rank workers:
step chords and the fused generate op agree with each other and with transformers."""

from __future__ import annotations

import pytest
from model_fixtures import hf_greedy, make_prompt
from test_models_hybrid import HYBRID_CONFIGS, make_hybrid_model, set_chunk_size

from celerytp.cluster import LocalCluster

STEPS = 12


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    family, extra, chunk = HYBRID_CONFIGS["qwen3_next_uneven"]  # 3 key heads, 3 KV groups: 2 + 1
    model = make_hybrid_model(family, extra, seed=11)
    path = tmp_path_factory.mktemp("hybrid") / "qwen3-next"
    model.save_pretrained(path, safe_serialization=True)
    set_chunk_size(path, chunk)
    return model, path


def test_step_and_fused_agree_with_transformers_at_tp2(qwen3_next):
    hf, path = qwen3_next
    prompt = make_prompt(hf.config.vocab_size, length=40)
    expected = hf_greedy(hf, prompt, steps=STEPS).tokens
    with LocalCluster(world_size=2, group="hybrid", model_roots=[str(path.parent)]) as cluster:
        leader = cluster.leader
        assert leader.load("next", path)[0].model_type == "qwen3_next"
        reply = leader.step("next", prompt, 0)
        stepped = [reply.token]
        while len(stepped) < STEPS:
            stepped.append(leader.step("next", [stepped[-1]], len(prompt) + len(stepped) - 1).token)
        spec = {"request_id": "h1", "prompt": prompt, "max_tokens": STEPS}
        fused = leader.call("generate", {"model_id": "next", "requests": [spec]})[0].rows[0]
        # The recurrent state restarts with each sequence: running again gives the same tokens.
        again = leader.call("generate", {"model_id": "next", "requests": [spec]})[0].rows[0]
    assert stepped == expected
    assert fused.token_ids == expected == again.token_ids
