"""The decisions a CUDA rank takes, run on a CPU (CELERYTP_DEVICE_PATH_ON_CPU=1: no GPU here).
Decode pads its batch width and the keys it reads to powers of two, and a prefill piece its
tokens and keys, so over many steps attention sees a handful of shapes (a CUDA graph or a cuDNN
attention plan each) instead of one per step, for dense, MoE and hybrid models, eager and
compiled; and the tokens are the same bits as without the padding (the batch-invariant kernel
ignores the keys past a row's own). A serving step makes the host wait for the device once on
rank 0 and never elsewhere (worker/host_syncs.py counts it)."""

from __future__ import annotations

import os

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


def _saved(family: str, path) -> object:
    """A small random model of `family` (or qwen3_next for "hybrid"), saved at `path`."""
    if family == "hybrid":
        from test_models_hybrid import HYBRID_CONFIGS, make_hybrid_model

        kind, kwargs, _ = HYBRID_CONFIGS["qwen3_next"]
        hf = make_hybrid_model(kind, kwargs, seed=3)
    else:
        hf = make_hf_model(*FAMILIES[family], seed=3)
    hf.save_pretrained(path, safe_serialization=True)
    return hf


def _decode_shapes(path, rows: list[list[int]]) -> tuple[set, list[list[int]], bool, set]:
    """The (batch width, keys read) of every decode step's attention over STEPS greedy steps of
    `rows` (recorded where decode makes its slots, outside any compiled graph), each row's tokens,
    whether the model padded its decode, and the shapes it says it met."""
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
    return seen, tokens, model.decode_buckets, model.decode_shapes


@pytest.mark.parametrize(("family", "compiled"), [("llama", "0"), ("llama", "1"), ("qwen3_moe", "0"), ("hybrid", "0")])
def test_decode_sees_one_shape_per_bucket_and_the_same_tokens(tmp_path, monkeypatch, family, compiled):
    hf = _saved(family, tmp_path / family)
    rows = [make_prompt(hf.config.vocab_size, n, seed=n) for n in (5, 9, 14)]
    monkeypatch.setenv("CELERYTP_COMPILE", compiled)  # this case's decode, eager or compiled
    plain_shapes, plain_tokens, padded, _ = _decode_shapes(tmp_path / family, rows)
    assert not padded and len(plain_shapes) >= STEPS  # precondition: a new key length every step
    monkeypatch.setenv("CELERYTP_DEVICE_PATH_ON_CPU", "1")
    shapes, tokens, padded, padded_model_shapes = _decode_shapes(tmp_path / family, rows)
    key_buckets = {bucket(max(n + step + 1, 16)) for n in (5, 9, 14) for step in range(STEPS)}
    assert padded and len(shapes) <= len(key_buckets), sorted(shapes)
    # what it logs and counts (a CUDA graph recorded for each): these, and a compiled load's warm-up
    assert shapes <= padded_model_shapes and padded_model_shapes - shapes <= {(1, 16), (2, 16)}
    assert {width for width, _ in shapes} == {bucket(len(rows))}  # 3 rows padded to 4
    assert tokens == plain_tokens


