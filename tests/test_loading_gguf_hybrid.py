"""Hybrid GGUF files (qwen3next, qwen35, qwen35moe), laid out as llama.cpp's convert_hf_to_gguf.py
writes them, against transformers.

Each file comes from a tiny random transformers model through the converter's own transformations
(model_fixtures.write_hybrid_gguf: ssm_a = -exp(A_log), norms + 1, conv1d squeezed, in_proj_qkvz
split into attn_qkv + attn_gate, Qwen3.5's value heads reordered, experts stacked, MTP blocks
appended). Loading it must give back transformers' tensors, its prompt logits (float32 file:
within 1e-4) and its greedy tokens, at TP 1 and 2. Q8_0 files keep their linears in q8_0 and
match the same file dequantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from model_fixtures import (
    Greedy,
    Job,
    assert_matches,
    hf_greedy,
    make_prompt,
    our_greedy,
    run_job,
    run_ranks,
    write_hybrid_gguf,
)
from test_models_hybrid import make_hybrid_model

from celerytp.core.errors import CeleryTPError
from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV
from celerytp.loading import open_checkpoint
from celerytp.models import load_model
from celerytp.quant.plan import quant_summary

VOCAB = 160
PROMPT_LEN = 12
STEPS = 16
# Layers linear, full, linear (full_attention_interval 2). 2 key heads, 4 value heads: Qwen3.5's
# converter reorders the value heads (only done when the counts differ). In-features are whole
# 32-blocks for Q8_0; at TP 2 each rank holds one key head (two value heads) and one KV head.
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 3,
    "layer_types": ["linear_attention", "full_attention", "linear_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "max_position_embeddings": 256,
}
MOE: dict[str, Any] = {
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
# name -> (transformers family, config, GGUF files to write: "f32" and/or "q8_0", MTP blocks appended).
# qwen3next: every layer MoE, as the converter's qwen3next tensor map has no dense MLP names.
# qwen35moe: value heads of 32, so out_proj's reordered columns are whole Q8_0 blocks (kept).
CASES: dict[str, tuple[str, dict[str, Any], tuple[str, ...], int]] = {
    "qwen3next": ("qwen3_next", COMMON | MOE | {"intermediate_size": 48}, ("f32", "q8_0"), 0),
    "qwen35": ("qwen3_5", COMMON | {"intermediate_size": 64, "tie_word_embeddings": True}, ("f32",), 1),
    "qwen35moe": ("qwen3_5_moe", COMMON | MOE | {"linear_value_head_dim": 32}, ("f32", "q8_0"), 0),
}
Q8_ATOL = 2e-4  # the exact (dequant) kernel against the same weights dequantized at load


@dataclass
class Case:
    model: Any
    prompt: list[int]
    reference: Greedy
    files: dict[str, Path]


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("hybrid_gguf")
    out = {}
    for seed, (name, (family, config, kinds, mtp)) in enumerate(CASES.items()):
        model = make_hybrid_model(family, config, seed=5 + seed)
        prompt = make_prompt(VOCAB, PROMPT_LEN, seed=105 + seed)
        files = {
            kind: write_hybrid_gguf(model, root / f"{name}_{kind}.gguf", T.Q8_0 if kind == "q8_0" else None, mtp)
            for kind in kinds
        }
        out[name] = Case(model, prompt, hf_greedy(model, prompt, STEPS), files)
    return out


def _hf_tensors(model: Any) -> dict[str, torch.Tensor]:
    """transformers' state dict in checkpoint naming (its fused experts split per expert; a tied
    lm_head is the embedding)."""
    out = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = t.split(t.shape[1] // 2, dim=1)
            for e in range(t.shape[0]):
                out[f"{name[: -len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                out[f"{name[: -len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{name[: -len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_tensor_reads_back_as_transformers_has_it(cases: dict[str, Case], name: str) -> None:
    """Each converter transformation is undone: names, shapes and values equal transformers'
    (MTP blocks skipped)."""
    expected = _hf_tensors(cases[name].model)
    with open_checkpoint(cases[name].files["f32"]) as ckpt:
        assert ckpt.hf_config["layer_types"] == COMMON["layer_types"]
        assert set(ckpt.names()) == set(expected)
        for tensor, want in expected.items():
            got = ckpt.source(tensor).read()
            torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-6, msg=tensor)


@pytest.mark.parametrize(
    ("name", "tensor"),
    [
        ("qwen3next", "model.layers.0.linear_attn.in_proj_qkvz.weight"),
        ("qwen35moe", "model.layers.0.linear_attn.in_proj_qkv.weight"),
        ("qwen35moe", "model.layers.2.linear_attn.in_proj_z.weight"),
    ],
)
def test_row_slices_read_only_their_rows(cases: dict[str, Case], name: str, tensor: str) -> None:
    """Slices cutting across heads (q, k, v, z of several key heads) come back as transformers'
    rows, each read logged as the HF slice it is."""
    want = cases[name].model.state_dict()[tensor]
    with open_checkpoint(cases[name].files["f32"]) as ckpt:
        source = ckpt.source(tensor)
        for rows in [(0, 16), (20, 50), (40, 64), (30, want.shape[0] - 3)]:
            torch.testing.assert_close(source.read(rows), want[rows[0] : rows[1]], atol=0, rtol=0)
            assert ckpt.reads[-1].shape == (rows[1] - rows[0], COMMON["hidden_size"])


def test_out_proj_column_slices(cases: dict[str, Case]) -> None:
    """Qwen3.5's out_proj columns (value heads, reordered by the converter) slice as in HF."""
    tensor = "model.layers.0.linear_attn.out_proj.weight"
    want = cases["qwen35moe"].model.state_dict()[tensor]
    with open_checkpoint(cases["qwen35moe"].files["f32"]) as ckpt:
        for cols in [(0, 64), (64, 128), (16, 80)]:
            got = ckpt.source(tensor).read(cols=cols)
            torch.testing.assert_close(got, want[:, cols[0] : cols[1]], atol=0, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_world_size_1_matches_transformers(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    result = run_job(Job(name, str(case.files["f32"]), case.prompt, STEPS), TPContext())
    assert_matches(result.greedy, case.reference, f"{name} gguf TP 1")


def test_world_size_2_matches_transformers(cases: dict[str, Case], tmp_path: Path) -> None:
    jobs = [Job(name, str(case.files["f32"]), case.prompt, STEPS) for name, case in cases.items()]
    per_rank = run_ranks(2, jobs, tmp_path)
    c = COMMON  # each rank holds its own heads only: half the rows of the packed [q k v z b a] projection
    rows = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + 2 * c["linear_num_value_heads"] * (
        c["linear_value_head_dim"] + 1
    )
    for rank, results in enumerate(per_rank):
        for name, case in cases.items():
            assert_matches(results[name].greedy, case.reference, f"{name} gguf rank {rank}/2")
        assert results["qwen3next"].shapes["model.layers.0.linear_attn.in_proj.weight"][0] == rows // 2


@pytest.mark.parametrize("name", [n for n, spec in CASES.items() if "q8_0" in spec[2]])
def test_q8_0_kept_matches_the_file_dequantized(
    cases: dict[str, Case], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """quant None keeps the file's q8_0 linears (through the converter's split attn_qkv/attn_gate,
    reordered value heads and stacked experts); the exact kernel matches the file dequantized."""
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    path, prompt = cases[name].files["q8_0"], cases[name].prompt
    kept = load_model(path, TPContext(), quant=None)
    types, fallbacks = quant_summary(kept)
    assert set(types) == {"q8_0"} and not fallbacks, (types, fallbacks)
    dequantized = load_model(path, TPContext(), quant="f32")
    ours, ref = our_greedy(kept, prompt, STEPS), our_greedy(dequantized, prompt, STEPS)
    assert_matches(ours, ref, f"{name} q8_0 kept vs dequantized", atol=Q8_ATOL)


def test_missing_hybrid_metadata_is_load_failed(tmp_path: Path) -> None:
    path = tmp_path / "bare.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35moe")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CeleryTPError) as err:
        open_checkpoint(path)
    assert err.value.kind == "load_failed" and "qwen35moe" in err.value.message
