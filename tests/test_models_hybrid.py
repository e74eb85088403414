"""Hybrid models (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) against transformers, at world sizes 1, 2 and 4.

The reference is transformers' own model on a tiny random config, run with its torch
fallbacks for the causal conv and the chunked delta rule (no kernels installed), recomputing
the whole sequence every step (no cache). Prompts are 80 tokens: longer than the chunk
size on both sides (transformers always chunks by 64; ours is 32 or 24 for two checkpoints
below, so their chunk boundaries differ from the reference's, and the default 64 for the
rest), then 20 greedy decode steps through the recurrent form. Tolerance: logits within atol 1e-4 everywhere, greedy tokens identical.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from model_fixtures import Greedy, Job, assert_matches, hf_greedy, make_prompt, run_job, run_ranks
from safetensors.torch import load_file, save_file

from celerytp.core.errors import CeleryTPError
from celerytp.distributed.tp import TPContext

PROMPT_LEN = 80
VOCAB = 160
# Layer 0 linear, 1 full, 2 linear: both token mixers and a state carried across both kinds.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    num_attention_heads=4,
    num_key_value_heads=2,  # 2 KV heads: replicated at world size 4
    head_dim=16,  # partial_rotary_factor 0.25 (the default) rotates 4 of 16 dims
    linear_num_key_heads=2,  # 2 key heads, 4 value heads: key heads replicated at world size 4
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
MOE: dict[str, Any] = dict(
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24
)

# name -> (transformers family, extra config, our chunk size or None for the default 64)
HYBRID_CONFIGS: dict[str, tuple[str, dict[str, Any], int | None]] = {
    # MoE on layers 0 and 2, dense MLP on layer 1 (mlp_only_layers); fused in_proj_qkvz/ba.
    "qwen3_next": ("qwen3_next", dict(intermediate_size=48, mlp_only_layers=[1], **MOE), 32),
    "qwen3_5": ("qwen3_5", dict(intermediate_size=48, tie_word_embeddings=True), None),
    "qwen3_5_moe": ("qwen3_5_moe", dict(MOE), 24),
    # Uneven at world size 2: 3 key heads (2 + 1, with 4 + 2 value heads), 3 KV groups (2 + 1).
    "qwen3_next_uneven": (
        "qwen3_next",
        dict(
            intermediate_size=48, num_attention_heads=6, num_key_value_heads=3, linear_num_key_heads=3,
            linear_num_value_heads=6, **MOE,
        ),
        None,
    ),
}
# Which checkpoints each world size runs (the uneven one cannot be split 4 ways).
WORLD_SIZE_CASES = {
    2: [*HYBRID_CONFIGS, "qwen3_5_multimodal"],
    4: ["qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen3_5_multimodal"],
}


def make_hybrid_model(family: str, kwargs: dict[str, Any], seed: int) -> Any:
    """A transformers hybrid model with random weights spread wide enough for clear greedy picks.

    Zero-centred norms (scale 1 + w) get small random w, the gated norm weights near 1;
    A_log and dt_bias keep transformers' initialisation (a realistic range of decays).
    """
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM
    from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    config_cls, model_cls = {
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM),
        "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
    }[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**(COMMON | kwargs))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                continue
            if "linear_attn.norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def set_chunk_size(path: Path, chunk: int | None) -> None:
    if chunk is None:
        return
    config = json.loads((path / "config.json").read_text())
    config["linear_chunk_size"] = chunk
    (path / "config.json").write_text(json.dumps(config))


def write_multimodal_checkpoint(model: Any, path: Path) -> None:
    """The layout of a real Qwen3.5 checkpoint: model_type qwen3_5 with the text model under
    `text_config` and `model.language_model.`, plus vision-tower and MTP tensors to skip."""
    text_dir = path.parent / f"{path.name}_text"
    model.save_pretrained(text_dir, safe_serialization=True)
    text_config = json.loads((text_dir / "config.json").read_text())
    tensors = {
        (f"model.language_model.{n[len('model.') :]}" if n.startswith("model.") else n): t
        for n, t in load_file(str(text_dir / "model.safetensors")).items()
    }
    tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
    tensors["model.visual.merger.linear_fc1.weight"] = torch.zeros(4, 8)
    tensors["mtp.fc.weight"] = torch.zeros(4, 8)
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"))
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text_config | {"model_type": "qwen3_5_text"},
        "vision_config": {"model_type": "qwen3_5", "depth": 1, "hidden_size": 8},
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
    }
    (path / "config.json").write_text(json.dumps(config))


@dataclass
class Case:
    path: Path
    prompt: list[int]
    reference: Greedy
    bf16_error: float | None = None  # transformers' own bf16 prompt-logit error vs its float32


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Case]:
    root = tmp_path_factory.mktemp("hybrid")
    out: dict[str, Case] = {}
    for seed, (name, (family, kwargs, chunk)) in enumerate(HYBRID_CONFIGS.items()):
        model = make_hybrid_model(family, kwargs, seed)
        prompt = make_prompt(VOCAB, PROMPT_LEN, seed=100 + seed)
        reference = hf_greedy(model, prompt)
        model.save_pretrained(root / name, safe_serialization=True)
        set_chunk_size(root / name, chunk)
        out[name] = Case(root / name, prompt, reference)
        if name == "qwen3_next":
            with torch.no_grad():
                bf16 = model.to(torch.bfloat16)(torch.tensor([prompt]), use_cache=False).logits[0].float()
            out[name].bf16_error = (bf16 - reference.prompt_logits).abs().max().item()
        if name == "qwen3_5":
            write_multimodal_checkpoint(model, root / "qwen3_5_multimodal")
            out["qwen3_5_multimodal"] = Case(root / "qwen3_5_multimodal", prompt, reference)
    return out


@pytest.mark.parametrize("name", [*HYBRID_CONFIGS, "qwen3_5_multimodal"])
@pytest.mark.parametrize("prefill", ["steps", "chunks"])
def test_world_size_1_matches_transformers(cases: dict[str, Case], name: str, prefill: str, monkeypatch) -> None:
    """Prefill token by token (the default) and by the chunked rule (CELERYTP_RECURRENT_PREFILL=chunks,
    set here so that its code is checked too)."""
    monkeypatch.setenv("CELERYTP_RECURRENT_PREFILL", prefill)
    case = cases[name]
    result = run_job(Job(name, str(case.path), case.prompt), TPContext())
    assert_matches(result.greedy, case.reference, name)


def test_tensor_parallel_matches_transformers(cases: dict[str, Case], tmp_path: Path) -> None:
    """World size 2 (whole key heads and KV groups per rank, uneven too) and 4 (both replicated)."""
    for world_size, names in WORLD_SIZE_CASES.items():
        jobs = [Job(n, str(cases[n].path), cases[n].prompt) for n in names]
        per_rank = run_ranks(world_size, jobs, tmp_path / f"w{world_size}")
        for rank, results in enumerate(per_rank):
            for name in names:
                assert_matches(results[name].greedy, cases[name].reference, f"{name} rank {rank}/{world_size}")


def test_prefill_in_one_call_equals_token_by_token(cases: dict[str, Case], monkeypatch) -> None:
    """Chunked prefill, uneven prefill pieces and one token per call (recurrent form) agree,
    and clear_cache forgets the recurrent state as well as the KV cache. The chunked rule is what
    this checks (CELERYTP_RECURRENT_PREFILL=chunks; the default prefill is the recurrent step, equal
    to decode bit for bit: tests/test_batch_invariance.py)."""
    from celerytp.models import load_model

    monkeypatch.setenv("CELERYTP_RECURRENT_PREFILL", "chunks")
    case = cases["qwen3_next"]
    model = load_model(case.path, TPContext())
    prompt = torch.tensor(case.prompt)
    whole = model.forward_tokens(prompt, 0)[-1]
    model.clear_cache()
    pieces = [prompt[:5], prompt[5:41], prompt[41:42], prompt[42:]]
    for piece in pieces:
        last = model.forward_tokens(piece, model.cache_len)[-1]
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=0)
    model.clear_cache()
    assert all(not s.ssm.any() and not s.conv.any() for s in model.model.recurrent_states())
    for token in prompt:
        last = model.forward_tokens(token[None], model.cache_len)[-1]
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=0)
    # A new sequence at offset 0 starts from empty state even without clear_cache (step mode).
    model.cache_lens[model.step_row] = 0
    torch.testing.assert_close(model.forward_tokens(prompt, 0)[-1], whole, atol=1e-5, rtol=0)
    rows = len(model.cache_lens)
    with pytest.raises(ValueError, match=f"row {rows} is outside the {rows} cache rows"):
        model.forward_tokens(prompt, 0, row=rows)


def test_hybrid_rows_decode_together_and_passengers_keep_their_state(cases: dict[str, Case]) -> None:
    """Several sequences in their own recurrent-state rows decode in one batch; a row that
    rides along inactive keeps its state and cache untouched."""
    from celerytp.models import load_model

    case = cases["qwen3_next"]
    model = load_model(case.path, TPContext(), max_batch=3)
    prompts = [case.prompt, case.prompt[:20], case.prompt[7:30]]
    alone = []
    for prompt in prompts:  # each sequence by itself in step mode's row: prompt, then one decode step
        model.clear_cache(model.step_row)
        first = int(model.forward_tokens(torch.tensor(prompt), 0, last_only=True)[-1].argmax())
        alone.append(model.forward_tokens(torch.tensor([first]), len(prompt))[-1])
    firsts = []
    for row, prompt in enumerate(prompts):
        firsts.append(int(model.forward_tokens(torch.tensor(prompt), 0, row=row, last_only=True)[-1].argmax()))
    state = [s.ssm[1].clone() for s in model.model.recurrent_states()]
    batched = model.decode([firsts[0], 0, firsts[2]], [True, False, True])  # row 1 is a passenger
    torch.testing.assert_close(batched, torch.stack([alone[0], alone[2]]), atol=1e-4, rtol=0)
    assert all(torch.equal(s.ssm[1], kept) for s, kept in zip(model.model.recurrent_states(), state))
    assert model.cache_lens[:3] == [len(prompts[0]) + 1, len(prompts[1]), len(prompts[2]) + 1]
    torch.testing.assert_close(model.decode([firsts[0] * 0, firsts[1]], [False, True])[0], alone[1], atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="cannot be cut back"):
        model.truncate(0, 3)  # recurrent state holds the whole history or nothing


def test_shards_and_memory_report(cases: dict[str, Case]) -> None:
    """World size 4: one replicated key head with 1 of its 2 value heads per rank; 1 KV head
    and 1 query head per rank; every expert sliced to moe_intermediate_size / 4 columns."""
    from celerytp.models import load_model

    hk, hv = 16, 8
    for rank in range(4):
        model = load_model(cases["qwen3_next"].path, TPContext(rank, 4))
        lin = model.model.layers[0].linear_attn
        assert (lin.num_k, lin.num_v) == (1, 1)
        assert tuple(lin.in_proj.weight.shape) == (2 * hk + 2 * hv + 2, 32)  # [q k | v z | b a]
        assert tuple(lin.conv1d.weight.shape) == (2 * hk + hv, 1, 4)
        assert tuple(lin.out_proj.weight.shape) == (32, hv)
        assert (lin.layout.heads.kv_start, lin.layout.heads.q_start) == (rank // 2, rank)
        attn = model.model.layers[1].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (1, 1)
        assert tuple(attn.qkv_proj.weight.shape) == ((2 + 1 + 1) * 16, 32)  # q + gate, k, v
        moe = model.model.layers[0].mlp
        assert tuple(moe.experts.w13.shape) == (8, 2 * 4, 32) and tuple(moe.experts.w2.shape) == (8, 32, 4)
        assert tuple(moe.gate.weight.shape) == (8, 32)  # replicated router
    report = model.memory_report()
    rows = 2  # one served sequence (max_batch 1) and step mode's row
    state = 2 * rows * ((2 * hk + hv) * 3 * 4 + 1 * hk * hv * 4)  # 2 linear layers: conv + ssm
    kv = 2 * rows * 1 * (256 + 1) * 16 * 4  # one full-attention layer: (k, v) x 1 head x 256 positions + scratch
    assert report["recurrent_state_bytes"] == state
    assert report["kv_cache_bytes"] == kv + state


def test_vision_and_mtp_tensors_are_skipped_with_a_log_line(
    cases: dict[str, Case], caplog: pytest.LogCaptureFixture
) -> None:
    from celerytp.models import load_model

    with caplog.at_level(logging.INFO, logger="celerytp.models.qwen3_next"):
        model = load_model(cases["qwen3_5_multimodal"].path, TPContext())
    assert model.config.model_type == "qwen3_5" and model.config.weight_prefix == "model.language_model."
    assert "skipping 2 vision and 1 mtp tensors" in caplog.text


def test_unsplittable_heads_name_the_numbers(cases: dict[str, Case]) -> None:
    from celerytp.models import load_model

    # 2 key heads over 3 ranks: 3 is neither <= 2 nor a multiple of it.
    with pytest.raises(CeleryTPError, match="linear_num_value_heads 4, linear_num_key_heads 2.*world size 3") as exc:
        load_model(cases["qwen3_next"].path, TPContext(0, 3))
    assert exc.value.kind == "load_failed"
    # 2 KV heads over 8 ranks: each KV head on 4 ranks, but its 2 query heads do not divide by 4.
    with pytest.raises(CeleryTPError, match="2 query heads do not divide by 4") as exc:
        load_model(cases["qwen3_5"].path, TPContext(0, 8))
    assert exc.value.kind == "load_failed"


def test_bfloat16_stays_close_to_float32(cases: dict[str, Case]) -> None:
    """bf16 weights (the CUDA default) on CPU: no further from float32 than transformers' bf16
    (this tiny random model has large activations, so bf16 costs ~0.9 of a 3.5 logit)."""
    from celerytp.models import load_model

    case = cases["qwen3_next"]
    model = load_model(case.path, TPContext(), dtype=torch.bfloat16)
    assert model.model.layers[0].linear_attn.state.ssm.dtype == torch.float32  # state accumulates in fp32
    logits = model.forward_tokens(torch.tensor(case.prompt), 0)
    err = (logits - case.reference.prompt_logits).abs().max().item()
    assert case.bf16_error is not None and err < 1.5 * case.bf16_error, (err, case.bf16_error)


@pytest.mark.parametrize(
    ("key_heads", "value_heads", "world_size"), [(2, 4, 1), (2, 4, 2), (2, 4, 4), (3, 6, 2), (2, 6, 2)]
)
def test_fused_projection_rows_follow_transformers_ordering(key_heads: int, value_heads: int, world_size: int) -> None:
    """Feed row numbers through transformers' own un-interleaving of in_proj_qkvz / in_proj_ba:
    each rank's pieces must pick exactly its heads' rows, in [Q | K | V | Z | B | A] order."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from celerytp.layers.gated_deltanet import GatedDeltaNetDims, LocalLayout
    from celerytp.layers.partition import split_linear_heads

    hk, hv = 4, 2
    config = Qwen3NextConfig(
        hidden_size=8, num_hidden_layers=1, layer_types=["linear_attention"], linear_num_key_heads=key_heads,
        linear_num_value_heads=value_heads, linear_key_head_dim=hk, linear_value_head_dim=hv,
    )  # fmt: skip
    ref = Qwen3NextGatedDeltaNet(config, 0)
    qkvz_rows, ba_rows = ref.in_proj_qkvz.out_features, ref.in_proj_ba.out_features
    q, k, v, z, b, a = ref.fix_query_key_value_ordering(
        torch.arange(qkvz_rows)[None, None].float(), torch.arange(ba_rows)[None, None].float()
    )  # row numbers, (1, 1, heads, dim) each
    dims = GatedDeltaNetDims(8, key_heads, value_heads, hk, hv, 4, 1e-6, fused_proj=True)
    for rank in range(world_size):
        heads = split_linear_heads(rank, world_size, value_heads, key_heads)
        ks, kc, vs, vc = heads.kv_start, heads.kv_count, heads.q_start, heads.q_count
        regions = ((q, ks, kc), (k, ks, kc), (v, vs, vc), (z, vs, vc))
        expected_qkvz = torch.cat([t[0, 0, s : s + c].flatten() for t, s, c in regions])
        expected_ba = torch.cat([b[0, 0, vs : vs + vc], a[0, 0, vs : vs + vc]])
        layout = LocalLayout(dims, heads)
        for name, total, expected in (("in_proj_qkvz", qkvz_rows, expected_qkvz), ("in_proj_ba", ba_rows, expected_ba)):
            assert layout.proj_totals[name] == total
            got = torch.full((layout.proj_size,), -1.0)
            for src, n, dst in layout.proj_pieces[name]:
                got[dst : dst + n] = torch.arange(src, src + n).float()
            offset = 0 if name == "in_proj_qkvz" else layout.offsets["b"]
            assert got[offset : offset + expected.numel()].tolist() == expected.tolist(), (name, rank, world_size)


