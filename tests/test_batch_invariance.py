"""Batch invariance (docs/models.md, "Batch invariance"), as it ships (CELERYTP_BATCH_INVARIANT on):
a request's logits are the same bits alone or in a ragged batch of 16 (other lengths, positions,
rows joining midway), cold or from a cached prefix, prefilled in one chunk or several; a seeded
request draws the same tokens in each case; a token's logits inside a prefill equal its decode
step's, so a resumed request prefills its earlier tokens in one pass and goes on as it would have.

Through the real serving loop (bare: ranks on a gloo group, no Celery) on the shipped SmolLM2
Q4_1 file at TP=2 (int4pack and int8pack kernels, compiled decode) and on small random float
models, dense and MoE (oneDNN linears, eager decode), at TP 1 and 2; in process at TP=1 for all
three. The comparison is exact: logprobs are
floats from the logits, compared with ==. With the switch off these fail (SDPA's key blocks and
MKL's row-count-dependent kernels): docs/models.md gives the measured counts.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from bare_loop import serve_bare
from model_fixtures import make_hf_model, make_prompt

from celerytp.core.model_files import default_model_path
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model

FAMILIES = {
    "llama": ("llama", dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)),
    "qwen3_moe": ("qwen3_moe", dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=16,
                                    intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                    moe_intermediate_size=40, mlp_only_layers=[1])),
}  # fmt: skip


def _model(family: str, tmp_path) -> tuple[str, int]:
    """(path, vocabulary size) of the shipped file or a small random model of `family`."""
    if family == "smollm2":
        return default_model_path(), 49152
    if family in FAMILIES:
        hf = make_hf_model(*FAMILIES[family], seed=7)
    else:  # a hybrid: Gated DeltaNet and full-attention layers, MoE
        from test_models_hybrid import HYBRID_CONFIGS, make_hybrid_model

        kind, kwargs, _ = HYBRID_CONFIGS[family]
        hf = make_hybrid_model(kind, kwargs, seed=7)
    hf.save_pretrained(tmp_path / family, safe_serialization=True)
    return str(tmp_path / family), hf.config.vocab_size


# The shipped file at the TP size it ships with (TP=1 below, in process: the loop's rows are the model's)
@pytest.mark.parametrize("family, world", [("smollm2", 2), ("llama", 1), ("llama", 2), ("qwen3_moe", 1), ("qwen3_moe", 2),
                                           ("qwen3_next", 2)])
def test_a_request_is_the_same_alone_batched_cached_and_resumed(tmp_path, family, world):
    path, vocab = _model(family, tmp_path)
    rng = random.Random(1)
    prompt = make_prompt(vocab, 13, seed=2)
    greedy = dict(request_id="g", prompt=prompt, max_tokens=10, sampling=dict(temperature=0, logprobs=2))
    seeded = dict(request_id="s", prompt=prompt[:9], max_tokens=10, sampling=dict(temperature=0.9, seed=3, logprobs=2))
    long = dict(request_id="long", prompt=prompt, max_tokens=24, sampling=dict(temperature=0))
    drawn = dict(request_id="drawn", prompt=prompt, max_tokens=24, sampling=dict(temperature=0.9, seed=11))
    # 14 others of 3 to 40 tokens, some queued while the rest decode: rows at other positions
    others = [dict(request_id=f"o{i}", prompt=make_prompt(vocab, rng.randrange(3, 40), seed=10 + i),
                   max_tokens=rng.randrange(2, 14), **({"after": rng.randrange(1, 6)} if i % 3 == 0 else {}))
              for i in range(14)]  # fmt: skip
    # rows holding the prompt's first 11 and 7 tokens and more, free when the two come: cached prefixes
    warm = [dict(request_id=f"warm{n}", prompt=[*prompt[:n], *make_prompt(vocab, 5, seed=n)], max_tokens=1) for n in (11, 7)]
    # the last run: the long runs resumed after the 16 tokens they had streamed before a failure
    runs = serve_bare(tmp_path, path, world, [
        [[greedy], []], [[seeded], []], [[long, drawn], []],
        [[*others, dict(greedy, after=2), dict(seeded, after=3)], []],
        [[*warm, dict(greedy, after=4), dict(seeded, after=4)], []],
        [[dict(long, resume=["long", 16]), dict(drawn, resume=["drawn", 16])], []],
    ], max_batch=16)  # fmt: skip
    alone = {**runs[0]["rows"], **runs[1]["rows"]}
    batched, cached = runs[3]["rows"], runs[4]["rows"]
    assert runs[3]["stats"]["peak_rows"] >= 12, runs[3]["stats"]
    if family != "qwen3_next":  # a recurrent state continues only its whole history: no prefix of it is reused
        assert cached["g"]["reused"] > 0 and cached["s"]["reused"] > 0, cached
    for rid in ("g", "s"):
        assert len(alone[rid]["tokens"]) > 1, alone[rid]
        assert batched[rid] == alone[rid], (rid, "batched")
        assert {**cached[rid], "reused": 0} == alone[rid], (rid, "cached")

    # The resumed tokens are prefilled with the prompt in one pass (4 steps at a prefill budget of
    # 8, not 16 decode steps), and each request ends with the tokens it had without a failure,
    # greedy or seeded.
    done, resumed = runs[2], runs[5]
    assert {rid: row["tokens"] for rid, row in resumed["rows"].items()} == {rid: row["tokens"] for rid, row in done["rows"].items()}
    assert resumed["stats"]["steps"] <= done["stats"]["steps"] - 12, (resumed["stats"], done["stats"])


@pytest.mark.parametrize("family", ["smollm2", "llama", "qwen3_moe", "qwen3_next", "qwen3_5_moe"])
def test_a_tokens_logits_inside_a_prefill_equal_its_decode_steps(tmp_path, family):
    """TP=1 in process: one prompt prefilled, 12 greedy decode steps alone, and again beside 15
    rows of other lengths; then prompt and tokens prefilled in one forward and in chunks of 5:
    every position's logits, bit for bit. Hybrid models too: their Gated DeltaNet prefills token
    by token with the decode's recurrent step."""
    path, vocab = _model(family, tmp_path)
    model = load_model(path, TPContext(), max_batch=16, max_context=128)
    assert model.batch_invariant
    prompt = make_prompt(vocab, 11, seed=4)
    others = [make_prompt(vocab, 3 + 5 * i, seed=20 + i) for i in range(15)]

    tokens, stepped = _greedy(model, [prompt])
    beside_tokens, beside = _greedy(model, [prompt, *others])
    assert beside_tokens == tokens and all(torch.equal(a, b) for a, b in zip(beside, stepped)), family
    whole = [*prompt, *tokens[:-1]]
    model.clear_cache()
    prefilled = model.forward_tokens(torch.tensor(whole), 0, row=0)[len(prompt) - 1 :]
    model.clear_cache()
    chunks = torch.cat([model.forward_tokens(torch.tensor(whole[i : i + 5]), i, row=0) for i in range(0, len(whole), 5)])
    for i, step in enumerate(stepped):
        assert torch.equal(prefilled[i], step), (family, i)
        assert torch.equal(chunks[len(prompt) - 1 + i], step), (family, i, "chunked")


