"""qwen2, mistral and phi3 against transformers' own implementations, on tiny random models.

Each architecture: logits within LOGITS_ATOL and identical greedy tokens over 32 decode steps at
TP 1 (in process), 2 and 3 (one spawn per world size for every case); the GGUF llama.cpp's
converter would write from the same weights (written here with gguf.GGUFWriter, laid out as
convert_hf_to_gguf.py's Qwen2Model / LlamaModel / Phi3MiniModel do) gives the same tokens; a q8_0
file kept quantized; refusals of what we do not run.

Splits covered: qwen2's 3 KV heads on 2 ranks (2 + 1, uneven) and 3; mistral's single KV head
replicated on 2 and 3 ranks; phi3's 4 KV heads on 3 ranks (2 + 1 + 1) and phi3-longrope's 3.
Mistral's 8-position window is shorter than its 8-token prompt + 32 steps, also through the
serving path (rows of different lengths in one decode batch, padded prefill, prefix reuse).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from model_fixtures import (
    LOGITS_ATOL,
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

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV
from celerytp.models import load_model
from celerytp.models.architectures import config_from_hf

STEPS = 32
LONGROPE_HALF = 6  # phi3_longrope: head_dim 16 * partial 0.75 = 12 rotary dims
_g = torch.Generator().manual_seed(7)
SHORT = (1.0 + 3.0 * torch.rand(LONGROPE_HALF, generator=_g)).tolist()
LONG = (1.0 + 3.0 * torch.rand(LONGROPE_HALF, generator=_g)).tolist()

# name -> (model_type, config kwargs); dims are multiples of 32 where GGUF blocks need them.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # 3 KV heads (2 + 1 on 2 ranks), tied; a window of 8 on layers from max_window_layers 1 on.
    "qwen2": (
        "qwen2",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=64,
             tie_word_embeddings=True, use_sliding_window=True, max_window_layers=1, sliding_window=8,
             rope_theta=20000.0),
    ),  # fmt: skip
    # One KV head (replicated on every rank), head_dim 32 != 64 / 6, every layer windowed (8).
    "mistral": (
        "mistral",
        dict(hidden_size=64, num_attention_heads=6, num_key_value_heads=1, head_dim=32, intermediate_size=96,
             sliding_window=8, tie_word_embeddings=False),
    ),  # fmt: skip
    # MHA 4/4 (2 + 1 + 1 on 3 ranks), half of each head rotates (Phi-4-mini style), window 12.
    "phi3": (
        "phi3",
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96,
             partial_rotary_factor=0.5, sliding_window=12, pad_token_id=None, eos_token_id=2),
    ),  # fmt: skip
    # Phi-3-128k style longrope (positions past the original 4 use the long factors), GQA 6/3,
    # 3/4 of each head rotates; no window.
    "phi3_longrope": (
        "phi3",
        dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=64,
             original_max_position_embeddings=4, pad_token_id=None, eos_token_id=2,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                              "short_factor": SHORT, "long_factor": LONG}),
    ),  # fmt: skip
}
GGUF_ARCH = {"qwen2": "qwen2", "mistral": "llama", "phi3": "phi3"}  # what llama.cpp's converter writes


# ---- GGUF, as convert_hf_to_gguf.py writes these architectures ---------------------------------


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute (Mistral is converted as llama): each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model: Any, path: Path, quant: gguf.GGMLQuantizationType | None = None, window_key: bool = False
) -> Path:
    """Qwen2Model (TextModel's keys), LlamaModel (+ vocab_size, rope dims, Q/K permuted) or
    Phi3MiniModel (its own keys, longrope factor tensors); `quant` stores the linears in that type;
    `window_key` adds llama.attention.sliding_window (which the converter never writes)."""
    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    rope = cfg.rope_parameters
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if arch == "llama":
        w.add_vocab_size(cfg.vocab_size)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_key_length(cfg.head_dim)  # TextModel: head_dim is in Mistral's config
        w.add_value_length(cfg.head_dim)
        if window_key:
            w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        rot_pct = rope.get("partial_rotary_factor", 1.0)
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        w.add_rope_dimension_count(int(rot_pct * cfg.hidden_size) // cfg.num_attention_heads)
        w.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("long_factor"):
            scale = cfg.max_position_embeddings / cfg.original_max_position_embeddings
            orig = cfg.original_max_position_embeddings
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)
            w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
            w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = _permute(data, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        if quant is not None and data.ndim == 2 and "_proj." in name:
            w.add_tensor(gname, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- cases --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """Tiny matrices: one intra-op thread is much faster than two fighting other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@dataclass
class Case:
    path: Path
    gguf: Path
    prompt: list[int]
    reference: Greedy
    model: Any
    gguf_reference: Greedy  # what the GGUF must give: qwen2's and mistral's files carry no window


# llama.cpp's converter writes no sliding window for these (Qwen2Model, LlamaModel), and llama.cpp
# runs them unwindowed: their GGUF matches transformers with the window off.
UNWINDOWED = {"qwen2": {"use_sliding_window": False}, "mistral": {"sliding_window": None}}


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("dense")
    out: dict[str, Case] = {}
    for seed, (name, (model_type, kwargs)) in enumerate(CONFIGS.items()):
        model = make_hf_model(model_type, kwargs, seed)
        prompt = make_prompt(model.config.vocab_size, seed=seed)
        model.save_pretrained(root / name, safe_serialization=True)
        reference = hf_greedy(model, prompt, STEPS)
        gguf_reference = reference
        if name in UNWINDOWED:
            unwindowed = make_hf_model(model_type, kwargs | UNWINDOWED[name], seed)
            unwindowed.load_state_dict(model.state_dict())
            gguf_reference = hf_greedy(unwindowed, prompt, STEPS)
        path = write_gguf(model, root / f"{name}.gguf")
        out[name] = Case(root / name, path, prompt, reference, model, gguf_reference)
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_world_size_1_matches_transformers(cases: dict[str, Case], name: str) -> None:
    case = cases[name]
    result = run_job(Job(name, str(case.path), case.prompt, steps=STEPS), TPContext())
    assert_matches(result.greedy, case.reference, name)


def test_the_windows_change_the_tokens(cases: dict[str, Case]) -> None:
    """The windows are short enough to matter: without them transformers decodes otherwise."""
    for name in UNWINDOWED:
        assert cases[name].gguf_reference.tokens != cases[name].reference.tokens, name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gguf_gives_the_same_tokens(cases: dict[str, Case], name: str) -> None:
    """phi3 files keep their window (Phi3MiniModel writes attention.sliding_window); qwen2 and
    mistral (converted as llama) files have none, and run as llama.cpp runs them: unwindowed."""
    case = cases[name]
    result = run_job(Job(name, str(case.gguf), case.prompt, steps=STEPS), TPContext())
    assert_matches(result.greedy, case.gguf_reference, f"{name} gguf")


def test_a_llama_gguf_with_a_window_key_gets_the_window(cases: dict[str, Case], tmp_path: Path) -> None:
    """The converter never writes llama.attention.sliding_window; a file that does carry it gets it."""
    case = cases["mistral"]
    keyed = write_gguf(case.model, tmp_path / "keyed.gguf", window_key=True)
    result = run_job(Job("mistral", str(keyed), case.prompt, steps=STEPS), TPContext())
    assert_matches(result.greedy, case.reference, "mistral gguf with llama.attention.sliding_window")


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensor_parallel_matches_transformers(cases: dict[str, Case], world_size: int, tmp_path: Path) -> None:
    jobs = [Job(n, str(c.path), c.prompt, steps=STEPS) for n, c in cases.items()]
    jobs += [Job(f"{n}.gguf", str(c.gguf), c.prompt, steps=STEPS) for n, c in cases.items()]
    expected = {n: c.reference for n, c in cases.items()} | {f"{n}.gguf": c.gguf_reference for n, c in cases.items()}
    per_rank = run_ranks(world_size, jobs, tmp_path)
    for rank, results in enumerate(per_rank):
        for name, ref in expected.items():
            assert_matches(results[name].greedy, ref, f"{name} rank {rank}/{world_size}")
    # The splits are what the docstring says: uneven, replicated.
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    rows = {n: [results[n].shapes[qkv][0] for results in per_rank] for n in ("qwen2", "mistral", "phi3")}
    if world_size == 2:
        assert rows["qwen2"] == [(4 + 2 + 2) * 16, (2 + 1 + 1) * 16]  # 3 KV groups: 2 + 1
        assert rows["mistral"] == [(3 + 1 + 1) * 32] * 2  # 1 KV head on both ranks, 3 query heads each
    else:
        assert rows["phi3"] == [(2 + 2 + 2) * 16, (1 + 1 + 1) * 16, (1 + 1 + 1) * 16]  # 4 KV heads: 2 + 1 + 1
        assert rows["mistral"] == [(2 + 1 + 1) * 32] * 3


# ---- the serving path with a sliding window ------------------------------------------------------


def _hf_last(model: Any, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()


def test_mistral_window_through_batched_decode_padded_prefill_and_prefix_reuse(cases: dict[str, Case]) -> None:
    """Rows of different lengths (some past the window, some not) in one padded prefill and in
    one decode batch, a passenger row, then a row truncated to a reused prefix and continued:
    every row's logits equal transformers' for that row's own sequence."""
    case = cases["mistral"]
    hf = case.model
    model = load_model(case.path, TPContext(), max_batch=3, max_context=64)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 160, (n,), generator=g).tolist() for n in (5, 11, 14)]
    logits = model.prefill_rows(prompts, [0, 1, 2])
    seqs = [list(p) for p in prompts]
    for b, seq in enumerate(seqs):
        torch.testing.assert_close(logits[b], _hf_last(hf, seq), atol=LOGITS_ATOL, rtol=0, msg=f"prefill row {b}")
    for step in range(12):
        nxt = [int(x) for x in logits.argmax(-1)]
        active = [True, step % 3 != 1, True]  # row 1 rides along as a passenger every third step
        feed = [t if a else 0 for t, a in zip(nxt, active)]
        for b, a in enumerate(active):
            if a:
                seqs[b].append(feed[b])
        out = model.decode(feed, active)
        live = [b for b, a in enumerate(active) if a]
        for i, b in enumerate(live):
            ref = _hf_last(hf, seqs[b])
            torch.testing.assert_close(out[i], ref, atol=LOGITS_ATOL, rtol=0, msg=f"decode step {step} row {b}")
        full = {b: out[i] for i, b in enumerate(live)}
        logits = torch.stack([full[b] if b in full else _hf_last(hf, seqs[b]) for b in range(3)])
    assert [model.cache_lens[b] for b in range(3)] == [len(s) for s in seqs]
    # Prefix reuse: row 2 keeps 13 of its positions (past the window) and continues another way.
    keep = 13
    model.truncate(2, keep)
    suffix = [7, 99, 42]
    seq = seqs[2][:keep] + suffix
    out = model.forward_tokens(torch.tensor(suffix), keep, row=2)
    for i in range(len(suffix)):
        ref = _hf_last(hf, seq[: keep + i + 1])
        torch.testing.assert_close(out[i], ref, atol=LOGITS_ATOL, rtol=0, msg=f"reused prefix, token {i}")
    for _ in range(4):
        nxt = int(out[-1].argmax())
        seq.append(nxt)
        out = model.decode([0, 0, nxt], [False, False, True])
        torch.testing.assert_close(out[0], _hf_last(hf, seq), atol=LOGITS_ATOL, rtol=0, msg="after reuse")


