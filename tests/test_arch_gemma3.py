"""Gemma 3 (text) against transformers' Gemma3ForCausalLM / Gemma3ForConditionalGeneration on tiny
random configs, at world sizes 1, 2 and 3, from safetensors and from GGUF.

Every case has a sliding window shorter than prompt + decode, so local layers attend to fewer
keys than global ones, and its own rotary bases. Tolerance as test_models_parity: logits within
atol 1e-4 at every prompt position and decode step, 32 greedy tokens identical. One spawn per
world size runs every case.
"""

from __future__ import annotations

import json
import logging
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
    _quantize,
    assert_matches,
    hf_greedy,
    hf_model_from_gguf,
    make_prompt,
    our_greedy,
    run_job,
    run_ranks,
)
from safetensors.torch import load_file, save_file

from celerytp.core.errors import CeleryTPError
from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV
from celerytp.loading import open_checkpoint
from celerytp.models import load_model
from celerytp.models.architectures import config_from_hf

STEPS = 32
VOCAB = 160
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6)
CONFIGS: dict[str, dict[str, Any]] = {
    # gemma3_text, untied, biases on q/k/v/o. 3 KV groups: 2 + 1 on 2 ranks, 1 each on 3.
    # Softmax scale 24 ** -0.5 (not head_dim's); a linear-scaled global rope and a local base
    # far from it.
    "text": dict(
        hidden_size=96, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
        head_dim=32, attention_bias=True, tie_word_embeddings=False, query_pre_attn_scalar=24, sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    ),
    # gemma3 (multimodal), tied, text_config only: MQA, its one KV head replicated on 2 and 3
    # ranks; global layer first. transformers' default bases (1e6 global, 1e4 local).
    "mm": dict(
        hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=1,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=4, layer_types=["full_attention", "sliding_attention"],
    ),
    # For GGUF as llama.cpp runs it: 6 layers from sliding_window_pattern 6 (layer 5 global),
    # local base 10000, softmax scale head_dim ** -0.5, transformers 4.x's rope keys (rope_theta,
    # rope_scaling for global layers); tied. Dims are whole q8_0 blocks.
    "gguf": dict(
        hidden_size=96, intermediate_size=96, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=3,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=5, rope_theta=20_000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
}
VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)
WORLD_SIZE_CASES = {2: ["text", "mm", "gguf_f32"], 3: ["text", "mm", "gguf_f32"]}


@dataclass
class Case:
    path: Path
    prompt: list[int]
    reference: Greedy
    model: Any


def make_gemma3(name: str, seed: int) -> Any:
    """A transformers Gemma 3 with random weights: norms (stored minus one) spread around 0, the
    rest wide enough that greedy has no near-ties."""
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, Gemma3TextConfig

    torch.manual_seed(seed)
    text = Gemma3TextConfig(**COMMON, **CONFIGS[name])
    if name == "mm":
        config = Gemma3Config(text_config=text.to_dict(), vision_config=VISION, mm_tokens_per_image=4)
        model = Gemma3ForConditionalGeneration(config).eval()
    else:
        model = Gemma3ForCausalLM(text).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in pname:  # tied: a small embedding keeps the input token from winning
                p.normal_(0.0, 0.02 if model.config.tie_word_embeddings else 0.05)
            else:
                p.normal_(0.0, 0.3)
    return model


