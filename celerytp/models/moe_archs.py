"""Sparse-MoE decoders: Qwen3-MoE (`qwen3_moe`) and Mixtral (`mixtral`).

Both are the shared decoder (models/decoder.py) with routed experts (layers/moe.py SparseMoeBlock,
no shared expert: softmax router, top-k, one all-reduce per block, every expert split along its
intermediate size) on their MoE layers. What is theirs is the config translation and checkpoint names:

- qwen3_moe: qwen3 attention (per-head q/k RMSNorm, o_proj bias with attention_bias); MoE on the
  layers decoder_sparse_step and mlp_only_layers pick (the dense gated MLP of intermediate_size
  elsewhere); top-k weights renormalized only with norm_topk_prob (transformers' default: not);
  a sliding window on every layer only with use_sliding_window (max_window_layers plays no part).
- mixtral: llama attention; every layer MoE, each expert of intermediate_size; top-k weights
  always renormalized; sliding_window, when set, on every layer. Hub checkpoints name the block
  `block_sparse_moe`, its router `gate` and each expert's gate / up / down `w1` / `w3` / `w2`.

Both also load experts fused into 3-D tensors (transformers 5's `save_original_format=False`,
loading/fused.py).
"""

from __future__ import annotations

import re
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import Checkpoint
from celerytp.loading.fused import unfuse_experts
from celerytp.models.base import Progress
from celerytp.models.config import common_fields, sliding_fields
from celerytp.models.decoder import DecoderForCausalLM
from celerytp.models.hybrid_config import moe_layers

# Our expert projection -> Mixtral's hub name for it.
MIXTRAL_EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_OUR_MOE_NAME = re.compile(r"(.+)\.mlp\.(gate\.weight|experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight)")


def _silu_experts(d: dict[str, Any]) -> None:
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise CeleryTPError(
            ErrorKind.UNSUPPORTED_ARCH, f"model_type {d.get('model_type')!r}: experts run silu, not hidden_act {act!r}"
        )


def _first(d: dict[str, Any], *keys: str) -> Any:
    """The first of `keys` in d (transformers 4 and 5 spell some MoE keys differently)."""
    for key in keys:
        if d.get(key) is not None:
            return d[key]
    raise KeyError(keys[0])


def qwen3_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    _silu_experts(d)
    n = d["num_hidden_layers"]
    # Qwen3MoeConfig: sliding_window only with use_sliding_window, and then on every layer.
    window = {k: v for k, v in d.items() if k != "max_window_layers"}
    experts = _first(d, "num_experts", "num_local_experts")
    return (
        common_fields(d)
        | (sliding_fields(window, n) if d.get("use_sliding_window") else {})
        | {
            "qk_norm": True,
            "moe_layers": moe_layers(d, n) if experts > 0 else (),
            "num_experts": experts,
            "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["moe_intermediate_size"],
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        }
    )


def mixtral_fields(d: dict[str, Any]) -> dict[str, Any]:
    _silu_experts(d)
    n = d["num_hidden_layers"]
    return (
        common_fields(d)
        | sliding_fields({"sliding_window": d.get("sliding_window")}, n)
        | {
            "moe_layers": tuple(range(n)),
            "num_experts": _first(d, "num_local_experts", "num_experts"),
            "num_experts_per_tok": d["num_experts_per_tok"],
            "moe_intermediate_size": d["intermediate_size"],
            "norm_topk_prob": True,
        }
    )


class MoeDecoderForCausalLM(DecoderForCausalLM):
    """The shared decoder; loads per-expert (hub) or fused 3-D expert tensors."""

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        return super().load_weights(unfuse_experts(checkpoint), progress)


class MixtralForCausalLM(MoeDecoderForCausalLM):
    """Mixtral: hub names (`block_sparse_moe`, w1/w3/w2) unless the checkpoint uses transformers 5's
    own (`mlp.gate`, `mlp.experts.*`, as a fused save has them)."""

    hub_names = True

    def load_weights(self, checkpoint: Checkpoint, progress: Progress | None = None) -> set[str]:
        self.hub_names = not any(_OUR_MOE_NAME.fullmatch(n) or ".mlp.experts." in n for n in checkpoint.names())
        return super().load_weights(checkpoint, progress)

    def checkpoint_table(self) -> dict[str, Any]:
        table = super().checkpoint_table()
        return {mixtral_name(n): v for n, v in table.items()} if self.hub_names else table


def mixtral_name(name: str) -> str:
    """Mixtral's hub name for one of our parameter names (others unchanged)."""
    m = _OUR_MOE_NAME.fullmatch(name)
    if m is None:
        return name
    prefix, _, expert, proj = m.groups()
    if expert is None:
        return f"{prefix}.block_sparse_moe.gate.weight"
    return f"{prefix}.block_sparse_moe.experts.{expert}.{MIXTRAL_EXPERT_NAMES[proj]}.weight"
