"""Block codecs against the gguf package's reference (gguf.quants), names, and kernel layouts.

Bit-identical means equal float32 bit patterns / equal bytes, on random tensors, on random
block bytes, and on real blocks of the SmolLM2 Q4_1 GGUF (its linears are Q4_1, its
token embedding Q8_0).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from celerytp.core.errors import CeleryTPError
from celerytp.core.model_files import default_model_path
from celerytp.layers.quantized import make_layout, run_kernel
from celerytp.loading import open_checkpoint
from celerytp.quant import ACCEPTED_NAMES, EXECUTABLE, dequantize_blocks, parse_quant, quantize_blocks, unpack_blocks

BLOCK_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K]
GGUF_QUANTIZES = [T.Q8_0, T.Q4_0, T.Q4_1]  # gguf.quants has no Q4_K quantizer


def _random_weights(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * rng.uniform(0.001, 4.0, (rows, 1))
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    x[1, :32] = 1.5  # a constant block
    x[2, 5] = -40.0  # an outlier
    return x.astype(np.float32)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("qtype", GGUF_QUANTIZES, ids=lambda t: t.name)
def test_quantize_is_bit_identical_to_gguf(qtype: T) -> None:
    x = _random_weights(48, 512, seed=int(qtype))
    ours = quantize_blocks(torch.from_numpy(x), qtype).numpy()
    ref = gguf.quants.quantize(x, qtype)
    assert ours.dtype == ref.dtype == np.uint8
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf(qtype: T) -> None:
    x = _random_weights(48, 512, seed=7)
    quantized = quantize_blocks(torch.from_numpy(x), qtype)
    # Random bytes too: every code, scale and 6-bit K scale pattern, with finite float16 scales.
    rng = np.random.default_rng(int(qtype))
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    noise = rng.integers(0, 256, (48, 512 // block, size), dtype=np.uint8)
    halves = 2 if qtype in (T.Q8_0, T.Q4_0) else 4
    noise[..., :halves] = rng.standard_normal((48, 512 // block, halves // 2)).astype(np.float16).view(np.uint8)
    for blocks in (quantized.numpy(), noise.reshape(48, -1)):
        ours = dequantize_blocks(torch.from_numpy(blocks), qtype).numpy()
        assert _bits_equal(ours, gguf.quants.dequantize(blocks, qtype))


def test_q4_k_quantizer_round_trips() -> None:
    x = _random_weights(32, 1024, seed=3)
    blocks = quantize_blocks(torch.from_numpy(x), T.Q4_K)
    back = gguf.quants.dequantize(blocks.numpy(), T.Q4_K)
    # 4-bit codes over a sub-block's range: mean error well under a step, as Q4_1's.
    err = np.abs(back - x).mean() / np.abs(x).mean()
    ref = np.abs(gguf.quants.dequantize(gguf.quants.quantize(x, T.Q4_1), T.Q4_1) - x).mean() / np.abs(x).mean()
    assert err < 1.25 * ref, (err, ref)


def test_real_smollm2_blocks() -> None:
    with open_checkpoint(default_model_path()) as ckpt:
        for name, qtype in [
            ("model.layers.0.self_attn.q_proj.weight", T.Q4_1),
            ("model.layers.29.mlp.down_proj.weight", T.Q4_1),
            ("model.embed_tokens.weight", T.Q8_0),
        ]:
            source = ckpt.source(name)
            assert source.ggml_type == qtype
            raw = source.read_blocks(qtype, rows=(0, 192))  # the file's bytes, no round trip
            ours = dequantize_blocks(raw, qtype).numpy()
            ref = gguf.quants.dequantize(raw.numpy(), qtype)
            assert _bits_equal(ours, ref), name
            if "q_proj" not in name:  # q/k rows are un-permuted; others equal the float read
                assert _bits_equal(ours, source.read(rows=(0, 192)).numpy()), name
            if qtype != T.Q4_1:
                continue
            # Requantizing gguf's own dequantization reproduces the bytes only through gguf too.
            assert np.array_equal(quantize_blocks(torch.from_numpy(ref), qtype).numpy(), gguf.quants.quantize(ref, qtype))


# ---- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "canonical"),
    [
        ("q8_0", "q8_0"),
        ("Q8_0", "q8_0"),
        ("q80", "q8_0"),
        ("q4_0", "q4_0"),
        ("Q40", "q4_0"),
        ("q4_1", "q4_1"),
        ("q4k", "q4_k"),
        ("Q4_K", "q4_k"),
        ("q4km", "q4_k"),
        ("Q4_K_M", "q4_k"),
        ("f16", "f16"),
        ("BF16", "bf16"),
        ("f_32", "f32"),
    ],
)
def test_accepted_names(given: str, canonical: str) -> None:
    assert parse_quant(given).name == canonical


@pytest.mark.parametrize("name", ["q5_0", "Q5_1", "q8_1", "q2k", "q3_k", "q5k", "Q5_K_M", "q6k", "q8k"])
def test_known_but_not_executable_names_are_bad_request(name: str) -> None:
    with pytest.raises(CeleryTPError) as err:
        parse_quant(name)
    assert err.value.kind == "bad_request"
    assert "cannot execute" in err.value.message and "q4_k" in err.value.message


@pytest.mark.parametrize("name", ["q4", "int8", "q4_2", "gptq", "fp8", ""])
def test_unknown_names_are_bad_request_listing_accepted(name: str) -> None:
    with pytest.raises(CeleryTPError) as err:
        parse_quant(name)
    assert err.value.kind == "bad_request"
    assert all(n in err.value.message for n in ACCEPTED_NAMES)


def test_every_accepted_name_parses_or_is_refused() -> None:
    for name in ACCEPTED_NAMES:
        try:
            assert parse_quant(name).name in EXECUTABLE
        except CeleryTPError as exc:
            assert exc.kind == "bad_request" and "cannot execute" in exc.message


# ---- kernels ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_kernels_match_exact_dequantization(qtype: T) -> None:
    """The fast layout (bfloat16 activations) is close to the exact product; dequant is exact."""
    w = torch.from_numpy(_random_weights(96, 512, seed=11)[:, :]) * 0.1
    u = unpack_blocks(quantize_blocks(w, qtype), qtype)
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(0)).reshape(10, 512)
    exact = x @ u.dequantize().T
    fast = "int8pack" if qtype == T.Q8_0 else "int4pack"
    y = run_kernel(fast, make_layout(fast, u), x, 96)
    assert y.dtype == torch.float32 and y.shape == (10, 96)
    rel = float((y - exact).abs().max() / exact.abs().max())
    assert rel < 0.02, rel
    layout = make_layout("dequant", u)
    assert layout["q"].nbytes == (96 * 512 if qtype == T.Q8_0 else 96 * 256)  # codes stay 8 / 4 bits
