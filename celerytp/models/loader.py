"""load_model: open a checkpoint, build this rank's shard, read only its slices, check names."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.model_files import read_json_object
from celerytp.core.switches import check_switches
from celerytp.distributed.tp import TPContext
from celerytp.layers.cuda_blas import hold_cublas_to_one_order
from celerytp.layers.packed_linear import pack_linears
from celerytp.loading import Checkpoint, open_checkpoint
from celerytp.loading.gguf_mmproj import MmprojCheckpoint, open_with_mmproj
from celerytp.models.architectures import architecture, config_from_hf
from celerytp.models.base import BuildOptions, CausalLM, Progress
from celerytp.models.compiled import compile_decode, compile_requested
from celerytp.models.config import ModelConfig
from celerytp.models.hybrid_config import HybridConfig
from celerytp.models.kv_budget import DEFAULT_KV_MEMORY_FRACTION, check_context, fit_context, memory_budget
from celerytp.quant.formats import QuantPlan
from celerytp.quant.plan import embedding_plan, finish_loading, mlp_block, plan_name, resolve_quant

log = logging.getLogger(__name__)


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
    kv_cache_bytes: int | None = None,
    kv_memory_fraction: float | None = None,
    kv_dtype: torch.dtype | None = None,
    prepare: bool = True,
    mmproj: str | os.PathLike[str] | None = None,
) -> CausalLM:
    """Load this rank's shard of the model at `path` (HF directory or .gguf file), and with
    `prepare`, make it ready to decode (`prepare_decode`; a rank worker calls that itself once
    every rank has read its shard, since compiling decode runs collectives).

    The KV cache holds max_batch + 1 rows (step mode has its own) of max_context positions,
    stored in `kv_dtype` (default: the compute dtype), within `kv_cache_bytes` per rank, or where
    that is unset within `kv_memory_fraction` (default DEFAULT_KV_MEMORY_FRACTION) of the memory
    free once the weights are in: an unset max_context is the largest that fits, up to the model's
    default; a set one that does not fit is refused (models/kv_budget.py).

    Raises CeleryTPError(ErrorKind.UNSUPPORTED_ARCH) for paths and architectures we cannot run and
    CeleryTPError(ErrorKind.LOAD_FAILED) for broken checkpoints or impossible splits. `quant` names the
    ggml format to keep linears in (CeleryTPError(ErrorKind.BAD_REQUEST) if it is not one); None keeps
    each GGUF tensor's own type (see celerytp/quant/plan.py) and leaves others float. `mmproj`:
    llama.cpp's mmproj file of a gemma3 or qwen2vl .gguf's vision tower, loaded with it (loading/gguf_mmproj.py).
    """
    check_switches()  # a mistyped CELERYTP_COMPILE or CELERYTP_PACK_LINEARS: fails before any weight is read
    if torch.device(device).type == "cuda":
        hold_cublas_to_one_order()  # a rank's first product is its load's: cuBLAS reads some of this once
    opened = open_checkpoint(path) if mmproj is None else open_with_mmproj(path, mmproj)
    with opened as checkpoint, torch.inference_mode():
        config = config_from_hf(checkpoint.hf_config)
        if isinstance(checkpoint, MmprojCheckpoint):  # its image processor's settings are the mmproj's
            config = checkpoint.with_vision(config)
        else:
            config = with_image_processor(config, checkpoint.path)
        plan = resolve_quant(quant, checkpoint, dtype)
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        check_context(config, max_context)
        # a budget in bytes sizes the cache now; else one position until the weights are in
        context = 1 if kv_cache_bytes is None else fit_context(
            config, tp.world_size, kv_dtype, max_batch, max_context, kv_cache_bytes)
        model = build_model(
            config, checkpoint, tp, dtype=dtype, device=device, max_context=context, max_batch=max_batch, quant=plan,
            kv_dtype=kv_dtype,
        )
        loaded = model.load_weights(checkpoint, progress)
        tensors = len(checkpoint.names())
        finish_loading(model)
        model.quant = plan_name(plan, model)  # the load reply's `quant`
        not_loaded = sorted(set(model.checkpoint_table()) - loaded)
        if not_loaded:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"missing: {not_loaded}; unexpected: []")
    if kv_cache_bytes is None:
        fraction = DEFAULT_KV_MEMORY_FRACTION if kv_memory_fraction is None else kv_memory_fraction
        budget = memory_budget(model.device, fraction, tp.world_size)
        model.resize_context(fit_context(config, tp.world_size, kv_dtype, max_batch, max_context, budget,
                                         f"kv_memory_fraction {fraction} of the memory free after the weights"))
    model.eval()
    if prepare:
        prepare_decode(model, None if progress is None else lambda what: progress(tensors, tensors, what))
    return model


def with_image_processor(config: ModelConfig | HybridConfig, path: str | os.PathLike[str]) -> ModelConfig | HybridConfig:
    """A vision-language config as served: with its vision tower and its image processor's
    settings where the checkpoint ships one (preprocessor_config.json); a gemma3 without one is
    served as text (its tower skipped, as before images were taken), another is refused."""
    vision = getattr(config, "vision_config", None)
    processor = Path(path) / "preprocessor_config.json"
    if vision is None:
        return config
    if processor.is_file():
        return replace(config, image_processor=read_json_object(processor))
    if config.model_type == "gemma3":
        log.info("%s ships no image processor (preprocessor_config.json): served as a text model", path)
        return replace(config, vision_config=None)
    raise CeleryTPError(ErrorKind.LOAD_FAILED, f"{config.model_type}: no image processor (preprocessor_config.json) "
                                               "beside the checkpoint")


def prepare_decode(model: CausalLM, progress: Callable[[str], None] | None = None) -> None:
    """Compile decode where asked (now, not in the first request's step: a warm-up decode, whose
    collectives every rank must meet) and pack the float linears for oneDNN."""
    compiled = compile_requested(model) and compile_decode(model, progress)
    # After compiling: the layers compiled decode traces keep their plain weights (packed_linear.py).
    pack_linears(model, exclude=model.model.layers if compiled else None)


def build_model(
    config: ModelConfig | HybridConfig,
    checkpoint: Checkpoint,
    tp: TPContext,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    max_context: int,
    max_batch: int = 1,
    quant: QuantPlan | None = None,
    kv_dtype: torch.dtype | None = None,
) -> CausalLM:
    """Allocate this rank's (uninitialised) shard; `checkpoint` only tells its quant blocks. The KV
    cache holds max_batch + 1 rows (step mode has its own) of max_context positions in `kv_dtype`
    (default: the compute dtype)."""
    model_cls = architecture(config.model_type).model_cls
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    options = BuildOptions(
        tp=tp,
        dtype=dtype,
        kv_dtype=kv_dtype,
        device=torch.device(device),
        max_context=max_context,
        max_batch=max_batch,
        mlp_block=mlp_block(_mlp_block(checkpoint, config), quant, getattr(config, "intermediate_size", 0), tp.world_size),
        quant=quant,
        embedding_quant=embedding_plan(quant, _embedding_type(checkpoint), config.tie_word_embeddings),
    )
    return model_cls(config, options)


def _embedding_type(checkpoint: Checkpoint) -> GGMLQuantizationType | None:
    """The ggml type the file stores the token embedding in (None: not a GGUF tensor)."""
    name = "model.embed_tokens.weight"
    return checkpoint.source(name).ggml_type if name in checkpoint.names() else None


def _mlp_block(checkpoint: Checkpoint, config: ModelConfig | HybridConfig) -> int:
    """The largest quant block along down_proj's input columns (1 when unquantized)."""
    names = set(checkpoint.names())
    blocks = [
        checkpoint.source(name).column_block()
        for i in range(config.num_layers)
        if (name := f"model.layers.{i}.mlp.down_proj.weight") in names
    ]
    return max(blocks, default=1)
