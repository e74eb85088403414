"""Qwen3-Next GGUF files, laid out as llama.cpp's convert_hf_to_gguf.py writes them, against transformers.

The file comes from a tiny random transformers Qwen3NextForCausalLM through the converter's own
transformations (model_fixtures.write_qwen3next_gguf: ssm_a = -exp(A_log), norms + 1, conv1d
squeezed, in_proj_qkvz split into attn_qkv + attn_gate, experts stacked). Loading it must give
back transformers' tensors, its prompt logits (float32 file: within 1e-4) and its greedy tokens,
at TP 1 and 2. A Q8_0 file keeps its linears in q8_0 and matches the same file dequantized.
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
    write_qwen3next_gguf,
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
# Layers linear, full, linear (full_attention_interval 2); every layer MoE, as the converter's
# qwen3next tensor map has no dense MLP names. In-features are whole 32-blocks for Q8_0; at TP 2
# each rank holds one key head (two value heads) and one KV head.
CONFIG: dict[str, Any] = {
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
    "intermediate_size": 48,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
}
Q8_ATOL = 2e-4  # the exact (dequant) kernel against the same weights dequantized at load


@dataclass
class Case:
    model: Any
    prompt: list[int]
    reference: Greedy
    f32: Path
    q8_0: Path


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> Case:
    root = tmp_path_factory.mktemp("qwen3next_gguf")
    model = make_hybrid_model("qwen3_next", CONFIG, seed=5)
    prompt = make_prompt(VOCAB, PROMPT_LEN, seed=105)
    reference = hf_greedy(model, prompt, STEPS)
    f32 = write_qwen3next_gguf(model, root / "f32.gguf")
    q8_0 = write_qwen3next_gguf(model, root / "q8_0.gguf", T.Q8_0)
    return Case(model, prompt, reference, f32, q8_0)


def _hf_tensors(model: Any) -> dict[str, torch.Tensor]:
    """transformers' state dict in checkpoint naming (its fused experts split per expert)."""
    out = {}
    for name, t in model.state_dict().items():
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


def test_every_tensor_reads_back_as_transformers_has_it(case: Case) -> None:
    """Each converter transformation is undone: names, shapes and values equal transformers'."""
    expected = _hf_tensors(case.model)
    with open_checkpoint(case.f32) as ckpt:
        assert ckpt.hf_config["layer_types"] == CONFIG["layer_types"]
        assert set(ckpt.names()) == set(expected)
        for name, want in expected.items():
            got = ckpt.source(name).read()
            torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-6, msg=name)


def test_qkvz_slice_reads_only_its_rows(case: Case) -> None:
    """A rank's rows of in_proj_qkvz (cutting across q, k, v and z of key head 0 and 1) come
    from attn_qkv / attn_gate row runs alone, and are logged as the HF slice."""
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    want = case.model.state_dict()[name]
    with open_checkpoint(case.f32) as ckpt:
        source = ckpt.source(name)
        for rows in [(0, 16), (20, 50), (40, 64), (30, 100)]:
            torch.testing.assert_close(source.read(rows), want[rows[0] : rows[1]], atol=0, rtol=0)
        assert ckpt.reads[-1].shape == (70, CONFIG["hidden_size"]) and ckpt.reads[-1].full_shape == tuple(want.shape)


def test_world_size_1_matches_transformers(case: Case) -> None:
    result = run_job(Job("qwen3next_f32", str(case.f32), case.prompt, STEPS), TPContext())
    assert_matches(result.greedy, case.reference, "qwen3next gguf TP 1")


def test_world_size_2_matches_transformers(case: Case, tmp_path: Path) -> None:
    per_rank = run_ranks(2, [Job("qwen3next_f32", str(case.f32), case.prompt, STEPS)], tmp_path)
    for rank, results in enumerate(per_rank):
        assert_matches(results["qwen3next_f32"].greedy, case.reference, f"qwen3next gguf rank {rank}/2")
        # Each rank holds its own heads only: half the rows of the packed [q k v z b a] projection.
        c = CONFIG
        rows = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + 2 * c["linear_num_value_heads"] * (
            c["linear_value_head_dim"] + 1
        )
        assert results["qwen3next_f32"].shapes["model.layers.0.linear_attn.in_proj.weight"][0] == rows // 2


def test_q8_0_kept_matches_the_file_dequantized(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """quant None keeps the file's q8_0 linears (through the converter's attn_qkv/attn_gate split
    and stacked experts); the exact kernel matches the same file dequantized at load."""
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    kept = load_model(case.q8_0, TPContext(), quant=None)
    types, fallbacks = quant_summary(kept)
    assert set(types) == {"q8_0"} and not fallbacks, (types, fallbacks)
    dequantized = load_model(case.q8_0, TPContext(), quant="f32")
    ours, ref = our_greedy(kept, case.prompt, STEPS), our_greedy(dequantized, case.prompt, STEPS)
    assert_matches(ours, ref, "q8_0 kept vs dequantized", atol=Q8_ATOL)


@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_qwen35_gguf_is_unsupported_arch_naming_what_is_missing(tmp_path: Path, arch: str) -> None:
    path = tmp_path / f"{arch}.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CeleryTPError) as err:
        open_checkpoint(path)
    assert err.value.kind == "unsupported_arch"
    assert arch in err.value.message and "value heads" in err.value.message and "out_proj" in err.value.message
