"""Qwen3-MoE and Mixtral against transformers' own models, from safetensors and from GGUF, at TP 1-3.

Tiny random models (2 layers, vocab 160, randomized norms): logits within atol 1e-4 of
transformers at every prompt position and decode step, greedy tokens identical for 32 steps.
Checkpoints: the hub layout save_pretrained writes (one tensor per expert; Mixtral's
block_sparse_moe / w1 w3 w2), transformers 5's fused 3-D experts (save_original_format=False),
and GGUF files laid out as llama.cpp's convert_hf_to_gguf.py writes them (qwen3moe; Mixtral as
`llama` with stacked, fused gate_up or legacy per-expert tensors and permuted Q/K). Splits: 3 KV
groups on 2 ranks (2 + 1), one KV head replicated on 2 and 3 ranks, expert intermediate sizes
40 and 64 over 3 ranks (14 + 13 + 13, 22 + 21 + 21). A q8_0 GGUF kept quantized matches the
float run of the same file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from model_fixtures import (
    Greedy,
    Job,
    assert_matches,
    gguf_name,
    hf_greedy,
    llama_cpp_permute,
    make_hf_model,
    make_prompt,
    our_greedy,
    run_job,
    run_ranks,
)

from celerytp.core.errors import CeleryTPError
from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV
from celerytp.loading import open_checkpoint
from celerytp.models import load_model
from celerytp.models.architectures import config_from_hf
from celerytp.quant.plan import quant_summary

STEPS = 32
Q = gguf.GGMLQuantizationType

# name -> (model_type, config kwargs, checkpoint format: "hub", "fused" or a GGUF layout)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # 3 KV groups (2 + 1 on 2 ranks), attention biases, a dense layer (mlp_only_layers), no top-k
    # renormalization (transformers' default), expert intermediate 40 (14 + 13 + 13 on 3 ranks).
    "qwen3_moe": (
        "qwen3_moe",
        dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=16, intermediate_size=64,
             attention_bias=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40,
             mlp_only_layers=[1], norm_topk_prob=False),
    ),  # fmt: skip
    # One KV head (replicated on every rank), tied embeddings, a 6-position sliding window on
    # every layer, expert intermediate 64 (22 + 21 + 21 on 3 ranks).
    "mixtral": (
        "mixtral",
        dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=1, head_dim=16, intermediate_size=64,
             num_local_experts=4, num_experts_per_tok=2, sliding_window=6, tie_word_embeddings=True),
    ),  # fmt: skip
    # GGUF-friendly dims (in-features multiples of 32): every layer MoE, top-k renormalized (llama.cpp's
    # qwen3moe always renormalizes); 3 KV groups.
    "qwen3moe_gguf": (
        "qwen3_moe",
        dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=3, head_dim=32, intermediate_size=96,
             num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True),
    ),  # fmt: skip
    # head_dim = hidden / heads, as Mixtral checkpoints have it (the converter writes no key_length).
    "mixtral_gguf": (
        "mixtral",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
             num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
    ),  # fmt: skip
}
# case -> (model, how it is written)
CASES: dict[str, tuple[str, str]] = {
    "qwen3_moe": ("qwen3_moe", "hub"),
    "qwen3_moe_fused": ("qwen3_moe", "fused"),
    "mixtral": ("mixtral", "hub"),
    "mixtral_fused": ("mixtral", "fused"),
    "qwen3moe_gguf": ("qwen3moe_gguf", "stacked"),
    "qwen3moe_gguf_q8_0": ("qwen3moe_gguf", "stacked_q8_0"),
    "mixtral_gguf": ("mixtral_gguf", "stacked"),
    "mixtral_gguf_gate_up": ("mixtral_gguf", "gate_up"),
    "mixtral_gguf_per_expert": ("mixtral_gguf", "per_expert"),
}
FLOAT_CASES = [name for name in CASES if not name.endswith("q8_0")]
WORLD_SIZE_CASES = {
    2: ["qwen3_moe", "qwen3_moe_fused", "mixtral", "qwen3moe_gguf", "mixtral_gguf"],
    3: ["qwen3_moe", "mixtral", "qwen3moe_gguf"],
}


# ---- GGUF, as convert_hf_to_gguf.py writes it --------------------------------------------------


def _moe_tensors(model: Any, layout: str) -> dict[str, np.ndarray]:
    """GGUF name -> array (torch order) after the converter's modify_tensors: experts stacked
    (Qwen2MoeModel / LlamaModel), or fused gate_up (--fuse-gate-up-exps), or one per expert
    (older Mixtral files); llama (Mixtral) Q/K permuted per head."""
    cfg = model.config
    mixtral = cfg.model_type == "mixtral"
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        data = t.detach().float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if mixtral and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(data, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        if name.endswith("mlp.gate.weight"):
            out[f"blk.{layer}.ffn_gate_inp.weight"] = data
        elif name.endswith("mlp.experts.gate_up_proj"):  # (E, 2 I, H): each expert's gate rows, then up
            gate, up = np.split(data, 2, axis=1)
            if layout == "gate_up":
                out[f"blk.{layer}.ffn_gate_up_exps.weight"] = data
            elif layout == "per_expert":
                for e in range(data.shape[0]):
                    out[f"blk.{layer}.ffn_gate.{e}.weight"], out[f"blk.{layer}.ffn_up.{e}.weight"] = gate[e], up[e]
            else:
                out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):  # (E, H, I)
            if layout == "per_expert":
                for e in range(data.shape[0]):
                    out[f"blk.{layer}.ffn_down.{e}.weight"] = data[e]
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = data
        else:
            out[gguf_name(name)] = data
    return out


def write_moe_gguf(model: Any, path: Path, layout: str, metadata: dict[str, int] | None = None) -> Path:
    """`model` as llama.cpp's converter writes it: arch qwen3moe, or llama for Mixtral. `layout`:
    stacked, gate_up, per_expert, or stacked_q8_0 (attention, experts and lm_head in Q8_0; the
    router, norms and embedding F32, as llama.cpp's quantizer leaves them). `metadata` overrides
    integer keys (to write a lying file)."""
    cfg = model.config
    mixtral = cfg.model_type == "mixtral"
    w = gguf.GGUFWriter(str(path), "llama" if mixtral else "qwen3moe")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    keys = {
        "block_count": cfg.num_hidden_layers,
        "context_length": cfg.max_position_embeddings,
        "embedding_length": cfg.hidden_size,
        "feed_forward_length": cfg.intermediate_size,
        "expert_count": cfg.num_local_experts,
        "expert_used_count": cfg.num_experts_per_tok,
    }
    if mixtral:  # LlamaModel.set_gguf_parameters; Mixtral's config has no head_dim (no key_length)
        keys |= {"vocab_size": cfg.vocab_size, "rope.dimension_count": head_dim}
    else:  # TextModel writes key/value_length from head_dim; Qwen2MoeModel the expert size
        keys |= {
            "attention.key_length": head_dim,
            "attention.value_length": head_dim,
            "expert_feed_forward_length": cfg.moe_intermediate_size,
        }
    for key, value in (keys | (metadata or {})).items():
        w.add_uint32(f"{w.arch}.{key}", value)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    quantized = ("attn_q.", "attn_k.", "attn_v.", "attn_output.", "_exps.", "output.")
    for name, data in _moe_tensors(model, layout.removesuffix("_q8_0")).items():
        if layout.endswith("_q8_0") and name.endswith(".weight") and any(s in name for s in quantized):
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(data), Q.Q8_0), raw_dtype=Q.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- cases --------------------------------------------------------------------------------------


@dataclass
class Case:
    path: Path
    prompt: list[int]
    reference: Greedy


@pytest.fixture(scope="module")
def models() -> dict[str, Any]:
    return {name: make_hf_model(t, kwargs, seed) for seed, (name, (t, kwargs)) in enumerate(MODELS.items())}


@pytest.fixture(scope="module")
def cases(models: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("moe")
    refs = {}
    for seed, name in enumerate(MODELS):
        prompt = make_prompt(160, seed=seed)
        refs[name] = (prompt, hf_greedy(models[name], prompt, STEPS))
    out: dict[str, Case] = {}
    for case, (name, how) in CASES.items():
        path = root / case
        if how in ("hub", "fused"):
            models[name].save_pretrained(path, safe_serialization=True, save_original_format=how == "hub")
        else:
            path = write_moe_gguf(models[name], root / f"{case}.gguf", how)
        out[case] = Case(path, *refs[name])
    return out


def test_checkpoint_layouts(cases: dict[str, Case]) -> None:
    """What the saves hold (so each case tests the layout it names) and the configs we read."""
    with open_checkpoint(cases["mixtral"].path) as ckpt:
        assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in ckpt.names()
    with open_checkpoint(cases["qwen3_moe_fused"].path) as ckpt:
        assert "model.layers.0.mlp.experts.gate_up_proj" in ckpt.names()
    config = json.loads((cases["qwen3_moe"].path / "config.json").read_text())
    assert "num_experts" not in config and config["num_local_experts"] == 8  # transformers 5's key
    with open_checkpoint(cases["mixtral_gguf"].path) as ckpt:
        hf = ckpt.hf_config
        facts = (hf["model_type"], hf["num_local_experts"], hf["num_experts_per_tok"], hf["head_dim"])
        assert facts == ("mixtral", 4, 2, 16)
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in ckpt.names()
        assert ckpt.source("model.layers.0.block_sparse_moe.experts.3.w1.weight").shape == (64, 64)
    with open_checkpoint(cases["qwen3moe_gguf_q8_0"].path) as ckpt:
        hf = ckpt.hf_config
        assert (hf["model_type"], hf["num_experts"], hf["moe_intermediate_size"], hf["mlp_only_layers"]) == (
            "qwen3_moe", 4, 64, []
        )
        assert hf["norm_topk_prob"] is True
        source = ckpt.source("model.layers.1.mlp.experts.2.down_proj.weight")
        assert source.shape == (64, 64) and source.ggml_type == Q.Q8_0


@pytest.mark.parametrize("name", FLOAT_CASES)
def test_world_size_1_matches_transformers(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    result = run_job(Job(name, str(case.path), case.prompt, steps=STEPS), TPContext())
    assert_matches(result.greedy, case.reference, name)


@pytest.mark.parametrize("world_size", sorted(WORLD_SIZE_CASES))
def test_tensor_parallel_matches_transformers(cases: dict[str, Case], world_size: int, tmp_path: Path) -> None:
    names = WORLD_SIZE_CASES[world_size]
    jobs = [Job(n, str(cases[n].path), cases[n].prompt, steps=STEPS) for n in names]
    per_rank = run_ranks(world_size, jobs, tmp_path)
    for rank, results in enumerate(per_rank):
        for name in names:
            assert_matches(results[name].greedy, cases[name].reference, f"{name} rank {rank}/{world_size}")
        # Experts split along their intermediate size on every rank: (E, 2 I_local, H) and (E, H, I_local).
        local = {2: [20, 20], 3: [14, 13, 13]}[world_size][rank]
        shapes = results["qwen3_moe"].shapes
        assert shapes["model.layers.0.mlp.experts.w13"] == (8, 2 * local, 64)
        assert shapes["model.layers.0.mlp.experts.w2"] == (8, 64, local)
        dense = {2: [32, 32], 3: [22, 21, 21]}[world_size][rank]  # layer 1's dense MLP, intermediate 64
        assert shapes["model.layers.1.mlp.down_proj.weight"] == (64, dense)
        # qwen3_moe: 3 KV groups -> 2 + 1 (TP 2) or 1 each (TP 3); 2 query heads of 16 per group.
        groups = {2: [2, 1], 3: [1, 1, 1]}[world_size][rank]
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == (4 * groups * 16, 64)
        # mixtral: its one KV head on every rank, with 6 / world_size of the query heads.
        shapes = results["mixtral"].shapes
        assert shapes["model.layers.0.self_attn.qkv_proj.weight"] == ((6 // world_size + 2) * 16, 64)
        local = {2: [32, 32], 3: [22, 21, 21]}[world_size][rank]
        assert shapes["model.layers.1.mlp.experts.w13"] == (4, 2 * local, 64)


def test_gguf_kept_q8_0_matches_the_float_run_of_the_file(
    cases: dict[str, Case], monkeypatch: pytest.MonkeyPatch
) -> None:
    """quant None keeps attention and experts in the file's Q8_0 blocks (router float); the exact
    kernel reproduces the float (dequantized) run of the same file."""
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    case = cases["qwen3moe_gguf_q8_0"]
    floats = run_job(Job("f32", str(case.path), case.prompt, steps=STEPS), TPContext())
    kept = load_model(case.path, TPContext())
    ours = our_greedy(kept, case.prompt, STEPS)
    assert_matches(ours, floats.greedy, "q8_0 kept", atol=1e-3)
    assert kept.quant == "q8_0"
    types, fallbacks = quant_summary(kept)
    # 2 layers x (4 experts x 2 weights + qkv + o) + lm_head, all Q8_0; nothing fell back.
    assert types["q8_0"]["tensors"] == 2 * (4 * 3 + 4) + 1 and not fallbacks
    experts = kept.model.layers[0].mlp.experts
    assert experts.w13.numel() == 0 and experts.q13 is not None  # the stacks hold no floats
    assert kept.model.layers[0].mlp.gate.weight.dtype == torch.float32


def test_unsupported_architectures_are_refused_naming_the_supported(tmp_path: Path, models: dict[str, Any]) -> None:
    config = json.loads((_saved(models["mixtral"], tmp_path / "m").joinpath("config.json")).read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"model_type": "dbrx"}))
    with pytest.raises(CeleryTPError) as info:
        load_model(tmp_path / "m", TPContext())
    assert info.value.kind == "unsupported_arch"
    assert "'dbrx'" in str(info.value) and "qwen3_moe" in str(info.value) and "mixtral" in str(info.value)
    # Experts run silu: another activation is refused, not silently run as silu.
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu_pytorch_tanh"}))
    with pytest.raises(CeleryTPError) as info:
        load_model(tmp_path / "m", TPContext())
    assert info.value.kind == "unsupported_arch" and "gelu_pytorch_tanh" in str(info.value)
    w = gguf.GGUFWriter(str(tmp_path / "olmoe.gguf"), "olmoe")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CeleryTPError) as info:
        load_model(tmp_path / "olmoe.gguf", TPContext())
    assert info.value.kind == "unsupported_arch" and "'olmoe'" in str(info.value) and "qwen3moe" in str(info.value)


def test_gguf_metadata_contradicting_its_tensors_is_load_failed_naming_them(
    tmp_path: Path, models: dict[str, Any]
) -> None:
    """expert_feed_forward_length 32 over tensors of 64 rows; expert_count 3 over stacks of 4."""
    model = models["qwen3moe_gguf"]
    path = write_moe_gguf(model, tmp_path / "ffn.gguf", "stacked", {"expert_feed_forward_length": 32})
    with pytest.raises(CeleryTPError) as info:
        load_model(path, TPContext())
    assert info.value.kind == "load_failed"
    assert ".mlp.experts." in str(info.value) and "(64, 64)" in str(info.value), info.value
    path = write_moe_gguf(model, tmp_path / "count.gguf", "stacked", {"expert_count": 3})
    with pytest.raises(CeleryTPError) as info:
        load_model(path, TPContext())
    assert info.value.kind == "load_failed" and "_exps.weight" in str(info.value) and "3 experts" in str(info.value)


def _saved(model: Any, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_hub_configs_translate() -> None:
    """Qwen3-30B-A3B's and Mixtral-8x7B's config.json keys (transformers 4 spellings)."""

    qwen = {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "norm_topk_prob": True, "rope_theta": 1000000.0, "rope_scaling": None,
        "max_position_embeddings": 40960, "max_window_layers": 48, "use_sliding_window": False,
        "sliding_window": None, "hidden_act": "silu", "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    }  # fmt: skip
    c = config_from_hf(qwen)
    assert (c.head_dim, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (128, 128, 8, 768)
    assert c.moe_layers == tuple(range(48)) and c.norm_topk_prob and c.qk_norm and not c.layer_types
    # use_sliding_window puts the window on every layer (Qwen3MoeConfig has no max_window_layers).
    c = config_from_hf(qwen | {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28})
    assert c.layer_types == ("sliding_attention",) * 48 and c.sliding_window == 4096
    c = config_from_hf(qwen | {"decoder_sparse_step": 2, "mlp_only_layers": [1, 2]})
    assert c.moe_layers == tuple(i for i in range(48) if i % 2 == 1 and i != 1)
    mixtral = {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 1000000.0, "sliding_window": None, "max_position_embeddings": 32768,
        "hidden_act": "silu", "rms_norm_eps": 1e-05, "router_aux_loss_coef": 0.02, "tie_word_embeddings": False,
    }  # fmt: skip
    c = config_from_hf(mixtral)
    assert (c.head_dim, c.num_experts, c.moe_intermediate_size, c.moe_layers) == (128, 8, 14336, tuple(range(32)))
    assert c.norm_topk_prob and not c.qk_norm and not c.layer_types
    with pytest.raises(CeleryTPError, match="num_local_experts"):
        config_from_hf({k: v for k, v in mixtral.items() if k != "num_local_experts"})
