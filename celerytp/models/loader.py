"""load_model: open a checkpoint, build this rank's shard, read only its slices, check names."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from gguf import GGMLQuantizationType

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.switches import check_switches
from celerytp.distributed.tp import TPContext
from celerytp.layers.packed_linear import pack_linears
from celerytp.layers.partition import split_heads, split_linear_heads
from celerytp.layers.rotary import scaled_context
from celerytp.loading import Checkpoint, open_checkpoint
from celerytp.models.architectures import architecture, config_from_hf
from celerytp.models.base import BuildOptions, CausalLM, Progress
from celerytp.models.compiled import compile_decode, compile_requested
from celerytp.models.config import ModelConfig
from celerytp.models.hybrid_config import HybridConfig
from celerytp.quant.formats import QuantPlan
from celerytp.quant.plan import embedding_plan, finish_loading, mlp_block, plan_name, resolve_quant

DEFAULT_KV_CACHE_BYTES = 2 << 30  # per rank; on CPU only the pages rows write become resident

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
    kv_dtype: torch.dtype | None = None,
    prepare: bool = True,
) -> CausalLM:
    """Load this rank's shard of the model at `path` (HF directory or .gguf file), and with
    `prepare`, make it ready to decode (`prepare_decode`; a rank worker calls that itself once
    every rank has read its shard, since compiling decode runs collectives).

    Raises CeleryTPError(ErrorKind.UNSUPPORTED_ARCH) for paths and architectures we cannot run and
    CeleryTPError(ErrorKind.LOAD_FAILED) for broken checkpoints or impossible splits. `quant` names the
    ggml format to keep linears in (CeleryTPError(ErrorKind.BAD_REQUEST) if it is not one); None keeps
    each GGUF tensor's own type (see celerytp/quant/plan.py) and leaves others float.
    """
    check_switches()  # a mistyped CELERYTP_COMPILE or CELERYTP_PACK_LINEARS: fails before any weight is read
    with open_checkpoint(path) as checkpoint, torch.inference_mode():
        config = config_from_hf(checkpoint.hf_config)
        plan = resolve_quant(quant, checkpoint, dtype)
        model = build_model(
            config, checkpoint, tp, dtype=dtype, device=device, max_context=max_context, max_batch=max_batch, quant=plan,
            kv_cache_bytes=kv_cache_bytes, kv_dtype=kv_dtype,
        )
        loaded = model.load_weights(checkpoint, progress)
        tensors = len(checkpoint.names())
        finish_loading(model)
        model.quant = plan_name(plan, model)  # the load reply's `quant`
        not_loaded = sorted(set(model.checkpoint_table()) - loaded)
        if not_loaded:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"missing: {not_loaded}; unexpected: []")
    model.eval()
    if prepare:
        prepare_decode(model, None if progress is None else lambda what: progress(tensors, tensors, what))
    return model


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
    max_context: int | None,
    max_batch: int = 1,
    quant: QuantPlan | None = None,
    kv_cache_bytes: int | None = None,
    kv_dtype: torch.dtype | None = None,
) -> CausalLM:
    """Allocate this rank's (uninitialised) shard; `checkpoint` only tells its quant blocks.

    The KV cache holds max_batch + 1 rows (step mode has its own) of max_context positions
    within `kv_cache_bytes` per rank (default DEFAULT_KV_CACHE_BYTES), stored in `kv_dtype`
    (default: the compute dtype): an unset max_context is the largest that fits, up to the
    model's default; a set one that does not fit is refused.
    """
    model_cls = architecture(config.model_type).model_cls
    kv_dtype = dtype if kv_dtype is None else kv_dtype
    max_context = fit_context(config, tp.world_size, kv_dtype, max_batch, max_context, kv_cache_bytes)
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


def kv_bytes_per_position(config: ModelConfig | HybridConfig, world_size: int, dtype: torch.dtype) -> int:
    """KV cache bytes one position of one row costs on the rank holding the most KV heads."""
    if isinstance(config, HybridConfig):  # its linear heads' split is checked first, as the model would
        for rank in range(world_size):
            split_linear_heads(rank, world_size, config.linear_num_value_heads, config.linear_num_key_heads)
    attention_layers = config.num_layers - getattr(config, "num_linear_layers", 0)
    kv_heads = max(split_heads(r, world_size, config.num_heads, config.num_kv_heads).kv_count for r in range(world_size))
    return attention_layers * 2 * kv_heads * config.head_dim * torch.empty((), dtype=dtype).element_size()


def fit_context(
    config: ModelConfig | HybridConfig,
    world_size: int,
    dtype: torch.dtype,
    max_batch: int,
    max_context: int | None,
    budget: int | None,
) -> int:
    """The KV cache's positions per row: as asked if it fits the budget, else the most that fits."""
    budget = DEFAULT_KV_CACHE_BYTES if budget is None else budget
    rows = max_batch + 1
    per_position = max(1, kv_bytes_per_position(config, world_size, dtype)) * rows
    fits = budget // per_position
    if max_context is None:
        max_context = min(config.default_max_context, fits)
        if max_context < 1:
            raise CeleryTPError(
                ErrorKind.LOAD_FAILED,
                f"the KV cache budget of {budget} bytes holds no position of {rows} rows ({per_position} bytes each)",
            )
    limit = scaled_context(config.rope, config.max_position_embeddings)
    if not 1 <= max_context <= limit:
        extended = f", extended by its {config.rope.rope_type} rope scaling" if limit > config.max_position_embeddings else ""
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"max_context {max_context} must be within 1..{limit} (max_position_embeddings"
            f" {config.max_position_embeddings}{extended})",
        )
    if max_context > fits:
        raise CeleryTPError(
            ErrorKind.LOAD_FAILED,
            f"a KV cache of {rows} rows x {max_context} positions needs {max_context * per_position >> 20}"
            f" MiB per rank, over the budget of {budget >> 20} MiB: lower max_batch or max_context,"
            f" or raise kv_cache_bytes (at most {fits} positions fit)",
        )
    return max_context


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
