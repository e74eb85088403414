"""GGUF files written with gguf.GGUFWriter (llama.cpp's layout, Q/K permuted for llama) load
to the same model transformers builds from the same file.

The reference is transformers' own GGUF reader (gguf.quants.dequantize and its
reverse_permute) feeding transformers' Llama/Qwen3; tolerance as in test_models_parity.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
from model_fixtures import (
    GGUF_CONFIGS,
    Greedy,
    Job,
    assert_matches,
    hf_greedy,
    hf_model_from_gguf,
    make_hf_model,
    make_prompt,
    run_job,
    run_ranks,
    write_gguf,
)

from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV
from celerytp.loading import GGUFCheckpoint, open_checkpoint
from celerytp.models.architectures import config_from_hf

Q = gguf.GGMLQuantizationType
# variant -> GGUF name substring -> quant type for 2-D weights
VARIANTS: dict[str, dict[str, dict[str, Q]]] = {
    "llama": {
        "f32": {},
        "mixed": {"attn_": Q.Q8_0, "ffn_": Q.Q4_1, "token_embd": Q.Q8_0, "output.": Q.F16},
    },
    "qwen3": {
        "f32": {},
        "q8_0": {"": Q.Q8_0},
    },
}
CASE_NAMES = [f"{arch}_{variant}" for arch, vs in VARIANTS.items() for variant in vs]


@dataclass
class Case:
    path: Path
    prompt: list[int]
    reference: Greedy


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for seed, (arch, (model_type, kwargs)) in enumerate(GGUF_CONFIGS.items(), start=10):
        model = make_hf_model(model_type, kwargs, seed)
        prompt = make_prompt(model.config.vocab_size, seed=seed)
        for variant, quant in VARIANTS[arch].items():
            path = write_gguf(model, root / f"{arch}_{variant}.gguf", quant)
            out[f"{arch}_{variant}"] = Case(path, prompt, hf_greedy(hf_model_from_gguf(model, path), prompt))
    return out


def test_metadata_becomes_the_model_config(cases: dict[str, Case]) -> None:
    with open_checkpoint(cases["llama_mixed"].path) as ckpt:
        assert isinstance(ckpt, GGUFCheckpoint)
        config = config_from_hf(ckpt.hf_config)
        assert (config.model_type, config.num_heads, config.num_kv_heads, config.head_dim) == ("llama", 6, 3, 32)
        assert (config.hidden_size, config.intermediate_size, config.vocab_size) == (96, 96, 160)
        assert config.attention_bias and not config.tie_word_embeddings
        assert config.rope.freq_factors is not None and len(config.rope.freq_factors) == 16
        assert "rope_freqs.weight" not in ckpt.names()
        assert ckpt.source("model.layers.0.mlp.down_proj.weight").column_block() == 32
    with open_checkpoint(cases["qwen3_q8_0"].path) as ckpt:
        config = config_from_hf(ckpt.hf_config)
        assert config.model_type == "qwen3" and config.tie_word_embeddings
        assert "model.layers.1.self_attn.k_norm.weight" in ckpt.names()


@pytest.mark.parametrize("name", CASE_NAMES)
def test_world_size_1_matches_transformers(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    result = run_job(Job(name, str(case.path), case.prompt), TPContext())
    assert_matches(result.greedy, case.reference, name)


def test_world_size_2_matches_transformers(cases: dict[str, Case], tmp_path: Path) -> None:
    jobs = [Job(n, str(cases[n].path), cases[n].prompt) for n in CASE_NAMES]
    for rank, results in enumerate(run_ranks(2, jobs, tmp_path)):
        for name in CASE_NAMES:
            assert_matches(results[name].greedy, cases[name].reference, f"{name} rank {rank}/2")
        # Quantized MLP splits move whole 32-column blocks: 96 -> 64 + 32.
        expected = 64 if rank == 0 else 32
        assert results["qwen3_q8_0"].shapes["model.layers.0.mlp.down_proj.weight"] == (64, expected)
        assert results["qwen3_f32"].shapes["model.layers.0.mlp.down_proj.weight"] == (64, 48)
        # llama: 3 KV groups -> 2 + 1, so o_proj holds 4 or 2 heads of 32 columns.
        assert results["llama_mixed"].shapes["model.layers.0.self_attn.o_proj.weight"] == (96, 128 if rank == 0 else 64)


@pytest.mark.parametrize("name", ["qwen3_q8_0", "llama_mixed"])
def test_kept_quantized_matches_transformers(cases: dict[str, Case], name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """quant None keeps each linear in the file's type (q8_0, q4_1; the F16 lm_head as float32);
    the exact kernel reproduces transformers' dequantized weights."""
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    case = cases[name]
    result = run_job(Job(name, str(case.path), case.prompt, quant=None), TPContext())
    assert_matches(result.greedy, case.reference, name)


def test_metadata_contradicting_a_tensor_is_load_failed_naming_it(tmp_path: Path) -> None:
    """A GGUF whose feed_forward_length says 64 while its MLP tensors have 96 rows: the load
    stops with load_failed naming the first tensor that disagrees, before any model runs."""
    from celerytp.core.errors import CeleryTPError
    from celerytp.models import load_model

    model_type, kwargs = GGUF_CONFIGS["qwen3"]
    model = make_hf_model(model_type, kwargs, seed=3)
    model.config.intermediate_size = 64  # what write_gguf records; the tensors keep 96
    path = write_gguf(model, tmp_path / "lying.gguf")
    with pytest.raises(CeleryTPError) as info:
        load_model(path, TPContext())
    assert info.value.kind == "load_failed"
    assert "model.layers.0.mlp." in str(info.value) and "(96, 64)" in str(info.value), info.value
