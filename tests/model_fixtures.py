"""Helpers for the model tests: tiny random transformers models, a GGUF writer, rank spawning.

Kept free of a top-level transformers import: spawned ranks import this module to find
their entry point and only need torch and celerytp.
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from celerytp.distributed.tp import TPContext
from celerytp.models import CausalLM, load_model

LOGITS_ATOL = 1e-4  # float32 logits vs transformers (values are O(1..10))
DECODE_STEPS = 20

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (model_type, config kwargs). Heads/hidden chosen so transformers accepts them.
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # GQA 6/3 (3 KV groups: 2+1 over 2 ranks), head_dim 16 != 48/6, biases, llama3 rope.
    "llama_gqa_bias": (
        "llama",
        dict(
            hidden_size=48,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=16,
            intermediate_size=96,
            attention_bias=True,
            mlp_bias=True,
            tie_word_embeddings=False,
            rope_theta=50000.0,
            rope_scaling=LLAMA3_ROPE,
        ),
    ),
    # 2 KV heads: replicated at world size 4; head_dim 32 != 64/8; tied embeddings.
    "qwen3_tied": (
        "qwen3",
        dict(
            hidden_size=64,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=80,
            tie_word_embeddings=True,
        ),
    ),
    # MHA 4/4: 2+1+1 KV groups at world size 3; tied; default rope.
    "llama_mha_tied": (
        "llama",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=64,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        ),
    ),
    # MQA: one KV head replicated on every rank; qwen3 with attention bias; untied.
    "qwen3_mqa_bias": (
        "qwen3",
        dict(
            hidden_size=32,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=16,
            intermediate_size=72,
            attention_bias=True,
            tie_word_embeddings=False,
        ),
    ),
}
# Dims suited to GGUF quant blocks of 32 (in-features multiples of 32).
GGUF_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    # 3 KV groups: 2+1 over 2 ranks, so Q/K un-permutation and o_proj byte ranges are uneven.
    "llama": (
        "llama",
        dict(
            hidden_size=96,
            num_attention_heads=6,
            num_key_value_heads=3,
            head_dim=32,
            intermediate_size=96,
            attention_bias=True,
            tie_word_embeddings=False,
            rope_scaling=LLAMA3_ROPE,
        ),
    ),
    "qwen3": (
        "qwen3",
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=96,
            tie_word_embeddings=True,
        ),
    ),
}
COMMON = dict(vocab_size=160, num_hidden_layers=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def make_hf_model(model_type: str, kwargs: dict[str, Any], seed: int) -> Any:
    """A transformers model of any architecture (COMMON, updated by kwargs), randomized by `randomize`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    return randomize(AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **(COMMON | kwargs))).eval())


def randomize(model: Any) -> Any:
    """Weights spread wide enough that greedy has no near-ties, norms randomized too (all-ones
    norms would hide a norm that was never loaded)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


def make_prompt(vocab_size: int, length: int = 8, seed: int = 1234) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (length,), generator=g).tolist()


@dataclass
class Greedy:
    """Logits of the prompt, then DECODE_STEPS greedy tokens and the logits after each."""

    prompt_logits: torch.Tensor  # (T, V)
    step_logits: torch.Tensor  # (steps, V)
    tokens: list[int]


def hf_greedy(model: Any, prompt: list[int], steps: int = DECODE_STEPS, use_cache: bool = False) -> Greedy:
    """Reference greedy decoding with transformers: by default recompute the whole sequence
    each step (independent of any cache); `use_cache` uses transformers' own KV cache."""
    seq = list(prompt)
    with torch.no_grad():
        out = model(torch.tensor([seq]), use_cache=use_cache)
        prompt_logits = out.logits[0].float()
        nxt = int(prompt_logits[-1].argmax())
        tokens, step_logits = [], []
        for _ in range(steps):
            tokens.append(nxt)
            seq.append(nxt)
            if use_cache:
                out = model(torch.tensor([[nxt]]), cache=out.cache, use_cache=True)
            else:
                out = model(torch.tensor([seq]), use_cache=False)
            logits = out.logits[0, -1].float()
            step_logits.append(logits)
            nxt = int(logits.argmax())
    return Greedy(prompt_logits, torch.stack(step_logits), tokens)


