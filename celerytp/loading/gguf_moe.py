"""MoE GGUF files: `qwen3moe`, and `llama` files with experts (Mixtral), as llama.cpp's converter writes them.

convert_hf_to_gguf.py (Qwen3MoeModel on Qwen2MoeModel; LlamaModel for MixtralForCausalLM) renames
and stacks the Hugging Face tensors; each source below presents one HF tensor of the checkpoint
it came from (qwen3_moe's `mlp.experts.{e}.*_proj`, Mixtral's `block_sparse_moe.experts.{e}.w1/w3/w2`):

- each layer's experts stacked into `ffn_{gate,up,down}_exps` (GGUF shape (in, out, E))
                                        undone by one 2-D view per expert (gguf_hybrid._expert_view)
- with --fuse-gate-up-exps, gate and up concatenated per expert into `ffn_gate_up_exps`
                                        undone by two row views per expert
- older Mixtral files: one tensor per expert, `ffn_{gate,up,down}.{e}`   renamed
- the router (`mlp.gate`, `block_sparse_moe.gate`) is `ffn_gate_inp`      renamed
- llama (Mixtral): q_proj / k_proj rows interleaved per head (LlamaModel.permute)
                                        undone as for dense llama (GGUFSource's unpermute)
- everything else: gguf_file.py's dense names.

Metadata: `{arch}.expert_count`, `expert_used_count`; the expert size is qwen3moe's
`expert_feed_forward_length` (llama.cpp falls back to feed_forward_length / expert_used_count) and
Mixtral's `feed_forward_length`. The converter writes no norm_topk_prob: llama.cpp renormalizes
the top-k routing weights of both (build_moe_ffn's norm_w), and so do we. qwen3moe layers without
`ffn_gate_inp` (which llama.cpp itself would refuse) load as dense qwen3_moe mlp_only_layers.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.loading.checkpoint import ReadRecord, TensorSource
from celerytp.loading.gguf_hybrid import _expert_view, _TensorView
from celerytp.loading.gguf_names import hf_name
from celerytp.loading.gguf_rope import ROPE_TENSORS
from celerytp.loading.gguf_source import GGUFSource

SourceFactory = Callable[[str, list[ReadRecord]], TensorSource]
MOE_GGUF_ARCHS = ("qwen3moe",)  # and `llama` when its blocks have experts
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "llama": "mixtral"}
# GGUF expert projection -> the HF checkpoint's name for it, per model_type.
EXPERT_NAMES = {
    "qwen3_moe": {
        "gate": "mlp.experts.{e}.gate_proj",
        "up": "mlp.experts.{e}.up_proj",
        "down": "mlp.experts.{e}.down_proj",
    },
    "mixtral": {
        "gate": "block_sparse_moe.experts.{e}.w1",
        "up": "block_sparse_moe.experts.{e}.w3",
        "down": "block_sparse_moe.experts.{e}.w2",
    },
}
ROUTER_NAMES = {"qwen3_moe": "mlp.gate", "mixtral": "block_sparse_moe.gate"}
SOFTMAX_GATING = 1  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
_STACKED_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down|gate_up)_exps\.weight")
_PER_EXPERT_RE = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
_ROUTER_RE = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_QK_RE = re.compile(r"blk\.\d+\.attn_[qk]\.(weight|bias)")


def is_moe_file(arch: object, tensors: dict[str, Any]) -> bool:
    """Whether gguf_moe reads this file: a qwen3moe file, or a llama file with routers (Mixtral)."""
    return arch in MOE_GGUF_ARCHS or (arch == "llama" and any(_ROUTER_RE.fullmatch(n) for n in tensors))


def moe_config(
    arch: str, dense: dict[str, Any], metadata: Callable[..., Any], tensors: dict[str, Any], where: str
) -> dict[str, Any]:
    """The HF config.json of a MoE file: gguf_file.py's dense translation `dense` plus the MoE keys
    the converter's set_gguf_parameters (TextModel, Qwen2MoeModel) wrote."""

    def key(suffix: str, default: Any = None) -> Any:
        return metadata(f"{arch}.{suffix}", default)

    experts, used = key("expert_count"), key("expert_used_count")
    if not experts or not used:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED, f"{where}: {arch} metadata lacks expert_count or expert_used_count"
        )
    if key("expert_gating_func", SOFTMAX_GATING) != SOFTMAX_GATING:
        raise CeleryTPError(
            ErrorKind.UNSUPPORTED_ARCH, f"{where}: {arch}.expert_gating_func {key('expert_gating_func')} is not softmax"
        )
    if key("expert_weights_scale", 0.0) not in (0.0, 1.0):
        raise CeleryTPError(
            ErrorKind.UNSUPPORTED_ARCH,
            f"{where}: {arch}.expert_weights_scale {key('expert_weights_scale')} is not supported",
        )
    model_type = MODEL_TYPES[arch]
    if model_type == "mixtral":
        return dense | {
            "model_type": model_type,
            "num_local_experts": experts,
            "num_experts_per_tok": used,
            "intermediate_size": key("expert_feed_forward_length") or dense["intermediate_size"],
        }
    layers = dense["num_hidden_layers"] or 0
    names = set(tensors)
    return dense | {
        "model_type": model_type,
        "num_experts": experts,
        "num_experts_per_tok": used,
        "moe_intermediate_size": key("expert_feed_forward_length") or (dense["intermediate_size"] or 0) // used,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names],
        "norm_topk_prob": True,
    }