# ---- quantized ------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "phi3"])
def test_q8_0_gguf_kept_quantized(
    cases: dict[str, Case], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A q8_0 file loads with its linears kept as the file's blocks (phi3's fused attn_qkv and
    ffn_up through their row ranges) and decodes as the float load of the same file does."""
    monkeypatch.setenv(KERNEL_ENV, "dequant")  # the exact kernel: float32 noise only
    case = cases[name]
    path = write_gguf(case.model, tmp_path / f"{name}.q8_0.gguf", quant=gguf.GGMLQuantizationType.Q8_0)
    kept = load_model(path, TPContext(), quant=None, max_context=64)
    assert "q8_0" in kept.quant.split("+")
    attn, mlp = kept.model.layers[0].self_attn, kept.model.layers[0].mlp
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        assert linear.qweight is not None and {p.fmt.name for p in linear.qweight.parts} == {"q8_0"}
    plain = load_model(path, TPContext(), quant="f32", max_context=64)
    reference = our_greedy(plain, case.prompt, STEPS)
    assert_matches(our_greedy(kept, case.prompt, STEPS), reference, f"{name} q8_0", atol=1e-3)


# ---- config translation and refusals --------------------------------------------------------------


def _base(model_type: str, **extra: Any) -> dict[str, Any]:
    return dict(model_type=model_type, vocab_size=160, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, intermediate_size=96) | extra  # fmt: skip


def test_config_translation() -> None:
    # qwen2: no window unless use_sliding_window (transformers' default is off, key absent or not).
    assert config_from_hf(_base("qwen2", sliding_window=4096)).layer_types == ()
    c = config_from_hf(_base("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=2))
    assert c.layer_types == ("full_attention",) * 2 + ("sliding_attention",) * 2 and c.sliding_window == 16
    assert (c.attention_bias, c.o_proj_bias) == (True, False)  # whatever attention_bias says
    # mistral: every layer when set; null is none; layer_types / use_sliding_window are ignored.
    c = config_from_hf(_base("mistral", sliding_window=32, layer_types=["full_attention"] * 4))
    assert c.layer_types == ("sliding_attention",) * 4 and c.sliding_window == 32
    assert config_from_hf(_base("mistral", sliding_window=None)).layer_types == ()
    # phi3: 4.x spellings of longrope, partial rotary top-level or in the rope parameters.
    half = 16 * 3 // 4 // 2
    for kind in ("su", "yarn", "longrope"):
        rope = {"type": kind, "short_factor": [1.0] * half, "long_factor": [2.0] * half}
        c = config_from_hf(
            _base("phi3", rope_scaling=rope, partial_rotary_factor=0.75, original_max_position_embeddings=64,
                  max_position_embeddings=256)
        )  # fmt: skip
        assert c.rope.rope_type == "longrope" and c.rotary_dim == 12 and c.rope.factor == 4.0
    rope = {"rope_type": "default", "partial_rotary_factor": 0.5}
    c = config_from_hf(_base("phi3", rope_parameters=rope))
    assert c.rotary_dim == 8 and c.layer_types == ()


def _write_config(path: Path, config: dict[str, Any]) -> Path:
    """A checkpoint directory with this config.json (and a placeholder tensor file)."""
    from safetensors.torch import save_file

    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(config["hidden_size"])}, path / "model.safetensors")
    return path


def test_unsupported_architectures_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(CeleryTPError) as info:
        load_model(_write_config(tmp_path / "phimoe", _base("phimoe")), TPContext())
    assert info.value.kind == ErrorKind.UNSUPPORTED_ARCH
    assert "'phimoe'" in str(info.value) and all(t in str(info.value) for t in ("qwen2", "mistral", "phi3"))
    w = gguf.GGUFWriter(str(tmp_path / "phi2.gguf"), "phi2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CeleryTPError) as info:
        load_model(tmp_path / "phi2.gguf", TPContext())
    assert info.value.kind == ErrorKind.UNSUPPORTED_ARCH
    assert "'phi2'" in str(info.value) and all(t in str(info.value) for t in ("qwen2", "phi3"))
    with pytest.raises(CeleryTPError, match="hidden_act 'gelu'") as info:  # what the shared MLP cannot run
        load_model(_write_config(tmp_path / "gelu", _base("mistral", hidden_act="gelu")), TPContext())
    assert info.value.kind == ErrorKind.UNSUPPORTED_ARCH


def test_fused_tensors_that_contradict_the_config_name_the_tensor(cases: dict[str, Case], tmp_path: Path) -> None:
    """phi3's fused qkv_proj / GGUF attn_qkv whose rows do not add up to q + k + v: load_failed naming it."""
    from safetensors.torch import load_file, save_file

    case = cases["phi3"]
    bad = tmp_path / "phi3_bad"
    bad.mkdir()
    (bad / "config.json").write_text((case.path / "config.json").read_text())
    tensors = load_file(case.path / "model.safetensors")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    tensors[name] = tensors[name][:-16].contiguous()  # one head's rows short
    save_file(tensors, bad / "model.safetensors")
    with pytest.raises(CeleryTPError, match=f"{name}: checkpoint shape \\(176, 64\\), the model expects 192") as info:
        load_model(bad, TPContext())
    assert info.value.kind == ErrorKind.LOAD_FAILED
    # GGUF: the metadata says 2 KV heads where attn_qkv holds 4.
    reader = gguf.GGUFReader(str(case.gguf))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "phi3")
    for field in reader.fields.values():
        if field.name.startswith("phi3.") and field.name != "phi3.attention.head_count_kv":
            w.add_key_value(field.name, field.contents(), field.types[0])
    w.add_head_count_kv(2)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        w.add_tensor(t.name, np.array(t.data), raw_shape=shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CeleryTPError, match=r"layers\.0\.self_attn\.qkv_proj\.weight: .*expects 128 rows") as info:
        load_model(tmp_path / "bad.gguf", TPContext())
    assert info.value.kind == ErrorKind.LOAD_FAILED
