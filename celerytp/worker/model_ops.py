"""Model ops on a rank: load (all ranks or none), step, clear the KV cache, unload."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from celerytp.core import protocol as p
from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.keys import load_progress_key
from celerytp.core.model_files import default_model_path
from celerytp.core.read_deadline import read_deadline
from celerytp.core.registry import LOAD_FIELDS, model_record
from celerytp.core.sampling import SamplingParams
from celerytp.core.tokenizer import Tokenizer, load_tokenizer
from celerytp.core.validation import bad_request, check_logit_bias, check_tokens, refuse_step_penalties, sampling_params
from celerytp.models import CausalLM, load_model
from celerytp.models.compiled import rejoin_decode
from celerytp.models.half_precision import check_half_precision
from celerytp.models.loader import prepare_decode
from celerytp.quant.plan import quant_summary
from celerytp.worker.heap import mapped_weights, release_memory
from celerytp.worker.image_features import image_features
from celerytp.worker.loaded_model import LoadedModel
from celerytp.worker.sampling import (
    SLICE_DRAW,
    RowSampler,
    draw_over_shards,
    sample_rows,
    slice_mode,
    token_logprob,
    top_logprobs,
)
from celerytp.worker.state import RankState, rss_bytes

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def confine(path: str, roots: tuple[str, ...], field: str = "path") -> Path:
    """Resolve `path` (the load request's `field`); it, and every file in it that a load may open
    (symlinks resolved), must lie under a configured model root or be the default model."""
    if "\x00" in path:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field '{field}': a NUL byte is not allowed in a path")
    real = Path(path).expanduser().resolve()
    allowed = [Path(r).expanduser().resolve() for r in roots]
    try:
        allowed.append(Path(default_model_path()).resolve().parent)
    except CeleryTPError:
        pass

    def inside(p: Path) -> bool:
        return any(p == root or root in p.parents for root in allowed)

    if not inside(real):  # the roots go to this rank's log only: a refusal never tells a caller where they are
        log.warning("refused to load %s: outside the model roots %s", path, [str(r) for r in allowed])
        raise CeleryTPError(ErrorKind.BAD_REQUEST,
                            f"field '{field}': {path} is outside the model roots this server allows")
    if real.is_dir():
        for entry in real.iterdir():
            if not inside(entry.resolve()):
                raise CeleryTPError(
                    ErrorKind.BAD_REQUEST, f"field '{field}': {entry.name} in {path} links outside the model roots"
                )
    return real


class ProgressReporter:
    """Publishes this rank's load progress to Redis (throttled) and the log."""

    def __init__(self, state: RankState, model_id: str):
        self._redis = state.redis
        self._key = load_progress_key(state.config.group, model_id)
        self._rank = str(state.rank)
        self._last = 0.0
        self._logged_tenth = -1
        self._total = 1

    def stage(self, name: str) -> None:
        """A step after the tensors (compiling decode): the bar full, the step named."""
        self(self._total, self._total, name)

    def __call__(self, done: int, total: int, name: str) -> None:
        self._total = total
        now = time.monotonic()
        if done == total or now - self._last > 0.2:
            self._last = now
            self._redis.hset(self._key, self._rank, json.dumps({"done": done, "total": total, "name": name}))
            self._redis.expire(self._key, 3600)
        tenth = done * 10 // max(total, 1)
        if tenth != self._logged_tenth:
            self._logged_tenth = tenth
            log.info("loading: %d/%d tensors (%s)", done, total, name)


def model_entry(state: RankState, model_id: str) -> LoadedModel:
    entry = state.models.get(model_id)
    if entry is None:
        raise CeleryTPError(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded (loaded: {sorted(state.models)})")
    return entry


def serving_tokenizer(path: Path) -> Tokenizer | None:
    """The tokenizer rank 0 serves a model with (stop strings), checked at load: a corrupt one, or
    a chat template that does not render, fails the load. None for a checkpoint that ships no
    tokenizer at all: it is served by token ids (requests with stop strings are refused)."""
    if not _has_tokenizer_files(path):
        return None  # nothing to read (no heavy transformers fallback tried for a checkpoint without one)
    try:
        tokenizer = load_tokenizer(path)
    except CeleryTPError as exc:
        raise CeleryTPError(ErrorKind.LOAD_FAILED, f"tokenizer: {exc.message}") from None
    if tokenizer.chat_template:
        try:
            tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
        except CeleryTPError as exc:
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"chat template: {exc.message}") from None
    return tokenizer


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _has_tokenizer_files(path: Path) -> bool:
    return path.is_file() or any((path / name).exists() for name in _TOKENIZER_FILES) or any(path.glob("*.gguf"))


def _load_failure(request: p.LoadRequest, exc: Exception) -> CeleryTPError:
    if isinstance(exc, CeleryTPError):
        return exc
    log.error("load of %s failed", request.model_id, exc_info=exc)
    return CeleryTPError(ErrorKind.LOAD_FAILED, f"{type(exc).__name__}: {exc}")


def _agree(state: RankState, failure: CeleryTPError | None) -> None:
    """One agreement of every rank on the control group: raises this rank's `failure`, or (the
    others failed) load_failed naming theirs, or the group's own failure."""
    try:
        state.collective(lambda: state.control.agree(failure))
    except CeleryTPError as exc:
        if failure is None and exc.kind not in (ErrorKind.RANK_LOST, ErrorKind.TIMEOUT):
            raise CeleryTPError(ErrorKind.LOAD_FAILED, f"rolled back: {exc.message}") from None
        raise


def _agree_on_context(state: RankState, model: CausalLM) -> None:
    """Every rank takes the smallest max_context of the group's: a cache sized from each rank's own
    free memory (models/kv_budget.py) may hold more positions on one, and the ranks must refuse
    a request alike."""
    least = int(state.collective(lambda: state.control.all_reduce(torch.tensor([model.max_context]), "min"))[0])
    if least < model.max_context:
        model.resize_context(least)


READY_WAIT_S = 1800.0  # ranks wait this long for each other's shards before committing a load (the leader's own limit)


def load(state: RankState, request: p.LoadRequest) -> p.Loaded:
    started = time.monotonic()
    progress = ProgressReporter(state, request.model_id)
    entry = _kept(state, request)
    kept = entry is not None
    if kept:  # a heal: the shards are here already, this rank meets the others' collectives
        entry.forget_all()  # the broken group's requests resume by a prefill of their tokens
        failure = None
    else:
        entry, failure = _read(state, request, progress)
    # All ranks or none: every rank read its shard before any compiles decode (its warm-up runs
    # collectives a rank that failed would never meet), and every rank is ready before any commits.
    try:
        state.collective(lambda: state.control.wait_for_all(READY_WAIT_S))
        _agree(state, failure)
        _agree_on_context(state, entry.model)  # a collective: its failure is the group's, not this load's
        try:
            if kept:
                rejoin_decode(entry.model, progress.stage)
            else:
                with mapped_weights():
                    prepare_decode(entry.model, progress.stage)
        except Exception as exc:  # noqa: BLE001
            failure = _load_failure(request, exc)
        _agree(state, failure)
    except CeleryTPError:
        state.models.pop(request.model_id, None)  # a kept model too: a load leaves every rank or none holding it
        del entry
        release_memory()
        raise
    finally:
        state.redis.delete(load_progress_key(state.config.group, request.model_id))
    if kept:
        log.info("model %s: kept its weights in the new group %s (not read again)", request.model_id, state.comm_id)
    model = entry.model
    config = model.config
    decode = "compiled" if getattr(model.model, "decode_runs", None) else "eager"
    dtype_name = _dtype_name(state, request)
    entry.record = model_record(
        request.model_dump(include=set(LOAD_FIELDS)), dtype=dtype_name, model_type=config.model_type,
        vocab_size=config.vocab_size, max_context=model.max_context, max_batch=model.max_batch, decode=decode,
        batch_invariant=model.batch_invariant, attention=model.attention,
    )
    memory = model.memory_report()
    entry.memory = {"weights": memory["sharded_bytes"] + memory["replicated_bytes"], "kv_cache": memory["kv_cache_bytes"]}
    state.models[request.model_id] = entry
    release_memory()  # dequantization temporaries: give the heap back before reporting RSS
    quant_types, fallbacks = quant_summary(model)
    return p.Loaded(
        rank=state.rank, model_id=request.model_id, model_type=config.model_type, dtype=dtype_name,
        quant=model.quant, quant_types=quant_types, quant_fallbacks=fallbacks, decode=decode,
        batch_invariant=model.batch_invariant, attention=model.attention,
        vocab_size=config.vocab_size, max_context=model.max_context, max_batch=model.max_batch,
        prefill_budget=request.prefill_budget, idle_s=request.idle_s, num_layers=config.num_layers,
        sharded_bytes=memory["sharded_bytes"], replicated_bytes=memory["replicated_bytes"],
        kv_cache_bytes=memory["kv_cache_bytes"], rss_bytes=rss_bytes(), load_s=round(time.monotonic() - started, 3),
        kept=kept,
    )


def _dtype_name(state: RankState, request: p.LoadRequest) -> str:
    return request.dtype or ("bfloat16" if state.device.type == "cuda" else "float32")


def _read(
    state: RankState, request: p.LoadRequest, progress: ProgressReporter,
) -> tuple[LoadedModel | None, CeleryTPError | None]:
    """This rank's shard read from the files, or the failure that kept it from being read."""
    dtype = DTYPES[_dtype_name(state, request)]
    try:
        path, mmproj = _model_files(state, request)
        check_half_precision(dtype, state.device)
        with read_deadline(request.read_deadline_s), mapped_weights():
            # rank 0 detokenizes: a model is loaded only if it can serve
            tokenizer = serving_tokenizer(path) if state.rank == 0 else None
            model = load_model(
                path, state.tp, dtype=dtype, device=state.device,
                max_context=request.max_context, max_batch=request.max_batch,
                progress=progress,
                quant=request.quant, kv_cache_bytes=request.kv_cache_bytes, kv_memory_fraction=request.kv_memory_fraction,
                kv_dtype=DTYPES[request.kv_dtype] if request.kv_dtype else None, prepare=False, mmproj=mmproj,
            )
            images = image_features(path, model, mmproj)
        entry = LoadedModel(model, str(path), prefill_budget=request.prefill_budget, idle_s=request.idle_s,
                            tokenizer=tokenizer, images=images, source=source_stamp(path, mmproj))
        return entry, None
    except Exception as exc:  # noqa: BLE001 - a broken file must not take the worker down
        return None, _load_failure(request, exc)


def _kept(state: RankState, request: p.LoadRequest) -> LoadedModel | None:
    """The model this rank holds under the request's id, when a `keep` load may keep it: loaded
    with the same settings, from files unchanged since. A held model that differs is dropped
    (read again); a plain load of a held model is refused."""
    entry = state.models.get(request.model_id)
    if entry is None:
        return None
    if not request.keep:
        raise CeleryTPError(ErrorKind.ALREADY_LOADED, f"model id {request.model_id!r} is already loaded")
    try:
        same = (entry.record.get("load") == request.model_dump(include=set(LOAD_FIELDS))
                and entry.source == source_stamp(*_model_files(state, request)))
    except (CeleryTPError, OSError):
        same = False  # read afresh: that load reports what is wrong
    if same:
        return entry
    log.warning("model %s changed since this rank loaded it (its settings or files): reading it again", request.model_id)
    del state.models[request.model_id], entry
    release_memory()
    return None


def _model_files(state: RankState, request: p.LoadRequest) -> tuple[Path, Path | None]:
    """The request's model path and mmproj, each confined to the model roots (`confine`)."""
    roots = state.config.model_roots
    return confine(request.path, roots), None if request.mmproj is None else confine(request.mmproj, roots, "mmproj")


def source_stamp(path: Path, mmproj: Path | None) -> list[list]:
    """Each file a load reads (a directory's entries), with its size and modification time: a
    kept shard is only as good as the files it was read from."""
    files = sorted(path.iterdir()) if path.is_dir() else [path]
    files += [mmproj] if mmproj is not None else []
    stats = [(f, f.stat()) for f in files if f.is_file()]
    return [[str(f), st.st_size, st.st_mtime_ns] for f, st in stats]


def _check_step(entry: LoadedModel, request: p.StepRequest) -> SamplingParams:
    """Refuse what would corrupt the cache; the same checks give the same answer on every rank."""
    model = entry.model
    if request.offset not in (0, model.cache_len):
        raise bad_request(
            "offset", f"{request.offset} does not match the {model.cache_len} tokens in the KV cache (0 starts over)"
        )
    check_tokens(
        request.tokens, max_context=model.max_context, vocab_size=model.config.vocab_size, field="tokens",
        offset=request.offset,
    )
    params = sampling_params(request.sampling)
    check_logit_bias(params, model.config.vocab_size)
    refuse_step_penalties(params)
    return params


def step(state: RankState, request: p.StepRequest) -> p.StepResult:
    entry = model_entry(state, request.model_id)
    params = _check_step(entry, request)
    model = entry.model
    if request.offset == 0:
        entry.reset_sequence()
    tokens = torch.tensor(request.tokens, dtype=torch.long, device=state.device)
    started = time.perf_counter()
    logits = state.run_model(lambda: model.forward_tokens(tokens, request.offset, last_only=True))  # (1, vocab)
    reply = p.StepResult(
        rank=state.rank, model_id=request.model_id, cache_len=model.cache_len, compute_s=time.perf_counter() - started
    )
    if state.rank != 0:
        return reply
    sampler = entry.step_sampler
    if sampler is None or sampler.params != params:  # a new sequence, or new parameters: start over
        sampler = entry.step_sampler = RowSampler.create(params, model.config.vocab_size, entry.history)
        entry.step_draws = 0
    entry.history.extend(request.tokens)
    for token in request.tokens:
        sampler.saw(token)
    if not request.sample:
        return reply
    last = logits[-1].float()  # (vocab,)
    if slice_mode(params) == SLICE_DRAW:  # as the serving loop draws it, so both modes agree
        token = draw_over_shards(last[None].cpu(), [sampler], [entry.step_draws], model.lm_head.shards)[0]
    else:
        token = sample_rows(last[None], [sampler])[0]
    entry.step_draws += 1
    return reply.model_copy(
        update={
            "token": token,
            "token_logprob": token_logprob(last, token),
            "top_logprobs": top_logprobs(last, params.logprobs) if params.logprobs else None,
            "logits": last.cpu().tolist() if request.return_logits else None,
        }
    )


def clear_kv_cache(state: RankState, request: p.ClearKVCacheRequest) -> p.Cleared:
    entry = model_entry(state, request.model_id)
    entry.forget_all()
    return p.Cleared(rank=state.rank, model_id=request.model_id)


def unload(state: RankState, request: p.UnloadRequest) -> p.Unloaded:
    model_entry(state, request.model_id)
    del state.models[request.model_id]
    release_memory()
    return p.Unloaded(rank=state.rank, model_id=request.model_id, rss_bytes=rss_bytes())