SYNC_REQUESTS = [
    dict(request_id="greedy", max_tokens=12, sampling=dict(temperature=0)),
    dict(request_id="long", max_tokens=6, sampling=dict(temperature=0), length=21),  # three prefill chunks
    dict(request_id="drawn", max_tokens=10, sampling=dict(temperature=0.8, seed=1)),  # over the whole vocabulary
    dict(request_id="scored", max_tokens=8, sampling=dict(temperature=0.7, top_k=5, logprobs=2)),
    dict(request_id="nucleus", max_tokens=8, sampling=dict(temperature=0.9, top_p=0.8, seed=2)),  # whole logits
    dict(request_id="prompt", max_tokens=3, sampling=dict(temperature=0), prompt_logprobs=2),
    dict(request_id="late", max_tokens=5, sampling=dict(temperature=0), after=2),  # joins running rows
]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "hybrid"])
def test_a_serving_step_waits_for_the_device_once_on_rank_0_and_never_elsewhere(tmp_path, monkeypatch, family):
    """Through the serving loop at TP=2 on the device path (padded decode), every step's forwards
    and scores are counted (worker/host_syncs.py): rank 0 reads the device once, a packed copy of
    what it samples from, other ranks never; nothing is sized by the data, built from Python data
    on the device or copied in blocking. A step over budget fails its rank (CELERYTP_SYNC_CHECK=1),
    and the bare loop's run with it. Greedy, drawn, top-k with logprobs, nucleus (whole logits)
    and prompt-logprobs rows, a prompt over three prefill chunks, a row joining running ones; the
    greedy and seeded ones give the tokens they give off the device path."""
    from bare_loop import serve_bare

    hf = _saved(family, tmp_path / family)
    specs = [{key: value for key, value in dict(spec, prompt=make_prompt(hf.config.vocab_size, spec.get("length", 6),
                                                                         seed=i)).items() if key != "length"}
             for i, spec in enumerate(SYNC_REQUESTS)]
    monkeypatch.setenv("CELERYTP_DEVICE_PATH_ON_CPU", "1")  # a CUDA rank's path (no GPU here)
    monkeypatch.setenv("CELERYTP_SYNC_CHECK", "1")  # what this test checks
    monkeypatch.setenv("CELERYTP_COMPILE", "0")  # the counting mode would be traced into a compiled graph
    (run,) = serve_bare(tmp_path, tmp_path / family, 2, [[specs, []]])
    assert all("tokens" in row for row in run["rows"].values()), run["rows"]
    stats, waits = run["stats"], run["stats"]["host_waits"]  # rank 0's
    assert stats["steps"] >= 12 and 0 < waits.pop("host_read") <= stats["steps"]
    assert waits == {}  # MoE too (qwen3_next has it): its experts' groups stay on the device (layers/moe.py)
    assert 1 <= stats["new_decode_shapes"] <= 8  # widths of 1, 2, 4 and 8 rows x 16 or 32 keys
    monkeypatch.delenv("CELERYTP_DEVICE_PATH_ON_CPU")
    monkeypatch.delenv("CELERYTP_SYNC_CHECK")
    (plain,) = serve_bare(tmp_path, tmp_path / family, 2, [[specs, []]])  # the same bits unpadded, copied apart
    for spec in specs:
        if spec["sampling"]["temperature"] == 0 or "seed" in spec["sampling"]:
            assert run["rows"][spec["request_id"]]["tokens"] == plain["rows"][spec["request_id"]]["tokens"], spec


def test_host_syncs_counts_what_would_make_a_gpu_wait():
    """The counter itself, on a CPU: reads of model tensors, data-sized outputs and inputs built
    or copied in blocking count; the same on host tensors, and non_blocking inputs, do not."""
    from celerytp.layers.host_transfer import expected_wait, to_device, to_host
    from celerytp.worker.host_syncs import HostSyncs

    weights = torch.randn(4, 4)  # made before: the model's
    with HostSyncs() as syncs:
        host = torch.tensor([1, 2, 3, 0])
        weights[host]  # a host index into a device tensor: copied in first
        ids = to_device([1, 2, 3, 0], torch.device("cpu"))
        rows = weights[ids]
        rows.cpu(), rows.tolist(), int(rows[0, 0])
        rows[rows > 0], rows.nonzero()
        torch.tensor([1], device="cpu")
        rows[[0, 1]]
        free = torch.zeros(3)
        free.tolist(), int(free[0]), (free + 1).sum().item(), free.to(torch.float64).tolist()
        (values, index), = [to_host([rows, ids])]
        with expected_wait("routing"):
            rows.tolist()
    assert dict(syncs.counts) == {"blocking_input": 2, "host_read": 4, "data_dependent": 2, "python_input": 1,
                                  "routing": 1}, syncs.where
    assert torch.equal(values, rows) and torch.equal(index, ids) and index.dtype == torch.long
    assert syncs.over({"host_read": 4, "blocking_input": 2, "data_dependent": 2, "python_input": 1}) == []
    assert syncs.over({"host_read": 4, "blocking_input": 2, "data_dependent": 2})[0].startswith("python_input: 1")


def _prefill_shapes(path, prompts: list[list[int]], chunk: int) -> tuple[set, list[torch.Tensor]]:
    """The (tokens, keys read) of every prefill forward of `prompts`, each prefilled in pieces of
    `chunk` into its own row, and every piece's logits."""
    model = load_model(path, TPContext(), max_batch=len(prompts), max_context=128)
    seen, original, logits = set(), CacheSlots.prefill, []

    def recording(*args, **kwargs) -> CacheSlots:
        slots = original(*args, **kwargs)
        seen.add((slots.positions.shape[1], slots.length))
        return slots

    CacheSlots.prefill = recording
    try:
        for row, prompt in enumerate(prompts):
            for start in range(0, len(prompt), chunk):
                piece = torch.tensor(prompt[start : start + chunk])
                logits.append(model.forward_tokens(piece, start, row=row))
    finally:
        CacheSlots.prefill = original
    return seen, logits


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_prefill_pads_its_pieces_to_buckets_and_computes_the_same_logits(tmp_path, monkeypatch, family):
    """On the device path a prefill piece's tokens and the keys it reads are padded to powers of
    two, so prompts of 20 lengths in pieces of 8 give attention a few shapes; every real
    position's logits are the same bits as unpadded (the pads sit past every real key, masked)."""
    hf = make_hf_model(*FAMILIES[family], seed=5)
    hf.save_pretrained(tmp_path / family, safe_serialization=True)
    prompts = [make_prompt(hf.config.vocab_size, n, seed=n) for n in range(3, 43, 2)]
    plain_shapes, plain = _prefill_shapes(tmp_path / family, prompts, 8)
    monkeypatch.setenv("CELERYTP_DEVICE_PATH_ON_CPU", "1")
    shapes, padded = _prefill_shapes(tmp_path / family, prompts, 8)
    pieces = [(min(len(p) - start, 8), start) for p in prompts for start in range(0, len(p), 8)]
    buckets = {(bucket(n), bucket(max(start + bucket(n), 16))) for n, start in pieces}
    assert len(plain_shapes) > 20 and shapes == buckets and len(buckets) <= 10, sorted(shapes)
    assert all(torch.equal(a, b) for a, b in zip(plain, padded, strict=True))