def our_greedy(model: CausalLM, prompt: list[int], steps: int = DECODE_STEPS) -> Greedy:
    """Ours: prefill once, then one token per forward through the KV cache."""
    prompt_logits = model.forward_tokens(torch.tensor(prompt), 0)
    nxt = int(prompt_logits[-1].argmax())
    tokens, step_logits = [], []
    for _ in range(steps):
        tokens.append(nxt)
        logits = model.forward_tokens(torch.tensor([nxt]), model.cache_len)[-1]
        step_logits.append(logits)
        nxt = int(logits.argmax())
    return Greedy(prompt_logits.cpu(), torch.stack(step_logits).cpu(), tokens)


def assert_matches(ours: Greedy, ref: Greedy, what: str, atol: float = LOGITS_ATOL) -> None:
    torch.testing.assert_close(ours.prompt_logits, ref.prompt_logits, atol=atol, rtol=0, msg=f"{what}: prompt logits")
    assert ours.tokens == ref.tokens, f"{what}: greedy tokens differ\nours {ours.tokens}\nref  {ref.tokens}"
    torch.testing.assert_close(ours.step_logits, ref.step_logits, atol=atol, rtol=0, msg=f"{what}: decode logits")


# ---- GGUF writing, as llama.cpp's convert_hf_to_gguf.py lays tensors out ----------------

_GGUF_BLOCK = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face llama/qwen3 tensor name."""
    module, _, kind = hf_name.rpartition(".")
    if module in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    return f"blk.{layer}.{_GGUF_BLOCK[rest]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (interleaves each head's rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(theta: float, head_dim: int, rope: dict[str, Any]) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 scaling (inv_freq is divided by these)."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _quantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """gguf's quantizer; the project's for the K-quants gguf cannot write (checked against gguf's
    dequantizer in test_quant_blocks)."""
    try:
        return gguf.quants.quantize(data, qtype)
    except NotImplementedError:
        from celerytp.quant import quantize_blocks

        return quantize_blocks(torch.from_numpy(data), qtype).numpy()


def write_gguf(
    model: Any,
    path: Path,
    quant: dict[str, gguf.GGMLQuantizationType] | None = None,
    arch: str | None = None,
) -> Path:
    """Write `model` as a GGUF file; `quant` maps a GGUF name substring to a quant type for
    2-D weights (first match wins; unmatched tensors stay F32)."""
    cfg = model.config
    arch = arch or cfg.model_type
    rope = cfg.rope_parameters
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rope["rope_theta"], cfg.head_dim, rope))
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.detach().float().numpy()
        if cfg.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            data = llama_cpp_permute(data, cfg.num_attention_heads if ".q_proj." in name else cfg.num_key_value_heads)
        gname = gguf_name(name)
        qtype = next((q for key, q in (quant or {}).items() if key in gname), None)
        if qtype is not None and data.ndim == 2:
            w.add_tensor(gname, _quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_model_from_gguf(model: Any, path: Path) -> Any:
    """`model`'s architecture with weights read by transformers' own GGUF loader
    (its dequantization and its reverse of llama.cpp's Q/K permutation)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ref = type(model)(model.config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=ref)["tensors"]
    result = ref.load_state_dict(tensors, strict=False)
    allowed = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    assert set(result.missing_keys) <= allowed, result.missing_keys
    assert not result.unexpected_keys, result.unexpected_keys
    return ref


# ---- running real ranks -----------------------------------------------------------------


@dataclass
class Job:
    """One model for every rank to load and decode greedily."""

    name: str
    path: str
    prompt: list[int]
    steps: int = DECODE_STEPS
    max_context: int | None = None
    quant: str | None = "f32"  # the exact float path: GGUF blocks dequantized on load


@dataclass
class RankResult:
    greedy: Greedy
    shapes: dict[str, tuple[int, ...]]
    memory: dict[str, int]
    progress: list[tuple[int, int, str]] = field(default_factory=list)


def run_job(job: Job, tp: TPContext) -> RankResult:
    progress: list[tuple[int, int, str]] = []
    model = load_model(
        job.path, tp, max_context=job.max_context, quant=job.quant, progress=lambda d, t, n: progress.append((d, t, n))
    )
    greedy = our_greedy(model, job.prompt, job.steps)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    for name, module in model.named_modules():  # a packed weight's shape (layers/packed_linear.py)
        if getattr(module, "onednn_weight", None) is not None:
            shapes[f"{name}.weight"] = tuple(module.onednn_weight.shape)
    return RankResult(greedy, shapes, model.memory_report(), progress)


def _rank_entry(rank: int, world_size: int, init_file: str, jobs: list[Job], out_dir: str) -> None:
    torch.set_num_threads(1)  # several ranks share two cores
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=120),
        )
        tp = TPContext(rank, world_size, None)
        results = {}
        for job in jobs:
            r = run_job(job, tp)
            results[job.name] = {
                "prompt_logits": r.greedy.prompt_logits,
                "step_logits": r.greedy.step_logits,
                "tokens": r.greedy.tokens,
                "shapes": r.shapes,
                "memory": r.memory,
            }
        dist.destroy_process_group()
        torch.save(results, out)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, out)
        raise


