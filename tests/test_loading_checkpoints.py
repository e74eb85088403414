"""Checkpoint loading: each rank reads only its slices; broken inputs give typed errors."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from model_fixtures import GGUF_CONFIGS, TINY_CONFIGS, make_hf_model, write_gguf
from safetensors.torch import load_file, save_file

from celerytp.core.errors import CeleryTPError
from celerytp.distributed.tp import TPContext
from celerytp.loading import open_checkpoint
from celerytp.models import build_model, load_model
from celerytp.models.architectures import config_from_hf
from celerytp.quant.plan import quant_summary

SHARDED = re.compile(r"(\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)|embed_tokens|lm_head)\.weight$")
COLUMN_BIAS = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.bias$")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, kwargs = TINY_CONFIGS["llama_gqa_bias"]
    path = tmp_path_factory.mktemp("ckpt") / "llama"
    make_hf_model(model_type, kwargs, seed=0).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model_type, kwargs = GGUF_CONFIGS["llama"]
    path = tmp_path_factory.mktemp("ckpt") / "llama_q8.gguf"
    return write_gguf(make_hf_model(model_type, kwargs, seed=1), path, {"": gguf.GGMLQuantizationType.Q8_0})


def load_rank(path: Path, rank: int, world_size: int):  # type: ignore[no-untyped-def]
    """Load one rank's shard without a process group (loading runs no collective)."""
    with open_checkpoint(path) as ckpt, torch.inference_mode():
        config = config_from_hf(ckpt.hf_config)
        model = build_model(
            config, ckpt, TPContext(rank, world_size), dtype=torch.float32, device="cpu", max_context=16
        )
        loaded = model.load_weights(ckpt)
        return model, loaded, list(ckpt.reads), ckpt.names()


@pytest.mark.parametrize("fmt", ["safetensors", "gguf_q8_0"])
def test_ranks_read_only_their_slices(
    fmt: str, llama_dir: Path, q8_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = llama_dir if fmt == "safetensors" else q8_gguf
    # Spy on dequantization (delegating to the real one): it must only ever see slices.
    dequantized: list[tuple[int, ...]] = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, q: dequantized.append(data.shape) or real(data, q))

    split_dims: dict[str, list[int]] = {}
    for rank in range(2):
        dequantized.clear()
        model, loaded, reads, names = load_rank(path, rank, 2)
        assert loaded == set(model.checkpoint_table()) and len(reads) == len(names)
        for r in reads:
            if SHARDED.search(r.name) or COLUMN_BIAS.search(r.name):
                assert r.shape != r.full_shape, f"rank {rank} read all of {r.name} {r.full_shape}"
                dim = 1 if ".o_proj." in r.name or ".down_proj." in r.name else 0
                assert len(r.shape) == 1 or r.shape[1 - dim] == r.full_shape[1 - dim]  # other dim whole
                split_dims.setdefault(r.name, []).append(r.shape[dim])
            else:
                assert r.shape == r.full_shape, r.name  # replicated
        if fmt == "gguf_q8_0":
            reader = gguf.GGUFReader(str(path))  # raw (rows, bytes) shapes of the split matrices
            split = re.compile(r"(attn_[qkv]|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
            full = {t.data.shape for t in reader.tensors if split.search(t.name)}
            assert len(full) > 2 and not {s for s in dequantized if len(s) == 2} & full, (dequantized, full)
    # The two ranks' slices of every split tensor add up to the whole dimension.
    with open_checkpoint(path) as ckpt:
        for name, sizes in split_dims.items():
            dim = 1 if ".o_proj." in name or ".down_proj." in name else 0
            assert len(sizes) == 2 and sum(sizes) == ckpt.source(name).shape[dim], (name, sizes)


def test_parameters_hold_only_the_local_shard(llama_dir: Path) -> None:
    # 6 q heads / 3 kv heads, head_dim 16, hidden 48, intermediate 96 over 2 ranks.
    full = load_file(str(llama_dir / "model.safetensors"))
    for rank, (q0, nq, k0, nk) in enumerate([(0, 4, 0, 2), (4, 2, 2, 1)]):
        model, *_ = load_rank(llama_dir, rank, 2)
        attn, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp
        q, k, v = attn.qkv_proj.weight.split([nq * 16, nk * 16, nk * 16])
        prefix = "model.layers.1."
        assert torch.equal(q, full[prefix + "self_attn.q_proj.weight"][q0 * 16 : (q0 + nq) * 16])
        assert torch.equal(k, full[prefix + "self_attn.k_proj.weight"][k0 * 16 : (k0 + nk) * 16])
        assert torch.equal(v, full[prefix + "self_attn.v_proj.weight"][k0 * 16 : (k0 + nk) * 16])
        assert torch.equal(attn.o_proj.weight, full[prefix + "self_attn.o_proj.weight"][:, q0 * 16 : (q0 + nq) * 16])
        assert torch.equal(attn.o_proj.bias, full[prefix + "self_attn.o_proj.bias"])  # added once, after the reduce
        i0 = 48 * rank
        gate, up = mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, full[prefix + "mlp.gate_proj.weight"][i0 : i0 + 48])
        assert torch.equal(up, full[prefix + "mlp.up_proj.weight"][i0 : i0 + 48])
        assert torch.equal(mlp.down_proj.weight, full[prefix + "mlp.down_proj.weight"][:, i0 : i0 + 48])
        assert torch.equal(model.model.layers[1].input_layernorm.weight, full[prefix + "input_layernorm.weight"])