def test_split_linear_heads() -> None:
    from celerytp.layers.partition import HeadShard, split_linear_heads

    # Qwen3-Next-80B: 16 key heads, 32 value heads.
    assert split_linear_heads(1, 4, 32, 16) == HeadShard(8, 8, 4, 4)
    assert split_linear_heads(5, 32, 32, 16) == HeadShard(5, 1, 2, 1, 2)  # replicated key head
    assert split_linear_heads(1, 2, 6, 3) == HeadShard(4, 2, 2, 1)  # uneven: 2 + 1 key heads
    with pytest.raises(CeleryTPError, match="world size 64"):
        split_linear_heads(0, 64, 32, 16)


def test_hub_style_configs_parse() -> None:
    """config.json as the Hub checkpoints write it (abridged): Qwen3-Next without layer_types
    (full_attention_interval, top-level partial_rotary_factor and rope_theta), and Qwen3.5's
    multimodal config with the text model under text_config and M-RoPE parameters."""
    from celerytp.models.architectures import config_from_hf
    from celerytp.models.hybrid_config import HybridConfig

    linear = dict(
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_value_head_dim=128,
    )  # fmt: skip
    next_80b = HybridConfig.from_hf_config(
        dict(
            model_type="qwen3_next", vocab_size=151936, hidden_size=2048, intermediate_size=5120,
            num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
            full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=10000000, rope_scaling=None,
            num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
            decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=262144,
            **linear,
        )
    )  # fmt: skip
    assert next_80b.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert next_80b.num_linear_layers == 36 and next_80b.moe_layers == tuple(range(48))
    assert (next_80b.rotary_dim, next_80b.rope.theta, next_80b.fused_linear_proj) == (64, 1e7, True)
    text = dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=4096, intermediate_size=12288,
        num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        layer_types=["linear_attention"] * 3 + ["full_attention"], max_position_embeddings=262144,
        rope_parameters=dict(
            rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
            mrope_interleaved=True, mrope_section=[11, 11, 10],
        ),
        **linear,
    )  # fmt: skip
    q35 = config_from_hf(dict(model_type="qwen3_5", text_config=text, vision_config={}, tie_word_embeddings=False))
    assert isinstance(q35, HybridConfig)
    assert (q35.weight_prefix, q35.fused_linear_proj, q35.moe_layers, q35.rotary_dim) == (
        "model.language_model.", False, (), 64,
    )  # fmt: skip
    with pytest.raises(CeleryTPError, match="text_config"):
        HybridConfig.from_hf_config(dict(model_type="qwen3_5"))


def test_one_all_reduce_per_block(cases: dict[str, Case]) -> None:
    """Each token mixer and each MLP (dense or MoE with shared expert) all-reduces exactly once:
    nothing inside the delta rule, none per expert."""
    from celerytp.models import load_model

    @dataclass(frozen=True)
    class CountingTP(TPContext):
        calls: list[int] = field(default_factory=list)

        def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
            self.calls.append(tensor.numel())
            return tensor

    tp = CountingTP()
    model = load_model(cases["qwen3_next"].path, tp)
    model.forward_tokens(torch.tensor(cases["qwen3_next"].prompt), 0)  # prefill
    model.forward_tokens(torch.tensor([1]), model.cache_len)  # decode
    layers, hidden = COMMON["num_hidden_layers"], COMMON["hidden_size"]
    assert tp.calls == [PROMPT_LEN * hidden] * 2 * layers + [hidden] * 2 * layers