@pytest.mark.parametrize("switch, value", [("CELERYTP_RECURRENT_PREFILL", "chunks"), ("CELERYTP_BATCH_INVARIANT", "0")])
def test_a_hybrid_model_prefills_by_the_chunked_rule_when_switched(tmp_path, monkeypatch, switch, value):
    """What the test above holds a hybrid to, broken on purpose: with either switch Gated DeltaNet
    prefills by the chunked rule (another order of sums), a token prefilled differs from its
    decode step, and the model says it is not invariant."""
    monkeypatch.setenv(switch, value)  # what this test checks
    path, vocab = _model("qwen3_next", tmp_path)
    model = load_model(path, TPContext(), max_batch=2, max_context=64)
    assert not model.batch_invariant
    prompt = make_prompt(vocab, 12, seed=4)
    prefilled = model.forward_tokens(torch.tensor(prompt), 0, row=0)
    stepped = [model.forward_tokens(torch.tensor(prompt[:1]), 0, row=1)[0]]
    stepped += [model.decode([0, token], [False, True])[0] for token in prompt[1:]]
    assert not all(torch.equal(a, b) for a, b in zip(prefilled, stepped))


def _greedy(model: Any, rows: list[list[int]]) -> tuple[list[int], list[torch.Tensor]]:
    """Row 0's 13 greedy tokens and the logits each was picked from (its prompt's last
    position's, then 12 decode steps'), `rows[1:]` prefilled and decoding beside it."""
    model.clear_cache()
    last = [model.forward_tokens(torch.tensor(p), 0, last_only=True, row=r)[-1] for r, p in enumerate(rows)]
    picked, nexts = [last[0]], [int(row.argmax()) for row in last]
    tokens = [nexts[0]]
    for _ in range(12):
        out = model.decode(nexts, [True] * len(rows))
        picked.append(out[0].clone())
        nexts = [int(t) for t in out.argmax(-1)]
        tokens.append(nexts[0])
    return tokens, picked


@pytest.mark.parametrize("head_dim", [16, 64, 80, 128])
def test_the_attention_kernel_is_one_order_per_query_at_every_head_size(head_dim):
    """The kernel alone (its fast paths for 64 and 128 dims and the general one): a query decoded
    alone, with keys read past its own, beside other rows, or inside a causal prefill gets the
    same bits, and they are SDPA's to float32 rounding."""
    import torch.nn.functional as F

    from celerytp.layers.invariant_attention import attention, attention_kind

    assert attention_kind(torch.device("cpu")) == "invariant"
    g = torch.Generator().manual_seed(head_dim)
    T, heads, kv_heads = 37, 6, 2
    q, k, v = (torch.randn(3, n, T, head_dim, generator=g) for n in (heads, kv_heads, kv_heads))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    prefill = attention(q, k, v, causal, 0.2, "invariant")  # (3, heads, T, head_dim)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(prefill, expected, atol=1e-5, rtol=1e-5)
    for t in (0, 5, 16, 36):
        alone = attention(q[:1, :, t : t + 1], k[:1, :, : t + 1], v[:1, :, : t + 1], None, 0.2, "invariant")
        assert torch.equal(alone[0, :, 0], prefill[0, :, t]), t
        past = (torch.arange(T) <= t)[None, None, None].expand(3, 1, 1, T)  # keys read past its own, 3 rows
        beside = attention(q[:, :, t : t + 1], k, v, past, 0.2, "invariant")
        assert torch.equal(beside[:, :, 0], prefill[:, :, t]), t