def moe_sources(arch: str, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, SourceFactory]:
    """HF tensor name -> how to build its source, for every tensor of a MoE GGUF file (`config`: its
    moe_config); unknown names pass through for the loader to report."""
    model_type = config["model_type"]
    experts_names, router = EXPERT_NAMES[model_type], ROUTER_NAMES[model_type]
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    head_dim = config["head_dim"] if arch == "llama" else None  # llama's q/k permutation
    table: dict[str, SourceFactory] = {}
    for gguf_name, tensor in tensors.items():
        if gguf_name in ROPE_TENSORS:  # folded into the config by gguf_file.py
            continue
        if m := _STACKED_RE.fullmatch(gguf_name):
            layer, proj = m.groups()
            if len(tensor.shape) != 3 or int(tensor.shape[2]) != num_experts:
                raise CeleryTPError(
                    ErrorKind.LOAD_FAILED,
                    f"{gguf_name}: GGUF shape {tuple(int(d) for d in tensor.shape)} does not stack"
                    f" {num_experts} experts",
                )
            for e in range(num_experts):
                prefix = f"model.layers.{layer}."
                if proj != "gate_up":
                    table[prefix + experts_names[proj].format(e=e) + ".weight"] = _plain(_expert_view(tensor, e))
                    continue
                gate, up = _gate_up_views(gguf_name, tensor, e)
                table[prefix + experts_names["gate"].format(e=e) + ".weight"] = _plain(gate)
                table[prefix + experts_names["up"].format(e=e) + ".weight"] = _plain(up)
        elif m := _PER_EXPERT_RE.fullmatch(gguf_name):
            layer, proj, expert = m.groups()
            table[f"model.layers.{layer}.{experts_names[proj].format(e=expert)}.weight"] = _plain(tensor)
        elif m := _ROUTER_RE.fullmatch(gguf_name):
            table[f"model.layers.{m.group(1)}.{router}.weight"] = _plain(tensor)
        else:
            unpermute = head_dim if _QK_RE.fullmatch(gguf_name) else None
            table[hf_name(gguf_name)] = _plain(tensor, unpermute)
    return table


def _plain(tensor: Any, unpermute_head_dim: int | None = None) -> SourceFactory:
    return lambda name, log: GGUFSource(tensor, name, log, unpermute_head_dim)


def _gate_up_views(gguf_name: str, tensor: Any, expert: int) -> tuple[_TensorView, _TensorView]:
    """Expert `expert` of ffn_gate_up_exps ((E, 2 I, in) in torch order: gate rows, then up rows)."""
    view = _expert_view(tensor, expert)
    rows = view.shape[1]
    if rows % 2:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{gguf_name}: {rows} rows per expert do not split into gate and up")
    half = rows // 2
    shape = (view.shape[0], half)
    return (
        _TensorView(shape, view.tensor_type, view.data[:half]),
        _TensorView(shape, view.tensor_type, view.data[half:]),
    )
