"""Vocab-parallel embedding and LM head against transformers at TP 1-3.

Vocab 161 splits unevenly over 2 (81 + 80) and 3 ranks (54 + 54 + 53); one model ties its
embeddings (one slice per rank shared by both ends), one does not. TP=2 runs its collectives
through shared memory, TP=3 through gloo. Tolerances as in test_models_parity: logits within
1e-4, greedy tokens identical over 20 steps. An untied LM head kept in q8_0 is checked against
the same q8_0 load at TP=1 through the exact dequantizing kernel (its slices hold the same
blocks, so only summation order differs).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from model_fixtures import COMMON, Greedy, Job, assert_matches, hf_greedy, make_prompt, run_job

from celerytp.distributed import shm
from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV
from celerytp.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding, first_max, vocab_shards

VOCAB = 161
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_untied": (
        "llama",
        {
            "hidden_size": 96,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": 32,
            "intermediate_size": 96,
            "tie_word_embeddings": False,
        },
    ),
    "qwen3_tied": (
        "qwen3",
        {
            "hidden_size": 48,
            "num_attention_heads": 6,
            "num_key_value_heads": 3,
            "head_dim": 16,
            "intermediate_size": 64,
            "tie_word_embeddings": True,
        },
    ),
}


def _hf_model(model_type: str, kwargs: dict[str, Any], seed: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[
        model_type
    ]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**COMMON, "vocab_size": VOCAB}, **kwargs)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Job, Greedy]]:
    root = tmp_path_factory.mktemp("vocab")
    out = {}
    for seed, (name, (model_type, kwargs)) in enumerate(CONFIGS.items(), 7):
        model = _hf_model(model_type, kwargs, seed)
        prompt = make_prompt(VOCAB, seed=seed)
        model.save_pretrained(root / name, safe_serialization=True)
        out[name] = (Job(name, str(root / name), prompt), hf_greedy(model, prompt))
    return out


def _rank_main(rank: int, world_size: int, init_file: str, work: Callable[[TPContext], dict], use_shm: bool,
               out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ[KERNEL_ENV] = "dequant"  # exact q8_0 (weights dequantized once), so TP=1 and TP=N compare tightly
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=120)
        )
        if use_shm:
            assert shm.attach(f"vocab{os.getppid()}", "t", rank, world_size, 120.0) is not None
        results = work(TPContext(rank, world_size))
        shm.detach()
        dist.destroy_process_group()
        torch.save(results, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def _run_jobs(jobs: list[Job], tp: TPContext) -> dict:
    return {job.name: (result.greedy, result.shapes) for job in jobs for result in [run_job(job, tp)]}


def _run_ranks(world_size: int, work: Callable[[TPContext], dict], use_shm: bool, workdir: Path) -> list[dict]:
    """`work` on `world_size` spawned ranks of one gloo group (and shared memory); each rank's result."""
    ctx = mp.get_context("spawn")
    args = (world_size, str(workdir / "pg"), work, use_shm, str(workdir))
    procs = [ctx.Process(target=_rank_main, args=(r, *args), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
    results = [torch.load(workdir / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
    for r, data in enumerate(results):
        assert "error" not in data, f"rank {r} failed:\n{data['error']}"
    return results


def test_world_size_1_matches_transformers(cases: dict[str, tuple[Job, Greedy]]) -> None:
    for name, (job, reference) in cases.items():
        assert_matches(run_job(job, TPContext()).greedy, reference, f"{name} tp=1")


@pytest.mark.parametrize(("world_size", "use_shm"), [(2, True), (3, False)])
def test_tensor_parallel_matches_transformers(
    cases: dict[str, tuple[Job, Greedy]],
    world_size: int,
    use_shm: bool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    jobs = [job for job, _ in cases.values()]
    quantized = Job("llama_untied_q8", cases["llama_untied"][0].path, cases["llama_untied"][0].prompt, quant="q8_0")
    per_rank = _run_ranks(world_size, partial(_run_jobs, [*jobs, quantized]), use_shm, tmp_path)
    shards = vocab_shards(TPContext(0, world_size), VOCAB)
    assert sum(count for _, count in shards) == VOCAB and len({count for _, count in shards}) == 2  # uneven
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    tp1_q8 = run_job(quantized, TPContext()).greedy
    for rank, results in enumerate(per_rank):
        for name, (_, reference) in cases.items():
            greedy, shapes = results[name]
            assert_matches(greedy, reference, f"{name} rank {rank}/{world_size}")
            hidden = CONFIGS[name][1]["hidden_size"]
            assert shapes["model.embed_tokens.weight"] == (shards[rank][1], hidden)
            assert ("lm_head.weight" in shapes) != CONFIGS[name][1]["tie_word_embeddings"]  # tied: one tensor
        assert_matches(results["llama_untied_q8"][0], tp1_q8, f"q8_0 lm_head rank {rank}/{world_size}")


def _candidates(tp: TPContext) -> dict:
    head = ParallelLMHead(8, VOCAB, tp, dtype=torch.float32, device=torch.device("cpu"))
    local = _candidate_logits()[:, head.start : head.start + head.count]
    results = {k: head.top_candidates(local.clone(), k)[:3] for k in (1, 7, 40)}
    extra = torch.full((5, 2), float(tp.rank))  # rides along: every rank's, in rank order
    results["extra"] = head.top_candidates(local.clone(), 3, extra)[3]
    assert head.top_candidates(local.clone(), 3, lse=False)[2] is None
    return results


def _candidate_logits() -> torch.Tensor:
    """Few distinct values, so ties inside and across the ranks' slices are common."""
    return torch.randint(0, 6, (5, VOCAB), generator=torch.Generator().manual_seed(0)).float()


@pytest.mark.parametrize(("world_size", "use_shm"), [(1, False), (2, True), (3, False)])
def test_top_candidates_from_slices_equal_the_top_of_the_whole_logits(world_size: int, use_shm: bool, tmp_path: Path) -> None:
    """What the serving loop samples from instead of gathering the logits: every rank gets each
    row's k largest logits over the whole vocabulary (for k = 1 the lowest id of equal maxima,
    argmax's choice) and the log-sum-exp over the whole vocabulary."""
    per_rank = _run_ranks(world_size, _candidates, use_shm, tmp_path)
    logits = _candidate_logits()
    order = torch.sort(-logits, stable=True)
    for rank, data in enumerate(per_rank):
        assert torch.equal(data.pop("extra"), torch.arange(world_size).float()[None, :, None].expand(5, -1, 2))
        for k, (values, ids, lse) in data.items():
            assert torch.equal(values, -order.values[:, :k]), (rank, k)
            assert torch.equal(logits.gather(1, ids), values)  # which of equal logits fill the k-th place may vary
            assert all(len(set(row)) == k for row in ids.tolist())
            torch.testing.assert_close(lse, torch.logsumexp(logits, -1))
        assert torch.equal(data[1][1][:, 0], logits.argmax(-1))


@pytest.mark.parametrize("width", [1, 54, 128, 161, 49152])
def test_first_max_is_max_with_the_lowest_index(width: int) -> None:
    """The blocked greedy pick equals torch's max over rows full of ties, and over -inf and NaN."""
    x = torch.randint(0, 4, (6, width), generator=torch.Generator().manual_seed(width)).float()
    x[1] = float("-inf")
    x[2, width // 2] = float("nan")
    values, ids = first_max(x)
    expected = x.max(-1, keepdim=True)
    assert torch.equal(ids, expected.indices)
    torch.testing.assert_close(values, expected.values, equal_nan=True)


def test_uneven_slices_cover_the_vocabulary_without_a_process_group() -> None:
    """Rank r's embedding rows and LM-head rows are the same contiguous slice."""
    ends = []
    for rank in range(3):
        tp = TPContext(rank, 3)
        emb = VocabParallelEmbedding(VOCAB, 8, tp, dtype=torch.float32, device=torch.device("cpu"))
        head = ParallelLMHead(8, VOCAB, tp, dtype=torch.float32, device=torch.device("cpu"), tied=emb)
        assert head.weight is emb.weight and (head.start, head.count) == (emb.start, emb.count)
        ends.append((emb.start, emb.start + emb.count))
    assert ends == [(0, 54), (54, 108), (108, 161)]


def test_quantized_tied_embedding_and_lm_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GGUF with a Q8_0 token_embd (tied) and Q8_0 linears, kept as the file ships it: one q8_0
    tensor is both the embedding (rows dequantized on lookup) and the LM head.

    Exact kernel (codes + scales): matches transformers' own GGUF dequantization within 1e-4.
    int8 kernel (rows re-rounded to one scale, bfloat16 activations): logits within 0.1 of it
    (bf16 keeps ~3 digits; logits O(1..10)) and the same first 10 greedy tokens.
    """
    from gguf import GGMLQuantizationType as T
    from model_fixtures import GGUF_CONFIGS, hf_model_from_gguf, make_hf_model, our_greedy, write_gguf

    from celerytp.models import load_model

    model_type, kwargs = GGUF_CONFIGS["qwen3"]
    assert kwargs["tie_word_embeddings"]
    hf = make_hf_model(model_type, kwargs, seed=3)
    path = write_gguf(hf, tmp_path / "m.gguf", {"token_embd": T.Q8_0, "attn_": T.Q8_0, "ffn_": T.Q8_0})
    prompt = make_prompt(hf.config.vocab_size, seed=3)
    ref = hf_greedy(hf_model_from_gguf(hf, path), prompt)
    for kernel in ("dequant", "int8pack"):
        monkeypatch.setenv(KERNEL_ENV, "dequant" if kernel == "dequant" else "auto")
        model = load_model(path, TPContext(), max_context=64)  # quant None: the file's q8_0 kept
        emb = model.model.embed_tokens
        assert emb.qweight is not None and model.lm_head.qweight is emb.qweight
        assert [p.kernel for p in emb.qweight.parts] == [kernel]
        assert emb.weight.numel() == 0  # no float copy of the embedding
        ours = our_greedy(model, prompt)
        if kernel == "dequant":
            assert_matches(ours, ref, "q8_0 tied, exact kernel")
        else:
            torch.testing.assert_close(ours.prompt_logits, ref.prompt_logits, atol=0.1, rtol=0)
            assert ours.tokens[:10] == ref.tokens[:10]
