"""Wire protocol between the leader and the rank workers: typed, validated JSON messages.

Every request is a JSON object with `op` and `seq`; every reply is a JSON object with
`type`. Failures are `error{kind, message, rank}` replies, never exceptions on the wire.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from celerytp.core.errors import CeleryTPError, ErrorKind
from celerytp.core.read_deadline import DEFAULT_READ_DEADLINE_S


class Message(BaseModel):
    """Strict JSON object: unknown fields and wrong types are refused, never coerced."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


M = TypeVar("M", bound=Message)


Seq = Annotated[int, Field(ge=1)]
ModelId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/-]+$")]


# ---- requests -------------------------------------------------------------------------


Epoch = Annotated[str, Field(max_length=64, pattern=r"^[A-Za-z0-9_-]*$")]


class Request(Message):
    """`seq` orders ops within an `epoch` (the group's sequence counter's life); a rank that sees a
    new epoch starts counting again, so a lost counter or one bogus number never blocks a rank."""

    op: str
    seq: Seq
    epoch: Epoch = ""


class PingRequest(Request):
    op: Literal["ping"] = "ping"


class InitRequest(Request):
    op: Literal["init"] = "init"
    comm_id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0


class SanityCheckRequest(Request):
    op: Literal["sanity_check"] = "sanity_check"


class ShutdownRequest(Request):
    op: Literal["shutdown"] = "shutdown"


DType = Literal["float32", "bfloat16", "float16"]
MAX_STOP_CHARS = 4096  # each stop string on the wire (a server may take less: server/limits.py)
TokenList = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=1 << 17)]


class LoadRequest(Request):
    op: Literal["load"] = "load"
    model_id: ModelId
    path: Annotated[str, Field(min_length=1, max_length=4096)]
    # llama.cpp's mmproj file of a gemma3 or qwen2vl .gguf (its vision tower), confined to the model roots as `path`
    mmproj: Annotated[str, Field(min_length=1, max_length=4096)] | None = None
    dtype: DType | None = None  # None: bfloat16 on CUDA, float32 on CPU
    max_context: Annotated[int, Field(ge=1, le=1 << 20)] | None = None
    max_batch: Annotated[int, Field(ge=1, le=256)] = 16  # sequences served at once (KV cache rows)
    quant: Annotated[str, Field(min_length=1, max_length=16)] | None = None  # ggml type name; None: keep the file's
    kv_cache_bytes: Annotated[int, Field(ge=1)] | None = None  # KV cache budget per rank; None: from memory
    # None: models/kv_budget.py DEFAULT_KV_MEMORY_FRACTION of the memory free after the weights
    kv_memory_fraction: Annotated[float, Field(gt=0, le=1)] | None = None
    kv_dtype: DType | None = None  # the KV cache's dtype; None: the compute dtype
    prefill_budget: Annotated[int, Field(ge=1, le=1 << 16)] = 256  # prompt tokens per serving step
    idle_s: Annotated[float, Field(ge=0.01, le=600)] = 1.0  # a serving loop with no work ends after this
    max_queue: Annotated[int, Field(ge=1, le=1 << 20)] = 256  # leaders refuse requests past this many queued
    # one read of a model file (a tensor slice, a header, a small file) may take this long, or the
    # load fails (core/read_deadline.py)
    read_deadline_s: Annotated[float, Field(gt=0, le=3600)] = DEFAULT_READ_DEADLINE_S
    # A heal's reload (client/healer.py): a rank that holds this model, loaded with these same
    # settings from files unchanged since, keeps its shards instead of reading them again
    keep: bool = False


class StepRequest(Request):
    """One forward step. `offset` = tokens already in the model's KV cache; 0 starts a new sequence."""

    op: Literal["step"] = "step"
    model_id: ModelId
    tokens: TokenList
    offset: Annotated[int, Field(ge=0)]
    sampling: dict[str, Any] | None = None  # SamplingParams fields
    sample: bool = True  # False for prefill chunks before the last: no token, no RNG draw
    return_logits: bool = False  # full last-position logits (tests)


RequestId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


MAX_IMAGE_B64 = 64 << 20  # base64 characters of one image on the wire (the leader's limits are lower)