def test_progress_reports_every_tensor(llama_dir: Path) -> None:
    calls: list[tuple[int, int, str]] = []
    load_model(llama_dir, TPContext(), progress=lambda done, total, name: calls.append((done, total, name)))
    with open_checkpoint(llama_dir) as ckpt:
        names = ckpt.names()
    assert [c[0] for c in calls] == list(range(1, len(names) + 1))
    assert {c[1] for c in calls} == {len(names)} and [c[2] for c in calls] == names


def test_bad_paths_are_unsupported(tmp_path: Path) -> None:
    with pytest.raises(CeleryTPError, match="no such path") as err:
        load_model(tmp_path / "nope", TPContext())
    assert err.value.kind == "unsupported_arch"
    with pytest.raises(CeleryTPError, match="nor a directory with config.json") as err:
        load_model(tmp_path, TPContext())
    assert err.value.kind == "unsupported_arch"
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(CeleryTPError) as err:
        load_model(not_gguf, TPContext())
    assert err.value.kind == "unsupported_arch"


def test_damaged_gguf_fails_to_load(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\x00" * 64)  # the magic, then nonsense
    with pytest.raises(CeleryTPError, match="not a readable GGUF file") as err:
        load_model(junk, TPContext())
    assert err.value.kind == "load_failed"


def test_unsupported_model_type(llama_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "gpt2"
    shutil.copytree(llama_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(CeleryTPError, match="model_type 'gpt2'") as err:
        load_model(copy, TPContext())
    assert err.value.kind == "unsupported_arch"


def test_unsupported_gguf_architecture(tmp_path: Path) -> None:
    model_type, kwargs = GGUF_CONFIGS["qwen3"]
    path = write_gguf(make_hf_model(model_type, kwargs, seed=2), tmp_path / "x.gguf", arch="gpt2")
    with pytest.raises(CeleryTPError, match="GGUF architecture 'gpt2'") as err:
        load_model(path, TPContext())
    assert err.value.kind == "unsupported_arch"


def test_missing_and_unexpected_tensors(llama_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    shutil.copy(llama_dir / "config.json", broken)
    tensors = load_file(str(llama_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(CeleryTPError) as err:
        load_model(broken, TPContext())
    assert err.value.kind == "load_failed"
    assert err.value.message == (
        "missing: [model.layers.1.self_attn.q_proj.weight]; unexpected: [model.layers.0.self_attn.extra.weight]"
    )


def test_shape_mismatch_names_both_shapes(llama_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "wrong"
    shutil.copytree(llama_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))
    with pytest.raises(
        CeleryTPError, match=r"mlp\.\w+\.weight: checkpoint shape \((96, 48|48, 96)\), model expects \((64, 48|48, 64)\)"
    ):
        load_model(copy, TPContext())


def test_impossible_splits_fail_at_load(llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CeleryTPError, match="world size 4 exceeds num_kv_heads 3") as err:
        load_model(llama_dir, TPContext(0, 4))
    assert err.value.kind == "load_failed"
    # qwen3 4 q / 2 kv heads split fine over 4 ranks, and Q8_0 blocks of 32 cannot give 4 ranks
    # a share of intermediate 96: that slice falls back to another format (reported), no failure.
    model_type, kwargs = GGUF_CONFIGS["qwen3"]
    path = write_gguf(make_hf_model(model_type, kwargs, 3), tmp_path / "q.gguf", {"": gguf.GGMLQuantizationType.Q8_0})
    _, fallbacks = quant_summary(load_model(path, TPContext(0, 4)))
    assert fallbacks and all("q8_0 ->" in f for f in fallbacks), fallbacks
    with pytest.raises(CeleryTPError, match=r"max_context 129 must be within 1..128 \(max_position_embeddings 128\)"):
        load_model(llama_dir, TPContext(), max_context=129)
