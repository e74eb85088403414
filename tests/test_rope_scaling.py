"""Rope scaling types yarn, dynamic (NTK) and longrope, against transformers.

- unit: our inverse frequencies and attention factor against transformers' ROPE_INIT_FUNCTIONS
  (built from the same config dict, 4.x and 5.x keys), and our cos/sin against its rotary
  embedding module, including positions past the original context and per-row batches;
- end to end: a tiny random Llama with each type, original context 16, a prompt then 20
  greedy steps going well past it: logits within 1e-4 and the same tokens as transformers
  (with its cache for dynamic and longrope, the semantics we implement; yarn recomputes);
- GGUF: llama.cpp's rope metadata (YaRN keys; Phi-3's longrope factor tensors) loads to the same
  rope config and tokens as the safetensors model;
- refusals: an unknown type is UNSUPPORTED_ARCH naming it, malformed parameters LOAD_FAILED.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from model_fixtures import COMMON, Greedy, Job, assert_matches, hf_greedy, make_prompt, randomize, run_job, write_gguf

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.distributed.tp import TPContext
from celerytp.layers.rotary import RotaryEmbedding, attention_scaling, inv_frequencies
from celerytp.loading import GGUFCheckpoint
from celerytp.loading.gguf_rope import ROPE_TENSORS, gguf_rope_parameters
from celerytp.models.config import SUPPORTED_ROPE_TYPES, rope_config

HEAD_DIM = 16
ORIGINAL = 16  # pretraining length of every scaled config here
STEPS = 20
CPU = torch.device("cpu")
SHORT = [1.0 + 0.15 * i for i in range(HEAD_DIM // 2)]
LONG = [1.5 + 0.9 * i for i in range(HEAD_DIM // 2)]
TINY = dict(
    hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, intermediate_size=64,
    tie_word_embeddings=False, rope_theta=1000.0,
)  # fmt: skip

# name -> config.json keys beyond TINY/COMMON (transformers 4.x `rope_scaling`, 5.x `rope_parameters`)
ROPES: dict[str, dict[str, Any]] = {
    "yarn": dict(
        max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    ),
    "yarn_mscale_4x": dict(  # 4.x spelling; mscale/mscale_all_dim set the attention factor
        max_position_embeddings=64,
        rope_scaling={
            "type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 8.0,
            "beta_slow": 2.0, "mscale": 0.8, "mscale_all_dim": 1.2, "truncate": False,
        },
    ),  # fmt: skip
    "yarn_attention_factor": dict(  # no original length: transformers uses max_position_embeddings
        max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3},
    ),
    "dynamic": dict(  # dynamic's original length is max_position_embeddings; it may run to 4x that
        max_position_embeddings=ORIGINAL, rope_scaling={"type": "dynamic", "factor": 4.0}
    ),
    "longrope": dict(  # Phi-3 style: top-level original length (it wins), factor derived (64 / 16)
        max_position_embeddings=64,
        original_max_position_embeddings=ORIGINAL,
        rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
    ),
    "longrope_explicit": dict(
        max_position_embeddings=64,
        rope_parameters={
            "rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG, "factor": 2.0,
            "attention_factor": 1.1, "original_max_position_embeddings": ORIGINAL,
        },
    ),  # fmt: skip
}


def hf_config_dict(name: str) -> dict[str, Any]:
    return copy.deepcopy({**COMMON, **TINY, **ROPES[name]})


def hf_config(d: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**copy.deepcopy(d))


# ---- unit: frequencies, attention factor, cos/sin ------------------------------------------


@pytest.mark.parametrize("name", ROPES)
def test_inv_freq_and_attention_factor_match_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    d = hf_config_dict(name)
    rope = rope_config(d)
    config = hf_config(d)
    init = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]]
    for seq_len in (None, 8, ORIGINAL, ORIGINAL + 1, 40, 200):
        ref, ref_scale = init(config, CPU, seq_len=seq_len)
        ours = inv_frequencies(rope, HEAD_DIM, seq_len)
        torch.testing.assert_close(ours, ref, atol=0, rtol=0, msg=f"seq_len {seq_len}")
        if rope.rope_type != "dynamic":  # transformers' dynamic forward keeps its init scale (1.0)
            assert attention_scaling(rope) == pytest.approx(ref_scale, rel=1e-12)
    assert rope.rope_type == config.rope_parameters["rope_type"]
    if rope.rope_type != "dynamic":
        assert rope.original_max_position_embeddings == config.rope_parameters["original_max_position_embeddings"]


def _hf_rotary(d: dict[str, Any]) -> Any:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(hf_config(d))


@pytest.mark.parametrize("prompt_len", [10, 24])
@pytest.mark.parametrize("name", ROPES)
def test_cos_sin_match_transformers_through_a_decode(name: str, prompt_len: int) -> None:
    """Prefill then one position per forward, as transformers' rotary module sees them with its
    cache (its dynamic and longrope state updated by each forward)."""
    d = hf_config_dict(name)
    ref, ours = _hf_rotary(d), RotaryEmbedding(HEAD_DIM, 64, rope_config(d), device=CPU)
    x = torch.zeros(1, dtype=torch.float32)
    steps = [torch.arange(prompt_len)[None]] + [torch.tensor([[p]]) for p in range(prompt_len, 44)]
    for positions in steps:
        cos, sin = ours(positions, torch.float32)
        ref_cos, ref_sin = ref(x, positions)
        assert cos.shape == (1, positions.shape[1], HEAD_DIM)
        torch.testing.assert_close(cos, ref_cos, atol=1e-6, rtol=0, msg=f"{name} cos at {positions.max()}")
        torch.testing.assert_close(sin, ref_sin, atol=1e-6, rtol=0, msg=f"{name} sin at {positions.max()}")


@pytest.mark.parametrize("name", ["dynamic", "longrope"])
def test_rows_are_scaled_independently(name: str) -> None:
    """A batch of a short row and a long row: each row as transformers gives it alone."""
    d = hf_config_dict(name)
    ours = RotaryEmbedding(HEAD_DIM, 64, rope_config(d), device=CPU)
    rows = torch.stack([torch.arange(2, 12), torch.arange(30, 40)])  # max 11 (< 16) and 39 (>= 16)
    cos, sin = ours(rows, torch.float64)
    assert cos.dtype == torch.float64
    for row in range(2):
        ref_cos, ref_sin = _hf_rotary(d)(torch.zeros(1, dtype=torch.float64), rows[row : row + 1])
        torch.testing.assert_close(cos[row : row + 1], ref_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[row : row + 1], ref_sin, atol=1e-6, rtol=0)
    # the short row is the plain table (no scaling), the long one is not
    plain = RotaryEmbedding(HEAD_DIM, 64, rope_config({**d, "rope_scaling": None}), device=CPU)
    assert torch.equal(cos[0], plain(rows[:1], torch.float64)[0][0]) == (name == "dynamic")
    assert not torch.allclose(cos[1], plain(rows[1:], torch.float64)[0][0])


# ---- end to end: tiny Llama checkpoints --------------------------------------------------


def tiny_llama(d: dict[str, Any], seed: int) -> Any:
    """make_hf_model's random model (wide weights, random norms) for a full config dict."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return randomize(LlamaForCausalLM(hf_config(d)).eval())