class GenSpec(Message):
    """One generation request, as a leader queues it for a model's serving loop (tokenized)."""

    request_id: RequestId
    prompt: TokenList
    max_tokens: Annotated[int, Field(ge=1, le=1 << 20)]
    sampling: dict[str, Any] | None = None
    stop: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=16)] = []
    eos_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=64)] = []
    stream: bool = False  # rank 0 XADDs each token to the request's stream (keys.stream_key)
    submitted_at: float = 0.0  # the leader's wall clock at submission (queue time in the result)
    queue_deadline: float = 0.0  # wall clock; taken later than this, it is answered `timeout` unrun
    # Set by the rank 0 that resumes a request whose earlier group failed under it: the tokens
    # already streamed to the client. The loop feeds them after the prompt and goes on from there.
    resumed: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1 << 20)] = []
    # Structured output (worker/grammar.py): {"json_schema": {...}} or {"lark": "..."}; rank 0
    # masks the row's logits to what the grammar allows. None: unconstrained.
    grammar: dict[str, Any] | None = None
    # The prompt tokens' log-probabilities, with this many alternatives per position (0..20);
    # None: not asked. Such a row is prefilled alone and cold (worker/serving.py `_prompt_scores`).
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # A vision-language model's images (core/images.py): each file's bytes in base64, in the
    # order of their runs of image tokens in `prompt`. Every rank decodes them itself.
    images: Annotated[list[Annotated[str, Field(max_length=MAX_IMAGE_B64)]], Field(max_length=64)] = []


LoopId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]


class ServeRequest(Request):
    """Run a model's serving loop: every rank in lockstep until the model's queue stays empty."""

    op: Literal["serve"] = "serve"
    model_id: ModelId
    loop_id: LoopId  # the running flag a leader set for this loop


class ClearKVCacheRequest(Request):
    op: Literal["clear_kv_cache"] = "clear_kv_cache"
    model_id: ModelId


class UnloadRequest(Request):
    op: Literal["unload"] = "unload"
    model_id: ModelId


# ---- replies --------------------------------------------------------------------------


class Reply(Message):
    type: str
    rank: Annotated[int, Field(ge=0)]


class Pong(Reply):
    type: Literal["pong"] = "pong"
    world_size: Annotated[int, Field(ge=1)]
    device: str
    comm_id: str | None = None
    rss_bytes: int = 0
    models: dict[str, dict[str, Any]] = {}  # model_id -> the load request that loaded it here
    group_broken: str | None = None  # why the process group broke while this worker lives (heal re-forms it)
    memory: dict[str, int] = {}  # bytes: free, total (the device's), weights, kv_cache, peak (worker/memory.py)


class InitOk(Reply):
    type: Literal["init_ok"] = "init_ok"
    comm_id: str
    backend: str


class SanityResult(Reply):
    type: Literal["sanity_result"] = "sanity_result"
    observed_sum: int


class Bye(Reply):
    type: Literal["bye"] = "bye"


class Loaded(Reply):
    type: Literal["loaded"] = "loaded"
    model_id: str
    model_type: str
    dtype: str
    quant: str | None = None  # the load's format for every linear, "gguf" (each tensor its file type), None: plain
    quant_types: dict[str, dict[str, int]] = Field(default_factory=dict)  # this rank: type -> {"tensors", "bytes"}
    quant_fallbacks: list[str] = Field(default_factory=list)  # "<tensor>: q4_k -> q5_0 (why)" on this rank
    decode: Literal["compiled", "eager"] = "eager"  # how decode steps run (CELERYTP_COMPILE, models/compiled.py)
    # a request's tokens do not depend on what is batched beside it (CELERYTP_BATCH_INVARIANT, docs/models.md)
    batch_invariant: bool = False
    attention: str = "sdpa"  # what attention runs on this rank (layers/invariant_attention.py `attention_kind`)
    vocab_size: int
    max_context: int
    max_batch: int
    prefill_budget: int = 256
    idle_s: float = 1.0
    num_layers: int
    sharded_bytes: int
    replicated_bytes: int
    kv_cache_bytes: int
    rss_bytes: int
    load_s: float
    kept: bool = False  # this rank kept the shards it held (a `keep` load) instead of reading them


class StepResult(Reply):
    type: Literal["step_result"] = "step_result"
    model_id: str
    cache_len: int
    compute_s: float = 0.0  # this rank's forward time
    token: int | None = None  # rank 0 only
    token_logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    logits: list[float] | None = None


