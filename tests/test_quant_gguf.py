"""GGUF files kept in their own ggml types, per rank: every weight type, and a Q4_K_M-style mix.

Each file is a tiny llama written with the gguf package's writer (gguf's quantizer where it has
one, the project's K-quant quantizer otherwise, checked through gguf's dequantizer in
test_quant_blocks). The reference is the same file dequantized to float32 by gguf at load
(quant="f32"). The exact kernel must match it to float32 noise wherever a rank's slice holds
whole blocks; a slice that does not is requantized to llama.cpp's fallback type (reported), and
the fast kernels run bfloat16 activations, so those runs are held to FAST_RTOL of the logits'
range and to the reference's argmax wherever its top two logits differ by more than MARGIN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as T
from model_fixtures import COMMON, Greedy, Job, make_hf_model, make_prompt, our_greedy, run_ranks, write_gguf

from celerytp.distributed.tp import TPContext
from celerytp.layers.quantized import KERNEL_ENV
from celerytp.models import load_model
from celerytp.quant.plan import quant_summary

TYPES = {
    "q8_0": T.Q8_0,
    "q8_1": T.Q8_1,
    "q8_k": T.Q8_K,
    "q4_0": T.Q4_0,
    "q4_1": T.Q4_1,
    "q5_0": T.Q5_0,
    "q5_1": T.Q5_1,
    "q2_k": T.Q2_K,
    "q3_k": T.Q3_K,
    "q4_k": T.Q4_K,
    "q5_k": T.Q5_K,
    "q6_k": T.Q6_K,
}
# 6 query heads of 128 over 3 KV heads: o_proj's 768 inputs are 3 super-blocks, whole per rank at
# TP 3 and 384 (not whole) at TP 2; intermediate 768 splits 512/256 at TP 2, 256 each at TP 3.
LLAMA = dict(
    hidden_size=768,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=128,
    intermediate_size=768,
    tie_word_embeddings=False,
)
EXACT_ATOL = 1e-4  # float32 logits of O(1..10)
# max |logit error| / max |logit| of the fast kernels on this random model (chaotic enough that
# plain bfloat16 inference is off by 0.024-0.032): int4pack keeps the codes (measured 0.015 for
# q4_0); int8pack also re-rounds each row to one int8 scale (measured 0.05 q8_0, 0.07 q6_k, 0.09 q5_0).
FAST_RTOL = {"int4pack": 0.05, "int8pack": 0.12}
INT4 = ("q4_0", "q4_1", "q4_k")
MARGIN = 0.5  # top-2 logit gap above which the argmax must agree
STEPS = 3
K_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "q8_k": "q8_0"}


def _model(kwargs: dict[str, Any], seed: int) -> Any:
    model = make_hf_model("llama", kwargs, seed=seed)
    with torch.no_grad():  # keep logits O(1..10) at this width
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(0.6)
    return model


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Greedy]]:
    """name -> (GGUF path, the float32 run of that file)."""
    model = _model(LLAMA, seed=3)
    root = tmp_path_factory.mktemp("types")
    out = {}
    for name, qtype in TYPES.items():
        path = write_gguf(model, root / f"{name}.gguf", {"attn_": qtype, "ffn_": qtype, "output": qtype})
        out[name] = path
    mixed = _model(MIXED, seed=4)
    out["mixed"] = write_gguf(mixed, root / "mixed.gguf", Q4_K_M)
    prompt = make_prompt(COMMON["vocab_size"], 10)
    return {
        n: (p, our_greedy(load_model(p, TPContext(), quant="f32", max_context=32), prompt, STEPS))
        for n, p in out.items()
    }


def _check(ours: Greedy, ref: Greedy, what: str, exact: bool, int4: bool = False) -> None:
    if exact:
        torch.testing.assert_close(ours.prompt_logits, ref.prompt_logits, atol=EXACT_ATOL, rtol=0, msg=what)
        assert ours.tokens == ref.tokens, what
        return
    scale = ref.prompt_logits.abs().max()
    err = float((ours.prompt_logits - ref.prompt_logits).abs().max() / scale)
    assert err < FAST_RTOL["int4pack" if int4 else "int8pack"], f"{what}: logits off by {err:.3g} of max"
    top = ref.prompt_logits.topk(2).values
    clear = (top[:, 0] - top[:, 1]) > MARGIN
    assert clear.sum() >= 3, f"{what}: too few clear positions"
    assert torch.equal(ours.prompt_logits.argmax(-1)[clear], ref.prompt_logits.argmax(-1)[clear]), what


def test_every_type_kept_at_tp1(files: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast kernels within FAST_RTOL (the exact one runs at TP 3 below, and on every type in
    test_quant_models)."""
    monkeypatch.setenv(KERNEL_ENV, "auto")
    for name in TYPES:
        path, ref = files[name]
        model = load_model(path, TPContext(), max_context=32)  # quant None: keep the file's types
        types, fallbacks = quant_summary(model)
        assert model.quant == name and set(types) == {name} and not fallbacks
        assert types[name]["tensors"] == 7 * COMMON["num_hidden_layers"] + 1  # q k v o gate up down, lm_head
        _check(
            our_greedy(model, make_prompt(COMMON["vocab_size"], 10), STEPS), ref, name, exact=False, int4=name in INT4
        )