def write_gemma3_gguf(model: Any, path: Path, qtype: gguf.GGMLQuantizationType | None = None) -> Path:
    """`model` as convert_hf_to_gguf.py's Gemma3Model writes it: TextModel's and its own
    set_gguf_parameters keys, every *norm.weight + 1, gguf's gemma3 tensor names; with `qtype`
    every 2-D tensor in that type."""
    cfg = model.config
    full = cfg.rope_parameters["full_attention"]
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(full["rope_theta"])  # the global layers'
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if full.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    w.add_sliding_window(cfg.sliding_window)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if name.endswith("norm.weight"):
            data = data + 1.0
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if qtype is not None and data.ndim == 2:
            w.add_tensor(gname, _quantize(np.ascontiguousarray(data), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _module_names_layout(saved: Path, out: Path) -> Path:
    """The multimodal checkpoint renamed from the saved layout (`language_model.model.*`,
    `vision_tower.*`) to transformers' module names (`model.language_model.*`, `model.vision_tower.*`)."""
    out.mkdir()
    (out / "config.json").write_text((saved / "config.json").read_text())
    renamed = {}
    for name, t in load_file(saved / "model.safetensors").items():
        if name.startswith("language_model.model."):
            name = "model.language_model." + name[len("language_model.model.") :]
        elif name.startswith(("vision_tower.", "multi_modal_projector.")):
            name = "model." + name
        renamed[name] = t
    save_file(renamed, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """These models are tiny: a second intra-op thread only adds waits (seconds per greedy run
    on a busy 2-core machine), so this module runs in one and restores the setting after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("gemma3")
    out: dict[str, Case] = {}
    for seed, name in enumerate(CONFIGS, start=30):
        model = make_gemma3(name, seed)
        prompt = make_prompt(VOCAB, length=10, seed=seed)
        reference = hf_greedy(model, prompt, steps=STEPS)
        if name == "gguf":
            for variant, qtype in (("f32", None), ("q8_0", gguf.GGMLQuantizationType.Q8_0)):
                path = write_gemma3_gguf(model, root / f"gemma3_{variant}.gguf", qtype)
                # transformers' own GGUF reader (it undoes the +1 too) gives the reference
                ref = reference if qtype is None else hf_greedy(hf_model_from_gguf(model, path), prompt, steps=STEPS)
                out[f"gguf_{variant}"] = Case(path, prompt, ref, model)
            continue
        model.save_pretrained(root / name)
        out[name] = Case(root / name, prompt, reference, model)
    mm = out["mm"]
    renamed = _module_names_layout(mm.path, root / "mm_module_names")
    out["mm_module_names"] = Case(renamed, mm.prompt, mm.reference, mm.model)
    return out


def test_the_window_and_the_tokens_are_meaningful(cases: dict[str, Case]) -> None:
    """The references would not catch a missing window or a greedy stuck on one token."""
    from transformers import Gemma3ForCausalLM

    for name in ("text", "mm", "gguf_f32"):
        assert len(set(cases[name].reference.tokens)) >= 8, (name, cases[name].reference.tokens)
    model = cases["text"].model
    wide = Gemma3ForCausalLM(type(model.config)(**{**model.config.to_dict(), "sliding_window": 128})).eval()
    wide.load_state_dict(model.state_dict())
    unwindowed = hf_greedy(wide, cases["text"].prompt, steps=4)
    assert (unwindowed.step_logits - cases["text"].reference.step_logits[:4]).abs().max() > 0.1


@pytest.mark.parametrize("name", ["text", "mm", "mm_module_names", "gguf_f32"])
def test_world_size_1_matches_transformers(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    result = run_job(Job(name, str(case.path), case.prompt, steps=STEPS), TPContext())
    assert_matches(result.greedy, case.reference, name)


def test_tensor_parallel_matches_transformers(cases: dict[str, Case], tmp_path: Path) -> None:
    """World sizes 2 and 3: uneven KV groups (3 on 2 ranks), replicated ones (1 KV head on 2
    and 3 ranks), the GGUF file with its 32-column blocks of o_proj and down_proj per rank."""
    for world_size, names in WORLD_SIZE_CASES.items():
        jobs = [Job(n, str(cases[n].path), cases[n].prompt, steps=STEPS) for n in names]
        per_rank = run_ranks(world_size, jobs, tmp_path / f"w{world_size}")
        for rank, results in enumerate(per_rank):
            for name in names:
                assert_matches(results[name].greedy, cases[name].reference, f"{name} rank {rank}/{world_size}")
        if world_size == 2:  # 6 query heads of 32 over 3 KV groups: 4 + 2 heads
            shapes = [r["text"].shapes["model.layers.0.self_attn.o_proj.weight"] for r in per_rank]
            assert shapes == [(96, 128), (96, 64)]


def test_kept_quantized_gguf_matches_transformers(cases: dict[str, Case], monkeypatch: pytest.MonkeyPatch) -> None:
    """quant None keeps the file's q8_0 linears (and the tied embedding) in their blocks; the exact
    kernel reproduces transformers' dequantization of the same file."""
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    case = cases["gguf_q8_0"]
    model = load_model(case.path, TPContext(), quant=None)
    assert model.quant == "q8_0"
    assert_matches(our_greedy(model, case.prompt, STEPS), case.reference, "gguf_q8_0")


def test_rows_at_different_lengths_decode_together(cases: dict[str, Case]) -> None:
    """prefill_rows of three prompts (3, 9 and 6 tokens), then batched decode with a passenger
    row, past the window of 5; then prefix reuse (truncate and continue). Each row's logits
    equal transformers' on that row's own sequence."""
    case = cases["text"]
    hf = case.model
    model = load_model(case.path, TPContext(), max_batch=3)
    seqs = [case.prompt[:3], case.prompt[:9], case.prompt[4:10]]

    def reference(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return hf(torch.tensor([seq]), use_cache=False).logits[0, -1].float()

    logits = model.prefill_rows(seqs, [0, 1, 2])
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(logits[row], reference(seq), atol=1e-4, rtol=0, msg=f"prefill row {row}")
    nxt = [int(x) for x in logits.argmax(-1)]
    for step in range(12):
        active = [True, step % 3 != 1, True]  # row 1 rides along every third step
        logits = model.decode(nxt, active)
        live = [r for r in range(3) if active[r]]
        for i, row in enumerate(live):
            seqs[row].append(nxt[row])
            torch.testing.assert_close(logits[i], reference(seqs[row]), atol=1e-4, rtol=0, msg=f"step {step} row {row}")
            nxt[row] = int(logits[i].argmax())
    assert model.cache_lens[:3] == [len(s) for s in seqs]
    keep = model.reusable_prefix(seqs[1], seqs[1][:11] + [7, 8])
    assert keep == 11
    model.truncate(1, keep)
    tail = model.forward_tokens(torch.tensor([7, 8]), keep, row=1)
    torch.testing.assert_close(tail[-1], reference(seqs[1][:11] + [7, 8]), atol=1e-4, rtol=0, msg="reused prefix")


def test_multimodal_checkpoint_without_an_image_processor_loads_its_text_model_only(
    cases: dict[str, Case], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="celerytp.models"):
        model = load_model(cases["mm"].path, TPContext())
    assert any("skipping" in r.message and "vision" in r.message for r in caplog.records)
    assert model.config.model_type == "gemma3" and model.config.tie_word_embeddings
    assert not any("vision" in n or "projector" in n for n, _ in model.named_parameters())


def test_hub_configs_translate_as_transformers_reads_them() -> None:
    """gemma-3-4b-it's config.json (a sparse text_config; transformers 4.x rope keys) and
    gemma-3-1b-it's (gemma3_text, rope_local_base_freq, sliding_window_pattern): our config has
    the heads, layer kinds, window, rotary bases and scales transformers derives."""
    from transformers import Gemma3Config, Gemma3TextConfig

    four_b = {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text", "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
        },
        "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                          "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14, "vision_use_head": False},
    }  # fmt: skip
    one_b = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attention_bias": False,
        "attn_logit_softcapping": None, "bos_token_id": 2, "eos_token_id": [1, 106], "final_logit_softcapping": None,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "intermediate_size": 6912,
        "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None,
        "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6, "vocab_size": 262144,
    }  # fmt: skip
    for d, text in ((four_b, Gemma3Config(**four_b).text_config), (one_b, Gemma3TextConfig(**one_b))):
        ours = config_from_hf(d)
        assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size, ours.num_layers) == (
            text.vocab_size, text.hidden_size, text.intermediate_size, text.num_hidden_layers)  # fmt: skip
        assert (ours.num_heads, ours.num_kv_heads, ours.head_dim) == (
            text.num_attention_heads, text.num_key_value_heads, text.head_dim)  # fmt: skip
        assert ours.layer_types == tuple(text.layer_types) and ours.sliding_window == text.sliding_window
        full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
        assert (ours.rope.theta, ours.rope.rope_type, ours.rope.factor) == (
            full["rope_theta"], full["rope_type"], full.get("factor", 1.0))  # fmt: skip
        assert ours.local_rope is not None
        assert (ours.local_rope.theta, ours.local_rope.rope_type) == (local["rope_theta"], "default")
        assert ours.attention_scale == text.query_pre_attn_scalar**-0.5
        assert ours.embedding_scale == text.hidden_size**0.5
        assert ours.tie_word_embeddings and ours.qk_norm and ours.zero_centered_norms
        assert ours.hidden_act == text.hidden_activation == "gelu_pytorch_tanh"
    assert config_from_hf(four_b).eos_token_ids == (1, 106)