@dataclasses.dataclass
class Case:
    model: Any
    path: Path
    references: dict[int, tuple[list[int], Greedy]]  # prompt length -> prompt, transformers' run


E2E = ["yarn", "yarn_mscale_4x", "dynamic", "longrope"]
PROMPT_LENGTHS = (24, 10)  # past the original length from the start; crossing it while decoding


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("rope")
    out = {}
    for seed, name in enumerate(E2E, start=40):
        model = tiny_llama(hf_config_dict(name), seed)
        # dynamic and longrope depend on what one forward sees: compare with transformers' cache.
        use_cache = name in ("dynamic", "longrope")
        refs = {}
        for n in PROMPT_LENGTHS:
            prompt = make_prompt(model.config.vocab_size, n, seed=seed)
            refs[n] = (prompt, hf_greedy(model, prompt, STEPS, use_cache=use_cache))
        model.save_pretrained(root / name, safe_serialization=True)
        out[name] = Case(model, root / name, refs)
    return out


@pytest.mark.parametrize("prompt_len", PROMPT_LENGTHS)
@pytest.mark.parametrize("name", E2E)
def test_matches_transformers_past_the_original_context(
    cases: dict[str, Case], name: str, prompt_len: int
) -> None:
    """max_context 64 on dynamic's 16 positions: the loader allows what the scaling stretches to."""
    case = cases[name]
    prompt, reference = case.references[prompt_len]
    assert prompt_len + STEPS > ORIGINAL + 10  # decodes well past the original context
    result = run_job(Job(name, str(case.path), prompt, STEPS, max_context=64), TPContext())
    assert_matches(result.greedy, reference, f"{name} prompt {prompt_len}")