class RowResult(BaseModel):
    """One request's outcome; `token_ids` excludes EOS, `matched_stop` is the stop string hit.

    `ttft_s` runs from submission (queue time included) to the first token; `reused_tokens`
    are prompt tokens found already in the cache row (prefix reuse); `logprobs` holds, per
    token, [logprob, [[id, logprob], ...]] when the request asked for logprobs; `prompt_logprobs`
    the same per prompt position when the request asked for them (None for the first token).
    """

    request_id: str
    token_ids: list[int]
    finish_reason: Literal["stop", "length", "cancelled"]
    matched_stop: str | None = None
    prompt_tokens: int
    ttft_s: float
    decode_s: float
    queued_s: float = 0.0
    reused_tokens: int = 0
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    # rank 0's time between consecutive sampled tokens (s, rounded to 0.1 ms), for the inter-token
    # latency histogram; and whether the request resumed after a group failed under it
    token_gaps_s: list[float] = []
    resumed: bool = False


class ServeResult(Reply):
    """What one serving loop did (rank 0's figures; the other ranks count steps only)."""

    type: Literal["serve_result"] = "serve_result"
    model_id: str
    steps: int
    requests: int = 0
    peak_rows: int = 0
    reused_tokens: int = 0
    shared_prompt_tokens: int = 0
    new_decode_shapes: int = 0  # bucketed decode shapes first met in this loop (on CUDA: graphs recorded)
    images: int = 0  # images in the requests the loop took (vision-language models)
    host_waits: dict[str, int] = Field(default_factory=dict)  # with CELERYTP_SYNC_CHECK=1 (worker/host_syncs.py)
    total_s: float = 0.0


class Cleared(Reply):
    type: Literal["cleared"] = "cleared"
    model_id: str


class Unloaded(Reply):
    type: Literal["unloaded"] = "unloaded"
    model_id: str
    rss_bytes: int


class ErrorReply(Reply):
    type: Literal["error"] = "error"
    kind: Annotated[ErrorKind, Field(strict=False)]  # arrives as its JSON string
    message: str


def _by_tag(classes: tuple[type[Message], ...], tag: str) -> dict[str, type]:
    return {cls.model_fields[tag].default: cls for cls in classes}


REQUESTS: dict[str, type[Request]] = _by_tag(
    (
        PingRequest, InitRequest, SanityCheckRequest, ShutdownRequest,
        LoadRequest, StepRequest, ServeRequest, ClearKVCacheRequest, UnloadRequest,
    ),
    "op",
)
REPLIES: dict[str, type[Reply]] = _by_tag(
    (Pong, InitOk, SanityResult, Bye, Loaded, StepResult, ServeResult, Cleared, Unloaded, ErrorReply), "type"
)


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors():
        field = ".".join(str(p) for p in item["loc"]) or "message"
        parts.append(f"field '{field}': {item['msg']}")
    return "; ".join(parts)


def parse_request(data: Any, expected_op: str | None = None) -> Request:
    """Validate a decoded JSON request; raise CeleryTPError(bad_request) naming the field."""
    if not isinstance(data, dict):
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"request must be a JSON object, got {type(data).__name__}")
    op = data.get("op")
    if not isinstance(op, str) or op not in REQUESTS:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'op': unknown op {op!r}; known: {sorted(REQUESTS)}")
    if expected_op is not None and op != expected_op:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"field 'op': {op!r} sent to the {expected_op!r} task")
    return validate_message(REQUESTS[op], data, op)


def validate_message(cls: type[M], data: Any, what: str) -> M:
    """`data` as a `cls` message; CeleryTPError(bad_request) naming each bad field otherwise."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise CeleryTPError(ErrorKind.BAD_REQUEST, f"{what}: {_describe(exc)}") from None


def parse_reply(data: Any) -> Reply:
    """Validate a decoded JSON reply (leader side)."""
    if not isinstance(data, dict) or data.get("type") not in REPLIES:
        raise CeleryTPError(ErrorKind.INTERNAL, f"malformed reply: {data!r:.200}")
    try:
        return REPLIES[data["type"]].model_validate(data, strict=False)  # JSON has no tuples
    except ValidationError as exc:
        raise CeleryTPError(ErrorKind.INTERNAL, f"malformed {data['type']} reply: {_describe(exc)}") from None


def error_reply(rank: int, kind: ErrorKind, message: str) -> dict[str, Any]:
    return ErrorReply(rank=rank, kind=kind, message=message).model_dump(mode="json")
