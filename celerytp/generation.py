"""Generation from the leader's side: prepare requests, run them fused or step by step, stream.

Fused mode (the default) sends the request to the ranks as part of one `generate` chord per
batch; step mode drives one `step` chord per token. Both sample with the same functions in
the same order, so greedy and seeded outputs are identical.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from celerytp.keys import stream_key
from celerytp.protocol import ErrorKind, RowResult
from celerytp.sampling import SamplingParams
from celerytp.stopping import StopChecker, cut_at_stop
from celerytp.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from celerytp.leader import Leader

DEFAULT_MAX_TOKENS = 256
PREFILL_CHUNK = 512
MODES = ("fused", "step")


@dataclass
class GenerationResult:
    """A finished completion. `token_ids` excludes the EOS token; `text` excludes stop strings."""

    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or a stop string), "length" or "cancelled"
    prompt_tokens: int
    request_id: str = ""
    ttft_s: float = 0.0  # request start to the first generated token
    decode_s: float = 0.0
    total_s: float = 0.0
    mode: str = "fused"

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first over the time they took."""
        return (self.completion_tokens - 1) / self.decode_s if self.decode_s > 0 and self.completion_tokens > 1 else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(completion_tokens=self.completion_tokens, tokens_per_s=round(self.tokens_per_s, 3))
        return out


@dataclass
class Prepared:
    """A request ready to run: its wire spec plus what the leader needs to finish it."""

    tokenizer: Tokenizer
    spec: dict[str, Any]  # a protocol GenSpec
    params: SamplingParams
    stops: list[str]
    started: float


def _error(kind: ErrorKind, message: str) -> Exception:
    from celerytp.leader import CeleryTPError, RankFailure

    return CeleryTPError("generate", [RankFailure(None, kind, message)])


def prompt_ids(tokenizer: Tokenizer, prompt: str | None, messages: list[dict] | None) -> list[int]:
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    ids = tokenizer.apply_chat_template(messages) if messages is not None else tokenizer.encode(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    return ids


def prepare(
    leader: Leader,
    model_id: str,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float | None = None,
    seed: int | None = None,
    stop: list[str] | str | None = None,
    request_id: str | None = None,
    stream: bool = False,
    ignore_eos: bool = False,
) -> Prepared:
    """Tokenize and check a request on the leader, so the ranks rarely see a bad one.

    `ignore_eos` generates on past EOS to max_tokens (benchmarks, like vLLM's option).
    """
    started = time.perf_counter()
    record = leader.models().get(model_id)
    if record is None:
        raise _error(ErrorKind.MODEL_NOT_LOADED, f"model {model_id!r} is not loaded")
    tokenizer = load_tokenizer(record["path"])
    ids = prompt_ids(tokenizer, prompt, messages)
    if len(ids) > record["max_context"]:
        raise _error(ErrorKind.BAD_REQUEST, f"the prompt's {len(ids)} tokens exceed the context limit {record['max_context']}")
    given = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "repetition_penalty": repetition_penalty, "seed": seed}
    params = SamplingParams.from_dict({**tokenizer.generation_defaults, **{k: v for k, v in given.items() if v is not None}})
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    stops = [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s]
    spec = {
        "request_id": request_id or uuid.uuid4().hex, "prompt": ids, "max_tokens": max_tokens,
        "sampling": params.to_dict(), "stop": stops, "stream": stream,
        "eos_token_ids": [] if ignore_eos else sorted(tokenizer.eos_token_ids),
    }
    return Prepared(tokenizer, spec, params, stops, started)


def finish(prepared: Prepared, row: RowResult, mode: str) -> GenerationResult:
    text, _ = cut_at_stop(prepared.tokenizer.decode(row.token_ids), prepared.stops)
    return GenerationResult(
        text=text, token_ids=row.token_ids, finish_reason=row.finish_reason, prompt_tokens=row.prompt_tokens,
        request_id=row.request_id, ttft_s=row.ttft_s, decode_s=row.decode_s,
        total_s=time.perf_counter() - prepared.started, mode=mode,
    )


def run_steps(leader: Leader, model_id: str, prepared: Prepared, max_context: int) -> RowResult:
    """Step mode: chunked prefill, then one step chord per token."""
    spec, ids = prepared.spec, prepared.spec["prompt"]
    room = max_context - len(ids) + 1
    checker = StopChecker(set(spec["eos_token_ids"]), min(spec["max_tokens"], room), prepared.stops, prepared.tokenizer.decode)
    start = time.perf_counter()
    offset = 0
    for i in range(0, len(ids) - PREFILL_CHUNK, PREFILL_CHUNK):  # all chunks but the last: no sample
        leader.step(model_id, ids[i : i + PREFILL_CHUNK], offset, sample=False)
        offset += PREFILL_CHUNK
    reply = leader.step(model_id, ids[offset:], offset, prepared.params)
    offset = len(ids)
    first = time.perf_counter()
    while (reason := checker.after(reply.token)) is None:
        reply = leader.step(model_id, [reply.token], offset, prepared.params)
        offset += 1
    return RowResult(
        request_id=spec["request_id"], token_ids=checker.token_ids, finish_reason=reason,
        matched_stop=checker.matched, prompt_tokens=len(ids), ttft_s=first - start, decode_s=time.perf_counter() - first,
    )


def generate(leader: Leader, model_id: str, mode: str = "fused", **request: Any) -> GenerationResult:
    """Generate one completion; `request` holds prepare()'s options."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    prepared = prepare(leader, model_id, **request)
    if mode == "step":
        row = run_steps(leader, model_id, prepared, leader.models()[model_id]["max_context"])
    else:
        row = leader.submit(model_id, prepared.spec).result()
    return finish(prepared, row, mode)


class TokenStream:
    """Text deltas of one fused request as rank 0 publishes its tokens; `.result` at the end.

    UTF-8 sequences split across tokens are held back until complete, and so is text that
    could be the start of a stop string.
    """

    def __init__(self, leader: Leader, prepared: Prepared, future: Future):
        self.request_id = prepared.spec["request_id"]
        self.result: GenerationResult | None = None
        self.ttft_s: float | None = None
        self._leader = leader
        self._prepared = prepared
        self._future = future

    def __iter__(self) -> Iterator[str]:
        client, key = self._leader.redis, stream_key(self._leader.group, self.request_id)
        last, ids, sent = "0-0", [], ""
        done = False
        while not done:
            reply = client.xread({key: last}, count=256, block=50)
            if not reply:
                if self._future.done() and not client.exists(key):
                    break  # the op ended without publishing (it failed): result() raises below
                continue
            for entry_id, fields in reply[0][1]:
                last = entry_id
                if b"t" in fields:
                    ids.append(int(fields[b"t"]))
                    self.ttft_s = self.ttft_s or time.perf_counter() - self._prepared.started
                done = done or b"done" in fields
            delta = self._safe_text(ids, final=done)[len(sent):]
            if delta:
                sent += delta
                yield delta
        row = self._future.result()
        client.delete(key)
        self.result = finish(self._prepared, row, "fused")
        rest = self.result.text[len(sent):]
        if rest:
            yield rest

    def _safe_text(self, ids: list[int], final: bool) -> str:
        text, _ = cut_at_stop(self._prepared.tokenizer.decode(ids), self._prepared.stops)
        if final:
            return text
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 sequence decodes to U+FFFD
        held = max(
            (n for stop in self._prepared.stops for n in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:n])),
            default=0,
        )
        return text[: len(text) - held]