def test_gguf_metadata_becomes_the_model_config(cases: dict[str, Case]) -> None:
    with open_checkpoint(cases["gguf_f32"].path) as ckpt:
        config = config_from_hf(ckpt.hf_config)
        names = set(ckpt.names())
    expected = config_from_hf(cases["gguf_f32"].model.config.to_dict())
    assert config.layer_types == expected.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    fields = ("sliding_window", "rope", "local_rope", "attention_scale", "embedding_scale", "num_kv_heads", "head_dim")
    for field in fields:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.model_type == "gemma3_text" and config.tie_word_embeddings
    block = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_attention_layernorm", "self_attn.q_norm")
    assert {f"model.layers.5.{name}.weight" for name in block} <= names


def test_unsupported_configs_are_refused_at_load(cases: dict[str, Case], tmp_path: Path) -> None:
    """final_logit_softcapping and bidirectional attention are refused as unsupported_arch naming
    the setting, before any weight is read; an unknown GGUF architecture names the supported ones."""
    for key, value in (("final_logit_softcapping", 30.0), ("use_bidirectional_attention", True)):
        path = tmp_path / key
        path.mkdir()
        config = json.loads((cases["text"].path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config | {key: value}))
        (path / "model.safetensors").write_bytes((cases["text"].path / "model.safetensors").read_bytes())
        with pytest.raises(CeleryTPError) as info:
            load_model(path, TPContext())
        assert info.value.kind == "unsupported_arch" and key in str(info.value), info.value
    w = gguf.GGUFWriter(str(tmp_path / "gemma2.gguf"), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CeleryTPError) as info:
        load_model(tmp_path / "gemma2.gguf", TPContext())
    assert info.value.kind == "unsupported_arch" and "'gemma2'" in str(info.value) and "gemma3" in str(info.value)


