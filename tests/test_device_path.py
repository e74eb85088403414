"""The decisions a CUDA rank takes, run on a CPU (CELERYTP_DEVICE_PATH_ON_CPU=1: no GPU here).
Decode pads its batch width and the keys it reads to powers of two, so over many steps attention
sees a handful of shapes (a CUDA graph or a cuDNN attention plan each) instead of one per step,
for dense, MoE and hybrid models, eager and compiled; and the tokens are the same bits as
without the padding (the batch-invariant kernel ignores the keys past a row's own)."""

from __future__ import annotations

import pytest
import torch
from model_fixtures import make_hf_model, make_prompt

from celerytp.distributed.tp import TPContext
from celerytp.layers.kv_cache import CacheSlots, bucket
from celerytp.models import load_model

STEPS = 64
FAMILIES = {
    "llama": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                                    intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=40)),
}  # fmt: skip


def _decode_shapes(path, rows: list[list[int]]) -> tuple[set, list[list[int]], bool]:
    """The (batch width, keys read) of every decode step's attention over STEPS greedy steps of
    `rows` (recorded where decode makes its slots, outside any compiled graph), each row's tokens,
    and whether the model padded its decode."""
    model = load_model(path, TPContext(), max_batch=8, max_context=128)
    seen, original = set(), CacheSlots.decode

    def recording(*args, **kwargs) -> CacheSlots:
        slots = original(*args, **kwargs)
        seen.add((len(slots.rows), slots.length))
        return slots

    last = [model.forward_tokens(torch.tensor(p), 0, last_only=True, row=r)[-1] for r, p in enumerate(rows)]
    nexts, tokens = [int(x.argmax()) for x in last], [[] for _ in rows]
    CacheSlots.decode = recording
    try:
        for _ in range(STEPS):
            nexts = [int(t) for t in model.decode(nexts, [True] * len(rows)).argmax(-1)]
            for row, token in zip(tokens, nexts):
                row.append(token)
    finally:
        CacheSlots.decode = original
    return seen, tokens, model.decode_buckets


@pytest.mark.parametrize(("family", "compiled"), [("llama", "0"), ("llama", "1"), ("qwen3_moe", "0"), ("hybrid", "0")])
def test_decode_sees_one_shape_per_bucket_and_the_same_tokens(tmp_path, monkeypatch, family, compiled):
    if family == "hybrid":
        from test_models_hybrid import HYBRID_CONFIGS, make_hybrid_model

        kind, kwargs, _ = HYBRID_CONFIGS["qwen3_next"]
        hf = make_hybrid_model(kind, kwargs, seed=3)
    else:
        hf = make_hf_model(*FAMILIES[family], seed=3)
    hf.save_pretrained(tmp_path / family, safe_serialization=True)
    rows = [make_prompt(hf.config.vocab_size, n, seed=n) for n in (5, 9, 14)]
    monkeypatch.setenv("CELERYTP_COMPILE", compiled)  # this case's decode, eager or compiled
    plain_shapes, plain_tokens, padded = _decode_shapes(tmp_path / family, rows)
    assert not padded and len(plain_shapes) >= STEPS  # precondition: a new key length every step
    monkeypatch.setenv("CELERYTP_DEVICE_PATH_ON_CPU", "1")
    shapes, tokens, padded = _decode_shapes(tmp_path / family, rows)
    key_buckets = {bucket(max(n + step + 1, 16)) for n in (5, 9, 14) for step in range(STEPS)}
    assert padded and len(shapes) <= len(key_buckets), sorted(shapes)
    assert {width for width, _ in shapes} == {bucket(len(rows))}  # 3 rows padded to 4
    assert tokens == plain_tokens