@pytest.mark.parametrize(("world", "kernel"), [(2, "auto"), (3, "dequant")])
def test_every_type_kept_with_tp(
    files: dict, world: int, kernel: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank's slices are whole blocks here (TP 2 splits the 3 KV groups 2 + 1, so o_proj
    512 + 256 columns, the MLP 512 + 256); TP 3 runs the exact kernel. The mixed file at TP 2
    adds fallbacks (see below)."""
    monkeypatch.setenv(KERNEL_ENV, kernel)  # spawned ranks inherit it
    prompt = make_prompt(COMMON["vocab_size"], 10)
    names = [*TYPES, "mixed"] if world == 2 else list(TYPES)
    jobs = [Job(n, str(files[n][0]), prompt, steps=STEPS, max_context=32, quant=None) for n in names]
    results = run_ranks(world, jobs, tmp_path)
    for name in names:
        _check(
            results[0][name].greedy, files[name][1], f"TP{world} {name}", exact=kernel == "dequant", int4=name in INT4
        )


# ---- a Q4_K_M-style mix -------------------------------------------------------------------------------

# Hidden 320 is not whole 256-element super-blocks, so (as llama.cpp's Q4_K_M of SmolLM2 does)
# tensors reading the hidden state are q5_0 / q8_0 in the file; those reading 256 or 512 are K-quants.
MIXED = dict(
    hidden_size=320,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    tie_word_embeddings=False,
)
Q4_K_M = {
    "attn_output": T.Q4_K,
    "blk.0.ffn_down": T.Q6_K,
    "blk.1.ffn_down": T.Q4_K,
    "attn_v": T.Q8_0,
    "attn_": T.Q5_0,
    "ffn_": T.Q5_0,
    "output": T.Q8_0,
    "token_embd": T.Q8_0,
}


def test_q4_k_m_mix_keeps_each_tensors_type(files: dict) -> None:
    path, ref = files["mixed"]
    prompt = make_prompt(COMMON["vocab_size"], 10)
    model = load_model(path, TPContext(), max_context=32)
    types, fallbacks = quant_summary(model)
    assert {t: v["tensors"] for t, v in types.items()} == {"q4_k": 3, "q6_k": 1, "q5_0": 8, "q8_0": 4} and not fallbacks
    assert all(v["bytes"] > 0 for v in types.values())
    _check(our_greedy(model, prompt, STEPS), ref, "mixed TP1", exact=False)
    for rank in range(2):  # TP 2: o_proj's 128 columns per rank cut q4_k super-blocks
        types, fallbacks = quant_summary(load_model(path, TPContext(rank, 2), max_context=32))
        assert {t: v["tensors"] for t, v in types.items()} == {"q4_k": 1, "q6_k": 1, "q5_0": 10, "q8_0": 4}
        assert [f.split(":")[0] for f in fallbacks] == [f"model.layers.{i}.self_attn.o_proj.weight" for i in range(2)]
    # quant given: everything quantizable requantized to it (q4_k where 256-blocks fit, else q5_0).
    model = load_model(path, TPContext(), quant="q4_k", max_context=32)
    types, fallbacks = quant_summary(model)
    assert model.quant == "q4_k" and set(types) == {"q4_k", "q5_0", "q8_0"}  # q8_0: the embedding
    assert types["q4_k"]["tensors"] == 4 and len(fallbacks) == 11  # 256/512-input tensors keep q4_k