def test_cuda_attention_is_the_memory_efficient_backend_with_its_query_heads_folded():
    """No GPU here, so this checks what can be checked without one: a CUDA device's attention is
    SDPA held to the memory-efficient backend (a decision, layers/invariant_attention.py), and the
    grouped query heads that backend needs folded into query positions give SDPA's own
    `enable_gqa` result on a CPU, for a prefill's 2-D mask, decode's 4-D one and none."""
    import torch.nn.functional as F

    from celerytp.layers.invariant_attention import attention_kind, grouped_sdpa

    assert attention_kind(torch.device("cuda")) == "sdpa_efficient"
    g = torch.Generator().manual_seed(0)
    for batch, heads, kv_heads, queries, keys in [(2, 6, 3, 1, 9), (1, 8, 2, 5, 12), (3, 4, 4, 2, 7)]:
        q = torch.randn(batch, heads, queries, 16, generator=g)
        k, v = (torch.randn(batch, kv_heads, keys, 16, generator=g) for _ in range(2))
        decode = torch.rand(batch, 1, queries, keys, generator=g) > 0.3
        decode[..., 0] = True
        prefill = torch.ones(queries, keys, dtype=torch.bool).tril(diagonal=keys - queries)
        for mask in (decode, prefill, None):
            expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=heads != kv_heads)
            torch.testing.assert_close(grouped_sdpa(q, k, v, mask, 0.25), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("invariant", ["1", "0"])
def test_a_cuda_rank_holds_cublas_to_one_order_per_shape(invariant):
    """No GPU here: whether cuBLAS then gives a row the same bits beside any rows is for
    benchmarks/invariance.py on a GPU (scripts/gpu_bench.sh). What runs here is the decision, in a
    fresh process as a rank makes it before its first product (layers/cuda_blas.py): with
    invariance on, split-K and reduced-precision reductions off, no cuBLASLt workspace for split-K,
    and settings the environment gave kept; with it off, nothing changed."""
    import subprocess
    import sys

    probe = (
        "import os, torch\n"
        "from celerytp.layers import cuda_blas\n"
        "m = torch.backends.cuda.matmul\n"
        "cuda_blas.hold_cublas_to_one_order()\n"
        "print(cuda_blas.held, m.allow_bf16_reduced_precision_reduction,"
        " m.allow_bf16_reduced_precision_reduction_split_k, m.allow_fp16_reduced_precision_reduction_split_k,"
        " os.environ.get('CUBLASLT_WORKSPACE_SIZE'), os.environ.get('CUBLAS_WORKSPACE_CONFIG'))\n"
    )
    env = dict(os.environ, CELERYTP_BATCH_INVARIANT=invariant, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    env.pop("CUBLASLT_WORKSPACE_SIZE", None)
    said = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout.split()
    if invariant == "1":
        assert said == ["True", "False", "False", "False", "1", ":4096:8"]
    else:
        assert said == ["False", "True", "True", "True", "None", ":4096:8"]


def test_the_experts_grouped_matmul_equals_one_product_per_expert(monkeypatch):
    """The float experts' one op (layers/moe.py `grouped_linear`): its CPU body (one product per
    expert) and torch's grouped kernel, called as a GPU calls it (no GPU here: torch's CPU kernel
    stands in), give each run of rows its expert's product, empty runs and a last expert included."""
    from celerytp.layers import moe

    x, w = torch.randn(9, 32), torch.randn(5, 24, 32)
    ends = torch.tensor([2, 2, 6, 6, 9], dtype=torch.int32)
    expected = torch.cat([x[:2] @ w[0].T, x[2:6] @ w[2].T, x[6:9] @ w[4].T])
    per_expert = torch.ops.celerytp.grouped_linear(x, w, ends)
    monkeypatch.setattr(moe, "_grouped_kernel", lambda x, weight: True)
    kernel = torch.ops.celerytp.grouped_linear(x, w, ends)
    for got in (per_expert, kernel):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
