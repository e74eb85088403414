"""Float linears through oneDNN with packed weights (layers/packed_linear.py) against transformers.

The test models are small, so by default (`auto`, matrices of MIN_ELEMENTS and up) nothing in them
is packed: CELERYTP_PACK_LINEARS=1 packs every float linear and LM head here. Reference:
transformers' own models on the same random checkpoints, logits within the parity tests' atol
at every prompt position and decode step, greedy tokens identical, at TP=1 and TP=2 (spawned
ranks, which inherit the environment); bfloat16 within the bf16 parity test's bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from model_fixtures import TINY_CONFIGS, Job, assert_matches, hf_greedy, make_hf_model, make_prompt, run_job, run_ranks

from celerytp.core.switches import PACK_ENV, switch
from celerytp.distributed.tp import TPContext
from celerytp.layers import packed_linear
from celerytp.layers.packed_linear import MIN_ELEMENTS, kernel_works, packed_copy
from celerytp.models import load_model

NAMES = ("llama_gqa_bias", "qwen3_tied")  # biases and an untied head; a tied head


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, list[int], object]]:
    root = tmp_path_factory.mktemp("packed")
    out = {}
    for seed, name in enumerate(NAMES):
        model_type, kwargs = TINY_CONFIGS[name]
        hf = make_hf_model(model_type, kwargs, seed + 20)
        prompt = make_prompt(hf.config.vocab_size, seed=seed + 20)
        hf.save_pretrained(root / name, safe_serialization=True)
        out[name] = (str(root / name), prompt, hf_greedy(hf, prompt))
    return out


def linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if "onednn_weight" in m._buffers and m.qweight is None]


def test_packed_linears_match_transformers(cases, monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(PACK_ENV, "1")
    jobs = [Job(name, path, prompt) for name, (path, prompt, _) in cases.items()]
    for job in jobs:
        assert_matches(run_job(job, TPContext()).greedy, cases[job.name][2], f"{job.name} packed")
    for rank, results in enumerate(run_ranks(2, jobs, tmp_path)):
        for name, result in results.items():
            assert_matches(result.greedy, cases[name][2], f"{name} packed rank {rank}/2")


def test_packing_frees_plain_weights_but_a_tied_heads(cases, monkeypatch) -> None:
    monkeypatch.setenv(PACK_ENV, "0")
    plain = {name: load_model(path, TPContext(), quant="f32") for name, (path, _, _) in cases.items()}
    monkeypatch.setenv(PACK_ENV, "1")
    for name, (path, _, _) in cases.items():
        model = load_model(path, TPContext(), quant="f32")
        assert all(m.onednn_weight is not None for m in linears(model))
        assert len(linears(model)) == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the head
        head, embedding = model.lm_head, model.model.embed_tokens
        tied = head.weight is embedding.weight
        assert tied == (name == "qwen3_tied")
        for m in linears(model):
            assert (m.weight.numel() > 0) == (m is head and tied), m  # a shared weight stays
        assert torch.equal(embedding.weight, plain[name].model.embed_tokens.weight)  # lookups still read it
        # The packed copy holds the same numbers in oneDNN's layout.
        assert torch.equal(head.onednn_weight.to_dense(), plain[name].lm_head.weight)
        # Memory as before, but a tied head's copy (replicated at TP=1).
        before, after = plain[name].memory_report(), model.memory_report()
        extra = head.onednn_weight.nbytes if tied else 0
        assert sum(after.values()) == sum(before.values()) + extra


@pytest.mark.skipif(not kernel_works(torch.bfloat16, "cpu"), reason="no packed bfloat16 kernel on this CPU")
def test_packed_bfloat16_stays_close_to_transformers(cases, monkeypatch) -> None:
    monkeypatch.setenv(PACK_ENV, "1")
    for name, (path, prompt, reference) in cases.items():
        model = load_model(path, TPContext(), dtype=torch.bfloat16)
        assert all(m.onednn_weight is not None for m in linears(model))
        logits = model.forward_tokens(torch.tensor(prompt), 0)
        err = (logits - reference.prompt_logits).abs().max().item()
        scale = reference.prompt_logits.abs().max().item()
        assert err < 0.05 * scale, (name, err, scale)


def test_only_matrices_that_pay_are_packed_by_default(monkeypatch) -> None:
    small, large = torch.randn(64, 64), torch.randn(MIN_ELEMENTS // 256, 256)
    monkeypatch.delenv(PACK_ENV, raising=False)
    assert switch(PACK_ENV) == "auto" and packed_copy(small) is None
    x = torch.randn(3, 256)
    y = packed_linear.float_linear(x, large, packed_copy(large))
    torch.testing.assert_close(y, x @ large.T, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv(PACK_ENV, "1")
    assert packed_copy(small) is not None and packed_copy(torch.empty(0, 64)) is None
    monkeypatch.setenv(PACK_ENV, "0")
    assert packed_copy(large) is None
    assert not kernel_works(torch.float32, "meta") and not kernel_works(torch.int8, "cpu")


def test_a_mistyped_switch_fails_the_load_before_any_weight(cases, monkeypatch) -> None:
    monkeypatch.setenv(PACK_ENV, "yes please")
    with pytest.raises(ValueError, match="CELERYTP_PACK_LINEARS must be auto, 1 or 0, got 'yes please'"):
        load_model(cases["qwen3_tied"][0], TPContext())
