"""load_model: open a checkpoint, build this rank's shard, read only its slices, check names."""

from __future__ import annotations

import os

import torch

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.distributed.tp import TPContext
from celerytp.loading import Checkpoint, open_checkpoint
from celerytp.models.base import BuildOptions, CausalLM, Progress
from celerytp.models.config import ModelConfig
from celerytp.models.hybrid_config import HybridConfig, config_from_hf
from celerytp.models.llama import LlamaForCausalLM
from celerytp.models.qwen3 import Qwen3ForCausalLM
from celerytp.models.qwen3_next import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM
from celerytp.quant.formats import QuantFormat
from celerytp.quant.plan import finish_loading, mlp_block, resolve_quant

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5": Qwen3_5ForCausalLM,
    "qwen3_5_text": Qwen3_5ForCausalLM,
    "qwen3_5_moe": Qwen3_5MoeForCausalLM,
    "qwen3_5_moe_text": Qwen3_5MoeForCausalLM,
}


def load_model(
    path: str | os.PathLike[str],
    tp: TPContext,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_context: int | None = None,
    max_batch: int = 1,
    progress: Progress | None = None,
    quant: str | None = None,
) -> CausalLM:
    """Load this rank's shard of the model at `path` (HF directory or .gguf file).

    Raises CeleryTPError(ErrorKind.UNSUPPORTED_ARCH) for paths and architectures we cannot run and
    CeleryTPError(ErrorKind.LOAD_FAILED) for broken checkpoints or impossible splits. `quant` names the
    ggml format to keep linears in (CeleryTPError(ErrorKind.BAD_REQUEST) if unknown or not executable);
    None keeps a GGUF file's own type (see celerytp/quant/plan.py) and leaves others float.
    """
    with open_checkpoint(path) as checkpoint, torch.inference_mode():
        config = config_from_hf(checkpoint.hf_config)
        fmt = resolve_quant(quant, checkpoint, config.model_type, dtype)
        model = build_model(
            config, checkpoint, tp, dtype=dtype, device=device, max_context=max_context, max_batch=max_batch, quant=fmt
        )
        loaded = model.load_weights(checkpoint, progress)
        finish_loading(model)
        not_loaded = sorted(set(model.checkpoint_table()) - loaded)
        if not_loaded:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"missing: {not_loaded}; unexpected: []")
    return model.eval()


def build_model(
    config: ModelConfig | HybridConfig,
    checkpoint: Checkpoint,
    tp: TPContext,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    max_context: int | None,
    max_batch: int = 1,
    quant: QuantFormat | None = None,
) -> CausalLM:
    """Allocate this rank's (uninitialised) shard; `checkpoint` only tells its quant blocks."""
    model_cls = MODEL_REGISTRY.get(config.model_type)
    if model_cls is None:
        raise CeleryTPError(ErrorKind.UNSUPPORTED_ARCH, f"model_type {config.model_type!r} has no implementation")
    if max_context is None:
        max_context = config.default_max_context
    if not 1 <= max_context <= config.max_position_embeddings:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"max_context {max_context} must be within 1..max_position_embeddings {config.max_position_embeddings}",
        )
    options = BuildOptions(
        tp=tp,
        dtype=dtype,
        device=torch.device(device),
        max_context=max_context,
        max_batch=max_batch,
        mlp_block=mlp_block(_mlp_block(checkpoint, config), quant),
        quant=quant,
    )
    return model_cls(config, options)


def _mlp_block(checkpoint: Checkpoint, config: ModelConfig | HybridConfig) -> int:
    """The largest quant block along down_proj's input columns (1 when unquantized)."""
    names = set(checkpoint.names())
    blocks = [
        checkpoint.source(name).column_block()
        for i in range(config.num_layers)
        if (name := f"model.layers.{i}.mlp.down_proj.weight") in names
    ]
    return max(blocks, default=1)
