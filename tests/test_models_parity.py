"""Parity with transformers' own Llama/Qwen3 on tiny random models, at world sizes 1-4.

Each spawned group loads several checkpoints so process start-up is paid once per world size.
Tolerance: logits within atol 1e-4 (rtol 0) at every prompt position and every decode step;
greedy tokens identical over 20 decode steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import (
    TINY_CONFIGS,
    Greedy,
    Job,
    assert_matches,
    hf_greedy,
    make_hf_model,
    make_prompt,
    our_greedy,
    run_job,
    run_ranks,
)

from celerytp.core.errors import CeleryTPError
from celerytp.distributed.tp import TPContext

# Which tiny configs each world size runs (the others cannot be split that way).
WORLD_SIZE_CASES = {
    2: ["llama_gqa_bias", "llama_gqa_bias_sharded", "qwen3_tied", "llama_mha_tied", "qwen3_mqa_bias"],
    3: ["llama_gqa_bias", "llama_mha_tied"],
    4: ["qwen3_tied", "llama_mha_tied", "qwen3_mqa_bias"],
}


@dataclass
class Case:
    path: Path
    prompt: list[int]
    reference: Greedy
    config: Any


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("parity")
    out: dict[str, Case] = {}
    for seed, (name, (model_type, kwargs)) in enumerate(TINY_CONFIGS.items()):
        model = make_hf_model(model_type, kwargs, seed)
        prompt = make_prompt(model.config.vocab_size, seed=seed)
        reference = hf_greedy(model, prompt)
        model.save_pretrained(root / name, safe_serialization=True)
        out[name] = Case(root / name, prompt, reference, model.config)
        if name == "llama_gqa_bias":
            sharded = root / f"{name}_sharded"
            model.save_pretrained(sharded, safe_serialization=True, max_shard_size="40KB")
            assert (sharded / "model.safetensors.index.json").is_file()
            assert len(list(sharded.glob("*.safetensors"))) > 2
            out[f"{name}_sharded"] = Case(sharded, prompt, reference, model.config)
    return out


@pytest.mark.parametrize("name", [*TINY_CONFIGS, "llama_gqa_bias_sharded"])
def test_world_size_1_matches_transformers(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    result = run_job(Job(name, str(case.path), case.prompt), TPContext())
    assert_matches(result.greedy, case.reference, name)
    assert result.progress[-1][:2] == (result.progress[-1][1], len(result.progress))


@pytest.mark.parametrize("world_size", sorted(WORLD_SIZE_CASES))
def test_tensor_parallel_matches_transformers(cases: dict[str, Case], world_size: int, tmp_path: Path) -> None:
    names = WORLD_SIZE_CASES[world_size]
    jobs = [Job(n, str(cases[n].path), cases[n].prompt) for n in names]
    per_rank = run_ranks(world_size, jobs, tmp_path)
    for rank, results in enumerate(per_rank):
        for name in names:
            assert_matches(results[name].greedy, cases[name].reference, f"{name} rank {rank}/{world_size}")


def test_uneven_and_replicated_shards_have_expected_shapes(cases: dict[str, Case], tmp_path: Path) -> None:
    """Shapes of the local shards: 3 KV groups on 2 ranks -> 2 + 1; 2 KV heads on 4 ranks
    -> each KV head on 2 ranks with 2 of its 4 query heads each."""
    from celerytp.models import load_model

    hd = 16  # llama_gqa_bias: 6 q heads, 3 kv heads, head_dim 16, intermediate 96
    for rank, kv_heads in ((0, 2), (1, 1)):
        model = load_model(cases["llama_gqa_bias"].path, TPContext(rank, 2))
        attn = model.model.layers[0].self_attn
        assert tuple(attn.qkv_proj.weight.shape) == ((2 * kv_heads + 2 * kv_heads) * hd, 48)
        assert tuple(attn.o_proj.weight.shape) == (48, 2 * kv_heads * hd)
        assert tuple(model.model.layers[0].mlp.down_proj.weight.shape) == (48, 48)
        assert tuple(model.model.embed_tokens.weight.shape) == (80, 48)  # vocab-parallel: 160 / 2
        assert tuple(model.lm_head.weight.shape) == (80, 48)  # untied: its own slice
    hd = 32  # qwen3_tied: 8 q heads, 2 kv heads, head_dim 32
    starts = []
    for rank in range(4):
        model = load_model(cases["qwen3_tied"].path, TPContext(rank, 4))
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert tuple(attn.qkv_proj.weight.shape) == ((2 + 1 + 1) * hd, 64)
        assert attn.kv_cache.k.shape == (2, 1, 128 + 1, hd)  # served row + step row; positions + scratch
        assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one slice per rank
        assert tuple(model.lm_head.weight.shape) == (40, 64)
        starts.append((attn.heads.q_start, attn.heads.kv_start))
    assert starts == [(0, 0), (2, 0), (4, 1), (6, 1)]


def test_cache_contract(cases: dict[str, Case]) -> None:
    from celerytp.models import load_model

    case = cases["llama_mha_tied"]
    model = load_model(case.path, TPContext(), max_context=16)
    assert model.max_context == 16 and model.cache_len == 0
    first = model.forward_tokens(torch.tensor(case.prompt), 0)
    assert first.dtype == torch.float32 and first.shape == (len(case.prompt), case.config.vocab_size)
    assert model.cache_len == len(case.prompt)
    with pytest.raises(ValueError, match="offset 0 != cache_len 8"):
        model.forward_tokens(torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="exceeds max_context 16"):
        model.forward_tokens(torch.tensor([1] * 9), 8)
    # Chunked prefill through the cache equals one-shot prefill.
    model.clear_cache()
    a = model.forward_tokens(torch.tensor(case.prompt[:3]), 0)
    b = model.forward_tokens(torch.tensor(case.prompt[3:]), 3, last_only=True)
    torch.testing.assert_close(a, first[:3], atol=1e-5, rtol=0)
    torch.testing.assert_close(b[0], first[-1], atol=1e-5, rtol=0)
    report = model.memory_report()
    assert report["kv_cache_bytes"] == 2 * 2 * 2 * 4 * 17 * 16 * 4  # layers * (k,v) * rows * heads * (ctx+1) * hd * 4B
    assert report["sharded_bytes"] > 0 and report["replicated_bytes"] == 160 * 64 * 4 + 5 * 64 * 4


def test_bfloat16_stays_close_to_float32(cases: dict[str, Case]) -> None:
    """bf16 weights and KV cache (the CUDA default) on CPU: float32 logits out, near the reference."""
    from celerytp.models import load_model

    for name in ("llama_gqa_bias", "qwen3_tied"):
        case = cases[name]
        model = load_model(case.path, TPContext(), dtype=torch.bfloat16)
        assert model.model.layers[0].self_attn.kv_cache.k.dtype == torch.bfloat16
        logits = model.forward_tokens(torch.tensor(case.prompt), 0)
        assert logits.dtype == torch.float32
        err = (logits - case.reference.prompt_logits).abs().max().item()
        scale = case.reference.prompt_logits.abs().max().item()
        assert err < 0.05 * scale, (name, err, scale)


def test_half_precision_kv_cache_on_a_float32_model(cases: dict[str, Case]) -> None:
    """kv_dtype bfloat16/float16 on float32 weights: half the cache bytes for the same shape,
    logits near the reference (only K and V are rounded: ~3 significant digits in bf16), and
    the positions that fit a budget double."""
    from celerytp.models import load_model

    case = cases["llama_gqa_bias"]
    plain = load_model(case.path, TPContext(), max_context=32)
    for kv_dtype, tolerance in ((torch.bfloat16, 0.02), (torch.float16, 0.005)):
        model = load_model(case.path, TPContext(), max_context=32, kv_dtype=kv_dtype)
        assert model.model.layers[0].self_attn.kv_cache.k.dtype == kv_dtype
        assert model.memory_report()["kv_cache_bytes"] * 2 == plain.memory_report()["kv_cache_bytes"]
        ours = our_greedy(model, case.prompt)
        scale = case.reference.prompt_logits.abs().max().item()
        err = (ours.prompt_logits - case.reference.prompt_logits).abs().max().item()
        assert 0 < err < tolerance * scale, (kv_dtype, err, scale)
        err = (ours.step_logits - case.reference.step_logits[: len(ours.step_logits)]).abs().max().item()
        assert err < tolerance * scale, (kv_dtype, err, scale)
    budget = plain.memory_report()["kv_cache_bytes"]
    fits = load_model(case.path, TPContext(), kv_cache_bytes=budget).max_context
    assert load_model(case.path, TPContext(), kv_cache_bytes=budget, kv_dtype=torch.bfloat16).max_context == 2 * fits


def test_the_kv_cache_is_sized_from_the_memory_left_after_the_weights(cases: dict[str, Case]) -> None:
    """With no budget in bytes, the cache takes `kv_memory_fraction` of the memory free once the
    weights are in (a CPU: available RAM over the group's ranks): the default holds this small
    model's whole context; a fraction sized for about 40 positions gets about 40 (RAM moves
    between the two reads); a context asked for past it is refused, naming the fraction."""
    import psutil

    from celerytp.models import load_model
    from celerytp.models.kv_budget import kv_bytes_per_position, memory_budget

    case = cases["llama_gqa_bias"]
    whole = load_model(case.path, TPContext())
    assert whole.max_context == whole.config.default_max_context
    per_position = kv_bytes_per_position(whole.config, 1, torch.float32) * (1 + 1)  # max_batch 1 and step mode's row
    available = psutil.virtual_memory().available
    assert abs(memory_budget(torch.device("cpu"), 0.5, 2) - available / 4) < available / 20  # shared by 2 ranks
    small = load_model(case.path, TPContext(), kv_memory_fraction=40 * per_position / available)
    assert 20 <= small.max_context <= 60 and small.model.layers[0].self_attn.kv_cache.k.shape[2] == small.max_context + 1
    assert small.model.rotary_embs[0].cos.shape[0] == small.max_context
    with pytest.raises(CeleryTPError, match="kv_memory_fraction"):
        load_model(case.path, TPContext(), kv_memory_fraction=40 * per_position / available, max_context=100)


AGREE_RANK = """
import os, sys, types, torch, torch.distributed as dist
from celerytp.distributed.control import ControlGroup
from celerytp.distributed.tp import TPContext
from celerytp.models import load_model
from celerytp.worker.model_ops import _agree_on_context
rank, path, init = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=2)
model = load_model(path, TPContext(rank, 2), max_context=(64, 48)[rank])  # as if each rank's memory fit another
state = types.SimpleNamespace(control=ControlGroup.on_default_group(rank, 2), collective=lambda fn: fn())
_agree_on_context(state, model)
cache = model.model.layers[0].self_attn.kv_cache.k.shape[2]
print(model.max_context, cache, model.model.rotary_embs[0].cos.shape[0], flush=True)
dist.barrier()
dist.destroy_process_group()
os._exit(0)
"""


def test_ranks_agree_on_the_smallest_context_their_memory_fits(cases: dict[str, Case], tmp_path) -> None:
    """Each rank sizes its cache from its own free memory, so two may fit different contexts; a
    load's ranks then all take the smallest (worker/model_ops.py), cache and rotary tables
    resized, so that every rank refuses a request alike. Two real ranks on a gloo group."""
    import subprocess
    import sys

    ranks = [subprocess.Popen([sys.executable, "-c", AGREE_RANK, str(r), str(cases["llama_gqa_bias"].path),
                               str(tmp_path / "init")], stdout=subprocess.PIPE, text=True) for r in range(2)]
    outs = [rank.communicate(timeout=120)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert [out.split() for out in outs] == [["48", "49", "48"]] * 2  # positions, cache (+ scratch), rotary