def run_ranks(world_size: int, jobs: list[Job], workdir: Path, timeout: float = 240.0) -> list[dict[str, RankResult]]:
    """Run `jobs` on `world_size` spawned ranks joined by a gloo group; per-rank results."""
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    init_file = workdir / "pg_init"
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world_size, str(init_file), jobs, str(workdir)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stuck:
        procs[r].kill()
        procs[r].join()
    results = []
    for r in range(world_size):
        out = workdir / f"rank{r}.pt"
        if not out.exists():
            raise AssertionError(f"rank {r} wrote no result (exitcode {procs[r].exitcode}, stuck ranks {stuck})")
        data = torch.load(out)
        if "error" in data:
            raise AssertionError(f"rank {r} failed:\n{data['error']}")
        results.append(
            {
                name: RankResult(Greedy(d["prompt_logits"], d["step_logits"], d["tokens"]), d["shapes"], d["memory"])
                for name, d in data.items()
            }
        )
    return results


# ---- hybrid GGUF writing, as llama.cpp's convert_hf_to_gguf.py does ----------------------
# Qwen3NextModel (qwen3next); Qwen3_5TextModel / Qwen3_5MoeTextModel (qwen35, qwen35moe), which run
# _LinearAttentionVReorderBase.modify_tensors before Qwen3NextModel's.

HYBRID_GGUF_ARCH = {"qwen3_next": "qwen3next", "qwen3_5_text": "qwen35", "qwen3_5_moe_text": "qwen35moe"}


def _qwen3next_split_qkvz(w: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3NextModel.modify_tensors on in_proj_qkvz: [q, k, v, z] per key head -> attn_qkv
    ([all q | all k | all v]) and attn_gate (all z), the converter's own steps."""
    hk, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    split = [hk, hk, nv // nk * hv, nv // nk * hv]
    data = w.permute(1, 0).contiguous().view(-1, nk, sum(split))  # (hidden, key heads, q+k+v+z)
    q, k, v, z = torch.split(data, split, dim=-1)
    q, k, v, z = (t.contiguous().view(cfg.hidden_size, -1) for t in (q, k, v, z))
    return torch.cat([q, k, v], dim=-1).permute(1, 0).contiguous(), z.permute(1, 0).contiguous()


def _reorder_v_heads(t: torch.Tensor, dim: int, num_k_heads: int, num_v_per_k: int, head_dim: int) -> torch.Tensor:
    """_LinearAttentionVReorderBase._reorder_v_heads: value heads grouped by key head -> tiled."""
    shape = list(t.shape)
    dim = dim % len(shape)
    t = t.reshape(*shape[:dim], num_k_heads, num_v_per_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).contiguous().reshape(shape)


def _qwen35_reorder(name: str, t: torch.Tensor, cfg: Any) -> torch.Tensor:
    """_LinearAttentionVReorderBase.modify_tensors (only when key and value head counts differ)."""
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if nk == nv or "linear_attn." not in name:
        return t
    hk, hv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    qk = 2 * nk * hk
    if ".in_proj_qkv." in name:
        return torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, nk, r, hv)])
    if ".in_proj_z." in name:
        return _reorder_v_heads(t, 0, nk, r, hv)
    if ".in_proj_b." in name or ".in_proj_a." in name:
        return _reorder_v_heads(t, 0, nk, r, 1)
    if ".A_log" in name or ".dt_bias" in name:
        return _reorder_v_heads(t.unsqueeze(-1), 0, nk, r, 1).squeeze(-1)
    if ".conv1d" in name:
        t = t.squeeze()
        return torch.cat([t[:qk], _reorder_v_heads(t[qk:], 0, nk, r, hv)])
    if ".out_proj." in name:
        return _reorder_v_heads(t, 1, nk, r, hv)
    return t