# ---- GGUF ------------------------------------------------------------------------------


def gguf_with(model: Any, path: Path, monkeypatch: pytest.MonkeyPatch, extra: Callable[[Any], None]) -> Path:
    """write_gguf, with `extra(writer)` adding keys/tensors (llama.cpp's rope metadata)."""
    base = gguf.GGUFWriter

    class Writer(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            extra(self)

    with monkeypatch.context() as m:
        m.setattr(gguf, "GGUFWriter", Writer)
        return write_gguf(model, path)


def _yarn_keys(w: Any) -> None:
    # convert_hf_to_gguf.py's TextModel.set_gguf_parameters for rope_type yarn (Qwen's YaRN)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(4.0)
    w.add_rope_scaling_orig_ctx_len(ORIGINAL)


def _longrope_keys(w: Any) -> None:
    # Phi3MiniModel: no scaling type, the original length, the attention factor and two tensors
    w.add_rope_scaling_orig_ctx_len(ORIGINAL)
    w.add_rope_scaling_attn_factors(float(np.sqrt(1 + np.log(64 / ORIGINAL) / np.log(ORIGINAL))))
    w.add_tensor("rope_factors_long.weight", np.array(LONG, dtype=np.float32))
    w.add_tensor("rope_factors_short.weight", np.array(SHORT, dtype=np.float32))


@pytest.mark.parametrize(("name", "keys"), [("yarn", _yarn_keys), ("longrope", _longrope_keys)])
def test_gguf_rope_metadata_loads_like_safetensors(
    cases: dict[str, Case], name: str, keys: Callable[[Any], None], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = cases[name]
    path = gguf_with(case.model, tmp_path / f"{name}.gguf", monkeypatch, keys)
    checkpoint = GGUFCheckpoint(path)
    try:
        assert not set(ROPE_TENSORS) & set(checkpoint.names())
        ours = rope_config(checkpoint.hf_config)
    finally:
        checkpoint.close()
    expected = rope_config(json.loads((case.path / "config.json").read_text()))
    if name == "longrope":  # the file stores the derived attention factor (float32)
        assert ours.attention_factor == pytest.approx(attention_scaling(expected), rel=1e-6)
        ours = dataclasses.replace(ours, attention_factor=None)
        assert ours.long_factor == pytest.approx(expected.long_factor)
        assert ours.short_factor == pytest.approx(expected.short_factor)
        ours = dataclasses.replace(ours, long_factor=expected.long_factor, short_factor=expected.short_factor)
    assert ours == expected
    prompt, reference = case.references[24]
    result = run_job(Job(name, str(path), prompt, STEPS), TPContext())
    assert_matches(result.greedy, reference, f"{name} gguf")


def _meta(arch: str = "llama", **values: Any) -> Callable[..., Any]:
    """A metadata getter over `values` keyed by gguf's own Keys.Rope names (attribute names)."""
    full = {getattr(gguf.Keys.Rope, k).format(arch=arch): v for k, v in values.items()}

    def key(suffix: str, default: Any = None) -> Any:
        return full.get(f"{arch}.{suffix}", default)

    return key


def test_gguf_yarn_keys_map_to_hf_names() -> None:
    key = _meta(
        FREQ_BASE=1e6, SCALING_TYPE="yarn", SCALING_FACTOR=4.0, SCALING_ORIG_CTX_LEN=32768,
        SCALING_YARN_BETA_FAST=16.0, SCALING_YARN_BETA_SLOW=2.0, SCALING_YARN_ATTN_FACTOR=1.2,
        SCALING_YARN_LOG_MUL=1.0, SCALING_YARN_EXT_FACTOR=1.0,
    )  # fmt: skip
    assert gguf_rope_parameters(key, {}, 128) == {
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768,
        "beta_fast": 16.0, "beta_slow": 2.0, "attention_factor": 1.2, "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    assert gguf_rope_parameters(_meta(SCALING_TYPE="none"), {}, 128) == {"rope_type": "default", "rope_theta": 10000.0}
    assert gguf_rope_parameters(_meta(SCALING_TYPE="linear", SCALING_FACTOR=2.0), {}, 128)["factor"] == 2.0


@pytest.mark.parametrize(
    ("meta", "tensors", "kind", "words"),
    [
        (dict(SCALING_TYPE="su-perduper"), {}, ErrorKind.UNSUPPORTED_ARCH, "'su-perduper'"),
        (dict(SCALING_TYPE="yarn"), {}, ErrorKind.LOAD_FAILED, "rope.scaling.factor"),
        (dict(SCALING_TYPE="linear"), {}, ErrorKind.LOAD_FAILED, "rope.scaling.factor"),
        (dict(SCALING_TYPE="yarn", SCALING_FACTOR=4.0, SCALING_YARN_EXT_FACTOR=0.5), {}, ErrorKind.UNSUPPORTED_ARCH,
         "yarn_ext_factor"),
        (dict(SCALING_TYPE="longrope"), {}, ErrorKind.LOAD_FAILED, "rope_factors_short.weight"),
    ],
)  # fmt: skip
def test_gguf_rope_refusals(meta: dict[str, Any], tensors: dict[str, Any], kind: ErrorKind, words: str) -> None:
    with pytest.raises(CeleryTPError) as info:
        gguf_rope_parameters(_meta(**meta), tensors, 128)
    assert info.value.kind == kind and words in info.value.message


# ---- config.json refusals ------------------------------------------------------------------


def test_unknown_rope_type_is_refused_naming_it() -> None:
    d = {**hf_config_dict("yarn"), "rope_parameters": {"rope_type": "mrope-9000", "factor": 2.0}}
    with pytest.raises(CeleryTPError) as info:
        rope_config(d)
    assert info.value.kind == ErrorKind.UNSUPPORTED_ARCH
    assert "'mrope-9000'" in info.value.message and all(t in info.value.message for t in SUPPORTED_ROPE_TYPES)


@pytest.mark.parametrize(
    ("name", "change", "words"),
    [
        ("longrope", {"long_factor": LONG[:-1]}, "long_factor"),
        ("longrope", {"short_factor": [1.0] * 7 + ["x"]}, "short_factor[7]"),
        ("longrope", {"long_factor": None}, "long_factor"),
        ("yarn", {"factor": "4"}, "factor"),
        ("yarn", {"factor": float("nan")}, "factor"),
        ("yarn", {"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
        ("yarn", {"original_max_position_embeddings": 12.5}, "original_max_position_embeddings"),
        ("yarn", {"truncate": "yes"}, "truncate"),
        ("yarn", {"attention_factor": -1.0}, "attention_factor"),
        ("yarn_mscale_4x", {"mscale": "big"}, "mscale"),
        ("dynamic", {"factor": None}, "factor"),
    ],
)
def test_malformed_rope_parameters_are_load_failed(name: str, change: dict[str, Any], words: str) -> None:
    d = hf_config_dict(name)
    params_key = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
    d[params_key] = {**d[params_key], **change}
    with pytest.raises(CeleryTPError) as info:
        rope_config(d)
    assert info.value.kind == ErrorKind.LOAD_FAILED and words in info.value.message, info.value.message


def test_missing_required_factor_is_load_failed() -> None:
    for name in ("yarn", "dynamic"):
        d = hf_config_dict(name)
        params_key = "rope_parameters" if "rope_parameters" in d else "rope_scaling"
        d[params_key] = {k: v for k, v in d[params_key].items() if k != "factor"}
        with pytest.raises(CeleryTPError) as info:
            rope_config(d)
        assert info.value.kind == ErrorKind.LOAD_FAILED and "'factor'" in info.value.message


def test_wrong_factor_length_for_the_rotary_dim_is_load_failed_at_build() -> None:
    rope = rope_config({**hf_config_dict("longrope"), "head_dim": None, "hidden_size": None})  # dim unknown here
    with pytest.raises(CeleryTPError) as info:
        RotaryEmbedding(2 * HEAD_DIM, 64, rope, device=CPU)
    assert info.value.kind == ErrorKind.LOAD_FAILED and "longrope factors" in info.value.message
