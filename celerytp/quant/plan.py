"""Which formats a load keeps its linear weights in, and what it ended up keeping (the load reply)."""

from __future__ import annotations

import math
from collections import Counter

import torch
from gguf import GGMLQuantizationType
from torch import nn

from celerytp.loading.checkpoint import Checkpoint
from celerytp.quant.formats import QuantFormat, QuantPlan, parse_quant

_LINEAR_SUFFIXES = (
    "_proj.weight",
    "lm_head.weight",
    "in_proj_qkvz.weight",
    "in_proj_ba.weight",
    "in_proj_qkv.weight",
    "in_proj_z.weight",
    "in_proj_b.weight",
    "in_proj_a.weight",
)
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def resolve_quant(quant: str | None, checkpoint: Checkpoint, dtype: torch.dtype) -> QuantPlan | None:
    """How this load keeps its linears; None = plain weights in the compute dtype. Every
    architecture's linears take the plan (layers/linear.py, layers/moe.py).

    `quant` names one format for every linear (CeleryTPError "bad_request" if it is not a weight
    format). None keeps each GGUF tensor's own type (a Q4_K_M file stays q4_k + q6_k), or plain
    weights when no linear is stored in a block format.
    """
    if quant is None:
        plan = QuantPlan() if _file_has_blocks(checkpoint) else None
    else:
        fmt = parse_quant(quant)
        plan = None if fmt.float_dtype == dtype else QuantPlan(fmt)  # f32 on a float32 load: the plain model
    return plan


def plan_name(plan: QuantPlan | None, model: nn.Module | None = None) -> str | None:
    """The load reply's `quant`: the target format, or for a kept GGUF the types its linears
    ended up in, most bytes first ("q4_k+q6_k+q5_0"); None for plain weights."""
    if plan is None or plan.target is not None or model is None:
        return None if plan is None else plan.target.name if plan.target else "gguf"
    types = quant_summary(model)[0]
    return "+".join(sorted(types, key=lambda t: -types[t]["bytes"])) or None


def embedding_plan(
    quant: QuantPlan | None, file_type: GGMLQuantizationType | None, tied: bool
) -> QuantPlan | None:
    """How a load keeps the token embedding (None: plain, in the compute dtype).

    Quantized loads keep it quantized, never in a tiled int4 format (row lookups): a block
    `quant` target becomes q8_0 (its int8 kernel runs a tied LM head), a float target stays that
    float; a kept GGUF keeps the file's type (SmolLM2's Q4_1 file ships token_embd in Q8_0), q4
    types as q8_0, and a float one plain. An untied embedding is only looked up, so it keeps the
    exact layout of its blocks. Rows that are not whole blocks fall back as the linears' do.
    """
    if quant is None:
        return None
    target = quant.target
    if target is None and (file_type is None or file_type in _FLOAT_TYPES):
        return None
    if target is not None and target.float_dtype is None:
        target = QuantFormat.of("q8_0")
    return QuantPlan(target, row_lookup=True, exact=not tied)


def _file_has_blocks(checkpoint: Checkpoint) -> bool:
    """Whether some linear weight is stored in a block format (a GGUF quant type)."""
    for name in checkpoint.names():
        if name.endswith(_LINEAR_SUFFIXES):
            qtype = checkpoint.source(name).ggml_type
            if qtype is not None and qtype not in _FLOAT_TYPES:
                return True
    return False


def mlp_block(checkpoint_block: int, fmt: QuantPlan | QuantFormat | None, intermediate: int = 0, world: int = 1) -> int:
    """Where MLP shards start: on both the file's blocks and the target format's when the
    intermediate size splits so, else the file's, else 32 (slices that cut blocks fall back)."""
    target = fmt.target if isinstance(fmt, QuantPlan) else fmt
    wanted = checkpoint_block if target is None else math.lcm(checkpoint_block, target.block_size)
    for block in (wanted, checkpoint_block, 32):
        if not intermediate or (intermediate % block == 0 and intermediate // block >= world):
            return block
    return 1


def finish_loading(model: nn.Module) -> None:
    """Convert every staged quantized weight into its kernel layout (after all shards loaded)."""
    from celerytp.layers.quantized import QuantizedWeight

    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            module.finish_loading()


def quant_summary(model: nn.Module) -> tuple[dict[str, dict[str, int]], list[str]]:
    """This rank's kept formats: {type: {"tensors": n, "bytes": b}} over checkpoint tensors, and
    the fallbacks taken ("<tensor>: q4_k -> q5_0 (why)")."""
    from celerytp.layers.quantized import QuantizedWeight

    tensors: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    fallbacks: list[str] = []
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            fallbacks += module.fallbacks
            for name, names, size in module.summary():
                tensors[name] += len(names)
                nbytes[name] += size
    return {t: {"tensors": tensors[t], "bytes": nbytes[t]} for t in sorted(tensors)}, sorted(set(fallbacks))
