"""Quantized shards end to end: every executable format on llama and qwen3, GGUF kept quantized
with TP (raw blocks sliced per rank), and the SmolLM2 Q4_1 file at TP 1, 2 and 3.

References are independent: transformers with each linear weight replaced by gguf's own
dequantization of the same blocks (or the float run of the same file). The exact kernel
(CELERYTP_QUANT_KERNEL=dequant) must match to float32 noise; the fast kernels run with
bfloat16 activations and bfloat16 group scales, so they must agree within bfloat16 noise.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from gguf import GGMLQuantizationType as T
from model_fixtures import COMMON, Greedy, assert_matches, hf_greedy, make_hf_model, make_prompt, our_greedy, write_gguf

from celerytp.core.errors import CeleryTPError
from celerytp.core.model_files import default_model_path
from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV, QuantizedWeight
from celerytp.models import load_model
from celerytp.quant import dequantize_blocks, quantize_blocks, unpack_blocks
from celerytp.quant.plan import quant_summary

# Dims that are whole Q4_K super-blocks (256) as well as 32-blocks.
K_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "llama",
        dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
             attention_bias=True, tie_word_embeddings=False),
    ),
    "qwen3": (
        "qwen3",
        dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
             tie_word_embeddings=True),
    ),
}
GGML = {"q8_0": T.Q8_0, "q8_1": T.Q8_1, "q8_k": T.Q8_K, "q4_0": T.Q4_0, "q4_1": T.Q4_1, "q5_0": T.Q5_0,
        "q5_1": T.Q5_1, "q2_k": T.Q2_K, "q3_k": T.Q3_K, "q4_k": T.Q4_K, "q5_k": T.Q5_K, "q6_k": T.Q6_K}
INT4 = ("q4_0", "q4_1", "q4_k")
# Stored bytes / float32 bytes of the linears: fast layouts (int4: 4 bits + bf16 scale and zero per
# 32; int4split: the code split over two 4-bit halves, each with its block's scale) and the exact one (codes, 4-bit ones packed, + float32 terms per group).
FAST_RATIO = {"f16": 0.5, "bf16": 0.5} | {q: 0.18 if q in INT4 else 0.32 for q in GGML}
EXACT_RATIO = {"q8_0": 0.282, "q8_1": 0.282, "q8_k": 0.255, "q4_0": 0.157, "q4_1": 0.188, "q4_k": 0.188, "q5_0": 0.282,
               "q5_1": 0.313, "q5_k": 0.313, "q6_k": 0.313, "q2_k": 0.251, "q3_k": 0.188, "f16": 0.5, "bf16": 0.5}
STEPS = 6
FAST_RTOL = 0.05  # fast kernels: max |logit error| / max |logit|; plain bfloat16 inference of these models is off by 0.02
SMOL_FAST_ATOL = 8.0  # SmolLM2 logits (max ~35) after 30 layers of bfloat16-precision matmuls
SMOL_MARGIN = 1.0  # logit gap above which a bfloat16-level error must not flip the argmax
SMOL_EXACT_ATOL = 1e-3  # exact kernel vs the float run of the same file (test_models_smollm2's figure)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> str:
    monkeypatch.setenv(KERNEL_ENV, request.param)
    return request.param


def _quantized_reference(model: Any, quant: str) -> Any:
    """A copy of `model` whose linear weights are what `quant` stores, dequantized by gguf; the
    embedding (and a tied lm_head with it) as a quantized load keeps it: q8_0 for block formats."""
    ref = type(model)(model.config).eval()
    ref.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, p in ref.named_parameters():
            linear = name.endswith("_proj.weight") or (name == "lm_head.weight" and not model.config.tie_word_embeddings)
            if name == "model.embed_tokens.weight":
                quant_here = quant if quant in ("f16", "bf16") else "q8_0"
            elif linear:
                quant_here = quant
            else:
                continue
            w = p.detach().numpy()
            if quant_here in GGML:
                back = dequantize_blocks(quantize_blocks(p, GGML[quant_here]), GGML[quant_here]).numpy()  # gguf's
            else:
                back = torch.from_numpy(w).to({"f16": torch.float16, "bf16": torch.bfloat16}[quant_here]).float().numpy()
            p.copy_(torch.from_numpy(np.ascontiguousarray(back)))
    return ref


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path]]:
    out = {}
    for name, (model_type, kwargs) in K_CONFIGS.items():
        model = make_hf_model(model_type, kwargs, seed=5)
        with torch.no_grad():  # keep logits O(1..10) at this width
            for pname, p in model.named_parameters():
                if "norm" not in pname:
                    p.mul_(0.6)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        out[name] = (model, path)
    return out


def _parts(model: Any) -> list[Any]:
    return [p for m in model.modules() if isinstance(m, QuantizedWeight) for p in m.parts]


# Requantizing safetensors to a sample of types (every type's codec is checked in
# test_quant_blocks, every type kept from a GGUF at TP 1-3 in test_quant_gguf).
CASES = [("llama", q, "dequant") for q in ["q8_0", "q4_0", "q4_1", "q4_k", "q5_0", "q6_k", "q2_k", "f16", "bf16"]] + [
    ("llama", "q4_k", "auto"), ("llama", "q5_k", "auto"), ("llama", "q8_0", "auto"),
    ("qwen3", "q6_k", "dequant"), ("qwen3", "q4_k", "auto"),
]


@pytest.mark.parametrize(("arch", "quant", "kernel"), CASES, indirect=["kernel"])
def test_quant_on_each_architecture(hf_dirs: dict, arch: str, quant: str, kernel: str) -> None:
    model, path = hf_dirs[arch]
    prompt = make_prompt(COMMON["vocab_size"], 8)
    ref = hf_greedy(_quantized_reference(model, quant), prompt, STEPS)
    ours_model = load_model(path, TPContext(), quant=quant.upper())
    qweights = [m for m in ours_model.modules() if isinstance(m, QuantizedWeight)]
    untied = not model.config.tie_word_embeddings
    # qkv, o, gate_up, down per layer, the embedding (+ an untied lm_head; a tied one is the embedding's)
    assert len(qweights) == 4 * COMMON["num_hidden_layers"] + 1 + untied
    embedding = ours_model.model.embed_tokens.qweight
    assert [p.fmt.name for p in embedding.parts] == [quant if quant in ("f16", "bf16") else "q8_0"]
    qweights = [m for m in qweights if m is not embedding]  # the linears: checked below
    assert ours_model.quant == quant and all(len(m.parts) == 1 and not m.fallbacks for m in qweights)
    ours = our_greedy(ours_model, prompt, STEPS)
    exact = kernel == "dequant" or quant in ("f16", "bf16")
    if exact:
        assert {p.kernel for p in _parts(ours_model)} <= {"dequant", "float"}
        assert_matches(ours, ref, f"{arch} {quant}", atol=1e-4)
    else:
        assert {p.kernel for m in qweights for p in m.parts} == {"int4pack" if quant in INT4 else "int4split"}
        assert {p.kernel for p in embedding.parts} == {"int8pack" if model.config.tie_word_embeddings else "dequant"}
        scale = ref.prompt_logits.abs().max()
        err = (ours.prompt_logits - ref.prompt_logits).abs().max() / scale
        assert err < FAST_RTOL, f"{arch} {quant}: prompt logits off by {err:.3g} of max"
        assert ours.tokens[:4] == ref.tokens[:4]
    stored = sum(b.nbytes for m in qweights for b in m.buffers())
    as_float32 = sum(4 * m.out_features * m.in_features for m in qweights)
    ratio = (EXACT_RATIO if kernel == "dequant" else FAST_RATIO)[quant]
    assert stored <= ratio * as_float32, stored / as_float32


def test_quant_f32_is_the_plain_model(hf_dirs: dict) -> None:
    _, path = hf_dirs["llama"]
    model = load_model(path, TPContext(), quant="F32")
    assert not any(isinstance(m, QuantizedWeight) for m in model.modules())


def test_bad_quant_is_refused_before_reading(hf_dirs: dict) -> None:
    _, path = hf_dirs["qwen3"]
    for quant in ("q7", "iq4_nl", "int8"):
        with pytest.raises(CeleryTPError) as err:
            load_model(path, TPContext(), quant=quant)
        assert err.value.kind == "bad_request" and "unknown quant" in err.value.message and "q6_k" in err.value.message


def test_split_that_cuts_a_block_falls_back(hf_dirs: dict) -> None:
    """o_proj at TP 2 gets 2 heads x 64 = 128 input columns: not whole Q4_K blocks of 256, so
    that tensor is kept as q5_0 (llama.cpp's choice) and reported; the rest stays q4_k."""
    _, path = hf_dirs["llama"]
    for rank in range(2):
        shard = load_model(path, TPContext(rank, 2), quant="q4_k", max_context=16)
        types, fallbacks = quant_summary(shard)
        layers = COMMON["num_hidden_layers"]
        assert types["q5_0"]["tensors"] == layers and types["q4_k"]["tensors"] == 6 * layers + 1
        assert len(fallbacks) == layers
        lo = rank * 128
        assert fallbacks[0] == f"model.layers.0.self_attn.o_proj.weight: q4_k -> q5_0 (columns {lo}:{lo + 128} are not whole 256-blocks)"
        assert shard.model.layers[0].self_attn.o_proj.qweight.parts[0].fmt.name == "q5_0"


# ---- GGUF kept quantized, with TP ------------------------------------------------------------


def test_gguf_slices_raw_blocks_per_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """quant=None keeps a Q4_1 file's linears as the file's own bytes: no dequantize of them."""
    model = make_hf_model("llama", K_CONFIGS["llama"][1] | {"hidden_size": 192, "intermediate_size": 384,
                                                           "num_attention_heads": 6, "num_key_value_heads": 3,
                                                           "head_dim": 32}, seed=2)
    path = write_gguf(model, tmp_path / "m.gguf", {"attn_": T.Q4_1, "ffn_": T.Q4_1, "output": T.Q4_1})
    dequantized: list[T] = []
    real = gguf.quants.dequantize
    monkeypatch.setattr(gguf.quants, "dequantize", lambda data, qtype: dequantized.append(qtype) or real(data, qtype))
    reader = gguf.GGUFReader(str(path))
    raw = {t.name: np.array(t.data) for t in reader.tensors}
    for rank in range(3):
        shard = load_model(path, TPContext(rank, 3), quant=None, max_context=16)
        down = shard.model.layers[1].mlp.down_proj
        start, size = down.start, down.local_size  # 128 intermediate columns each: 4 blocks
        assert (start, size) == (rank * 128, 128)
        (qw,) = down.qweight.parts
        assert qw.fmt.name == "q4_1" and qw.kernel in ("int4pack", "dequant")
        nbytes = lambda cols: cols // 32 * 20  # noqa: E731
        expected = raw["blk.1.ffn_down.weight"][:, nbytes(start) : nbytes(start + size)]
        layout = {"q", "scale", "zero"} if qw.kernel == "dequant" else {"packed", "sz"}
        assert set(dict(qw.named_buffers())) == layout
        u = unpack_blocks(torch.from_numpy(np.ascontiguousarray(expected)), T.Q4_1)
        if qw.kernel == "dequant":
            assert torch.equal(qw.scale, u.scale) and torch.equal(qw.zero, u.zero)
    assert T.Q4_1 not in dequantized, "a Q4_1 linear was dequantized while loading"


def _rank_entry(rank: int, world: int, init_file: str, path: str, prompt: list[int], steps: int, kernel: str,
                forced_tokens: list[int], out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ[KERNEL_ENV] = kernel
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        model = load_model(path, TPContext(rank, world, None), max_context=128)
        g = our_greedy(model, prompt, steps)
        model.clear_cache()
        forced = model.forward_tokens(torch.tensor(prompt + forced_tokens), 0)  # (T, V), for teacher forcing
        kernels = sorted({p.kernel for m in model.modules() if isinstance(m, QuantizedWeight) for p in m.parts})
        dist.destroy_process_group()
        torch.save({"greedy": (g.prompt_logits, g.step_logits, g.tokens), "kernels": kernels, "forced": forced,
                    "memory": model.memory_report()}, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def _run_ranks(
    world: int, path: str, prompt: list[int], steps: int, kernel: str, forced: list[int], workdir: Path
) -> list[dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    args = (str(workdir / "pg_init"), path, prompt, steps, kernel, forced, str(workdir))
    procs = [ctx.Process(target=_rank_entry, args=(r, world, *args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 240
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    results = []
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
        out = workdir / f"rank{r}.pt"
        assert out.exists(), f"rank {r} wrote no result (exitcode {p.exitcode})"
        data = torch.load(out)
        assert "error" not in data, f"rank {r} failed:\n{data.get('error')}"
        results.append(data)
    return results


@pytest.fixture(scope="module")
def smol_float() -> tuple[list[int], Greedy]:
    """The float run of the same file (quant f32: every block dequantized at load), 20 tokens."""
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
              8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    model = load_model(default_model_path(), TPContext(), quant="f32", max_context=128)
    return prompt, our_greedy(model, prompt, 20)


def _check_fast(forced: torch.Tensor, prompt: list[int], ref: Greedy) -> None:
    """Teacher-forced on the float run's first 10 tokens: logits within SMOL_FAST_ATOL, and the
    same argmax wherever the float run's top two differ by more than SMOL_MARGIN. SmolLM2 has
    near-ties (504 vs 60 at the first answer token of the France prompt differ by 0.06), which
    bfloat16-precision matmuls (plain bfloat16 inference too) may flip; then free-running greedy
    diverges, which says nothing about the kernel."""
    ours = forced[len(prompt) - 1 : len(prompt) + 9]  # logits that predict ref.tokens[0..9]
    theirs = torch.cat([ref.prompt_logits[-1:], ref.step_logits[:9]])
    torch.testing.assert_close(ours, theirs, atol=SMOL_FAST_ATOL, rtol=0)
    top = theirs.topk(2).values
    clear = (top[:, 0] - top[:, 1]) > SMOL_MARGIN
    assert clear.sum() >= 5, "prompt has too few clear positions to test"
    assert torch.equal(ours.argmax(-1)[clear], theirs.argmax(-1)[clear])


@pytest.mark.slow
def test_smollm2_q4_1_tp1_both_kernels(smol_float: tuple[list[int], Greedy], monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, ref = smol_float
    monkeypatch.setenv(KERNEL_ENV, "dequant")
    exact = load_model(default_model_path(), TPContext(), max_context=128)  # quant None: keep Q4_1
    assert_matches(our_greedy(exact, prompt, 20), ref, "TP1 exact", atol=SMOL_EXACT_ATOL)
    monkeypatch.setenv(KERNEL_ENV, "auto")
    fast = load_model(default_model_path(), TPContext(), max_context=128)
    _check_fast(fast.forward_tokens(torch.tensor(prompt + ref.tokens[:10]), 0), prompt, ref)
    mem, plain = fast.memory_report()["sharded_bytes"], 424673280  # float32 linears of SmolLM2
    assert mem <= 0.18 * plain, mem / plain


@pytest.mark.slow
@pytest.mark.parametrize(("world", "kernel"), [(2, "auto"), (3, "dequant")])
def test_smollm2_q4_1_kept_quantized_with_tp(smol_float: tuple[list[int], Greedy], world: int, kernel: str,
                                            tmp_path: Path) -> None:
    """TP 3: 3 KV groups, one each; intermediate 1536 = 3 x 512 = 16 blocks of 32 per rank."""
    prompt, ref = smol_float
    results = _run_ranks(world, default_model_path(), prompt, 20, kernel, ref.tokens[:10], tmp_path)
    logits, steps, tokens = results[0]["greedy"]
    ours = Greedy(logits, steps, tokens)
    # Q4_1 linears on int4pack; the file's Q8_0 embedding (tied head) on int8pack
    assert all(r["kernels"] == (["int4pack", "int8pack"] if kernel == "auto" else ["dequant"]) for r in results)
    if kernel == "dequant":
        assert_matches(ours, ref, f"TP{world} exact", atol=SMOL_EXACT_ATOL)
    else:
        _check_fast(results[0]["forced"], prompt, ref)