def test_gguf_metadata_contradicting_a_tensor_is_load_failed_naming_it(cases: dict[str, Case], tmp_path: Path) -> None:
    model = cases["gguf_f32"].model
    model.config.intermediate_size = 64  # what the writer records; the tensors keep 96
    try:
        path = write_gemma3_gguf(model, tmp_path / "lying.gguf")
    finally:
        model.config.intermediate_size = 96
    with pytest.raises(CeleryTPError) as info:
        load_model(path, TPContext())
    assert info.value.kind == "load_failed"
    assert "model.layers.0.mlp.gate_proj.weight: checkpoint shape (96, 96), model expects (64, 96)" in str(info.value)


def test_bfloat16_stays_close_to_float32(cases: dict[str, Case]) -> None:
    """bf16 weights and KV cache (the CUDA default): the (1 + w) norms and the embedding scale
    in bf16 as transformers rounds them; float32 logits near the float32 reference."""
    for name in ("text", "mm"):
        case = cases[name]
        model = load_model(case.path, TPContext(), dtype=torch.bfloat16)
        logits = model.forward_tokens(torch.tensor(case.prompt), 0)
        err = (logits - case.reference.prompt_logits).abs().max().item()
        scale = case.reference.prompt_logits.abs().max().item()
        assert err < 0.05 * scale, (name, err, scale)