def _hybrid_tensors(model: Any, arch: str) -> dict[str, torch.Tensor]:
    """GGUF name -> tensor after the converter's modify_tensors chain."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        layer = name.split(".")[2] if name.startswith("model.layers.") else None
        if arch != "qwen3next":
            t = _qwen35_reorder(name, t, cfg)
        if name.endswith(".A_log"):  # Qwen3NextModel.modify_tensors from here
            t = -torch.exp(t)
        elif name.endswith(".dt_bias"):
            name = name.rpartition(".dt_bias")[0] + ".dt_proj.bias"
        elif "conv1d" in name:
            t = t.squeeze()
        elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            t = t + 1
        if "in_proj_qkvz.weight" in name:
            qkv, z = _qwen3next_split_qkvz(t, cfg)
            out[f"blk.{layer}.attn_qkv.weight"], out[f"blk.{layer}.attn_gate.weight"] = qkv, z
        elif name.endswith("mlp.experts.gate_up_proj"):  # Qwen2MoeModel: (E, 2 I, H), gate first
            gate, up = t.split(t.shape[-2] // 2, dim=-2)
            out[f"blk.{layer}.ffn_gate_exps.weight"], out[f"blk.{layer}.ffn_up_exps.weight"] = gate, up
        elif name.endswith("mlp.experts.down_proj"):  # (E, H, I), stacked as is
            out[f"blk.{layer}.ffn_down_exps.weight"] = t
        else:
            out[names.get_name(name, try_suffixes=(".weight", ".bias"))] = t
    return out


def _write_hybrid_metadata(w: gguf.GGUFWriter, cfg: Any, arch: str, mtp_layers: int) -> None:
    """TextModel, Qwen2MoeModel and Qwen3NextModel.set_gguf_parameters (+ Qwen3.5's mixins)."""
    full = [i for i, kind in enumerate(cfg.layer_types) if kind == "full_attention"]
    interval = full[0] + 1
    assert cfg.layer_types == [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(cfg.num_hidden_layers)
    ], "llama.cpp describes the layer kinds by full_attention_interval only"
    w.add_block_count(cfg.num_hidden_layers + mtp_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    if getattr(cfg, "intermediate_size", None) is not None:
        w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if arch != "qwen3next":
        w.add_rope_dimension_sections([11, 11, 10, 0])  # _Qwen35MRopeMixin's default
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if getattr(cfg, "num_experts", None):
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    w.add_full_attention_interval(interval)
    w.add_rope_dimension_count(int(cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 0.25)))
    if mtp_layers:
        w.add_nextn_predict_layers(mtp_layers)


def write_hybrid_gguf(
    model: Any, path: Path, quant: gguf.GGMLQuantizationType | None = None, mtp_layers: int = 0
) -> Path:
    """Write a transformers Qwen3-Next / Qwen3.5 / Qwen3.5-MoE model as llama.cpp's converter
    would: its metadata keys and transformed tensors; with `quant`, the linear weights (not
    norms, conv, router, embedding) in that type; `mtp_layers` appends that many MTP blocks
    (placeholder tensors under the converter's nextn names) for the reader to skip."""
    cfg = model.config
    arch = HYBRID_GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(str(path), arch)
    _write_hybrid_metadata(w, cfg, arch, mtp_layers)
    linears = (
        "attn_q.", "attn_k.", "attn_v.", "attn_output", "attn_qkv", "attn_gate", "ssm_ba", "ssm_beta", "ssm_alpha",
        "ssm_out", "_exps", "_shexp.", "ffn_gate.", "ffn_up.", "ffn_down.", "output.",
    )  # fmt: skip
    tensors = _hybrid_tensors(model, arch)
    for i in range(cfg.num_hidden_layers, cfg.num_hidden_layers + mtp_layers):
        tensors[f"blk.{i}.nextn.eh_proj.weight"] = torch.zeros(cfg.hidden_size, 2 * cfg.hidden_size)
        tensors[f"blk.{i}.attn_norm.weight"] = torch.zeros(cfg.hidden_size)
    for name, t in tensors.items():
        data = np.ascontiguousarray(t.numpy(), dtype=np.float32)
        if quant is not None and any(s in name for s in linears) and "gate_inp" not in name:
            w.add_tensor(name, _quantize(data, quant), raw_dtype=quant)
        else:
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
