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
from celerytp.layers.quantized import INT4_TYPES, dequantize_layout, make_layout, run_kernel
from celerytp.loading import open_checkpoint
from celerytp.quant import ACCEPTED_NAMES, EXECUTABLE, dequantize_blocks, parse_quant, quantize_blocks, unpack_blocks

BLOCK_TYPES = [T.Q8_0, T.Q8_1, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_K]
GGUF_QUANTIZES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1]  # gguf.quants has no K-quant quantizer
GGUF_DEQUANTIZES = [t for t in BLOCK_TYPES if t not in (T.Q8_1, T.Q8_K)]  # ggml's activation formats: no codec
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
SHAPES = [(48, 512), (3, 256), (1, 1024), (5, 768)]
# Byte offsets of the float16 fields in each block (random bytes there could be inf/nan).
F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q2_K: [80, 82],
              T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208]}
# Mean |error| / mean |w| of our K-quant quantizers (min/max scales) on Gaussian rows; what
# llama.cpp's searched scales reach is somewhat lower.
K_ERROR = {T.Q2_K: 0.40, T.Q3_K: 0.19, T.Q4_K: 0.10, T.Q5_K: 0.05, T.Q6_K: 0.025}


def _random_weights(rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * rng.uniform(0.001, 4.0, (rows, 1))
    x[0, :32] = 0.0  # an all-zero block (scale 0)
    if rows > 2:
        x[1, :32] = 1.5  # a constant block
        x[2, 5] = -40.0  # an outlier
    return x.astype(np.float32)


def _random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random block bytes: every code and scale bit pattern, with finite float16 fields."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    noise = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        noise[..., at : at + 2] = rng.standard_normal((rows, cols // block, 1)).astype(np.float16).view(np.uint8)
    return noise.reshape(rows, -1)


def _bits_equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", GGUF_QUANTIZES, ids=lambda t: t.name)
def test_quantize_is_bit_identical_to_gguf(qtype: T, shape: tuple[int, int]) -> None:
    x = _random_weights(*shape, seed=int(qtype))
    ours = quantize_blocks(torch.from_numpy(x), qtype).numpy()
    ref = gguf.quants.quantize(x, qtype)
    assert ours.dtype == ref.dtype == np.uint8
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("qtype", GGUF_DEQUANTIZES, ids=lambda t: t.name)
def test_dequantize_is_bit_identical_to_gguf(qtype: T, shape: tuple[int, int]) -> None:
    quantized = quantize_blocks(torch.from_numpy(_random_weights(*shape, seed=7)), qtype).numpy()
    for blocks in (quantized, _random_blocks(qtype, *shape, seed=int(qtype))):
        ours = dequantize_blocks(torch.from_numpy(blocks), qtype).numpy()
        assert _bits_equal(ours, gguf.quants.dequantize(blocks, qtype))


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quantizers_round_trip_through_gguf(qtype: T) -> None:
    x = _random_weights(32, 1024, seed=3)
    blocks = quantize_blocks(torch.from_numpy(x), qtype).numpy()
    back = gguf.quants.dequantize(blocks, qtype)
    err = np.abs(back - x).mean() / np.abs(x).mean()
    assert err < K_ERROR[qtype], err
    # Requantizing what gguf read back is stable: the same weights again.
    again = gguf.quants.dequantize(quantize_blocks(torch.from_numpy(back), qtype).numpy(), qtype)
    assert np.abs(again - back).mean() / np.abs(x).mean() < K_ERROR[qtype] / 4


def _ggml_q8_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's quantize_row_q8_K_ref, one block at a time: (d, codes)."""
    ds, qs = [], []
    for blk in x.reshape(-1, 256):
        imax = int(np.argmax(np.abs(blk)))
        if blk[imax] == 0:
            ds.append(0.0), qs.append(np.zeros(256))
            continue
        iscale = np.float32(-127.0) / blk[imax]
        qs.append(np.minimum(127, np.rint(iscale * blk)))
        ds.append(np.float32(1) / iscale)
    return np.array(ds, np.float32), np.array(qs, np.int8)


@pytest.mark.parametrize("shape", SHAPES[:2], ids=str)
def test_q8_1_and_q8_k_follow_ggml(shape: tuple[int, int]) -> None:
    """gguf has no codec for these; Q8_1's codes are Q8_0's (ggml's reference) with float32 d and
    s = d * sum(q) (gguf-py's 40-byte block); Q8_K follows quantize_row_q8_K_ref."""
    x = _random_weights(*shape, seed=5)
    q8_0 = gguf.quants.quantize(x, T.Q8_0).reshape(-1, 34)
    b = quantize_blocks(torch.from_numpy(x), T.Q8_1).numpy().reshape(-1, 40)
    d = b[:, 0:4].copy().view(np.float32)[:, 0]
    codes = b[:, 8:].view(np.int8)
    assert np.array_equal(b[:, 8:], q8_0[:, 2:])
    assert np.array_equal(d.astype(np.float16), q8_0[:, 0:2].copy().view(np.float16)[:, 0])
    assert np.allclose(b[:, 4:8].copy().view(np.float32)[:, 0], d * codes.sum(1), rtol=1e-6)
    ours = dequantize_blocks(torch.from_numpy(b.reshape(shape[0], -1)), T.Q8_1).numpy()
    assert _bits_equal(ours, (codes.astype(np.float32) * d[:, None]).reshape(shape))

    b = quantize_blocks(torch.from_numpy(x), T.Q8_K).numpy().reshape(-1, 292)
    d, codes = _ggml_q8_k(x)
    assert np.array_equal(b[:, 0:4].copy().view(np.float32)[:, 0], d)
    assert np.array_equal(b[:, 4:260].view(np.int8), codes)
    assert np.array_equal(b[:, 260:].copy().view(np.int16), codes.reshape(-1, 16, 16).sum(-1, dtype=np.int16))
    ours = dequantize_blocks(torch.from_numpy(b.reshape(shape[0], -1)), T.Q8_K).numpy()
    assert _bits_equal(ours, (codes.astype(np.float32) * d[:, None]).reshape(shape))


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
def test_every_ggml_weight_name_executes(name: str) -> None:
    assert parse_quant(name).executable


@pytest.mark.parametrize("name", ["q4", "int8", "q4_2", "gptq", "fp8", "iq4_nl", ""])
def test_names_that_are_not_weight_formats_are_bad_request_listing_executable(name: str) -> None:
    with pytest.raises(CeleryTPError) as err:
        parse_quant(name)
    assert err.value.kind == "bad_request"
    assert all(n in err.value.message for n in EXECUTABLE)


def test_every_accepted_name_parses() -> None:
    assert {parse_quant(name).name for name in ACCEPTED_NAMES} == set(EXECUTABLE)


# ---- kernels ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_kernels_match_exact_dequantization(qtype: T) -> None:
    """The fast layout (bfloat16 activations) is close to the exact product; dequant is exact."""
    w = torch.from_numpy(_random_weights(96, 512, seed=11)[:, :]) * 0.1
    u = unpack_blocks(quantize_blocks(w, qtype), qtype)
    x = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(0)).reshape(10, 512)
    exact = x @ u.dequantize().T
    fast = "int4pack" if qtype in INT4_TYPES else "int8pack"
    y = run_kernel(fast, make_layout(fast, u), x, 96)
    assert y.dtype == torch.float32 and y.shape == (10, 96)
    rel = float((y - exact).abs().max() / exact.abs().max())
    # int4pack keeps the codes (bfloat16 scales); int8pack re-rounds each row to one scale
    # (<= max|row| / 254 per weight; these rows hold a 40x outlier).
    assert rel < (0.02 if fast == "int4pack" or qtype == T.Q8_0 else 0.03), rel
    layout = make_layout("dequant", u)
    assert layout["q"].nbytes == (96 * 256 if qtype in (*INT4_TYPES, T.Q2_K, T.Q3_K) else 96 * 512)  # 4-bit codes packed
    assert _bits_equal(dequantize_layout(layout, u.offset, u.group, 512).numpy(), u.dequantize().numpy())
    rows = dequantize_layout(layout, u.offset, u.group, 512, (10, 30)).numpy()
    assert _bits_equal(rows, u.dequantize()[10:30].numpy())
